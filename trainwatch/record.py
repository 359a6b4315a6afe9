"""What one training step looked like, as plain host-side data.

Collectors fill it, the readback turns its device tensors into floats, rules
read it. Rules never see a model, so each can be tested with a hand-built
record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainwatch.fresh import fresh_maker
from trainwatch.layers import ParamInfo
from trainwatch.overwrite_conversion import Conversion
from trainwatch.process_steps import OriginTold


@dataclass(frozen=True)
class CopiedFrom:
    """What a target network copies: a model an optimizer trains, or a part of this
    model, by ``name``; and where it copies only some of it (BYOL's target: the
    online network less its predictor), the largest modules it copies, by their
    names in that model (or in this one, for a part)."""

    name: str
    parts: tuple[str, ...] = ()


@dataclass
class NonfiniteReport:
    """Where a NaN/Inf was born, with module names resolved."""

    module: str | None
    # "module", "input" (data), "loss", "parameter"; "unlocated" when the
    # step's forward ran where no hook sees it (a model compiled in place);
    # "norm_overflow" (as ``nonfinite_backward`` only): no NaN/Inf at all, the
    # gradients are finite but their norm overflowed (exploding_gradient tells it)
    cause: str
    kind: str | None = None
    count: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    device: str | None = None
    input_min: float | None = None
    input_max: float | None = None
    op: str | None = None
    source: str | None = None
    op_basis: str | None = None
    # The op's own inputs held -inf (a mask made inside the module).
    op_inputs_masked: bool = False
    parameter: str | None = None
    spread: list[str] = field(default_factory=list)
    # exploding_gradient was reported before: the NaN/Inf is where that led
    # (a learning rate too high), not a log or a division at its domain's edge.
    after_exploding: bool = False
    # The gradients' norm overflowed while every gradient is finite: the largest
    # element (in ``parameter``), and the total norm a clip_grad_norm_ in progress
    # measured (None: none was).
    largest: float | None = None
    clip_norm: float | None = None
    # "loss": the loss the training code held, when it was not handed over
    # (None: not found), and whether the op named in its backward lies under a
    # torch.where (the branch it did not pick still went through backward).
    loss: float | None = None
    under_where: bool = False
    # Non-finite where it entered the model, while every parameter's gradient is
    # finite: the model's own forward (a ReLU or clamp at its output) zeroed it.
    gradients_finite: bool = False


@dataclass
class AmpReport:
    """What the loss scaler did up to this step, once its warm-up is over.

    A GradScaler that starts high skips every step until its scale fits:
    those skips come before any update was applied and are never reported.
    """

    # Backward passes in a row that no optimizer step used (GradScaler skipping).
    skipped: int = 0
    # Backward passes per optimizer step when healthy (gradient accumulation).
    passes_per_step: int = 1
    # The GradScaler's loss scale, where one is visible (``tw.watch(scaler=...)``,
    # Lightning's precision plugin).
    scale: float | None = None


@dataclass
class ModeReport:
    """Mode-dependent modules (dropout, batch norm) in the wrong mode for a pass."""

    modules: list[str]  # qualified names, in the order the model calls them
    kinds: list[str]  # class names (or the function called), aligned with ``modules``
    # The root module itself is in that mode: the whole model was switched
    # (``model.eval()`` with no ``model.train()``), not a chosen part of it. For a
    # part called on its own, the part's root; and, in training mode, the model's
    # too (a part put back in ``train()`` after ``model.eval()`` is a chosen part).
    whole_model: bool
    total: int  # mode-dependent modules in the model
    # Those of ``modules`` inside a frozen part of the model (the nearest module
    # holding parameters, itself or an ancestor, has none that trains): a frozen
    # backbone, teacher or loss network kept in eval on purpose.
    in_frozen_parts: list[str] = field(default_factory=list)
    # Found on a training pass, modules in eval mode: the modules ``.eval()`` was
    # called on, below a pass root still in training mode, whose own layers train
    # (``self.net.eval()`` left on inside a LightningModule). Their modules are the
    # forgotten ``.train()``, norms among them too: the frozen-statistics idiom
    # puts the norm layers alone in eval, or a frozen part.
    parts_in_eval: list[str] = field(default_factory=list)
    # The frozen parts holding ``modules``, as ``.eval()`` would be called on them
    # (``backbone``; or sibling parts frozen together, ``conv1``, ``bn1``,
    # ``layer1``... of a ResNet whose ``fc`` trains): what a ``during_training``
    # report names.
    frozen_parts: list[str] = field(default_factory=list)
    # Found on a training pass: a large frozen part (a teacher, a backbone) ran in
    # training mode while the rest of the model trains.
    during_training: bool = False
    # A ``during_training`` report told earlier, its part training now (a freeze
    # undone: a staged fine-tune, the backbone unfrozen after the head's warm-up):
    # the finding no longer stands.
    trains_now: bool = False
    # That part's parameters still require grad, but no watched optimizer holds
    # them and no step saw them with a gradient (a teacher never frozen).
    held_by_no_optimizer: bool = False
    # Passes of a model whose weights stayed unchanged, with no step of its own,
    # while other models' optimizers stepped between them: used frozen, a teacher
    # or target, not evaluated.
    frozen_use: bool = False
    # That model trained here first (then stopped): not one loaded and used.
    trained_first: bool = False
    # A no-grad pass's first input tensor (None: not a floating one) and first
    # floating output, by shape: whether it drew samples from a latent vector
    # (``collect/eval_passes.py``'s ``generator_sample``), read only when told.
    input_shape: tuple[int, ...] | None = None
    output_shape: tuple[int, ...] | None = None


@dataclass
class BroadcastReport:
    """An elementwise op on the model's output that broadcast a batch axis against
    another, or a class-index map across the output's channels."""

    op: str
    shapes: list[tuple[int, ...]]
    result: tuple[int, ...]
    source: str | None = None
    # "training": in a training step's loss; "evaluation": in what an evaluation
    # computed from the model's outputs (a validation loss, a metric).
    phase: str = "training"
    # The part of the model whose output it is, called on its own (a PPO agent's
    # ``critic``); None for the model's own output.
    module: str | None = None
    # "batch": samples paired with samples; "class_index_map": a target of class
    # indices ``(N, 1, H, W)`` broadcast over the output's ``(N, C, H, W)`` channels.
    kind: str = "batch"
    # class_index_map only: the channel axis, the map's smallest and largest index,
    # and the value it marks pixels to ignore with (255, -100), where it holds one.
    axis: int | None = None
    values: tuple[int, int] | None = None
    ignored: int | None = None


