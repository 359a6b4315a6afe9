"""A short audit of the loss's elementwise ops for batch-against-batch broadcasting.

For the first few training steps a ``TorchFunctionMode`` is active from the
end of each forward pass of the model to the step boundary: the span in which
the loss is computed. It follows the tensors derived from every forward pass
of the step (by identity, weakly), so a loss built from many passes is
followed too: a policy-gradient loop makes one pass per environment step on a
batch of one, keeps each ``log_prob`` in a list and stacks them once per
episode; ``torch.stack`` and ``torch.cat`` of followed tensors are followed.
A pass without gradients is not followed, and does not end the span while
the step's earlier outputs are held: a DQN's target or an actor-critic's
bootstrap value, computed under ``no_grad`` after the online pass, precedes
the loss.
It looks at the shapes of each elementwise op or loss function that takes one
of them: ``(T, 1)`` against ``(T,)`` makes ``(T, T)`` and silently averages
every prediction against every target, whatever the model's own batch size.
The model's own forward pass is not the loss, and is not judged, with one
exception: a pass given labels (an argument named ``labels``, ``targets``,
``y``...; Hugging Face models compute their loss in ``forward`` from them).
There the mode follows the labels alone, through the ops that only reshape or
convert them, and judges each elementwise op or loss that pairs them with
something else: a ``(N, 1)`` prediction against ``(N,)`` labels inside the
model's ``forward`` is the same bug. After the audit the mode is not entered
again until the audit is re-armed (``rearm``): for as many steps again when a
new phase of training begins (the monitor sees a new optimizer, a part of the
model replaced, parameters frozen or unfrozen), for one step at sparse
sampled steps, for a loss changed with no such sign, from the step after a
layer got its first gradient unaudited until it gets one again
(``collect/joined_layers.py``: a rare task's head, an auxiliary loss switched
on), and from the step after a loss of a new kind was read until one of that
kind is audited (``collect/loss_kind.py``: a term a curriculum adds; the audit
tells it the kind of each loss it follows to ``backward``). In between the
check costs nothing. Operands of equal rank pair no batch with
another, but the model's ``(N, C, H, W)`` output against a ``(N, 1, H, W)``
operand from elsewhere may be a class-index label map broadcast over the
channels: its values are measured on the device and judged at the step's end
(``collect/class_index_map.py``); so are labels of that shape that a pass given
them pairs with a prediction (a Dice computed in ``forward``). The first
evaluation passes of the run, whenever they come (and of each new phase), are
followed by an audit of their own with this judge (``collect/broadcast_eval.py``).
On the same training steps a loss function that takes logits is looked at for a
softmax's or sigmoid's output as its input (``collect/loss_input.py``, rule
``loss_input``), and ``nll_loss`` for raw logits given where log-probabilities
belong (``collect/log_probabilities.py``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from trainwatch.callers import called_from
from trainwatch.collect import quiet
from trainwatch.collect.class_index_map import (
    PendingClassMap,
    broadcast_channel,
    class_index_evidence,
)
from trainwatch.collect.log_probabilities import PendingNll, log_probability_gap
from trainwatch.collect.loss_input import (
    LOSS_INPUTS,
    made_by_log_softmax,
    probabilities_fed,
    squashing_node,
)
from trainwatch.collect.loss_kind import KindReader, backward_roots, node_number
from trainwatch.collect.mode_stack import enter_loss_mode
from trainwatch.collect.mode_stack import leave as leave_mode
from trainwatch.collect.model_kind import LOSSES
from trainwatch.collect.op_trace import _user_line
from trainwatch.collect.tensors import spread_rows, tensor_leaves
from trainwatch.record import BroadcastReport, LossInputReport
from trainwatch.user_warnings import reattributed

_MAX_TRACKED = 4096
# Ops that compare a prediction with its target: the other operand's spread
# across the batch is the scale a regression output should reach.
_REGRESSION = frozenset(
    {
        "sub",
        "rsub",
        "subtract",
        "__sub__",
        "__rsub__",
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
    }
)
_MAX_FINDINGS = 4

# Loss functions compare an output with its target sample by sample: an axis
# given in the loss never makes their pairing a matrix meant on purpose.
_LOSSES = frozenset(
    {
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "soft_margin_loss",
        "poisson_nll_loss",
        "gaussian_nll_loss",
        "kl_div",
    }
)

# Ops that pair their operands element by element: the arithmetic ones, and the
# loss functions (they compare input and target elementwise, then reduce).
_ELEMENTWISE = _LOSSES | frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "where",
        "rsub",
        "true_divide",
        "subtract",
        "multiply",
        "divide",
        "pow",
        "maximum",
        "minimum",
        "atan2",
        "hypot",
        "remainder",
        "fmod",
        "xlogy",
        "squared_difference",
        "add_",
        "sub_",
        "mul_",
        "div_",
        "__add__",
        "__radd__",
        "__iadd__",
        "__sub__",
        "__rsub__",
        "__isub__",
        "__mul__",
        "__rmul__",
        "__imul__",
        "__truediv__",
        "__rtruediv__",
        "__itruediv__",
        "__pow__",
        "__rpow__",
    }
)
# Comparisons of a prediction with its target: an accuracy ``(pred > 0) == y``
# with ``pred (N, 1)`` and ``y (N,)`` is the same pairing. Judged in evaluations
# only: a training loss never goes through them (they carry no gradient).
_COMPARISONS = frozenset(
    {
        "eq",
        "ne",
        "gt",
        "lt",
        "ge",
        "le",
        "greater",
        "less",
        "greater_equal",
        "less_equal",
        "not_equal",
        "isclose",
        "__eq__",
        "__ne__",
        "__gt__",
        "__lt__",
        "__ge__",
        "__le__",
    }
)


# Arguments of a forward pass that hold the targets of a loss computed inside it.
_LABEL_NAMES = frozenset({"labels", "label", "targets", "target", "y", "y_true"})
# Ops after which a tensor still holds the labels' values, only reshaped,
# converted or selected (a shift for next-token targets, a cast to float).
_KEEPS_LABELS = frozenset(
    {
        "to",
        "float",
        "double",
        "half",
        "bfloat16",
        "long",
        "int",
        "type",
        "type_as",
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "squeeze",
        "unsqueeze",
        "flatten",
        "contiguous",
        "clone",
        "detach",
        "__getitem__",
        "narrow",
        "select",
        "expand",
        "expand_as",
    }
)


def _label_tensors(module: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors passed to ``module``'s forward as labels, by keyword or by position."""
    named = dict(kwargs)
    if args:
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
            named.update(bound.arguments)  # a wrapper's (**kwargs) keeps the keywords too
        except (TypeError, ValueError):
            pass
    return [
        value
        for name, value in named.items()
        if name in _LABEL_NAMES and isinstance(value, torch.Tensor) and value.dim() > 0
    ]


