"""A trainable parameter the optimizer holds, getting no learning signal."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

from trainwatch.alert import Alert
from trainwatch.collect.dropped_gradients import LeavingsNotes
from trainwatch.collect.parameter_reads import ParameterReads
from trainwatch.collect.weights_at_alert import BOTH_ZERO, FROZEN, LR_ZERO, NO_OPTIMIZER
from trainwatch.collect.zero_derivatives import ZeroDerivativeLook
from trainwatch.config import ZeroGradientConfig
from trainwatch.layers import ParamInfo
from trainwatch.record import BetweenBackwardsRecord, HandUpdateRecord, StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names
from trainwatch.rules.rnn_directions import unused_directions
from trainwatch.rules.trainable_parameters import common_module

_HINTS = {
    "none": (
        "backward never reached these parameters: look for a .detach(), a "
        ".item()/.numpy() round trip, torch.no_grad() around the layer, a custom "
        "torch.autograd.Function whose backward returns None for an input, or a "
        "branch whose output does not reach the loss."
    ),
    "custom_function": (
        "a custom torch.autograd.Function's backward() returns None for an input that "
        "needs a gradient: None means no gradient, so nothing before it learns (a "
        "rounding or clamping op written without its straight-through estimator). "
        "Return a gradient for that input (grad_output itself, or masked where the "
        "forward clipped); None is right only for inputs that need no gradient."
    ),
    "gradients_off": (
        "the layer ran with gradients off inside the training pass: torch.no_grad() "
        "around it, or a reentrant torch.utils.checkpoint (use_reentrant=True) whose "
        "inputs do not require grad (a frozen embedding before it); pass "
        "use_reentrant=False or make the input require grad. A freeze meant this way "
        "(the backbone for the first steps) is better said with requires_grad_(False) "
        "on its parameters, which also keeps the optimizer's state off them."
    ),
    "never_called": (
        "the layer is defined but its forward never ran, so its parameters get no "
        "gradient. Fine if deliberate (an unused head or pooler); otherwise call it "
        "in forward(). Under DDP it needs find_unused_parameters=True."
    ),
    "never_called_optimized": (
        "the layer is defined but its forward never ran, yet an optimizer holds its "
        "parameters: they and their optimizer state take memory for nothing, and "
        "under DistributedDataParallel without find_unused_parameters=True the run "
        "fails at its second iteration. Freeze the layer (requires_grad_(False)), "
        "leave its parameters out of the optimizer, or call it in forward()."
    ),
    "not_run": (
        "an expert the router sends no token (a collapsed router: add a load-balancing "
        "loss, router noise or capacity limits), or a member of the container that "
        "forward() never calls (an off-by-one slice of a ModuleList). Under DDP it "
        "needs find_unused_parameters=True."
    ),
    "never_read": (
        "no forward pass with gradients read this parameter: a learned token or "
        "embedding defined in __init__ and left out of forward(), or one its module's "
        "code reads on rare steps only (classifier-free guidance's null embedding with "
        "a drop probability none of these steps drew). Use it in forward(), or delete "
        "it (or freeze it and leave it out of the optimizer). Under DDP it needs "
        "find_unused_parameters=True."
    ),
    "output_without_signal": (
        "the loss sends that output nothing: a task whose loss weight is 0 for now "
        "(a schedule that switches it on later), or its term multiplied by zero by "
        "mistake. Its head learns nothing while this lasts."
    ),
    "not_updated": (
        "the loop's hand-written update leaves these parameters out: check the loop "
        "that applies the gradients (a list or dict of names missing this layer, a "
        "filter on names, parameters gathered before the layer was added). If they are "
        "meant to stay fixed, freeze them (requires_grad_(False))."
    ),
    "zero": (
        "backward reached these parameters but every gradient entry is exactly "
        "zero: usually all units upstream are dead (ReLU stuck at 0), the output "
        "is multiplied by zero, or a mask removes everything."
    ),
    "zero_derivative_op": (
        "round, floor, ceil, trunc and sign have a derivative of exactly zero, so "
        "backward passes nothing through them: a quantiser written with them (fake "
        "quantization, binarised weights, a rounded activation) without a "
        "straight-through estimator leaves everything behind it untrained. Round in "
        "the forward only: `w + (w.round() - w).detach()` (the same with the op "
        "used), a custom autograd Function whose backward returns grad_output, or "
        "torch.fake_quantize_per_tensor_affine, whose gradient passes straight through."
    ),
    "zero_weight_path": (
        "the layer's bias got a gradient, so the gradient reaches the layer's output "
        "and its own units are not dead; a weight's gradient is its input times that "
        "gradient, so what is zero is on the weight's side: its input is exactly zero "
        "for the whole batch (every unit feeding it dead (ReLU stuck at 0), an input "
        "zeroed or masked out), the weight is multiplied by an all-zero mask before "
        "use, or it passes through an op with a zero derivative (torch.round, floor, "
        "sign: a quantiser without a straight-through estimator, fixed as "
        "`w + (w.round() - w).detach()`)."
    ),
    "zero_table": (
        "backward reached this embedding table but every gradient entry is exactly "
        "zero, step after step: its looked-up vectors are multiplied by zero or "
        "masked out before the loss, or every lookup hits padding_idx (a column "
        "that is always missing)."
    ),
}


def _reset_by_hand(record: StepRecord) -> frozenset[str]:
    """Gradients zeroed in place between backward and ``monitor.step()``.

    Rewritten after backward and all zero: a reset (``p.grad.zero_()``), not a
    dead signal. Clipping rewrites every gradient too, but leaves the live
    ones non-zero, so a dead layer among them is still reported.
    """
    rewritten = record.rewritten
    if not rewritten:
        return frozenset()
    for info, norm in zip(record.present, record.param_norms):
        if norm != 0.0 and info.name in rewritten:
            return frozenset()
    return rewritten


def _zeroed_by_the_loop(record: StepRecord) -> tuple[ParamInfo, ...]:
    """The parameters whose gradient is exactly zero that the step's latest backward
    left a gradient on, written in place or replaced by the loop since, while
    others kept what it left: zeroed by the loop (a layer kept out of some
    updates), not a gradient backward made zero. Known while the tracker notes
    what backward leaves (``rewritten_after_backward``); a write through ``.data``
    moves no version counter, and is not seen."""
    rewritten = record.rewritten_after_backward
    return tuple(
        info
        for info, norm in zip(record.present, record.param_norms)
        if norm == 0.0 and info.name in rewritten
    )


def _learning_layers(record: StepRecord) -> set[str]:
    """Layers with some parameter whose gradient is non-zero this step."""
    return {info.owner for info, norm in zip(record.present, record.param_norms) if norm != 0.0}


def _shift_free_biases(record: StepRecord) -> frozenset[str]:
    """Biases with an exactly zero gradient in a layer whose weight learns.

    The loss does not depend on that shift: a critic's output bias in
    ``D(fake).mean() - D(real).mean()`` (WGAN), a bias that batch norm right
    after removes. Dead units, a zero mask or a cut graph zero the weight's
    gradient too, so those are still reported. For a bias with no gradient at
    all, see _unreached_shifts.
    """
    learning = _learning_layers(record)
    return frozenset(
        info.name
        for info, norm in zip(record.present, record.param_norms)
        if norm == 0.0 and info.owner in learning and info.name.rsplit(".", 1)[-1] == "bias"
    )


def _unreached_shifts(record: StepRecord) -> frozenset[str]:
    """Biases with no gradient (None) that torch's own layer adds to its output
    (``ParamInfo.shift``: nn.Linear, a convolution, a norm layer), in a layer
    whose weight learns this step, the layer not seen skipped.

    A loss built only from derivatives of the output (a Hamiltonian network's
    ``torch.autograd.grad(H, x, create_graph=True)``, forces as ``-dE/dx``)
    never reaches a constant shift of it, so backward leaves such a bias None
    by design: the shift-free bias of _shift_free_biases, unreached instead of
    zeroed. A layer cut off whole (its weight None too), a bias its layer's own
    forward may leave out (a module of the user's own, a subclass redefining
    forward), and a layer whose weight is read without the layer running
    (``F.linear(x, fc.weight)``: the call tracker saw it not called) are still
    reported. Asked only on steps with a parameter missing.
    """
    shifts = [info for info in record.missing if info.shift]
    if not shifts:
        return frozenset()
    learning = _learning_layers(record)
    held_by = record.calls_held_by or {}
    followed, called = record.calls_followed, record.called_now
    unreached = set()
    for info in shifts:
        if info.owner not in learning:
            continue
        runs = held_by.get(info.owner, info.owner)
        if runs in record.never_called or (
            called is not None and runs in followed and runs not in called
        ):
            continue  # its weight used without the layer running: the bias is left out
        unreached.add(info.name)
    return frozenset(unreached)


# Steps a layer seen not running (and never seen running) is given beyond
# ``patience`` before it counts as never called: a block skipped at random, an
# expert given no token, may simply not have run yet.
_NOT_YET_RAN = 10
# The same, for a member of a container whose siblings have run (an expert of a
# mixture, a block of a ModuleList): a router that starts collapsed sends some
# experts no token for many steps, then balances.
_SIBLINGS_RAN = 100
# Steps without a gradient a parameter that had gradients before is given while
# some output of the model is left out of the loss: a loss term added only on
# batches with targets for it (a box loss skipped when a batch has no positive
# box) leaves its head without one now and then (unused_parameter notes that at
# once). A layer cut off inside the model (every output still reached) is not.
_USED_BEFORE = 50
# Steps in a row a module told of as getting no gradient must get one at every
# parameter told before its warning is withdrawn: a staged auxiliary head whose
# loss term joins after a warm-up keeps getting gradients from then on, while a
# head used on rare steps (unused_parameter's story) or a layer-drop block back
# for a step does not.
_JOINED_STEPS = 10
# The streak kind of a parameter told of as getting no gradient, now getting one:
# its ``start`` is the first step of that run, its ``count`` the steps in it.
_JOINED = "joined"
# Layout ids remembered for that (bounded: a router's layouts may change every step).
_LAYOUTS_KEPT = 64
_NAME = attrgetter("name")
_POSITION = attrgetter("position")
_RESET_HINT = (
    "zero_grad() (optimizer.zero_grad() or model.zero_grad()) runs between "
    "loss.backward() and optimizer.step(), wiping the gradients backward just made: "
    "the update applies nothing and the model does not learn. Call it before "
    "backward (or right after optimizer.step()); with gradient accumulation, after "
    "the step."
)
_RESET_BY_HAND_HINT = (
    "the gradients are zeroed (model.zero_grad(set_to_none=False), p.grad.zero_()) "
    "between loss.backward() and the hand-written update (p -= lr * p.grad), wiping "
    "the gradients backward just made: every update applies zeros and the model does "
    "not learn. Zero the gradients after the update (or before backward), not between "
    "them. (An update whose learning rate is 0 leaves the weights the same way.)"
)
_WIPED_HINT = (
    "zero_grad() sits inside the gradient-accumulation loop, so each micro-batch wipes "
    "the gradients the earlier ones left. Move optimizer.zero_grad() to right after "
    "optimizer.step(), inside the `if` that steps (or before the first micro-batch of "
    "each accumulation window only)."
)
_RESET_HOW = {"set_to_none": "set to None", "zeroed_in_place": "zeroed in place"}
# Steps in a row without any gradient from the loss before it is noted (once).
_NO_SIGNAL_STEPS = 50
# Why the all-zero weight a zero gradient comes through stays zero (collect.weights_at_alert).
_STAYS_ZERO = {
    LR_ZERO: "; its param group's learning rate is 0, so it never leaves zero",
    FROZEN: "; it is frozen (requires_grad=False), so it never leaves zero",
    NO_OPTIMIZER: "; no watched optimizer holds it, so it never leaves zero",
}
# Said with the usual zero hint where no pass's graph could show whether such an op
# is there (a first step told at once, a model called only through a compiled graph).
_ZERO_DERIVATIVE_TOO = (
    " Or an op with a zero derivative (torch.round, floor, sign) stands on the way "
    "without a straight-through estimator: write `x + (x.round() - x).detach()`."
)
_PARTNER_HINT = (
    "a weight initialised to zero (a LoRA B matrix, a low-rank factor) "
    "multiplies the path to these parameters: their gradient is exactly zero until "
    "it moves, and it is still exactly zero. Check that it gets a gradient and an "
    "update (its learning rate, requires_grad, its place in the optimizer), or "
    "initialise it otherwise."
)
_PARTNER_HINTS = {
    LR_ZERO: (
        "a weight initialised to zero (LoRA's B) learns with a learning rate of 0, so "
        "it stays zero and nothing learns through it: the LoRA B-init-zero plus lr=0 "
        "bug. Check how that param group's lr is computed (a ratio truncated by int(), "
        "a scheduler's factor of 0, a warm-up that never leaves 0)."
    ),
    FROZEN: (
        "a weight initialised to zero (LoRA's B) was frozen, so it stays zero and "
        "nothing learns through it. Unfreeze it (requires_grad_(True)) and give it to "
        "the optimizer, or freeze the whole adapter."
    ),
    NO_OPTIMIZER: (
        "a weight initialised to zero (LoRA's B) is left out of the optimizer, so it "
        "stays zero and nothing learns through it. Add it to the optimizer's param groups."
    ),
    BOTH_ZERO: (
        "both halves of the adapter (LoRA's A and B, or the two factors of a low-rank "
        "weight) were initialised to zero: each one's gradient passes "
        "through the other, so both stay exactly zero and nothing learns. Initialise "
        "one of them randomly: LoRA's A with nn.init.kaiming_uniform_(A, a=math.sqrt(5)) "
        "(as PEFT does), B kept at zero so the adapter starts as a no-op."
    ),
}
_JOINED_HINT = (
    "nothing to do if its loss term was meant to start later (an auxiliary task "
    "switched on after a warm-up, a curriculum). If not, look at what kept it out "
    "of the loss until then: a condition on the epoch or step that held too long."
)
_NO_SIGNAL_HINT = (
    "nothing is learned while this lasts. Fine for a margin, hinge or triplet loss that "
    "every sample already satisfies (the model has converged on this data: harder "
    "examples or a larger margin give it work again); otherwise the loss does not depend "
    "on the model's output (multiplied by zero, every target masked or ignored)."
)


class _Streak:
    __slots__ = (
        "start",
        "count",
        "kind",
        "reported",
        "called",
        "skipped",
        "excused",
        "gradless",
        "unfed",
    )

    def __init__(self, start: int, kind: str) -> None:
        self.start = start
        self.count = 0
        self.kind = kind
        self.reported = False
        # Steps of the streak its layer was seen called / seen not called at all.
        self.called = False
        self.skipped = 0
        # Steps of the streak explained by the step itself: the layer not run, or
        # some output of the model left out of the loss.
        self.excused = 0
        # Its layer was seen running with gradients off inside the training pass.
        self.gradless = False
        # An exactly zero streak from the first step, judged once at ``patience``:
        # whether its layer was not fed (see ZeroGradientRule._unfed); None: not yet.
        self.unfed: bool | None = None


class ZeroGradientRule(Rule):
    id = "zero_gradient"
    needs = frozenset({"call_tracker"})
    config: ZeroGradientConfig
    # The latest pass's graph, kept while a zero streak is not yet told and looked
    # at as its alert is built (an op with a zero derivative); set by the pipeline.
    zero_look: ZeroDerivativeLook | None = None
    # Which of the model's own parameters its passes read, asked while such a
    # parameter has had no gradient yet (a null embedding not used yet); set by the pipeline.
    reads: ParameterReads | None = None
    # Has what each backward leaves noted for a few steps, asked where a gradient is
    # missing, exactly zero or dropped (one the loop drops after backward); set by
    # the pipeline.
    leavings: LeavingsNotes | None = None

    def __init__(self, config: ZeroGradientConfig) -> None:
        super().__init__(config)
        self._streaks: dict[str, _Streak] = {}
        self._first_step: int | None = None
        # Steps in a row where the loss sent no gradient into the model (from when).
        self._no_signal: tuple[int, int] | None = None
        self._no_signal_told = False
        # Per optimizer, its steps in a row whose gradients were reset between
        # backward and the step: (from when, how many, whether told).
        self._resets: dict[int | None, tuple[int, int, bool]] = {}
        # Parameters seen with a gradient, updated once per new layout of a step's
        # gradients (ids of the layouts seen: a C lookup per step).
        self._had_gradient: set[str] = set()
        self._layouts_seen: set[int] = set()
        # The model was told as no longer called while its optimizer steps.
        self._not_called_told = False
        # Per module told of as getting no gradient (a warning), the parameters
        # told: withdrawn once they all keep getting gradients (a staged head).
        self._pending: dict[str, list[str]] = {}
        # Modules whose warning is never withdrawn: told of otherwise too (an
        # exactly zero gradient), or withdrawn once already.
        self._settled: set[str] = set()
        # A model's own parameters a pass with gradients read on a step they got no
        # gradient: cut off (a .detach()), not used on some steps only.
        self._read_cut: set[str] = set()

    # ids and collectors: this process's only
    _NOT_STATE = Rule._NOT_STATE | {"_layouts_seen", "zero_look", "reads", "leavings"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for streak in self._streaks.values():
            if not hasattr(streak, "called"):  # saved before the call evidence existed
                streak.called, streak.skipped = False, 0
            if not hasattr(streak, "excused"):
                streak.excused = 0
            if not hasattr(streak, "gradless"):
                streak.gradless = False
            if not hasattr(streak, "unfed"):
                streak.unfed = None
        if not hasattr(self, "_read_cut"):
            self._read_cut = set()

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.source not in ("optimizer", "manual"):
            if record.source == "between_backwards":
                return self._reset_between_backwards(record)  # type: ignore[arg-type]
            if record.source == "hand_update":
                return self._reset_before_update(record)  # type: ignore[arg-type]
            if record.source == "copy_in_optimizer":
                return self._copy_in_optimizer(record)
            return []
        # Under DDP the next iteration fails when a layer of the optimizer's is
        # never called: that is worth saying at once, not after `patience`.
        # With find_unused_parameters=True DDP copes (a head or an expert not
        # called yet is allowed there), so the usual patience applies.
        # The same holds for any parameter of the optimizer's that got no
        # gradient from the first step on (a branch cut off by a detach): DDP's
        # reducer waits for it. One that had gradients before and has none now
        # is unused_parameter's finding, made at once already.
        if self._first_step is None:
            self._first_step = record.step
        layout = record.layout
        if layout is not None and id(layout) not in self._layouts_seen:
            if len(self._layouts_seen) >= _LAYOUTS_KEPT:
                self._layouts_seen.clear()  # layouts that change every step (a router)
            self._layouts_seen.add(id(layout))
            self._had_gradient.update(map(_NAME, record.present))
        if record.no_signal:
            # Every gradient zero because the gradient entering the model was: a
            # margin or hinge loss every sample satisfies, a batch whose every
            # target is masked. No layer's streak moves either way.
            return self._without_signal(record)
        self._no_signal = None
        if record.rewritten_since_backward:  # (never on the usual step)
            cause = record.gradients_reset_after_backward()
            if cause is not None:
                # Backward's gradients wiped before the step: says nothing of any
                # layer, no layer's streak moves.
                return self._reset_before_step(record, cause)
        if self._resets:
            self._resets.pop(record.optimizer, None)
        at_once = record.distributed == "ddp" and record.source == "optimizer"
        # Parameters that left the model (a replaced head) are not_optimized's story.
        silent: list[tuple[ParamInfo, str]] = (
            [(info, "none") for info in record.missing if info.in_model] if record.missing else []
        )
        if 0.0 in record.param_norms and not record.sharded:  # a zero shard says nothing
            reset = _reset_by_hand(record) if record.rewritten else frozenset()
            shift_free = _shift_free_biases(record)
            zeroed = record.rewritten_after_backward  # (see _zeroed_by_the_loop)
            silent += [
                (info, "zero")
                for info, norm in zip(record.present, record.param_norms)
                if norm == 0.0
                and info.in_model
                and info.name not in reset
                and info.name not in shift_free
                and info.name not in zeroed
            ]
        if not silent and not self._streaks:
            return []  # the healthy step: every gradient there and non-zero
        # Gradients backward made that the loop dropped before the step, keeping
        # others: set to None (the pipeline took them out of ``missing``) or zeroed.
        dropped = record.dropped
        if record.rewritten_after_backward and not record.sharded:
            dropped += _zeroed_by_the_loop(record)
        if record.skipped_batch:
            # No backward since the optimizer's last step: a batch skipped before
            # its backward says nothing of any layer. No streak moves, none starts.
            return []
        if dropped and self._streaks:
            # Backward reached them; the loop dropped what it made (SwAV's
            # prototypes, DINO's last layer, kept out of the first updates): no
            # cut, no branch skipped. A streak of theirs ends, told of nothing.
            for info in dropped:
                self._streaks.pop(info.name, None)
        if record.missing and not at_once:
            # Under DDP (at_once) a parameter without a gradient fails the next
            # iteration whatever the reason: told as before.
            unreached = _unreached_shifts(record)
            if unreached:
                silent = [item for item in silent if item[0].name not in unreached]
                if self._streaks:
                    for name in unreached:  # a streak of theirs ends, as one with a gradient
                        self._streaks.pop(name, None)
                elif not silent:
                    return []
        if record.not_called_since is not None:
            # No pass of the model between its optimizer's steps: says nothing of any layer.
            return self._not_called(record)
        if self.leavings is not None:
            self._note_leavings(silent, dropped)
        if record.moved_without_grad:
            silent = self._left_out_of_update(record, silent)
        silent_names = {info.name for info, _ in silent}
        reads = self.reads
        if reads is not None and reads.watching:
            # Read by a pass of this step, yet no gradient: cut off inside the model.
            self._read_cut.update(reads.take() & silent_names)
        unread: set[str] = set()  # the model's own parameters whose reads are followed
        joined: set[str] = set()  # modules whose told parameters have joined long enough
        for info in record.present:
            if info.name not in silent_names:
                streak = self._streaks.pop(info.name, None)
                if streak is not None and self._pending:
                    self._follow_joining(info, streak, record.step, joined)

        due: list[ParamInfo] = []
        followed, called = record.calls_followed, record.called_now
        gradless = record.called_gradless
        held_by = record.calls_held_by
        ran: frozenset[str] | None = None  # modules that ran (asked for on this path only)
        unfed: dict[str, bool] = {}  # per silent group, whether it was fed (see _unfed)
        for info, kind in silent:
            streak = self._streaks.get(info.name)
            if streak is None or streak.kind == _JOINED:  # (a joined one: silent again)
                streak = self._streaks[info.name] = _Streak(record.step, kind)
            elif kind == "not_updated":
                streak.kind = kind  # its first step could not tell (see _left_out_of_update)
            if kind == "zero" and record.same_weights:
                # The weights are the last step's (every learning rate was 0, a
                # warm-up's first step): a gradient zero because a zero-initialised
                # gate downstream has not moved yet is the same step again.
                continue
            streak.count += 1
            not_run = False
            # The module whose calls tell whether this layer ran: its holder, for
            # one whose holder reads its weights without calling it.
            runs = held_by.get(info.owner, info.owner) if held_by else info.owner
            if kind == "none" and called is not None and runs in followed:
                if runs in called:
                    streak.called = True
                else:
                    streak.skipped += 1
                    not_run = True
            if gradless and kind == "none" and runs in gradless:
                streak.gradless = True
            # An output left out of the loss explains a layer only where the layer
            # is in some output's graph (a head whose loss is off for now); a layer
            # cut off inside the model (an LSTM's embedding detached while its
            # recurrent state, returned too, is left out) is not.
            left_out = kind == "none" and record.unreached_outputs and runs not in record.cut_off
            if kind == "none" and (not_run or left_out):
                streak.excused += 1
            needed = self.config.patience
            # A layer seen not running on its steps without a gradient, and never
            # seen running on them, is skipped by design (a block stochastic depth
            # drops, an expert given no token) once it is seen running on other
            # steps: unused_parameter's story, not a cut. One not seen running yet
            # may be skipped by design from the first step: unless the call
            # tracker saw the module holding it run without it (a head defined but
            # never called), it is given _NOT_YET_RAN more steps to run.
            # Seen running: called on a step its calls were followed, or holding a
            # gradient on an earlier step. The pipeline's ``calls_ran`` knows the
            # steps of the optimizer stepping now only; a fresh optimizer built per
            # task (the old task's head no longer called) starts that afresh, while
            # the head ran under the one before: that is what ``_had_gradient`` keeps.
            skipped = streak.skipped and not streak.called
            if skipped and runs not in record.calls_ran and info.name not in self._had_gradient:
                skipped = False
                if info.owner not in record.never_called:  # its holder skipped too
                    if ran is None:
                        ran = _ran(record)
                    needed += _SIBLINGS_RAN if _siblings_ran(info.owner, ran) else _NOT_YET_RAN
            if left_out and not at_once:
                # An output of the model is left out of the loss now: a loss term
                # added only on some batches, if these trained before; if not, the
                # first batches may simply have had no targets for it yet.
                trained = info.name in self._had_gradient
                needed = max(needed, _USED_BEFORE if trained else needed + _NOT_YET_RAN)
            elif (
                kind == "none"
                and not at_once
                and info.name in self._had_gradient
                and _held_by_a_container(info, record)
            ):
                # A parameter of a module's own code (classifier-free guidance's
                # null embedding, a learned token) that trained before: read on
                # some steps only, as no call shows (its module runs every step).
                needed = max(needed, _USED_BEFORE)
            elif (
                kind == "none"
                and not at_once
                and info.name not in self._read_cut
                and _held_by_a_container(info, record)
            ):
                # The same, with no gradient yet: the null embedding's first
                # unconditional batch may come at step 5 or 30. Its passes are
                # watched for reads of it: one read on a step it got no gradient
                # (a .detach()) is told at the usual patience, one no pass reads
                # (a token defined and forgotten) after these steps.
                needed = max(needed, _USED_BEFORE)
                if not streak.reported:
                    unread.add(info.name)
            elif kind == "zero" and info.table:
                # An embedding table whose batch looked up only its padding row
                # (padding_idx gets no gradient) or rows the loss masked out: a
                # sparse categorical column whose first batches hold only missing
                # values. A table the loss never reaches stays zero, told later.
                needed = max(needed, _USED_BEFORE)
            elif kind == "zero" and not at_once and streak.start != self._first_step:
                # A layer whose gradient was non-zero at the step before its streak
                # began: a branch that stochastic depth multiplies by zero for the
                # whole batch (torchvision's mode="batch") gets exact zeros on some
                # steps, several in a row by chance. A layer dying for good (its
                # units dead, dead_units' finding too) stays zero.
                needed = max(needed, _USED_BEFORE)
            elif (
                kind == "zero"
                and not at_once
                and streak.count >= needed
                and self._unfed(info, streak, record, silent, unfed)
            ):
                # From the first step, with no step before to show it trained: a
                # group of layers whose every gradient is exactly zero while the
                # model around it learns, reached from the output past no
                # activation of its own (a branch stochastic depth dropped at the
                # first steps, an expert the router gave an empty buffer). Dead
                # units, an op with a zero derivative, an all-zero partner weight
                # are told at the usual patience.
                needed = max(needed, _USED_BEFORE)
            if (
                kind == "none"
                and not at_once
                and streak.called
                and streak.excused
                and streak.count - streak.excused < self.config.patience
                and runs not in record.cut_off
            ):
                # Steps where the layer did not run mixed with steps where it ran
                # and its output was left out of the loss (an early-exit network
                # trained at an exit drawn at random): each explained by its step,
                # together no cut. A streak with patience steps of neither is not
                # excused; one of not-run steps only is judged as skipped above.
                trained = info.name in self._had_gradient
                excused = _USED_BEFORE if trained else self.config.patience + _NOT_YET_RAN
                needed = max(needed, excused)
            if at_once and kind == "none" and streak.start == self._first_step:
                needed = 1
            if streak.count >= needed and not streak.reported and not skipped:
                streak.reported = True
                due.append(info)

        alerts = self._withdrawn(record, joined) if joined else []
        if not due:
            if reads is not None:
                reads.want(unread)
            if self.zero_look is not None:
                self._keep_graphs()  # (after the streaks above: a new one, one ended)
            return alerts  # the usual step with a streak: no further call
        # Per layer, the ops with a zero derivative behind its zero gradients (None:
        # no graph to look at); a walk of the graph where some gradient is zero.
        zero_ops = self._zero_ops(due)
        for owner, params in by_owner(due).items():
            params.sort(key=_POSITION)  # the module's own order, not the gradients'
            streaks = [self._streaks[p.name] for p in params]
            kinds = {s.kind for s in streaks}
            kind = "none" if "none" in kinds else "zero" if "zero" in kinds else "not_updated"
            since = min(s.start for s in streaks)
            steps = record.step - since + 1
            what = "no gradient (None)" if kind == "none" else "an exactly zero gradient"
            message = (
                f"{short_names(params)} got {what} in {steps} consecutive "
                f"step{'s' if steps != 1 else ''} since step {since}"
            )
            if kind == "not_updated":
                message = (
                    f"{short_names(params)} did not move in {steps} consecutive steps since "
                    f"step {since}, while the loop's own update moved the model's other "
                    "weights with no gradient in .grad (computed outside it: torch.func, "
                    "torch.autograd.grad)"
                )
            severity = None
            hint = _HINTS[kind]
            if kind == "zero" and all(p.table for p in params):
                hint = _HINTS["zero_table"]
            data = {
                "kind": kind,
                "parameters": [p.name for p in params],
                "since_step": since,
                "steps": steps,
            }
            if kind == "none" and owner in record.never_called:
                kind = data["kind"] = "never_called"
                if record.source == "optimizer":
                    # Its parameters are in an optimizer: wasted, and fatal under DDP.
                    hint = _HINTS["never_called_optimized"]
                    data["in_optimizer"] = True
                    data["distributed"] = bool(record.distributed)
                    message = (
                        f"{owner} is never called in forward, yet an optimizer holds "
                        f"its parameters: {message}"
                    )
                    if record.distributed == "find_unused":
                        message += (
                            " (DDP runs only because find_unused_parameters=True, "
                            "which walks the autograd graph every iteration)"
                        )
                    elif record.distributed:
                        message += (
                            " (under DDP without find_unused_parameters=True the "
                            "next iteration fails)"
                        )
                else:
                    # No optimizer holds them: usually deliberate, a note.
                    hint, severity = _HINTS["never_called"], "info"
                    message = f"{owner} is never called in forward: {message}"
            elif (
                kind == "none"
                and owner is not None
                and all(s.skipped and not s.called for s in streaks)  # seen not running
                and (siblings := _siblings_ran(owner, _ran(record)))
            ):
                data["kind"] = "not_run"
                data["siblings_ran"] = siblings
                message = (
                    f"{owner} has not run in {steps} steps since step {since} while "
                    f"{_listed(siblings)} of the same container did, so "
                    f"{short_names(params)} got no gradient"
                )
                hint = _HINTS["not_run"]
            elif (
                kind == "none"
                and reads is not None
                and all(p.name not in self._read_cut and reads.watched(p.name) for p in params)
            ):
                # A model's own parameter no watched pass read (only those are watched).
                data["cause"] = "never_read"
                data["passes_watched"] = min(reads.watched(p.name) for p in params)
                message += (
                    f", and none of the {data['passes_watched']} forward passes with gradients "
                    f"watched since step {since + 1} read "
                    f"{'them' if len(params) > 1 else 'it'}"
                )
                hint = _HINTS["never_read"]
            elif kind == "none" and all(s.gradless for s in streaks):
                data["cause"] = "gradients_off"
                message += ", its layer having run with gradients off inside the training pass"
                hint = _HINTS["gradients_off"]
            elif (
                kind == "none"
                and record.through_functions
                and (functions := record.through_functions.get(owner))
            ):
                data["cause"] = "custom_function"
                data["functions"] = functions
                which = "Functions" if len(functions) > 1 else "Function"
                message += (
                    ", though the layer runs and is in the graph: backward reaches it only "
                    f"through the custom autograd {which} {_listed(functions)}, whose "
                    "backward returns None for the input coming from it"
                )
                hint = _HINTS["custom_function"]
            elif kind == "zero" and record.silent_outputs:
                # Some output of the model got an exactly zero gradient while
                # another did not: its loss is weighted by zero (a task switched
                # off for now), and the layers only it feeds learn nothing by design.
                outputs = record.silent_outputs
                data["kind"] = "output_without_signal"
                data["outputs"] = outputs
                message += (
                    f", while output{'s' if len(outputs) > 1 else ''} "
                    f"{', '.join(map(str, outputs))} of the model got an exactly zero "
                    "gradient from the loss and another did not"
                )
                hint, severity = _HINTS["output_without_signal"], "info"
            elif kind == "zero" and (outputs := self._returned_as_outputs(params)):
                # Parameters the model returns as they are (a learned prior's mu):
                # each is an output of its own, and the loss sent it nothing.
                data["kind"] = "output_without_signal"
                data["outputs"] = outputs
                them = "them" if len(params) > 1 else "it"
                are = "they are" if len(params) > 1 else "it is"
                message += (
                    f", and the model returns {them} as {are} (output"
                    f"{'s' if len(outputs) > 1 else ''} {', '.join(map(str, outputs))}): "
                    f"the loss sent {them} nothing"
                )
                hint, severity = _HINTS["output_without_signal"], "info"
            elif (
                kind != "not_updated"
                and not record.sharded
                and (
                    rnn := unused_directions(
                        owner, record.present, record.param_norms, record.missing
                    )
                )
            ):
                # Whole layer-directions of an RNN silent while the others learn:
                # the loss reads only part of its output (h_n[-1] of a bidirectional one).
                data["cause"] = "rnn_output_unused"
                data["unused_directions"] = rnn.names()
                message += (
                    ", while the module's other layer-directions got one: nothing the loss "
                    f"uses comes from {rnn.said()}"
                )
                hint = rnn.hint()
            elif kind == "zero" and (partners := self._all_zero_partners(owner, params)):
                name, why = _partner_to_name(partners, params)
                data["cause"] = "all_zero_partner"
                data["zero_partner"] = name
                data["partner_stays_zero"] = why
                if why == BOTH_ZERO:
                    data["all_zero_weights"] = weights = [n for n, _ in partners]
                    message += f": {_each_through_the_other(weights)}"
                else:
                    message += f": {_through_zero(name, params)}{_STAYS_ZERO.get(why, '')}"
                hint = _PARTNER_HINTS.get(why, _PARTNER_HINT)
            elif kind == "zero" and zero_ops and (ops := zero_ops.get(owner)):
                data["cause"] = "zero_derivative_op"
                data["ops"] = ops
                them = "them" if len(params) > 1 else "it"
                message += (
                    f": every path from the model's output back to {them} passes through "
                    f"{_listed(ops)}, whose derivative is zero"
                )
                if _bias_learns(record, owner):
                    message += " (the layer's bias got a gradient: its units are not dead)"
                hint = _HINTS["zero_derivative_op"]
            elif kind == "zero" and _bias_learns(record, owner):
                data["bias_learns"] = True
                bias = f"{owner}.bias" if owner else "bias"
                message += (
                    f", while {bias} got a gradient: the gradient reaches the layer's "
                    "output, and stops on the weight's own side"
                )
                hint = _HINTS["zero_weight_path"]
            elif kind == "zero" and zero_ops is None and hint == _HINTS["zero"]:
                hint += _ZERO_DERIVATIVE_TOO  # no graph was seen to rule it out
            elif kind == "none" and at_once and since == self._first_step:
                data["distributed"] = True
                message += (
                    " (under DDP without find_unused_parameters=True the next iteration fails)"
                )
            if kinds == {"none"} and severity is None:
                self._told_none(owner, params)
            else:
                self._never_withdrawn(owner)
            alerts.append(self.alert(since, owner, message, hint, data, severity=severity))
        if reads is not None:
            reads.want(unread)  # (after the alerts: they say how many passes were watched)
        if self.zero_look is not None:
            self._keep_graphs()
        return alerts

    def _unfed(
        self,
        info: ParamInfo,
        streak: _Streak,
        record: StepRecord,
        silent: list[tuple[ParamInfo, str]],
        judged: dict[str, bool],
    ) -> bool:
        """Whether an exactly zero streak from the first step, due now, is that of a
        layer not fed on those steps: judged once per streak, as it falls due (the
        healthy step never comes here), per silent group once a step (``judged``).

        The group is the largest module around the layer none of whose parameters
        got a non-zero gradient, below a model that learns. It was not fed where
        the latest pass's output reaches one of its parameters by a path through
        no activation and no op with a zero derivative: the gradient was zero
        before it reached the group (its output multiplied by zero, an empty
        capacity buffer with a zero combine weight). A group reached only through
        its activations may have dead units (a ReLU stuck at 0 from a large
        negative bias), and one holding an all-zero weight its gradient passes
        through (LoRA's A and B both zero) is held at zero: both told as usual,
        and so is a step where some output of the model got no gradient from the
        loss (a task weighted by zero for now: its own finding)."""
        if streak.unfed is not None:
            return streak.unfed
        streak.unfed = False
        look = self.zero_look
        if look is None or record.sharded or record.silent_outputs:
            return False  # (an output the loss sends nothing is told as such, at once)
        learning = {i.owner for i, norm in zip(record.present, record.param_norms) if norm != 0.0}
        group = _silent_group(info.owner, learning)
        if group is None:
            return False
        if group not in judged:
            inside = [
                i
                for i, kind in silent
                if kind == "zero" and (i.owner == group or i.owner.startswith(group + "."))
            ]
            judged[group] = not any(
                self._all_zero_partners(owner, params) for owner, params in by_owner(inside).items()
            ) and bool(look.reached_past_the_units({i.name for i in inside}))
        streak.unfed = judged[group]
        return streak.unfed

    def _keep_graphs(self) -> None:
        """The model's latest pass's graph is kept while some zero streak is not yet
        told: its alert names the op with a zero derivative behind it, if any."""
        assert self.zero_look is not None
        self.zero_look.want(
            any(s.kind == "zero" and not s.reported for s in self._streaks.values())
        )

    def _note_leavings(
        self, silent: list[tuple[ParamInfo, str]], dropped: tuple[ParamInfo, ...]
    ) -> None:
        """What the next steps' backward passes leave is noted while some parameter
        has no gradient or an exactly zero one, not yet told, or had its gradient
        dropped by the loop: a drop after backward (``p.grad = None``,
        ``p.grad.zero_()``) is told from a cut or a dead layer by it."""
        streaks = self._streaks
        assert self.leavings is not None
        if dropped or any(
            info.name not in streaks or not streaks[info.name].reported for info, _ in silent
        ):
            self.leavings.request()

    def _zero_ops(self, due: list[ParamInfo]) -> dict[str, list[str]] | None:
        """Per layer of ``due``, the ops with a zero derivative on every path from
        the latest pass's output to its parameters whose gradient is exactly zero;
        None where no pass's graph was kept to look at."""
        look = self.zero_look
        if look is None:
            return None
        wanted: dict[str, list[str]] = {}
        for info in due:
            if self._streaks[info.name].kind == "zero":
                wanted.setdefault(info.owner, []).append(info.name)
        return look.ops(wanted) if wanted else {}

    def _told_none(self, owner: str, params: list[ParamInfo]) -> None:
        """Note a module warned of as getting no gradient: a staged head whose loss
        term joins later has its warning withdrawn then (see _follow_joining)."""
        if owner not in self._settled:
            told = self._pending.setdefault(owner, [])
            told += [p.name for p in params if p.name not in told]

    def _never_withdrawn(self, owner: str | None) -> None:
        """A module told of otherwise (an exactly zero gradient, a reset) keeps
        whatever this rule told of it: a withdrawal would take all of it back."""
        if owner is not None:
            self._settled.add(owner)
            self._pending.pop(owner, None)

    def _follow_joining(
        self, info: ParamInfo, streak: _Streak, step: int, joined: set[str]
    ) -> None:
        """A parameter with a gradient whose streak just ended (or was a joined one):
        if its module was told of as getting none, it is followed while it keeps
        getting one, its module noted in ``joined`` once that lasted long enough.
        Parameters told of only: the usual step has no streak and never comes here."""
        told = self._pending.get(info.owner)
        if told is None or info.name not in told:
            return
        if streak.kind != _JOINED:
            streak = _Streak(step, _JOINED)
        streak.count += 1
        self._streaks[info.name] = streak
        if streak.count >= _JOINED_STEPS:
            joined.add(info.owner)

    def _withdrawn(self, record: StepRecord, joined: set[str]) -> list[Alert]:
        """Modules told of as getting no gradient whose every told parameter has had
        one for _JOINED_STEPS steps in a row, none of the module's parameters
        silent now: the module joined the loss late (a staged auxiliary head, a
        curriculum), and its warning is withdrawn, once, as a note dated at the
        step it joined. A cut for good (a .detach()) never gets here."""
        alerts = []
        for owner in sorted(joined):
            told = self._pending[owner]
            streaks = [self._streaks.get(name) for name in told]
            if any(s is None or s.kind != _JOINED or s.count < _JOINED_STEPS for s in streaks):
                continue
            if any(
                s.kind != _JOINED and name.rpartition(".")[0] == owner
                for name, s in self._streaks.items()
            ):
                continue  # another parameter of it silent now: its finding may be dated earlier
            for name in told:
                del self._streaks[name]
            self._never_withdrawn(owner)
            since = max(s.start for s in streaks if s is not None)
            listed = _listed(told, 4)
            alerts.append(
                self.alert(
                    since,
                    owner,
                    f"{listed} got a gradient in every step from step {since} on "
                    f"({record.step - since + 1} steps in a row): {owner or 'the model'} "
                    f"joined the loss at step {since} (a staged head, a curriculum), so the "
                    "warning that it got no gradient no longer stands",
                    _JOINED_HINT,
                    {
                        "kind": _JOINED,
                        "finding": _JOINED,
                        "withdraws": True,  # the warning no longer stands (--fail-on)
                        "parameters": list(told),
                        "since_step": since,
                        "steps": record.step - since + 1,
                    },
                    severity="info",
                )
            )
        return alerts

    def _left_out_of_update(
        self, record: StepRecord, silent: list[tuple[ParamInfo, str]]
    ) -> list[tuple[ParamInfo, str]]:
        """No parameter holds a gradient, yet the loop's own update moved some weights
        (gradients computed outside .grad: torch.func, torch.autograd.grad): those
        train, and their streaks end (begun where the first such step could not
        tell). The others, unmoved, are left out of that update: no .detach() to
        look for."""
        assert record.moved_without_grad is not None
        for name in record.moved_without_grad:
            self._streaks.pop(name, None)
        return [(info, "not_updated") for info, _ in silent]

    def _all_zero_partners(
        self, owner: str, params: list[ParamInfo]
    ) -> list[tuple[str, str | None]]:
        """Other weights of ``owner`` that are exactly zero everywhere (read now, as
        the alert is built), through which the zero gradient of ``params`` comes: a
        LoRA ``B`` initialised to zero makes ``A``'s gradient exactly zero until
        ``B`` moves. Weights whose own gradient is silent too are no such cause,
        unless they and some of ``params`` are all zeros alike (both halves of a
        LoRA initialised to zero): then each holds the other at zero, and all of
        them are returned, those of ``params`` among them."""
        held = self.held
        if held is None or not owner:
            return []
        silent = [name for name, streak in self._streaks.items() if streak.kind != _JOINED]
        return held.all_zero_partners(owner, [p.name for p in params], silent)

    def _returned_as_outputs(self, params: list[ParamInfo]) -> list[int]:
        """The output positions under which the model's latest pass returned
        ``params`` as they are (none read inside the model): empty where it did not,
        or no pass was looked at."""
        look = self.zero_look
        return look.returned([p.name for p in params]) if look is not None else []

    def _reset_before_step(self, record: StepRecord, cause: str) -> list[Alert]:
        """Told once per streak, after ``patience`` steps in a row, dated at its first:
        a step that drops its gradients now and then on purpose stays silent."""
        since, count, told = self._resets.get(record.optimizer, (record.step, 0, False))
        count += 1
        due = count >= self.config.patience and not told
        self._resets[record.optimizer] = (since, count, told or due)
        if not due:
            return []
        params = [*record.present, *record.dropped] if record.present else record.missing
        names = [info.name for info in params]
        module = common_module([info.owner for info in params])
        self._never_withdrawn(module)
        return [
            self.alert(
                since,
                module,
                f"the gradients of all {len(names)} parameters the optimizer steps were "
                f"{_RESET_HOW[cause]} after backward and before optimizer.step(), in "
                f"{count} consecutive step{'s' if count != 1 else ''} since step {since}: "
                "zero_grad() sits between backward and the step",
                _RESET_HINT,
                {
                    "kind": "reset_before_step",
                    "cause": cause,
                    "parameters": names[:50],
                    "count": len(names),
                    "since_step": since,
                    "steps": count,
                    "optimizer": record.optimizer,
                },
            )
        ]

    def _reset_before_update(self, record: HandUpdateRecord) -> list[Alert]:
        """Found by the step pipeline without an optimizer, once, after ``patience``
        hand-written updates in a row that wrote the weights and moved none."""
        found = record.zeroed
        if found is None:
            return []
        params = record.present
        names = found.parameters
        module = common_module([info.owner for info in params]) if params else ""
        self._never_withdrawn(module)
        count = found.updates
        updates = f"{count} consecutive update{'s' if count != 1 else ''} since step {found.since}"
        if found.at_backward_end:
            what = (
                f"each hand-written update wrote the weights of all {len(names)} trainable "
                f"parameters and left them exactly as they were, in {updates}: the gradients "
                "it applied were zero, zero_grad() sitting between backward and the update"
            )
        else:
            what = (
                f"the gradients of all {len(names)} trainable parameters were zeroed in place "
                f"after backward and before the hand-written update, in {updates}: each "
                "update wrote the weights and left them exactly as they were, zero_grad() "
                "sitting between backward and the update"
            )
        return [
            self.alert(
                found.since,
                module,
                what,
                _RESET_BY_HAND_HINT,
                {
                    "kind": "reset_before_step",
                    "cause": "zeroed_in_place",
                    "parameters": names[:50],
                    "count": len(names),
                    "since_step": found.since,
                    "steps": count,
                    "optimizer": None,
                    "update": "hand_written",
                },
            )
        ]

    def _not_called(self, record: StepRecord) -> list[Alert]:
        """The optimizer keeps stepping while the model is not called at all: none of
        its parameters gets a gradient, and no forward pass comes between its steps.
        No layer is cut off; the model holding them is no longer the one trained
        (replaced by a copy after the optimizer was built). Told once, for the
        whole model, after ``patience`` such steps."""
        for info in record.missing:
            self._streaks.pop(info.name, None)
        if self.reads is not None:
            self.reads.want(())
        since = record.not_called_since
        assert since is not None
        steps = record.step - since + 1
        if steps < self.config.patience or self._not_called_told:
            return []
        self._not_called_told = True
        params = [info for info in record.missing if info.in_model] or record.missing
        owner = common_module([info.owner for info in params])
        self._never_withdrawn(owner)
        count = len(params)
        return [
            self.alert(
                since,
                owner,
                f"optimizer {record.optimizer} keeps stepping while the model is not called "
                f"at all: none of its {count} parameter{'s' if count != 1 else ''} "
                f"({short_names(params)}) got a gradient in {steps} consecutive steps since "
                f"step {since}, and no forward pass of the model came between them: the "
                "model holding these parameters is no longer the one trained",
                "was the model replaced after the optimizer was built (model = "
                "copy.deepcopy(best), torch.ao.quantization.prepare_qat(model) or another "
                "inplace=False transform, a new instance loaded), so that the loop trains "
                "the new model while the optimizer still steps the old one's parameters? "
                "Build the optimizer over the new model, or load the weights into the model "
                "it holds instead (model.load_state_dict(best.state_dict())). If this model "
                "is paused on purpose, stop stepping its optimizer.",
                {
                    "kind": "model_not_called",
                    "parameters": [p.name for p in params],
                    "since_step": since,
                    "steps": steps,
                    "optimizer": record.optimizer,
                },
            )
        ]

    def _copy_in_optimizer(self, record: StepRecord) -> list[Alert]:
        """An EMA or averaged copy of a model sits in that model's optimizer: its
        parameters never get a gradient, by design (it runs under ``no_grad`` and
        is moved by its own update), so no layer of it is cut off. One note, told
        once per optimizer: a note and not a warning, since SGD, Adam and AdamW
        skip a parameter without a gradient (no momentum, no weight decay) and the
        copy stays as its update leaves it. (``copy_part``: the copy's class, where
        the copy is this model; None where it lies outside the model.)"""
        copied = record.copy_of
        assert copied is not None
        params = record.missing
        for info in params:
            self._streaks.pop(info.name, None)
        inside = record.copy_part is not None
        owner = "" if inside else params[0].owner
        count = len(params)
        what = (
            f"this model ({record.copy_part}) is a copy of {copied.name}, shape for shape, "
            f"and none of its {count} parameter{'s' if count != 1 else ''} "
            f"({short_names(params)}) gets a gradient"
            if inside
            else f"{count} parameters outside the model are, shape for shape and in order, "
            "a copy of the model's own, and none of them gets a gradient"
        )
        return [
            self.alert(
                record.step,
                owner,
                f"optimizer {record.optimizer} ({record.optimizer_class}) holds the parameters "
                f"of a copy of the model it trains beside the model's: {what}: an EMA or "
                "averaged copy handed to the optimizer",
                "an EMA copy (torch.optim.swa_utils.AveragedModel, or a copy.deepcopy moved "
                "by lerp_/mul_/add_ under no_grad) gets no gradient by design: it is moved by "
                "its own update and evaluated in eval mode, so nothing is cut off and no "
                "model.train() is missing. Its parameters were handed to the optimizer by "
                "mistake (SGD([*model.parameters(), *ema.parameters()])): build the "
                "optimizer over model.parameters() alone. Harmless as it stands with SGD, "
                "Adam or AdamW, which skip a parameter without a gradient (no momentum, no "
                "weight decay), unless the loop applies weight decay itself; were the copy "
                "ever run with gradients into the loss, the optimizer would move it off "
                "its average.",
                {
                    "kind": "copy_in_optimizer",
                    "copy_of": copied.name,
                    "copy_class": record.copy_part,
                    "parameters": [p.name for p in params],
                    "optimizer": record.optimizer,
                    "optimizer_class": record.optimizer_class,
                },
                severity="info",
            )
        ]

    def _reset_between_backwards(self, record: BetweenBackwardsRecord) -> list[Alert]:
        """Found by the step pipeline, once per optimizer, after ``patience`` steps."""
        found = record.wiped
        if found is None:
            return []
        names = [info.name for info in record.present]
        passes, wiped = found.backward_passes, found.wiped
        module = common_module([info.owner for info in record.present])
        self._never_withdrawn(module)
        return [
            self.alert(
                found.since,
                module,
                f"the optimizer steps once every {passes} backward passes, but zero_grad() "
                f"ran before each of them: only the last backward's gradients reach each "
                f"step, the other {wiped} {'is' if wiped == 1 else 'are'} wiped (in "
                f"{found.steps} consecutive steps since step {found.since}): each update "
                f"learns from a batch {passes}x smaller than meant (and, with the loss "
                f"divided by {passes} for the accumulation, takes a {passes}x smaller step)",
                _WIPED_HINT,
                {
                    "kind": "reset_between_backwards",
                    "backward_passes": passes,
                    "wiped": wiped,
                    "optimizer": record.optimizer,
                    "parameters": names[:50],
                    "count": len(names),
                    "since_step": found.since,
                    "steps": found.steps,
                },
            )
        ]

    def _without_signal(self, record: StepRecord) -> list[Alert]:
        """Told once, as a note, when the loss has sent nothing for many steps in a row."""
        since, count = self._no_signal or (record.step, 0)
        self._no_signal = (since, count + 1)
        if count + 1 < _NO_SIGNAL_STEPS or self._no_signal_told:
            return []
        self._no_signal_told = True
        return [
            self.alert(
                since,
                None,
                f"the loss sent no gradient into the model for {count + 1} consecutive steps "
                f"since step {since}: every gradient entering its output was exactly zero",
                _NO_SIGNAL_HINT,
                {"kind": "no_signal", "since_step": since, "steps": count + 1},
                severity="info",
            )
        ]


def _bias_learns(record: StepRecord, owner: str) -> bool:
    """Whether ``owner``'s bias got a non-zero gradient this step: the gradient
    reaches the layer's output. Asked as a zero-gradient alert is built."""
    bias = f"{owner}.bias" if owner else "bias"
    return any(
        info.name == bias and norm != 0.0 for info, norm in zip(record.present, record.param_norms)
    )


def _partner_to_name(
    partners: list[tuple[str, str | None]], params: list[ParamInfo]
) -> tuple[str, str | None]:
    """The all-zero weight an alert names: one that stays zero for good first (that
    is the bug); of weights that hold each other at zero, one not among ``params``
    (the other half), else the last (LoRA's B beside its A)."""
    if partners[0][1] == BOTH_ZERO:
        told = {p.name for p in params}
        return next((item for item in partners if item[0] not in told), partners[-1])
    return min(partners, key=lambda item: item[1] is None)


def _each_through_the_other(weights: list[str]) -> str:
    if len(weights) == 2:
        return (
            f"{weights[0]} and {weights[1]} are both all zeros, and the gradient of each "
            "passes through the other, so neither ever leaves zero"
        )
    return (
        f"{', '.join(weights)} are all zeros, and the gradient of each passes through "
        "the others, so none of them ever leaves zero"
    )


def _through_zero(name: str, params: list[ParamInfo]) -> str:
    gradients = "the gradients of" if len(params) > 1 else "the gradient of"
    verb = "pass" if len(params) > 1 else "passes"
    return f"{name} is all zeros, and {gradients} {short_names(params)} {verb} through it"


def _listed(names: list[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def _ran(record: StepRecord) -> frozenset[str]:
    """Modules seen running: those with a gradient this step, and the followed
    layers seen called on some step."""
    return record.calls_ran.union(info.owner for info in record.present)


def _siblings_ran(owner: str, ran: frozenset[str]) -> list[str]:
    """The members of the nearest container holding ``owner`` (or a module around
    it) that ran: for ``moe.experts.5.0``, the experts ``moe.experts.K`` with a
    module seen running. The model's own attributes are not taken for one
    container's members."""
    name = owner
    while True:
        parent, dot, _ = name.rpartition(".")
        if not dot or not ran:
            return []
        prefix, mine = parent + ".", name + "."
        found = {
            prefix + other[len(prefix) :].split(".", 1)[0]
            for other in ran
            if other.startswith(prefix) and other != name and not other.startswith(mine)
        }
        if found:
            return sorted(found)
        name = parent


def _silent_group(owner: str, learning: set[str]) -> str | None:
    """The largest module around ``owner`` (itself included) that holds no module of
    ``learning`` (those with a non-zero gradient), short of the model itself; None
    where ``owner`` is the model, or learns, or nothing learns."""
    if not owner or not learning or _holds(owner, learning):
        return None
    group = owner
    while (parent := group.rpartition(".")[0]) and not _holds(parent, learning):
        group = parent
    return group


def _holds(module: str, owners: set[str]) -> bool:
    prefix = module + "."
    return any(o == module or o.startswith(prefix) for o in owners)


def _held_by_a_container(info: ParamInfo, record: StepRecord) -> bool:
    """Whether ``info`` belongs to a module that holds other modules (a model's own
    ``nn.Parameter``), which its forward may read on some steps only; a leaf
    layer's parameters are read whenever it runs. Asked on the no-gradient path."""
    owner = info.owner
    prefix = owner + "." if owner else ""
    return any(
        other.owner != owner and other.owner.startswith(prefix)
        for other in (*record.present, *record.missing)
    )