@dataclass
class LossInputReport:
    """A loss function that takes logits given the output of a softmax or sigmoid."""

    # "softmax_into_cross_entropy", "softmax_into_nll", "sigmoid_into_bce_with_logits",
    # "logits_into_nll" (raw scores where log-probabilities belong).
    kind: str
    loss: str  # the loss function, as torch names it ("cross_entropy")
    source: str | None = None
    # The model's forward applied the softmax (its output is probabilities), not the loop.
    in_forward: bool = False
    # The part of the model whose pass made them ("" for the model's own pass);
    # None where the loop applied the softmax.
    module: str | None = None
    # logits_into_nll only: the largest input value measured, and the largest
    # |logsumexp| of a row over the classes (log-probabilities: at most 0, and 0).
    largest: float | None = None
    logsumexp: float | None = None


@dataclass
class ActivationStats:
    """One module's sampled output statistics for a step (host floats)."""

    module: str
    # Which of the module's outputs ("logits", "hidden.0"; "" for a plain
    # tensor), and whether it is the primary one (the first batch-first one
    # carrying gradient: a model's prediction).
    output: str = ""
    primary: bool = True
    # Mean over features of the standard deviation across the batch, for the
    # output and for the module's first input; the output's RMS and mean.
    out_spread: float | None = None
    in_spread: float | None = None
    out_rms: float | None = None
    out_mean: float | None = None
    # ReLU family only: fraction of sampled outputs that are exactly zero, and
    # of positions (units) that are zero for every sampled row.
    zero_fraction: float | None = None
    dead_fraction: float | None = None
    rows: int = 0