def batch_broadcast(
    first: tuple[int, ...],
    second: tuple[int, ...],
    batch: int | None = None,
    given: frozenset[int] = frozenset(),
    output_lower: bool = False,
) -> tuple[int, ...] | None:
    """The result shape when two operands broadcast a batch axis against another.

    The pattern: operands of different rank, the higher-rank one with a
    trailing axis of size 1 that the other's axis of size N fills, while the
    higher-rank one's own axis of the same size N is what the other lacks.
    ``(N, 1)`` with ``(N,)`` gives ``(N, N)``. An explicit pairwise op
    (``a[:, None] - b[None, :]``, same ranks) or an outer product of unequal
    sizes (``t[:, None] * freqs``) is not it. Only shapes are judged, never
    the model's batch size: a loss over ``T`` passes on a batch of one makes
    ``(T, 1)`` against ``(T,)`` just the same.

    The size-1 axis may also sit inside, with per-sample axes after it that
    both operands share: a one-channel mask ``(N, 1, H, W)`` against an
    ``(N, H, W)`` target gives ``(N, N, H, W)``; or that are of size 1 on its
    side, a value per sample against the other's features: an ``(N, 1, 1)``
    target against an ``(N, K)`` prediction gives ``(N, N, K)``. There the
    paired size must be ``batch``, the model's batch: query embeddings
    ``(Q, 1, D)`` against ``(K, D)`` prototypes pair on purpose, and may have
    equal sizes by chance. ``given`` holds the axes of the higher-rank operand
    created in the loss code: such an axis pairing against shared per-sample
    axes (``z.unsqueeze(1) - keys``), or meeting the other's batch as the last
    axis (``area_a[:, None] + area_b`` in a pairwise IoU, ``s.unsqueeze(1) - t``
    in a ranking margin), is a pairing written on purpose.

    ``output_lower``: the lower-rank operand is the model's output (and the
    other is not). Then the other side may hold the batch twice already, made
    so before the op: ``(N, N, C)`` soft targets against ``(N, C)``
    log-probabilities (``_batch_beside_output``).
    """
    if len(first) == len(second) or not first or not second:
        return None
    try:
        result = tuple(torch.broadcast_shapes(first, second))
    except RuntimeError:
        return None
    high, low = (first, second) if len(first) > len(second) else (second, first)
    # A trailing axis of size 1 on both sides (stacked (1, 1) values of a
    # value head against (T, 1) returns) is a single feature, not where the
    # pairing happens: the axes before it are judged.
    paired = result
    while len(low) > 1 and high[-1] == 1 and low[-1] == 1:
        high, low, paired = high[:-1], low[:-1], paired[:-1]
    rank = len(paired)
    low_padded = (1,) * (rank - len(low)) + tuple(low)
    if high[-1] == 1 and paired[-1] > 1 and rank - 1 not in given:
        size = paired[-1]
        if any(low_padded[i] == 1 and high[i] == size for i in range(rank - 1) if paired[i] > 1):
            return result
    found = _inner_pairing(high, low_padded, batch, given, result)
    if found is None and output_lower:
        return _batch_beside_output(high, low_padded, batch, result)
    return found


def _batch_beside_output(
    high: tuple[int, ...],
    low_padded: tuple[int, ...],
    batch: int | None,
    result: tuple[int, ...],
) -> tuple[int, ...] | None:
    """``batch_broadcast``'s case of a target side that pairs the samples itself: the
    model's output ``low`` meets ``high``'s batch with its own, and ``high`` has the
    batch again on an axis the output lacks (or has of size 1).

    A mixup coefficient shaped ``(N, 1, 1, 1)`` for the images, reused on the
    ``(N, C)`` one-hot targets, makes them ``(N, 1, N, C)`` (``(N, N, C)`` from an
    ``(N, 1, 1)`` one) with no output involved; the loss's
    ``-target * log_softmax(out)`` then scores each sample's output against every
    sample's mixed target. Only the target side's second batch axis is judged:
    a pairwise matrix of outputs (``z @ z.T``, ``cdist``) is the output's own,
    and the judge passes this case for one side from the model only.
    """
    if batch is None or batch < 2:
        return None
    pairs = list(zip(high, low_padded))
    if any(h == batch and o == batch for h, o in pairs) and any(
        h == batch and o == 1 for h, o in pairs
    ):
        return result
    return None


