"""Whether training changes what the model computes: its first batch, re-run now and then.

A forward pass with gradients of a training phase's first step leaves a few
rows of its inputs behind (at most ``rows``, cloned once): the first pass of
each module the step ran. The model called whole runs one; a loop that calls
the model's parts (``self.head(self.encoder(x))``) runs each, and each is
measured: the model moved as far as the part that moved most, so a part
that trains shows the model training while another part stands still (a
head whose gradients a bug wipes, a backbone frozen on purpose). Its first
pass: a step with a closure (LBFGS) updates the weights between its
evaluations. A pass through a module with no trainable parameter is never
kept (re-run on its own inputs it cannot move: a frozen encoder), and one
whose module got no gradient while the step's weights did (cut off by a
stray ``detach()``) is left out; the last one so cut off leaves the phase
unmeasured.

Nothing is re-run inside a pass: between a forward and its backward the
graph holds the weights it saw, and a re-run that writes into one (an
``nn.Embedding(max_norm=...)`` renormalises its rows in place on every call)
would fail the user's backward. The model's output on the rows, the
reference, is taken at the first step's boundary, as its gradients are
gathered, and with the weights its passes saw: copies of them, put in place
of the model's own for the call, so that even a model that writes into its
weights when run in eval mode leaves the user's untouched. Where the step is
gathered after its update (``monitor.step()`` without an optimizer, a step
with a closure) those copies were taken before it: as the pass ended, or as
``step(closure)`` began.

Every ``every`` steps the model is run on those rows again, in eval mode,
without gradients and under the quiet marker (no other collector sees the
pass), with the RNG forked and the buffers swapped for copies, the user's
forward hooks held off (an activation kept for a penalty), and whatever
the forward changes in the model's state (MoCo's momentum update and queue,
a memory appended to, a weight renormalised in place, a generator of its
own drawn from) put back as it was (:class:`UndoneEffects`), so training
goes on bit for bit as it would have.
Batch-norm running statistics are the ones kept at the start of the phase:
they move on every training pass whatever the learning rate, so only the
weights can move the output. A model whose re-run would leave a change that
cannot be put back is stopped before it and not re-run again (see
:meth:`FirstBatchProbe._run`).

On the same sampled steps the weights are copied before the optimizer's
update (for a step with a closure, as ``step(closure)`` begins: it is
gathered only once it returned, its update made), which gives each layer's
update-to-weight ratio ``||dW|| / ||W||`` after it: about 1e-3 in healthy
runs, orders of magnitude less when the learning rate is effectively zero.
Without an optimizer a step boundary is no proof of an update: under
``trainwatch run`` each backward's end is one, so a hand-written loop with
micro-batches has boundaries with no update between them, and a sampled step
landing there finds every weight as it was. Where nothing was written into
the weights since they were copied (version counters and storages as they
were) and none moved while the output did move since the phase began, the
re-run waits for the next boundary, at most ``WAIT_AT_MOST`` of them (see
:meth:`FirstBatchProbe._waits_for_update`).
One step in ``RATE_EVERY`` is sampled as well, for the optimizers' learning
rates alone: a rate that collapsed shows there long before the re-runs see
the updates stop.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Sequence
from itertools import compress, filterfalse, groupby, repeat
from operator import attrgetter, is_, itemgetter, methodcaller, truediv
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from trainwatch.collect.grads import layer_norms
from trainwatch.collect.nonfinite_replay import replay_target
from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.rerun_effects import UndoneEffects, call_arguments
from trainwatch.collect.rerun_guard import rerun_guarded
from trainwatch.collect.small_norms import LayerSums
from trainwatch.collect.tensors import detached_copies, floating_tensors, tensor_leaves
from trainwatch.layers import LayerMap
from trainwatch.process_steps import PROCESS_STEPS
from trainwatch.record import StallReport, StepRecord

_NORM_STATS = nn.modules.batchnorm._NormBase
_TRAINING = attrgetter("training")
_PARAMETERS = attrgetter("_parameters")  # a module's weights, by name
_VERSION = attrgetter("_version")  # a tensor's in-place write counter
_DATA_PTR = methodcaller("data_ptr")
_REQUIRES_GRAD = attrgetter("requires_grad")
_GRAD = attrgetter("grad")
_NUMEL = methodcaller("numel")
_LAYER_INDEX = attrgetter("layer_index")
_OWNER = attrgetter("owner")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_DETACH = methodcaller("detach")
_CLONE = methodcaller("clone")
_FLOAT = methodcaller("float")
_POSITIVE = (0.0).__lt__  # a norm above zero (NaN is not)
_consume = deque(maxlen=0).extend  # runs a C loop (a ``map``) for its effects
# Steps between two looks at the learning rates: a look reads every param
# group's ``lr`` in Python, which a healthy step must not pay for.
RATE_EVERY = 10
# Step boundaries a re-run waits at most, without an optimizer, for an update
# between two of them: a hand-written accumulation of more micro-batches than
# this is rare; a phase whose wait found none waits no more.
WAIT_AT_MOST = 64


class FirstBatchProbe:
    """Keeps a phase's first batch (a few rows) and measures how far the output moved on it.

    Healthy steps must not pay for it: it listens to the passes only until it
    has its batch, and the monitor reads the sampled steps off plain
    attributes (``loss_until``, ``look_from``) without a call. A model wrapped in
    DDP is re-run through its inner module (no collective on one rank), one with
    SyncBatchNorm or FSDP-sharded parts not at all.

    ``optimizers``: the watched optimizers (the monitor's own list, which it adds
    to). With none, ``monitor.step()`` marks each step once its update is made,
    so the weights a pass saw are copied as it ends; None: every step is
    gathered before its update.
    """

    def __init__(
        self,
        passes: ModelPasses,
        every: int,
        rows: int,
        loss_window: int,
        optimizers: Sequence[Any] | None = None,
    ) -> None:
        self.every = every
        self.rows = rows
        self.loss_window = loss_window
        self._passes = passes
        self._optimizers = optimizers
        self.phase = 0  # counts the training phases, from 1
        self._phase_start = 0  # the first step of the current phase
        # The sampled steps: the first ``loss_window`` of the phase, the
        # ``loss_window`` before each re-run, and the step the re-run follows.
        self.loss_until = 0
        self.due = 0
        self.loss_from = 0
        # The next look at the learning rates, and the first sampled step after
        # ``loss_until``: the earlier of that look and ``loss_from``.
        self.rates_due = 0
        self.look_from = 0
        # The phase's first step is over: its passes are no longer listened to.
        self.settled = False
        # Until the phase's first step with a pass is gathered: a step with a
        # closure beginning copies the weights its passes will see (read by the
        # step pipeline as a plain attribute). Its first steps with no pass seen
        # end it: a phase whose passes show up later copies no weights at every
        # step meanwhile.
        self.first_step_open = True
        # While not settled: PROCESS_STEPS.taken at the latest pass with gradients
        # (None: none yet this phase). A step taken since ends the first step:
        # its last pass is the one to keep.
        self._since: int | None = None
        # The first step's passes that may give the phase's batch, the last to run
        # last: the module, its first rows (args, kwargs), its norm layers' running
        # statistics. They are run at the step's boundary (:meth:`_take_reference`).
        self._candidates: list[tuple[weakref.ref[nn.Module], Any, Any, list[Any]]] = []
        # Copies of the weights the first step's passes saw, taken before an update
        # that comes ahead of the step's boundary: id -> (weight, copy).
        self._first_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # A step boundary went by unsampled since the first step's passes: weights
        # not copied before it may have moved.
        self._missed = False
        # The sampled steps report: a batch is kept, or the model's re-run would
        # leave a change that cannot be put back and the output's move is left
        # out (None).
        self._ready = False
        # Models whose re-run would have left a change that cannot be put back (by
        # id, each held weakly): not re-run again. Told once (``stopped``).
        self._lasting: dict[int, weakref.ref[nn.Module]] = {}
        self.stopped = ""
        # The weights as a step with a closure began (its step, its parameters,
        # their copies): that step is gathered after its update.
        self._held: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        # monitor.step() comes after the update: the weights at the boundary before a re-run,
        # and where they stood then (version counters, storages).
        self._weights_at_boundary: list[torch.Tensor] | None = None
        # The passes measured: the model's, or each part's where the loop calls
        # the parts (the last to run first).
        self._parts: list[_Part] = []
        self._marks: tuple[list[int], list[int]] | None = None
        # Boundaries the re-run has waited so far for an update between two of them,
        # and whether it still may in this phase (see _waits_for_update).
        self._waited = 0
        self._may_wait = True
        # Kept between reports while the parameters stay as they were: the
        # per-layer sums of the update ratios, and the trainable counts.
        self._sums: tuple[list[str], tuple[int, ...], tuple[LayerSums, list[str]]] | None = None
        self._counts: tuple[list[str], Any, tuple[int, int, list[str]]] | None = None

    # -- the passes ------------------------------------------------------------
    def pass_starts(self, module: nn.Module) -> None:
        return None

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.settled or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        since = self._since
        if since is not None and since != PROCESS_STEPS.taken:
            # A step ended since the latest pass (one not sampled): that pass
            # was the first step's last, and an update may have come since. Its
            # candidates run at the next sampled step's boundary, not here: this
            # pass's backward is still to come.
            self._missed = True
            self._settle()
            return
        self._since = PROCESS_STEPS.taken
        target = replay_target(module)  # never a collective: DDP's inner module, or nothing
        candidates = self._candidates
        if target is None or (candidates and candidates[-1][0]() is target):
            # Its first pass of the step is kept: the later ones (micro-batches, an
            # LBFGS step's evaluations, which follow updates of its own) add nothing.
            return
        if any(map(_REQUIRES_GRAD, target.parameters())):
            self._note(target, args, kwargs)  # the step's last module so far

    def restart(self, step: int) -> None:
        """A new phase (the first, a new optimizer, a replaced module): a new first batch."""
        self.phase += 1
        self._phase_start = step
        self.loss_until = step + self.loss_window
        self._schedule(step + self.every - 1)
        self.settled = False
        self.first_step_open = True
        self._since = None
        self._may_wait = True
        self._forget()
        if not self._passes.listens(self):
            self._passes.subscribe("stalled training", self, starts=False)

    def passed(self, step: int) -> None:
        """The re-run at ``step`` is over (or was not possible): the next one."""
        self._schedule(step + self.every)

    def _schedule(self, due: int) -> None:
        self.due = due
        self.loss_from = due - self.loss_window + 1
        self.look_from = min(self.loss_from, self.rates_due)

    def rates_read(self, step: int) -> None:
        """The learning rates were read at ``step``: the next look, ``RATE_EVERY`` on."""
        self.rates_due = step + RATE_EVERY
        self.look_from = min(self.loss_from, self.rates_due)

    def detach(self) -> None:
        self._passes.unsubscribe(self)
        self.settled = True
        self.first_step_open = False
        self._forget()

    def _forget(self) -> None:
        """The phase's batch, its candidates and every copy of the weights, dropped."""
        self._parts = []
        self._candidates = []
        self._first_weights = {}
        self._missed = self._ready = False
        self._weights_at_boundary = self._held = self._marks = None
        self._waited = 0

    def _settle(self) -> None:
        """The first step's passes are over: the passes that follow cost nothing."""
        self.settled = True
        self.first_step_open = False
        self._passes.unsubscribe(self)

    def closure_step_begins(self, params: Sequence[torch.Tensor], step: int) -> None:
        """A step with a closure begins, the phase's first or the re-run's: the
        weights before its update (its evaluations see them first), kept for the
        reference and for :meth:`sample` (both reached after the update). Each its
        own copies: a reference run may write into those it is given. A lazy
        module's weights, not made before the closure's first forward, have
        nothing to copy yet: the reference copies them at the boundary."""
        if any(map(is_lazy, params)):
            params = list(filterfalse(is_lazy, params))
        if self.first_step_open:
            self._first_weights.update(zip(map(id, params), zip(params, _copies(params))))
        if step == self.due:
            self._held = (step, list(params), _copies(params))

    # -- the sampled steps -------------------------------------------------------
    def sample(
        self, record: StepRecord, params: Sequence[torch.Tensor], step: int
    ) -> tuple[bool, list[torch.Tensor] | None]:
        """One of the sampled steps: the rule sees its loss. Returns whether the re-run
        follows this step, and the weights before its update (None: not known).

        An optimizer's pre-step hook comes before the update; ``monitor.step()``
        after it, so there the weights are copied one step boundary earlier; a
        step with a closure is gathered after its update, so its weights were
        copied as it began (:meth:`closure_step_begins`). The first sampled step
        after the phase's first passes takes the reference: a step boundary, no
        forward waiting for its backward.
        """
        record.stall_phase = self.phase
        if not self.settled:
            if self._since is not None:
                self._settle()  # the first step's passes are over
            else:
                self._first_weights = {}  # a step with no pass: nothing its weights fit
                # (the phase may have begun in this very gathering: its step is next)
                self.first_step_open = step <= self._phase_start
        if self._candidates:
            self._take_reference(params)  # the first step's boundary: nothing is in a pass
        if step > self.due:
            self.passed(step - 1)  # steps counted elsewhere (a resumed run)
        ready = self._ready
        manual = record.source == "manual"
        if manual and step == self.due - 1 and ready:
            self._weights_at_boundary = _copies(params)
            self._marks = _marks(params)
        if step != self.due:
            return False, None
        if not ready:
            self.passed(step)  # no batch kept (yet): the next stretch
            return False, None
        if manual:
            before, self._weights_at_boundary = self._weights_at_boundary, None
            return True, before
        held = self._held
        if held is not None and held[0] == step:
            # A step with a closure: the weights as it began, if it stepped the same ones.
            kept, copies = held[1], held[2]
            same = len(kept) == len(params) and all(map(is_, kept, params))
            return True, copies if same else None
        return True, _copies(params)

    def report(
        self,
        step: int,
        params: Sequence[torch.Tensor],
        before: list[torch.Tensor] | None,
        layers: LayerMap,
    ) -> StallReport | None:
        """The output's move on the first batch and each layer's update ratio, after the
        update; None where no update came since the weights were copied (the re-run
        waits for the next boundary)."""
        self._held = None
        ratios = self._ratios(params, before, layers)
        change = self._change()
        if self._waits_for_update(step, params, before, ratios, change):
            return None
        self.passed(step)
        trainable, total, where = self._trainable(layers)
        stopped, self.stopped = self.stopped, ""
        return StallReport(
            steps=step - self._phase_start + 1,
            change=change,
            update_ratios=ratios,
            trainable=trainable,
            total=total,
            trainable_in=where,
            rerun_stopped=stopped,
        )

    def _waits_for_update(
        self,
        step: int,
        params: Sequence[torch.Tensor],
        before: list[torch.Tensor] | None,
        ratios: dict[str, float],
        change: float | None,
    ) -> bool:
        """Whether the re-run waits for the next boundary: without an optimizer, no
        weight was written since ``before`` was copied (version counters and storages
        as they were then) and none moved (every ratio exactly 0), while the output
        moved since the phase began (``change`` above 0, or not measured: updates do
        come). That boundary had no update (a micro-batch of a hand-written
        accumulation, each backward's end a step under ``trainwatch run``):
        ``||dW|| = 0`` there says nothing of the updates. A model whose output never
        moved (nobody updates it) and an update that wrote the weights and moved none
        (zeroed gradients, a learning rate of 0) are measured as they are. After
        ``WAIT_AT_MOST`` boundaries without an update the phase's re-runs wait no
        more (updates through ``.data`` that stopped moving anything)."""
        marks, self._marks = self._marks, None
        if (
            marks is None
            or before is None
            or not ratios
            or any(ratios.values())
            or (change is not None and not change > 0.0)
        ):
            self._waited = 0
            return False
        if not self._may_wait or _marks(params) != marks:
            self._waited = 0
            return False
        self._waited += 1
        if self._waited > WAIT_AT_MOST:
            self._may_wait = False
            self._waited = 0
            return False
        self._weights_at_boundary, self._marks = before, marks  # the weights still
        self._schedule(step + 1)
        return True

    def _ratios(
        self, params: Sequence[torch.Tensor], before: list[torch.Tensor] | None, layers: LayerMap
    ) -> dict[str, float]:
        """Each layer's ``||dW|| / ||W||``: the norms in one batched kernel each, their
        per-layer sums in C loops (:class:`LayerSums`, kept while the parameters stay)."""
        flags = list(map(_REQUIRES_GRAD, params))
        now = list(compress(params, flags))
        old = list(compress(before or [], flags))
        if len(old) < len(now):  # fewer weights kept than the step holds: those kept
            now = now[: len(old)]
        if not now:
            return {}
        with torch.no_grad():
            floats = list(map(_FLOAT, map(_DETACH, now)))
            moved = torch._foreach_sub(floats, list(map(_FLOAT, old)))
            both = [*torch._foreach_norm(moved), *torch._foreach_norm(floats)]
            norms = torch.stack(both).tolist()
        count = len(now)
        kept = self._layer_sums(now, layers)
        if kept is not None:
            sums, names = kept
            updates, weights = sums.of(norms[:count]), sums.of(norms[count:])
            if updates is not None and weights is not None:
                return _divided(updates[0], weights[0], names)
        # A weight outside the model, or a non-finite norm: the general way.
        infos = [layers.info(p) for p in now]
        weights = layer_norms(infos, norms[count:], layers.layers)[0]
        updates = layer_norms(infos, norms[:count], layers.layers)[0]
        return _divided(updates, weights, list(weights))

    def _layer_sums(
        self, params: list[torch.Tensor], layers: LayerMap
    ) -> tuple[LayerSums, list[str]] | None:
        """The per-layer sums of these parameters, in this order, and their layers in
        the order the parameters name them; None when one is not the model's. The
        map keeps the parameters it knows alive, so their ids key the sums safely
        while it is the map."""
        key = tuple(map(id, params))
        kept = self._sums
        if kept is not None and kept[0] is layers.layers and kept[1] == key:
            return kept[2]
        infos = list(map(layers.known().get, key))
        if any(map(is_, infos, repeat(None))):
            return None
        names = list(dict.fromkeys(map(layers.layers.__getitem__, map(_LAYER_INDEX, infos))))
        found = LayerSums(infos, layers.layers), names
        self._sums = (layers.layers, key, found)
        return found

    def _trainable(self, layers: LayerMap) -> tuple[int, int, list[str]]:
        """Trainable and total parameter counts, and the modules holding the most
        trainable ones: worked out again only when a size or a flag changed."""
        params = layers.parameters()
        key = (tuple(map(_NUMEL, params)), tuple(map(_REQUIRES_GRAD, params)))
        kept = self._counts
        if kept is not None and kept[0] is layers.layers and kept[1] == key:
            return kept[2]
        found = _trainable(layers, params, *key)
        self._counts = (layers.layers, key, found)
        return found

    # -- internals ---------------------------------------------------------------
    def _note(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """``module``'s pass, a candidate for the phase's batch in place of an earlier
        pass of the same module: its first rows and its norm layers' running
        statistics cloned now, its run left for the step's boundary. With no
        optimizer watched that boundary comes after the update: the weights the
        pass saw are copied too."""
        batch = _batch_size(args, kwargs)
        rows = _first_rows(args, batch, self.rows)
        named = _first_rows(kwargs, batch, self.rows)
        stats = [
            (sub._buffers, name, buf.detach().clone())
            for sub in module.modules()
            if isinstance(sub, _NORM_STATS)
            for name, buf in sub._buffers.items()
            if buf is not None
        ]
        if self._optimizers is not None and not self._optimizers:
            self._hold_weights(list(filter(_REQUIRES_GRAD, module.parameters())))
        candidates = [kept for kept in self._candidates if kept[0]() is not module]
        candidates.append((weakref.ref(module), rows, named, stats))
        self._candidates = candidates

    def _hold_weights(self, params: list[torch.Tensor]) -> None:
        """Copies of ``params`` as they are now, for the reference (one held stays)."""
        held = self._first_weights
        fresh = [param for param in params if id(param) not in held]
        held.update(zip(map(id, fresh), zip(fresh, _copies(fresh))))

    def _take_reference(self, params: Sequence[torch.Tensor]) -> None:
        """At the first step's boundary (its backward over): its candidate passes run,
        the last first, each with the weights it saw; each whose output can be
        measured (not constant, not failed) is one of the phase's batches. The
        model called whole gives one; a loop calling the parts
        (``self.head(self.backbone(x))``) gives each part's, so that a part
        training while another does not (a head whose gradients a bug wipes)
        still shows the model moving. Unless the last one measured got no
        gradient while ``params`` (the step's weights) did: its output, cut off
        from the loss, cannot tell whether training changes anything, and the
        phase is not measured; an earlier part cut off so is left out. None
        measured while a model's re-run would have left a change that cannot be
        put back: the sampled steps report without the output's move."""
        candidates, self._candidates = self._candidates, []
        held, self._first_weights = self._first_weights, {}
        missed, self._missed = self._missed, False
        lasting = False
        parts: list[_Part] = []
        for ref, rows, named, stats in reversed(candidates):
            module = ref()
            if module is None:
                continue
            if self._left_lasting(module):
                lasting = True
                continue
            swap = _weights_seen(module, held, missed)
            if swap is None:
                continue  # updated since its pass, its weights not copied before
            output = self._run(module, rows, named, stats, swap)
            if output is None:
                lasting = lasting or self._left_lasting(module)
                continue
            spread = float(output.std()) if output.numel() > 1 else 0.0
            if not math.isfinite(spread) or spread <= 0.0:
                continue  # a constant output: nothing to measure a move against
            if (
                not missed
                and _any_grad(params)
                and not _any_grad(filter(_REQUIRES_GRAD, module.parameters()))
            ):
                if not parts:
                    return
                continue
            parts.append(_Part(ref, rows, named, stats, output, spread))
        self._parts = parts
        self._ready = bool(parts) or lasting

    def _left_lasting(self, module: nn.Module) -> bool:
        """Whether a re-run of ``module`` was stopped before a change it could not
        put back (usually none was)."""
        lasting = self._lasting
        if not lasting:
            return False
        ref = lasting.get(id(module))
        return ref is not None and ref() is module

    def _change(self) -> float | None:
        """The largest move of a measured pass's output over its spread (None: none
        measured now): the model moves as far as its part that moved most."""
        moves = [move for part in self._parts if (move := self._moved(part)) is not None]
        return max(moves) if moves else None

    def _moved(self, part: _Part) -> float | None:
        module = part.module()
        if module is None or self._left_lasting(module):
            return None
        output = self._run(module, part.args, part.kwargs, part.stats, None)
        reference = part.reference
        if output is None or output.shape != reference.shape:
            return None
        moved = float((output - reference).pow(2).mean().sqrt())
        return moved / part.spread if math.isfinite(moved) else None

    def _run(
        self,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        stats: list[tuple[dict[str, Any], str, torch.Tensor]],
        swap: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor | None:
        """Rows through ``module``, as training would never see it: its output (None
        if it fails).

        ``swap``: (weight, copy) pairs, each copy in its weight's place for the
        call wherever a module registers it (a tied weight in each).

        A forward may change state as it runs, on every call: a momentum
        encoder moved (``param_k.data = ...`` or in place), a queue of keys
        written and its pointer moved, a memory appended to, a weight
        renormalised (``nn.Embedding(max_norm=...)``), a counter, a
        ``setattr`` of an ``nn.Parameter``. All of it is put back as it was
        once the call returns (:class:`UndoneEffects`), the values written and
        their version counters included, so training goes on bit for bit and
        a graph that saved a weight still runs its backward. A change that
        could not be put back is not made (the call is stopped before it):
        that model is not re-run again.
        """
        subs = list(module.modules())
        modes = list(map(_TRAINING, subs))
        devices = _cuda_devices(module)
        effects = UndoneEffects(subs, call_arguments(args, kwargs))
        try:
            with rerun_guarded(module, subs, devices, effects):
                for buffers, name, kept in stats:
                    buffers[name] = kept.clone()  # the phase's running statistics
                if swap:
                    weights = list(map(_PARAMETERS, subs))
                    _swap_in([table for table in weights if isinstance(table, dict)], swap)
                _consume(map(setattr, subs, repeat("training"), repeat(False)))
                output = module(*detached_copies(args), **detached_copies(kwargs))
                flat = [t.detach().float().reshape(-1) for t in floating_tensors(output)]
                found = torch.cat(flat) if flat else None
        except Exception:
            # A model that cannot run on a few of its own rows again (a fixed
            # batch size, a change it could not put back) is not measured;
            # training is untouched either way.
            found = None
        finally:
            _consume(map(setattr, subs, repeat("training"), modes))
        if effects.lasting:
            self._lasting[id(module)] = weakref.ref(module)
            self.stopped = self.stopped or effects.lasting
        return found


class _Part:
    """One pass measured: its module (held weakly), its first rows, its norm
    layers' running statistics then, its output on them and that output's spread."""

    __slots__ = ("module", "args", "kwargs", "stats", "reference", "spread")

    def __init__(
        self,
        module: weakref.ref[nn.Module],
        args: Any,
        kwargs: Any,
        stats: list[tuple[dict[str, Any], str, torch.Tensor]],
        reference: torch.Tensor,
        spread: float,
    ) -> None:
        self.module = module
        self.args = args
        self.kwargs = kwargs
        self.stats = stats
        self.reference = reference
        self.spread = spread


def _swap_in(tables: list[dict[str, Any]], swap: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each weight of ``swap`` replaced by its copy in every table that holds it."""
    copies = {id(weight): copy for weight, copy in swap}
    for table in tables:
        for name, value in list(table.items()):
            copy = copies.get(id(value))
            if copy is not None:
                table[name] = copy


def _weights_seen(
    module: nn.Module, held: dict[int, tuple[torch.Tensor, torch.Tensor]], missed: bool
) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(weight, copy) for each of ``module``'s trainable weights as its pass saw
    them: held since (copied before an update), or copied now, at a boundary
    before the update; None where one was not held and a boundary went by
    (``missed``). Frozen weights do not move: they stay in place."""
    params = list(filter(_REQUIRES_GRAD, module.parameters()))
    fresh = [param for param in params if id(param) not in held]
    if fresh and missed:
        return None
    held.update(zip(map(id, fresh), zip(fresh, _copies(fresh))))
    return list(map(held.__getitem__, map(id, params)))


def _divided(
    updates: dict[str, float], weights: dict[str, float], names: list[str]
) -> dict[str, float]:
    """``updates[layer] / weights[layer]`` for each of ``names`` (in that order) whose
    weights' norm is above zero, in C loops."""
    values = list(map(weights.__getitem__, names))
    positive = list(map(_POSITIVE, values))
    moved = map(updates.__getitem__, compress(names, positive))
    return dict(zip(compress(names, positive), map(truediv, moved, compress(values, positive))))


def _any_grad(params: Any) -> bool:
    """Whether any of ``params`` holds a gradient."""
    return not all(map(is_, map(_GRAD, params), repeat(None)))


def _marks(params: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Where ``params`` stand: their version counters and storages (C loops)."""
    return list(map(_VERSION, params)), list(map(_DATA_PTR, params))


def _copies(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(map(_CLONE, map(_DETACH, params)))


def _batch_size(args: Any, kwargs: Any) -> int | None:
    for _, tensor in tensor_leaves((args, kwargs)):
        if tensor.dim() > 0:
            return tensor.shape[0]
    return None


def _first_rows(value: Any, batch: int | None, rows: int) -> Any:
    """``value`` with each batch-first tensor cut to its first ``rows`` rows, all cloned."""
    if isinstance(value, torch.Tensor):
        if batch is not None and batch > rows and value.dim() > 0 and value.shape[0] == batch:
            value = value[:rows]
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_first_rows(item, batch, rows) for item in value))
    if type(value) in (tuple, list):
        return type(value)(_first_rows(item, batch, rows) for item in value)
    if type(value) is dict:
        return {key: _first_rows(item, batch, rows) for key, item in value.items()}
    return detached_copies(value)


def _cuda_devices(module: nn.Module) -> list[int]:
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cuda":
        return []
    return [first.device.index if first.device.index is not None else 0]


def _trainable(
    layers: LayerMap, params: list[torch.Tensor], counts: tuple[int, ...], flags: tuple[bool, ...]
) -> tuple[int, int, list[str]]:
    """Trainable and total parameter counts (``counts``, ``flags``: the map's
    ``params``' sizes and whether each is trainable), and the three modules
    holding the most trainable ones, the first named first among equals."""
    known = layers.known()
    owners = list(map(_OWNER, map(known.__getitem__, map(id, compress(params, flags)))))
    trainable = list(compress(counts, flags))
    pairs = sorted(zip(owners, trainable))
    by_owner = {owner: sum(map(_SECOND, pair)) for owner, pair in groupby(pairs, _FIRST)}
    where = sorted(dict.fromkeys(owners), key=by_owner.__getitem__, reverse=True)[:3]
    return sum(trainable), sum(counts), where