@dataclass
class FrozenOutput:
    """Frozen layers the model's output comes straight from, while other parameters train."""

    layers: list[str]  # qualified names
    frozen: int  # their parameter elements
    upstream: int  # elements of the trainable parameters behind them
    # The frozen layers behind them, up to the first that train, and the elements
    # of all (theirs included): a head, or a whole frozen network after what trains.
    behind: list[str] = field(default_factory=list)
    tail: int = 0


@dataclass
class LooseTraining:
    """What the optimizers train where no layer of the model trains: the root's own
    parameters and tensors held by no module, which feed none of its layers."""

    names: list[str]  # the root's own parameters among them
    outside: int  # tensors held by no module
    elements: int  # elements of all of them
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # of those outside


@dataclass
class SetupCheck:
    """What the trainable-parameter audit hands its rule (counts in parameter elements)."""

    revision: int  # which audit: 0 the first, one more for each change of the setup
    optimizers: int  # watched optimizers
    trainable: int
    unheld: int  # trainable elements no watched optimizer holds
    trainable_owners: list[str] = field(default_factory=list)
    # Where none of the model's parameters is trainable: the trainable elements the
    # watched optimizers hold all the same, outside the model (another model's:
    # under trainwatch run each model's monitor sees a shared optimizer whole).
    trained_outside: int = 0
    # First step after the audit: the trainable parameters the step should
    # have used, when a backward ran and none of them got a gradient.
    unreached: list[ParamInfo] = field(default_factory=list)
    never_called: frozenset[str] = frozenset()
    # First step after the audit, without an optimizer: how many trainable parameters
    # the loop's own update moved with no gradient in .grad (torch.func,
    # torch.autograd.grad), told once as a note instead of ``unreached``.
    outside_grad: int = 0
    # The step the check was due at, when it waited a boundary to see the weights move.
    since: int | None = None
    # Under DDP: trainable parameters its reducer, built while they were frozen,
    # does not all-reduce (names), with the counts that showed it.
    unsynced: list[str] = field(default_factory=list)
    synced: int = 0  # parameter tensors DDP's reducer holds
    sync_trainable: int = 0  # parameter tensors DDP would hold if built now
    find_unused: bool = False
    unsynced_all: bool = False  # ``unsynced`` names every trainable one: none seen unfrozen
    # Under DDP without find_unused_parameters: parameters frozen since its
    # reducer was built, whose gradients it waits for (the next forward fails);
    # ``synced`` and ``sync_trainable`` say how many it waits for.
    frozen_after: list[str] = field(default_factory=list)
    # A pass's output came straight from layers whose every weight is frozen (a
    # head frozen by mistake, or a deliberately fixed one): told as a note.
    frozen_output: FrozenOutput | None = None
    # First step after the audit: no layer of the model trains, and the optimizers
    # train only tensors outside the layers, which fed none of them on that step.
    loose: LooseTraining | None = None


@dataclass
class ClassTargets:
    """A sampled step's look at the loss's class targets and the training loader."""

    # The targets counted per class; empty when no class loss was seen.
    counts: list[float] = field(default_factory=list)
    # A class loss over tokens or pixels was seen (a language model's stream).
    per_position: bool = False
    # How the training DataLoader reads its data in order, when it is seen to.
    data_order: str | None = None
    # The sampler of the user's own that composes its batches (few classes each
    # by design: a P x K or episode sampler), when it is seen.
    own_batching: str | None = None