def _inner_pairing(
    high: tuple[int, ...],
    low_padded: tuple[int, ...],
    batch: int | None,
    given: frozenset[int],
    result: tuple[int, ...],
) -> tuple[int, ...] | None:
    """``batch_broadcast``'s inner case: ``high``'s axis ``j`` of size 1 meets the batch
    in ``low``, each axis after ``j`` is the same in both or of size 1 in ``high``,
    and an axis of ``high`` before ``j`` is the batch where ``low`` has none."""
    if batch is None or batch < 2:
        return None
    rank = len(high)
    for j in range(1, rank - 1):
        if high[j] != 1 or low_padded[j] != batch:
            continue
        after = list(zip(high[j + 1 :], low_padded[j + 1 :]))
        if all(h == o for h, o in after):
            if j in given:
                continue  # an axis given to pair each sample with every other's
        elif not all(h == 1 or h == o for h, o in after):
            continue
        if any(high[i] == batch and low_padded[i] == 1 for i in range(j)):
            return result
    return None


# Ops that give a tensor a new axis in the loss code, and ops after which it
# still has the axes it had (a copy, a cast, a move to the model's device). A
# view or reshape to ``(N, 1)`` gives none: it is how a target is matched to an
# ``(N, 1)`` output, and put on the wrong side (the output squeezed) it is the bug.
_ADDS_AXES = frozenset({"unsqueeze", "__getitem__"})
_KEEPS_AXES = frozenset(
    {"to", "float", "double", "half", "bfloat16", "type_as", "contiguous", "clone", "detach"}
)


def _index_new_axes(index: Any, rank: int) -> list[int] | None:
    """Where ``t[index]`` puts its ``None`` axes, for a basic index; None for another."""
    entries = index if isinstance(index, tuple) else (index,)
    for entry in entries:
        if isinstance(entry, bool) or not (
            entry is None or entry is Ellipsis or isinstance(entry, (int, slice))
        ):
            return None
    consumed = sum(1 for entry in entries if entry is not None and entry is not Ellipsis)
    position, found = 0, []
    for entry in entries:
        if entry is None:
            found.append(position)
            position += 1
        elif entry is Ellipsis:
            position += rank - consumed
        elif isinstance(entry, slice):
            position += 1
    return found


def _inserted_ones(source: tuple[int, ...], out: tuple[int, ...]) -> list[int] | None:
    """The axes of ``out`` that are ``source``'s with size-1 axes inserted, read from the
    left (``(N, 1)`` viewed as ``(N, 1, 1)`` gained its last); None for another reshape."""
    i, found = 0, []
    for position, size in enumerate(out):
        if i < len(source) and source[i] == size:
            i += 1
        elif size == 1:
            found.append(position)
        else:
            return None
    return found if i == len(source) else None


def _new_axes(
    name: str, args: Any, kwargs: dict[str, Any], source: torch.Tensor, out: torch.Tensor
) -> list[int] | None:
    """The positions in ``out`` of the size-1 axes the op gave ``source``, or None."""
    if name == "unsqueeze":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return [dim % out.dim()] if isinstance(dim, int) else None
    if name == "__getitem__" and len(args) > 1:
        found = _index_new_axes(args[1], source.dim())
        if found is not None:
            return found
    return _inserted_ones(tuple(source.shape), tuple(out.shape))


def _scalars_beside(args: Any, kwargs: dict[str, Any]) -> bool:
    """The op's other operands reach no axis of its first: ``area[:, None] * 0.5``,
    ``s[:, None] / tau`` keep the axis given; ``pred * mask[:, None]`` makes one
    that also came out of the model."""
    others = (*args[1:], *kwargs.values())
    return all(not isinstance(v, torch.Tensor) or v.dim() == 0 for v in others)


def _given_axes(
    name: str, args: Any, kwargs: dict[str, Any], out: Any, before: frozenset[int]
) -> frozenset[int]:
    """The axes of ``out`` given in the loss code: the op's new ones, and ``before``,
    the source's own given axes, where they carry over."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor):
        return frozenset()
    if name not in _ADDS_AXES or out.dim() <= source.dim():
        same = out.shape == source.shape
        if same and (name in _KEEPS_AXES or _scalars_beside(args, kwargs)):
            return before
        return frozenset()
    new = _new_axes(name, args, kwargs, source, out)
    if new is None:  # an index beyond inserting axes: any size-1 axis may be new
        return frozenset(i for i, size in enumerate(out.shape) if size == 1)
    kept = [i for i in range(out.dim()) if i not in new]
    if [out.shape[i] for i in kept] != list(source.shape):
        return frozenset(new)
    return frozenset(new) | {kept[i] for i in before if i < len(kept)}


def _one_tensor(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Both operands are one tensor, seen two ways: ``s - s.view(-1)`` pairs its rows on purpose.

    A pairwise ranking loss written that way compares every score with every
    other; the bug pairs a prediction with a target, two different tensors.
    Sharing a storage is not enough: one pass over chosen and rejected answers
    together, split with ``r.chunk(2)``, gives two views of one output over
    different rows, and ``r_c - r_r.view(-1)`` pairs every chosen answer with
    every rejected one. So the two must start at the same element of the
    storage and cover the same elements (``s``, ``s.view(-1)``, ``s.t()``,
    ``s.unsqueeze(0)``, ``s.expand(...)``).
    """
    try:
        ptr = first.untyped_storage().data_ptr()
        if ptr == 0 or ptr != second.untyped_storage().data_ptr():
            return False
        return first.storage_offset() == second.storage_offset() and _elements_covered(
            first
        ) == _elements_covered(second)
    except Exception:  # a tensor without storage (sparse, functional): judge it
        return False