@dataclass
class PaddedLabels:
    """Label positions at padding that the loss counts, seen on a sampled step."""

    # "attention_mask": labels where the mask the model was called with is 0;
    # "padding_idx": targets equal to the padding index of the model's embedding.
    kind: str
    padded: int  # label positions at padding that the loss counts
    labelled: int  # label positions the loss counts (not ``ignore_index``)
    pad_positions: int  # padding positions in the batch
    pad_value: int  # the label found there (the most common on the host, the largest on the device)
    other_pad_value: int | None  # the smallest found there, where it differs
    ignore_index: int  # what the loss ignores
    module: str = ""  # the module called with the labels; the root for a loss after it
    # "padding_idx": that index is also the model's end of text (pad = EOS), so only
    # the ids past a row's closing one were counted as padding.
    pad_ends_text: bool = False


@dataclass
class StallReport:
    """How far the model's output on its phase's first batch moved, measured on a sampled step."""

    steps: int  # steps taken in this phase so far
    # RMS move of the output on the first batch over the output's own spread
    # then; None when it could not be measured.
    change: float | None
    # Per layer, ||dW|| / ||W|| of this step's update.
    update_ratios: dict[str, float] = field(default_factory=dict)
    trainable: int = 0  # trainable parameters (elements) of the model
    total: int = 0
    trainable_in: list[str] = field(default_factory=list)  # the modules holding most of them
    learning_rates: list[float] = field(default_factory=list)  # the optimizers' own
    # Each param group's learning rate before any scheduler (its ``initial_lr``, else
    # its ``lr``): what a schedule decayed from.
    initial_learning_rates: list[float] = field(default_factory=list)
    # The learning rates of those groups holding a weight of the model itself (an
    # optimizer may hold another model's too: a head called apart from the backbone
    # ``trainwatch run`` watches as a model of its own).
    model_learning_rates: list[float] = field(default_factory=list)
    # not_optimized has told that no optimizer updates any of the trainable weights,
    # or the model, without an optimizer, copies one an optimizer trains (a target).
    left_out_told: bool = False
    # The model's re-run was stopped before a change it could not put back (what
    # the forward did): it is not re-run again, the output's move is left out.
    rerun_stopped: str = ""


@dataclass
class LearningRates:
    """One watched optimizer's learning rates, read on a sampled step."""

    optimizer: int  # its index among the monitor's optimizers
    optimizer_class: str
    # Each param group's ``lr``; NaN where it is no plain number (a tensor).
    rates: list[float]
    # The latest step it applied (this step for the optimizer stepping now);
    # None: it never stepped.
    last_step: int | None


@dataclass(frozen=True)
class SteppedTwice:
    """Two of the model's optimizers stepped the same parameters on one gradient
    (``not_optimized`` lists them): ``first`` stepped them, then ``second``
    stepped them again before any backward wrote their gradients anew."""

    first: int
    first_class: str
    second: int
    second_class: str
    # How many parameter tensors each of the two holds in all.
    first_holds: int
    second_holds: int
    # The names the training code gives the two (None: not found).
    first_name: str | None = None
    second_name: str | None = None
    # The name the training code gives the model (None: not found).
    model_name: str | None = None


@dataclass(frozen=True)
class LeftOutModel:
    """A model of its own (not a loss module's weights) that no optimizer holds and
    nothing updates, with the training code's names where they were found."""

    model_class: str
    model_name: str | None  # what the training code calls it
    optimizer_class: str  # the class its optimizer would have (the loop's others')
    # The loop's optimizer named after the model (``decoder_optimizer``) that holds
    # none of its parameters, and what it holds instead (None: not found).
    meant: str | None = None
    holds_instead: str | None = None