def _elements_covered(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """The elements of its storage a view covers, from its start, as (size, stride) runs.

    Axes of size 1 or stride 0 add no element; the rest, outermost stride first,
    are merged where one axis continues another (``(N, D)`` strided ``(D, 1)`` is
    the run ``(N * D, 1)``), so views reshaped, transposed or given new axes
    read the same.
    """
    axes = sorted(
        (
            (size, stride)
            for size, stride in zip(tensor.shape, tensor.stride())
            if size > 1 and stride
        ),
        key=lambda axis: -axis[1],
    )
    runs: list[tuple[int, int]] = []
    for size, stride in reversed(axes):
        if runs and stride == runs[-1][0] * runs[-1][1]:
            inner_size, inner_stride = runs.pop()
            runs.append((size * inner_size, inner_stride))
        else:
            runs.append((size, stride))
    return runs


def _stack_is_ours_to_use() -> bool:
    """Whether our mode can be pushed now and popped later without disturbing another.

    A mode the user entered around the forward pass would be exited while
    ours sits above it, and ``TorchFunctionMode.__exit__`` pops whatever is
    on top: ours instead of theirs. So the audit skips such passes; only the
    default-device context (which restores the stack itself) and another
    model's audit (which pops itself only from the top, as ours does) may be
    below: an actor's and a critic's audits are both live in the same span,
    and so may the sampled looks at class targets and at the model output's
    target, and zero_gradient's look at the parameters a pass reads, and the
    look at a pass's dropout and batch-norm calls, which pop themselves the
    same way.
    """
    if torch._C._len_torch_function_stack() == 0:
        return True
    try:
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext
    except ImportError:  # pragma: no cover - other torch versions
        return False
    from trainwatch.collect.class_targets import _TargetMode  # imports this module
    from trainwatch.collect.functional_modes import _CallMode  # imports this module
    from trainwatch.collect.output_target import _OutputTargetMode  # imports this module
    from trainwatch.collect.parameter_reads import _ReadMode

    ours = (DeviceContext, _AuditMode, _TargetMode, _OutputTargetMode, _ReadMode, _CallMode)
    return all(isinstance(m, ours) for m in _get_current_function_mode_stack())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a model output or op result: ``out["logits"]`` is followed too."""
    for _, tensor in tensor_leaves(value):
        yield tensor


def _inputs(args: Any, kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """Every tensor an op reads: its operands and those of a sequence argument.

    ``torch.stack(saved)`` and ``torch.cat(saved)`` take a list: the result is
    derived from the model when any tensor in it is.
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item


def _op_name(func: Any) -> str:
    return getattr(func, "__name__", "") or ""


def _op_told(name: str) -> str:
    """The op as a finding names it: ``__rsub__`` is the same subtraction as ``sub``."""
    op = name.strip("_")
    if op.startswith("r") and name.startswith("__r"):
        op = op[1:]  # operands swapped
    return op


# Where ``Normal(mu, std).log_prob(a)`` subtracts the mean from the action: the
# other side is a sample the policy drew itself, spread by its exploration
# noise, not a target the output should match; the model's spread is not
# measured against it (asked on audited steps only, until a target is measured).
_DISTRIBUTIONS = ("/torch/distributions/",)


def _call(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run the user's op; its warnings still name the user's line.

    Called from the mode, an op's warning would name this frame: a loss
    function warns with ``stacklevel=2``, a C++ op (``torch.std`` of one
    element) from the innermost Python frame. Each is warned again from the
    line that called the op, under the filters there; the filters themselves
    are never changed (that would show every once-per-line warning of the
    process again).
    """
    with reattributed(func):
        return func(*args, **kwargs)


# Audits whose model is inside its forward pass right now. A model's own ops
# are not a loss: while any watched model runs (a critic called between an
# actor's pass and the loss, perhaps on the actor's features), no audit follows
# or judges anything, so the critic's inner ops are not taken for the actor's
# loss.
_IN_PASS: weakref.WeakSet[BroadcastAudit] = weakref.WeakSet()


class _AuditMode(TorchFunctionMode):
    def __init__(self, audit: BroadcastAudit) -> None:
        super().__init__()
        self.audit = weakref.ref(audit)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = _call(func, args, kwargs)
        audit = self.audit()
        if audit is None:
            return out
        rider = audit.rider
        if rider is not None:
            rider(func, args, kwargs)  # a look reading the same span (it catches its own errors)
        if audit.live and not quiet.replaying():
            try:
                if audit.inside:
                    audit.inside_op(func, args, kwargs, out)
                elif not _IN_PASS:
                    audit.after_op(func, args, kwargs, out)
            except Exception as exc:  # never break the user's loss
                audit.fail(exc)
        return out


class BroadcastAudit:
    # What its findings are told as: the loss of a training step.
    phase = "training"
    # The ops whose operands it judges.
    judged_ops = _ELEMENTWISE

    def __init__(self, steps: int, on_error: Any, loss_inputs: bool = False) -> None:
        self.steps_left = steps
        self.live = steps > 0
        self._on_error = on_error
        # Failed or detached: never re-armed.
        self.ended = False
        # Whether a regression-like op's target side is measured (the first audit's
        # steps only: constant_output's reference is the run's first targets).
        self.measures_target = True
        self._mode = _AuditMode(self)
        self._depth: int | None = None  # the mode stack's depth with ours on top
        # Tensors derived from the step's forward passes, by id; an entry goes
        # when its tensor does, so nothing here outlives what the user holds.
        self._tracked: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )
        # By id, of the tracked tensors made from a part's pass: the part's name.
        self._parts: dict[int, str] = {}
        # Tensors given a size-1 axis in the loss (z.unsqueeze(1), keys[:, None]),
        # by id, with the positions of the axes given: one placed to pair each
        # sample with every other (a distance to each key of a momentum encoder,
        # to each class centre) is on purpose, unlike an axis that came out of
        # the model (N, 1, H, W) or with the data (a (N, 1, 1) target).
        self._given: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[int]]] = {}
        self.findings: list[BroadcastReport] = []
        # Ops of this span measured for a class-index map, read at its end.
        self._class_maps: list[PendingClassMap] = []
        self._seen: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
        self.audited_pass = False
        # Device scalar: the spread across the batch of the loss's target side
        # (first regression-like op of a step), for constant_output's reference.
        self.target_spread: torch.Tensor | None = None
        self._batch: int | None = None
        # Inside a pass given labels: the labels and what only reshapes them, by id.
        self.inside = False
        self._labels: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        # The name of the module called with labels, as a finding names it ("" the
        # model, else its part), asked of ``name_called`` (set by the pipeline) once
        # labels are found; None where no name is known.
        self._inside_part: str | None = None
        self.name_called: Callable[[Any], str | None] | None = None
        # Whether a loss function's input is looked at for probabilities (loss_input).
        self.judges_loss_inputs = loss_inputs
        self.loss_inputs: list[LossInputReport] = []
        # nll_loss calls whose input is measured for log-probabilities, read at the
        # step's end (a result negated later is a gather, not a loss).
        self._nll = PendingNll()
        # The source line of the first nll_loss found given raw logits (its loss falls
        # without bound): what an exploding gradient's hint names as the cause.
        self.unbounded_nll: str | None = None
        # The loss functions seen taking the model's outputs (or its labels), by
        # their torch names: what an explosion's hint says depends on them.
        self.losses: set[str] = set()
        # The softmax and sigmoid nodes that made a pass's outputs, by id, with the
        # part of the model that made them ("" the model): probabilities out of forward.
        self._squashed: dict[int, tuple[Any, str]] = {}
        # A sampled look that reads the same span, from a pass's end to the step
        # boundary (the class target look): while the audit's mode is on the stack it
        # is handed each op the mode sees instead of pushing a mode of its own, so a
        # step both audited and sampled dispatches every op of its loss through one
        # mode, not two. Set and cleared by the look.
        self.rider: Callable[[Any, Any, dict[str, Any]], None] | None = None
        # Handed each loss the audit follows to its ``backward`` (its roots, the
        # number of the step's latest pass node, and True: audited), whose kind
        # the pipeline reads (``collect/loss_kind.py``); set by the pipeline.
        self.on_loss_kind: KindReader | None = None
        # The number of the latest autograd node the step's passes made: the
        # loss's nodes come after it.
        self._last_node = -1

    # -- the span: from the model's output to the step boundary -------------
    def pass_starts(
        self, module: Any = None, inputs: tuple[Any, dict[str, Any]] | None = None
    ) -> None:
        """The model's forward pass begins: no audit follows its output until it ends.

        A pass given labels (``module``'s arguments, ``inputs``) computes a loss
        inside: its labels are followed through the pass.
        """
        self.stop()
        self._leave_inside()
        if not self.live:
            return
        _IN_PASS.add(self)
        if module is None or inputs is None or self.steps_left <= 0:
            return
        if not torch.is_grad_enabled():
            return
        if self._depth is not None:
            # Our mode is still on the stack, waiting for one above it to leave
            # (asked from inside a handler): entering it again would leave a
            # second copy behind for good once the first one leaves.
            return
        labels = _label_tensors(module, *inputs)
        if not labels or not _stack_is_ours_to_use():
            return
        for tensor in labels:
            self._labels[id(tensor)] = tensor
        self._inside_part = None if self.name_called is None else self.name_called(module)
        self.inside = True
        self.audited_pass = True
        enter_loss_mode(self._mode)
        self._depth = torch._C._len_torch_function_stack()

    def pass_ends(self, output: Any, grad: bool, part: str | None = None) -> None:
        """The pass ended (also when it raised); with gradients on, follow its output.
        ``part``: the name of the part of the model the pass called on its own.

        A pass without gradients is not followed, but it does not end the span
        of the step's earlier passes: a DQN's target ``net(s2).max(1)`` or an
        actor-critic's bootstrap value, computed under ``no_grad`` after the
        online pass, comes before the loss that pairs them.
        """
        _IN_PASS.discard(self)
        self._leave_inside()
        if grad:
            self.start(output, part)
        elif self._follows_earlier_passes():
            self._enter()
        else:
            self.stop()

    def _leave_inside(self) -> None:
        if self.inside:
            self.inside = False
            self._labels.clear()

    def start(self, output: Any, part: str | None = None) -> None:
        """The model produced ``output`` with gradients on: follow it into the loss.

        Tensors of the step's earlier passes stay followed: a loss may stack
        the outputs of one pass per environment step. ``part``: the part of the
        model that made them, called on its own (a PPO agent's ``critic``), which
        a finding on them names.
        """
        if not self.live or self.steps_left <= 0:
            return
        self.audited_pass = True
        reads_kind = self.on_loss_kind is not None
        for tensor in _tensors(output):
            self._track(tensor, part)
            if reads_kind:
                self._last_node = max(self._last_node, node_number(tensor))
            if self._batch is None and tensor.dim() > 0:
                self._batch = tensor.shape[0]
            if self.judges_loss_inputs:
                self._note_squashed(tensor, part)
        self._enter()

    def _note_squashed(self, tensor: torch.Tensor, part: str | None) -> None:
        """A pass output made by a softmax or sigmoid: the model's forward made it."""
        node = squashing_node(tensor) if tensor.grad_fn is not None else None
        if node is not None and len(self._squashed) < _MAX_FINDINGS:
            self._squashed[id(node)] = (node, part or "")

    def _follows_earlier_passes(self) -> bool:
        """Outputs of the step's passes with gradients are still held, the audit still on."""
        return self.live and self.steps_left > 0 and len(self._tracked) > 0

    def _enter(self) -> None:
        """Put the mode on the stack, unless it is there already or another's mode
        would be left under it (ours is popped from the top only)."""
        if self._depth is None and _stack_is_ours_to_use():
            enter_loss_mode(self._mode)
            self._depth = torch._C._len_torch_function_stack()

    def stop(self) -> None:
        """Leave the span; only pops the mode when it is still on top of the stack.

        Called as each pass of the model starts (the model's own ops are not
        the loss) and at the step boundary; what is followed is kept until
        the step ends.
        """
        if self._depth is None:
            return
        if leave_mode(self._mode):
            self._depth = None
        # Otherwise another mode entered after ours is still active: popping
        # now would pop it. Ours stays, inert once the audit ends, and is
        # retried at the next boundary.

    def step_boundary(self) -> list[BroadcastReport]:
        self.stop()
        self._last_node = -1
        self._tracked.clear()
        self._parts.clear()
        self._given.clear()
        self._squashed.clear()
        _IN_PASS.discard(self)
        if self.audited_pass:
            self.steps_left -= 1
            self.audited_pass = False
        if self.steps_left <= 0:
            self.live = False
        found = self.take_findings()
        self._batch = None
        return found

    def rearm(self, steps: int) -> None:
        """Audit ``steps`` more steps from the next pass: a new phase of training, or a
        sampled step. What was told already (an op and its shapes) is not told again."""
        if self.ended or steps <= 0:
            return
        if not self.live:
            self.measures_target = False
        self.steps_left = max(self.steps_left, steps)
        self.live = True

    def take_loss_inputs(self) -> list[LossInputReport]:
        found, self.loss_inputs = self.loss_inputs, []
        if self._nll.judgements:
            measured = self._nll.take()
            self._forget_nll()
            for judgement, top, lse in measured:
                if self.unbounded_nll is None:
                    self.unbounded_nll = judgement.source or "?"
                if len(found) >= _MAX_FINDINGS:
                    break
                found.append(
                    LossInputReport(
                        "logits_into_nll",
                        "nll_loss",
                        judgement.source,
                        judgement.module is not None,
                        judgement.module,
                        largest=top,
                        logsumexp=lse,
                    )
                )
        return found

    def take_target(self) -> torch.Tensor | None:
        found, self.target_spread = self.target_spread, None
        return found

    @property
    def carries(self) -> bool:
        """Its mode is on the stack and follows this span's loss: a look of the same
        span may ride it (``rider``) instead of pushing a mode of its own."""
        return self.live and self._depth is not None and not self.inside

    @property
    def finished(self) -> bool:
        """The audit is over and its mode is off the stack: nothing of it runs again."""
        return not self.live and self._depth is None

    def detach(self) -> None:
        self.live = False
        self.ended = True
        self._leave_inside()
        self.stop()
        self._tracked.clear()
        self._parts.clear()
        self._given.clear()
        self._squashed.clear()
        self._class_maps.clear()
        self._forget_nll()
        _IN_PASS.discard(self)

    def fail(self, exc: BaseException) -> None:
        self.live = False
        self.ended = True
        self._leave_inside()
        _IN_PASS.discard(self)
        self._on_error("broadcast audit", exc)

    # -- inside the mode -------------------------------------------------------
    def _track(self, tensor: torch.Tensor, part: str | None = None) -> None:
        if len(self._tracked) < _MAX_TRACKED:
            self._tracked[id(tensor)] = tensor
            if part is not None:
                self._parts[id(tensor)] = part
            elif self._parts:
                self._parts.pop(id(tensor), None)  # an id freed and given again

    def _part_of(self, tensors: Any) -> str | None:
        """The part whose pass made the first of ``tensors`` derived from one."""
        if not self._parts:
            return None
        for tensor in tensors:
            if self._derived(tensor):
                part = self._parts.get(id(tensor))
                if part is not None:
                    return part
        return None

    def _follows(self, tensor: torch.Tensor, name: str) -> bool:
        """Followed: what carries the model's gradient, and its detached copy (an
        advantage built from values). Not what was only computed from it without
        gradient: an action sampled from the policy, and the rewards and
        observations an environment makes of it, are not the model's output."""
        return tensor.requires_grad or name == "detach"

    def _derived(self, tensor: torch.Tensor) -> bool:
        return self._tracked.get(id(tensor)) is tensor

    def _measure_target(self, operands: list[torch.Tensor]) -> None:
        if not self.measures_target:
            return
        if len(operands) < 2 or sum(self._derived(t) for t in operands[:2]) != 1:
            return
        target = operands[1] if self._derived(operands[0]) else operands[0]
        n = target.shape[0] if target.dim() > 0 else 0
        if n < 2 or n != self._batch or not target.is_floating_point():
            return
        rows = spread_rows(target.detach(), 16).reshape(min(n, 16), -1).float()
        self.target_spread = (rows - rows.mean(dim=0)).square().mean(dim=0).sqrt().mean()

    def _axes_given_to(self, tensor: torch.Tensor) -> frozenset[int]:
        ref, axes = self._given.get(id(tensor), (None, frozenset()))
        return axes if ref is not None and ref() is tensor else frozenset()

    def _note_given_axes(self, name: str, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Any tensor's, the model's or the data's: ``data.unsqueeze(1) - samples``
        in a kernel between the data and the model's samples pairs on purpose too."""
        source = args[0] if args else None
        before = self._axes_given_to(source) if isinstance(source, torch.Tensor) else frozenset()
        if not before and name not in _ADDS_AXES:
            return
        axes = _given_axes(name, args, kwargs, out, before)
        if axes and len(self._given) < _MAX_TRACKED:
            self._given[id(out)] = (weakref.ref(out), axes)

    def after_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name = _op_name(func)
        if name in _ADDS_AXES or self._given:
            self._note_given_axes(name, args, kwargs, out)
        if not any(self._derived(t) for t in _inputs(args, kwargs)):
            return
        operands = [a for a in args if isinstance(a, torch.Tensor)]
        operands += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        part = self._part_of(_inputs(args, kwargs))
        for tensor in _tensors(out):
            if self._follows(tensor, name):
                self._track(tensor, part)
        if (
            name in _REGRESSION
            and self.target_spread is None
            and not called_from(_DISTRIBUTIONS, depth=12)
        ):
            self._measure_target(operands)
        if name in LOSSES:
            self.losses.add(name)
        elif name == "backward" and self.on_loss_kind is not None:
            self.on_loss_kind(backward_roots(args, kwargs), self._last_node, True)
        if name in LOSS_INPUTS and self.judges_loss_inputs:
            self._judge_loss_input(name, args, kwargs, out, in_pass=False)
        if name not in self.judged_ops or len(operands) < 2 or len(self.findings) >= _MAX_FINDINGS:
            return
        self._judge(name, operands[0], operands[1])

    def inside_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """An op inside a pass given labels: follow the labels, judge what pairs them."""
        labels = self._labels
        if not any(labels.get(id(t)) is t for t in _inputs(args, kwargs)):
            return
        name = _op_name(func)
        if name in _KEEPS_LABELS:
            for tensor in _tensors(out):
                if len(labels) < _MAX_TRACKED:
                    labels[id(tensor)] = tensor
            return
        if name in LOSSES:
            self.losses.add(name)
        if name in LOSS_INPUTS and self.judges_loss_inputs:
            self._judge_loss_input(name, args, kwargs, out, in_pass=True)
        operands = [a for a in args if isinstance(a, torch.Tensor)]
        operands += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        if name not in _ELEMENTWISE or len(operands) < 2 or len(self.findings) >= _MAX_FINDINGS:
            return
        first, second = operands[0], operands[1]
        first_is_label = labels.get(id(first)) is first
        if first_is_label == (labels.get(id(second)) is second):
            return  # labels against labels, or neither: not a prediction and its target
        if first.dim() == second.dim():
            # The pass's prediction (it carries the gradient) against the labels it was
            # given: a Dice computed in ``forward`` from a class-index map.
            target, output = (first, second) if first_is_label else (second, first)
            if output.requires_grad:
                self._measure_class_map(name, (first, second), output, target, self._inside_part)
            return
        self._judge(name, first, second)

    def _judge(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        first, second = tuple(a.shape), tuple(b.shape)
        if len(first) == len(second):
            self._look_for_class_map(name, a, b)  # equal ranks pair no batch with another
            return
        # The inner form pairs the model's output with a target or mask; two
        # tensors both derived from the model (``z1.unsqueeze(1) - z2``, every
        # embedding against every other view's) are paired on purpose, and so is
        # one given its pairing axis in the loss (against a momentum encoder's keys,
        # a pairwise IoU's ``area_a[:, None] + area_b``), unless a loss function
        # takes it: ``F.mse_loss(pred, y.unsqueeze(1))`` is a mismatched target.
        high, low = (a, b) if a.dim() > b.dim() else (b, a)
        batch = None if self._derived(a) == self._derived(b) else self._batch
        given = frozenset() if name in _LOSSES else self._axes_given_to(high)
        output_lower = batch is not None and self._derived(low)
        result = batch_broadcast(first, second, batch, given, output_lower)
        if result is None or _one_tensor(a, b):
            return
        key = (name, first, second)
        if key in self._seen:
            return
        self._seen.add(key)
        part = self._part_of((a, b) if self._derived(a) else (b, a))
        self.findings.append(
            BroadcastReport(_op_told(name), [first, second], result, _user_line(), self.phase, part)
        )

    def _look_for_class_map(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """The model's ``(N, C, H, W)`` output against a ``(N, 1, H, W)`` side from
        elsewhere that carries no gradient: measured for a class-index map on the
        device, judged at the step's end (``collect/class_index_map.py``)."""
        derived = self._derived(a)
        if derived == self._derived(b):
            return
        output, target = (a, b) if derived else (b, a)
        self._measure_class_map(name, (a, b), output, target, self._part_of((output,)))

    def _measure_class_map(
        self,
        name: str,
        operands: tuple[torch.Tensor, torch.Tensor],
        output: torch.Tensor,
        target: torch.Tensor,
        module: str | None,
    ) -> None:
        """``target`` broadcast over ``output``'s channels by the op: its values measured,
        once for each op and pair of shapes, while it carries no gradient."""
        if len(self._class_maps) >= _MAX_FINDINGS:
            return
        axis = broadcast_channel(name, tuple(output.shape), tuple(target.shape))
        if axis is None or target.requires_grad:
            return
        shapes = (tuple(operands[0].shape), tuple(operands[1].shape))
        if (name, *shapes) in self._seen or any(
            (p.name, *p.shapes) == (name, *shapes) for p in self._class_maps
        ):
            return
        evidence = class_index_evidence(target, output.shape[axis])
        if evidence is not None:
            self._class_maps.append(
                PendingClassMap(
                    evidence, name, shapes, tuple(output.shape), axis, _user_line(), module
                )
            )

    def take_findings(self) -> list[BroadcastReport]:
        """What the span found: its batch pairings, and the ops measured that paired a
        class-index map with the output's channels (their evidence read now)."""
        measured, self._class_maps = self._class_maps, []
        for pending in measured:
            key = (pending.name, *pending.shapes)
            values = pending.values()
            if values is None or key in self._seen or len(self.findings) >= _MAX_FINDINGS:
                continue
            self._seen.add(key)
            first, second = pending.shapes
            self.findings.append(
                BroadcastReport(
                    _op_told(pending.name),
                    [first, second],
                    pending.output,
                    pending.source,
                    self.phase,
                    pending.module,
                    kind="class_index_map",
                    axis=pending.axis,
                    values=(values.low, values.high),
                    ignored=values.ignored,
                )
            )
        found, self.findings = self.findings, []
        return found

    def _judge_loss_input(
        self, name: str, args: Any, kwargs: dict[str, Any], out: Any, in_pass: bool
    ) -> None:
        """A loss taking logits given a softmax's output: a softmax the pass applied
        (its output, or ``in_pass``: a loss computed inside ``forward``) names the
        model, or the part called on its own; one the loop applied names none.
        ``nll_loss`` given anything else with a graph is measured for raw logits."""
        found = probabilities_fed(name, args, kwargs)
        if found is None and name == "nll_loss":
            self._measure_nll_input(args, kwargs, out, in_pass)
            return
        if found is None or len(self.loss_inputs) >= _MAX_FINDINGS:
            return
        kind, node = found
        made = self._squashed.get(id(node))
        if made is not None and made[0] is node:
            module: str | None = made[1]
        else:
            module = "" if in_pass else None
        self.loss_inputs.append(
            LossInputReport(kind, name, _user_line(), module is not None, module)
        )

    def _measure_nll_input(
        self, args: Any, kwargs: dict[str, Any], out: Any, in_pass: bool
    ) -> None:
        """``nll_loss`` given what no log_softmax made: a few rows measured on the
        device, read at the step's end (raw logits: values above 0, rows whose
        logsumexp is far from 0). Without a graph nothing is told, as above."""
        given = args[0] if args else kwargs.get("input")
        if not isinstance(given, torch.Tensor) or given.grad_fn is None:
            return
        if made_by_log_softmax(given):
            return
        if len(self._nll.judgements) >= _MAX_FINDINGS:
            return
        gap = log_probability_gap(args, kwargs)
        if gap is not None:
            self._nll.add(gap, out, _user_line(), "" if in_pass else None)
            # Until the step's end, each op is also looked at for negating the result
            # (a gather): an attribute of this audit, so an audited step without
            # nll_loss runs no more of it.
            self.after_op = self._after_op_following_nll  # type: ignore[method-assign]

    def _after_op_following_nll(
        self, func: Any, args: Any, kwargs: dict[str, Any], out: Any
    ) -> None:
        self._nll.after_op(_op_name(func), args, out)
        type(self).after_op(self, func, args, kwargs, out)

    def _forget_nll(self) -> None:
        self._nll.clear()
        self.__dict__.pop("after_op", None)