@dataclass
class ReplacedModel:
    """What trains a model that no optimizer holds, replaced after its optimizer was
    built: the optimizer stepping the parameters of the module it replaced, a
    module no longer called (``trainwatch run`` finds both), or of the model
    itself from before a conversion in overwrite mode; or of a part of it replaced
    since (a new head)."""

    optimizer_class: str
    # The module whose parameters that optimizer steps: its class (None: no module
    # holds them any more, the old model freed), and the name ``trainwatch run``
    # watched it under (None: never called while watched).
    stale_class: str | None
    stale_model: str | None = None
    # The stale model's step at which its optimizer first stepped without it
    # being called (None: it was never called at all).
    since: int | None = None
    # Not replaced but converted in overwrite mode (``.to()``, ``.double()`` with
    # ``set_overwrite_module_params_on_conversion(True)``): the optimizer holds
    # the model's own parameters from before the conversion (see
    # trainwatch.overwrite_conversion). None: a replacement.
    conversion: Conversion | None = None
    # Not the model replaced but a part of it (a new head): the name, in the model,
    # of the module that replaced the one whose parameters the optimizer steps
    # (see trainwatch.replaced_part). None: the whole model.
    part: str | None = None


@dataclass
class StepRecord:
    step: int
    # "optimizer": an optimizer's step() ended it; "manual": monitor.step();
    # "attach": the audit made when the monitor attaches (no gradients yet);
    # "setup": the trainable-parameter audit (at attach, after a change);
    # "unwatched_step": the step of an optimizer found stepping the model, not yet
    # watched, judged for its NaN/Inf alone (trainwatch/optimizer_not_given.py).
    source: str = "optimizer"
    optimizer: int | None = None
    # The optimizer's class name, where a message names the optimizer (set on the
    # rare paths that tell of one; None on a step's own record).
    optimizer_class: str | None = None
    # Trainable parameters the step used, and the L2 norm of each one's gradient.
    present: list[ParamInfo] = field(default_factory=list)
    param_norms: list[float] = field(default_factory=list)
    # Trainable parameters the step should have used but whose .grad is None.
    missing: list[ParamInfo] = field(default_factory=list)
    # Parameters whose gradient the step's latest backward made and the loop set
    # to None before the step, while others of the optimizer kept theirs: a layer
    # kept out of some updates on purpose (SwAV's prototypes for the first
    # iterations, DINO's last layer in the first epoch), not one backward never
    # reached. Left out of ``missing``; found where that backward's gradients were
    # noted (collect.dropped_gradients), never on the usual step.
    dropped: tuple[ParamInfo, ...] = ()
    # Parameters whose gradient that backward made and the loop set to None,
    # replaced or wrote in place since (zeroed, or clipped one by one), while
    # others' stayed as it left them: looked at over the first steps and while
    # zero_gradient asks (collect.dropped_gradients), never on the usual step.
    rewritten_after_backward: frozenset[str] = frozenset()
    # With every one of the optimizer's parameters missing: the step since which
    # the optimizer steps while the model is not called at all (no forward pass
    # between two of its steps); None on every other step.
    not_called_since: int | None = None
    # With every one of the optimizer's parameters missing and no backward anywhere
    # since its last step: a batch skipped before its backward (Lightning's
    # training_step returning None), which says nothing of any layer. A class
    # attribute, not a field: set on that path only, the usual record never builds it.
    skipped_batch = False
    # Layers never called in a forward pass since watching began (filled only
    # when parameters are missing): defined-but-unused, not cut off.
    never_called: frozenset[str] = frozenset()
    # How the model trains under DDP ("ddp"; "find_unused" for a model built
    # with find_unused_parameters=True; "" when not); filled with ``never_called``.
    distributed: str = ""
    # Layers followed since they went without a gradient, and those of them called
    # in this step's passes (None: not knowable, a compiled pass).
    calls_followed: frozenset[str] = frozenset()
    called_now: frozenset[str] | None = None
    calls_ran: frozenset[str] = frozenset()  # of those, the ones seen running in some step
    # Layers whose holder reads their weights without calling them (nn.MultiheadAttention's
    # out_proj), each with that holder: its calls tell whether they ran.
    calls_held_by: dict[str, str] | None = None
    # Of those called now, the ones called only with gradients off inside a pass
    # with gradients (torch.no_grad() around them, a reentrant checkpoint whose
    # inputs do not require grad).
    called_gradless: frozenset[str] = frozenset()
    # Layers seen running without a gradient, each with the custom autograd
    # Functions nearest it on its every path to the model's output (whose backward
    # returns None for it); set on steps with parameters missing, None when none.
    through_functions: dict[str, list[str]] | None = None
    # requires_grad=False parameters inside the optimizer's param groups, and
    # how many trainable parameters each owning module has in the optimizer.
    frozen: list[ParamInfo] = field(default_factory=list)
    # The frozen ones still watched for moves by hand (their verdict waits), and
    # those found moved by the training code (a momentum encoder): not forgotten.
    frozen_pending: bool = False
    frozen_moved: frozenset[str] = frozenset()
    # Of ``frozen``, those outside the model, once their verdict is due: each
    # placeholder name to the name to tell it by (the one its holding module
    # gives it, ``NTXent.log_t``, or its place in the optimizer), or None where
    # another monitor holding the optimizer watches it in its own model (a loss
    # module ``trainwatch run`` watches as a model of its own) and judges it.
    frozen_outside: dict[str, str | None] = field(default_factory=dict)
    # Parameters of the optimizer frozen at its last setup change, trainable now.
    unfrozen: list[ParamInfo] = field(default_factory=list)
    # Without an optimizer: how many of the model's parameters are frozen.
    frozen_count: int = 0
    trainable_by_module: dict[str, int] = field(default_factory=dict)
    # Without an optimizer: parameters whose gradient was rewritten in place after
    # backward reached them (reset by hand, clipped) before monitor.step().
    rewritten: frozenset[str] = frozenset()
    # With an optimizer: every gradient the step's last backward left on its
    # parameters was set to None or written since that backward ended, before
    # this step (zero_grad() between backward and step, or a clip in place).
    rewritten_since_backward: bool = False
    # The step's last backward was looked at as it ended (exploding_gradient asks,
    # after a jump; see collect.backward_end_norms), and, where the loop wrote into
    # some gradient since (Langevin noise added to .grad), each layer's norm as that
    # backward left it. Never on the usual step.
    backward_end_seen: bool = False
    backward_layer_norms: Mapping[str, float] | None = None
    # Every gradient of the step exactly zero, and so was the gradient that entered
    # the model's output: the loss sent nothing (a margin loss every sample
    # satisfies), which says nothing of any layer.
    no_signal: bool = False
    # Output positions of the model's last pass whose entering gradient was exactly
    # zero while another's was not (a task weighted by 0), when some gradient was.
    silent_outputs: list[int] = field(default_factory=list)
    # The weights this step ran with are the previous step's: that step's optimizer
    # had every learning rate at exactly 0 (a warm-up's first step) and moved none.
    same_weights: bool = False
    # Without an optimizer, at a boundary where no parameter holds a gradient and
    # backward reached none: the trainable parameters whose weights moved since the
    # previous boundary, updated by the loop from gradients computed outside .grad
    # (torch.func, torch.autograd.grad); they are left out of ``missing``. None
    # where not looked at; ``weights_unseen`` at the first such boundary, which has
    # nothing to compare with.
    moved_without_grad: frozenset[str] | None = None
    weights_unseen: bool = False
    # Output positions the step's last backward never reached while it reached
    # another (an output the loss left out), when some gradient was missing.
    unreached_outputs: list[int] = field(default_factory=list)
    # Layers seen running without a gradient whose parameters lie in no graph of
    # the model's outputs (cut off inside it), when some gradient was missing: an
    # output left out of the loss does not explain them.
    cut_off: frozenset[str] = frozenset()
    # Parameters that got a gradient although no watched optimizer holds them
    # (with stepped_twice: those two optimizers both stepped on one gradient).
    not_optimized: list[ParamInfo] = field(default_factory=list)
    # With not_optimized: the two optimizers that both stepped them (set on that rare path).
    stepped_twice: SteppedTwice | None = None
    # Of those, the ones (by name) that were frozen while no optimizer held them,
    # when the optimizers' membership was last looked at (a backbone frozen for a
    # linear probe as the optimizer was built over the head): unfrozen since, after
    # the optimizer was built, which never got them.
    unfrozen_unheld: frozenset[str] = frozenset()
    # With not_optimized: the model replaced another one after the optimizer was
    # built, and that optimizer steps the old one's parameters (set on that rare path).
    replaced: ReplacedModel | None = None
    # With not_optimized: its optimizer never stepped while the process took this many
    # steps of other models (0: the parameters are in no optimizer at all).
    idle_steps: int = 0
    # With idle_steps: the model's own optimizer (its index) that never stepped while
    # its other optimizers took them (None: the model's only optimizers never did).
    idle_optimizer: int | None = None
    # With idle_optimizer: the step it last stepped at (None: it never stepped).
    idle_since: int | None = None
    # With idle_steps: the loop threw away the idle optimizer's gradients this many
    # times, reset and written anew with no step between (0: not seen).
    idle_lost: int = 0
    # With idle_steps: what the training code calls the idle optimizer and the model
    # (None: not found; looked up only as the finding is told).
    idle_optimizer_name: str | None = None
    idle_model_name: str | None = None
    # Parameters whose gradient still held the previous step's values when
    # backward added onto it, and how that was established.
    accumulated: list[ParamInfo] = field(default_factory=list)
    accumulation_method: str | None = None
    # The step that last applied this optimizer's gradients (None: not known).
    used_at: int | None = None
    # Hand-written updates under trainwatch run: the boundary whose backward first
    # added onto used gradients, confirmed at this one (None: this one).
    accumulated_since: int | None = None
    # A model no optimizer holds, with accumulated or never-reset gradients: the
    # model an optimizer trains that it is a copy of (its target network).
    copy_of: CopiedFrom | None = None
    # With not_optimized and idle_steps: a model of its own (not a loss module) that
    # no optimizer holds and nothing updates (set on that rare path).
    left_out: LeftOutModel | None = None
    # With copy_of naming a part of this model: the part that copies it (a target
    # network held inside the model), whose parameters are ``accumulated``.
    copy_part: str | None = None
    layer_norms: dict[str, float] = field(default_factory=dict)
    # The layout of ``present`` kept across steps (a GradientLayout), when its
    # norms were planned: its per-layer sums, and a layout rules saw before.
    layout: Any = None
    # Layers whose gradient history starts over here: their parameters were
    # replaced in this process (same name, new objects), or a new optimizer
    # started over them (a new training phase).
    restarted_layers: frozenset[str] = frozenset()
    # Optimizers whose training started over here (their state emptied or loaded
    # back to an earlier one): their runs are judged as from their first step.
    restarted_optimizers: frozenset[int] = frozenset()
    total_norm: float | None = None
    loss: float | None = None
    # The previous step's loss, handed over after its optimizer step
    # (``monitor.step(loss=loss)`` after ``optimizer.step()``).
    late_loss: float | None = None
    # NaN/Inf origins (the cascade downstream of an origin is not reported).
    nonfinite_forward: NonfiniteReport | None = None
    nonfinite_backward: NonfiniteReport | None = None
    nonfinite_loss: NonfiniteReport | None = None
    nonfinite_params: list[ParamInfo] = field(default_factory=list)
    # When the weights' NaN/Inf is seen in the next forward, the update that
    # made it was the step before: alerts carry that step.
    nonfinite_params_step: int | None = None
    # They were written in place after the last update, by the training code; an
    # OriginTold where another model's NaN/Inf was reported before (copied from it:
    # its knock-on). One field for both: the record is made at every step.
    nonfinite_params_written: bool | OriginTold = False
    # Backward passes with non-finite gradients that no optimizer step used
    # (GradScaler skipping) in a row, ending at this record.
    skipped_backward_passes: int = 0
    # Set only once updates have begun to apply, or when the loss scale fell below 1.
    amp: AmpReport | None = None
    # Behaviour checks (mode, shape and activation statistics).
    train_in_eval: ModeReport | None = None
    eval_in_train: ModeReport | None = None
    broadcasts: list[BroadcastReport] = field(default_factory=list)
    # Loss functions given probabilities: set on the broadcast audit's steps only.
    loss_inputs: Sequence[LossInputReport] = ()
    # Empty on steps that were not sampled.
    activations: list[ActivationStats] = field(default_factory=list)
    # The setup audit's figures: at an audit, and on the first step after one.
    setup: SetupCheck | None = None
    # Set on the steps the class targets are looked at (unshuffled_data).
    class_targets: ClassTargets | None = None
    # Padding positions carrying labels the loss counts (loss_on_padding): set
    # only on the sampled step where they are found.
    padded_labels: PaddedLabels | None = None
    # stalled_training's sampled steps: the phase (from 1) whose losses it
    # keeps (0 on other steps), and the re-run of the first batch.
    stall_phase: int = 0
    stall: StallReport | None = None
    # Every watched optimizer's learning rates, on one sampled step in ten.
    optimizer_rates: list[LearningRates] | None = None
    # Under FSDP2 the gradients measured are this rank's shards: a shard can be
    # all zero while its layer's gradient is not (an embedding's rows no batch used).
    sharded: bool = False

    def gradients_reset_after_backward(self) -> str | None:
        """How the step's gradients were wiped between backward and the step, if
        they were (``zero_grad()`` there): ``"set_to_none"``, every one set to None;
        ``"zeroed_in_place"``, every one exactly zero and written since backward
        ended (a clip in place leaves them non-zero). None: not so.

        The one place this is decided: the step's checks of what backward
        reached and the zero_gradient rule both ask it.
        """
        if not self.rewritten_since_backward:
            return None
        if not self.present:
            return "set_to_none" if self.missing else None
        if self.sharded or any(self.param_norms):
            return None  # (a zero shard says nothing)
        return "zeroed_in_place"


# Made at every step (trainwatch.fresh): new_step_record(step), the rest at defaults.
new_step_record = fresh_maker(StepRecord)


@dataclass
class WipedReport:
    """An optimizer's steps in a row each of whose backward passes after the first
    began on the previous one's gradients wiped (zero_grad() inside the
    accumulation loop): each step applied only its last backward's gradients."""

    since: int  # the first of those steps
    steps: int
    backward_passes: int  # per step (the latest step's)
    wiped: int  # of them, how many were wiped before the step


@dataclass
class CancelledReport:
    """An optimizer's steps whose gradients, left by one backward while another
    optimizer stepped, the next backward mostly cancelled (a GAN's generator fed the
    discriminator's loss through an output not detached): each step applied a
    small remainder of the two."""

    optimizer: int
    since: int  # the first cancelled step of those looked at
    looked: int  # steps looked at (the latest ones)
    cancelled: int  # of them, how many were cancelled
    before: float  # the latest cancelled step's norm as the later backward began
    at_step: float  # and at the step
    ids: list[int]  # the parameters cancelled (that step's), by id
    others: tuple[str, ...]  # the optimizers that stepped in between


@dataclass(slots=True)
class BetweenBackwardsRecord(StepRecord):
    """Not a step's record: a finding about the backward passes between an
    optimizer's steps (``source`` "between_backwards"), its parameters in ``present``."""

    wiped: WipedReport | None = None
    cancelled: CancelledReport | None = None


@dataclass
class ZeroedUpdateReport:
    """Hand-written updates in a row (no optimizer) that wrote the weights and left
    them exactly as they were: the gradients they applied were zeroed before them."""

    since: int  # the step of the first of those updates
    updates: int
    # Found between backward ends (``trainwatch run``), not at ``monitor.step()``.
    at_backward_end: bool
    parameters: list[str]  # the trainable parameters' names


@dataclass(slots=True)
class HandUpdateRecord(StepRecord):
    """Not a step's record: a finding about the hand-written updates between step
    boundaries without an optimizer (``source`` "hand_update")."""

    zeroed: ZeroedUpdateReport | None = None
