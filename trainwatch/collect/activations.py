"""Sampled output statistics per module: spread across the batch, and zero fractions.

A standard deviation over the batch of every module's output costs 1.5-2.6x
a training step (measured on CPU), so it is taken only on sampled steps (the first
few, then every N), on the forward passes with gradients of those steps, on
at most ``rows`` rows of the batch, evenly strided over it, and at most
``_MAX_FEATURES`` positions (a strided view): the cost per module is bounded
whatever the layer's size.
On other passes no module is hooked at all: the hook is installed when a
sampled pass begins and removed when it ends. The numbers stay on the
device and join the step's single readback.

Which values: the floating tensors of a module's output (whatever structure
holds them: a dict, a dataclass, a named tuple) that have the batch axis of
its input, up to ``_MAX_LEAVES`` of them, each a row of its own. The first
of them that carries gradient is the module's *primary* output (a model's
prediction: ``logits`` of a Hugging Face-style output, whose ``loss`` is a
0-d tensor); dead units look at that one only. Integer, bool, complex and
empty tensors, 0-d tensors, batches of one and values that are not tensors
are skipped.

In-place modules (``nn.ReLU(inplace=True)``) return the tensor they were
given, changed: told apart from a container passing its child's output on by
the tensor's version counter, they are measured again, and their input's
spread is the one measured before the change.
"""

from __future__ import annotations

import math
import weakref
from itertools import compress
from operator import attrgetter, itemgetter, ne
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from trainwatch.collect import quiet
from trainwatch.collect.tensors import (
    is_checkable_float,
    spread_rows,
    tensor_leaves,
    version_of,
)
from trainwatch.compiled import compiling, transform_level, unwrap, user_name, wrapper_class
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.record import ActivationStats

if TYPE_CHECKING:
    from trainwatch.collect.output_target import OutputTargetLook

_MAX_FEATURES = 1024
_MAX_LEAVES = 8  # output tensors measured per module
# Modules measured per sampled pass past the first steps, besides the model's output.
_PER_PASS = 32
_NAN = float("nan")
_TENSOR = torch.Tensor
_STRIDED = torch.strided
# Stats per module, in this order, in one row of the step's tensor.
FIELDS = ("out_spread", "in_spread", "out_rms", "out_mean", "zero_fraction", "dead_fraction")

# The pseudo-module name under which the loss target's spread is handed over.
TARGET = "<loss target>"
# And the spread of the target of the sampled model output, on its own pass.
PASS_TARGET = "<pass target>"

# Modules whose output is exactly zero where a unit is inactive.
RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.Threshold)


class RowKey(NamedTuple):
    """Whose statistics a row holds: a module, which of its outputs, whether the primary one."""

    module: str
    output: str  # path inside the module's output ("logits", "0"); "" for a plain tensor
    primary: bool


class _Measured(NamedTuple):
    ref: weakref.ref[torch.Tensor]
    slot: int
    version: int | None


def _first_input(args: Any) -> torch.Tensor | None:
    """The module's first real-valued input tensor with values (ids count: they vary too)."""
    first = args[0] if type(args) is tuple and args else None
    if type(first) is _TENSOR and _has_real_values(first):
        return first  # the usual call, found without a walk
    for _, tensor in tensor_leaves(args):
        if _has_real_values(tensor):
            return tensor
    return None


def _has_real_values(tensor: torch.Tensor) -> bool:
    return tensor.layout == _STRIDED and tensor.numel() > 0 and not tensor.is_complex()


def _batched(tensor: torch.Tensor) -> bool:
    return is_checkable_float(tensor) and tensor.dim() > 0 and tensor.shape[0] >= 2


def _batched_outputs(output: Any) -> list[tuple[str, torch.Tensor]]:
    """The output's floating tensors with a batch axis of two or more rows, each once.

    A structure may hold one tensor twice (``logits`` and ``hidden_states[-1]``):
    it keeps the first path.
    """
    if type(output) is _TENSOR:  # the usual module: one plain tensor, no walk
        return [("", output)] if _batched(output) else []
    found = []
    seen: set[int] = set()
    for path, tensor in tensor_leaves(output):
        if id(tensor) in seen:
            continue
        if _batched(tensor):
            seen.add(id(tensor))
            found.append((path, tensor))
            if len(found) == _MAX_LEAVES:
                break
    return found


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Up to ``rows`` rows spread over the batch, at most ``_MAX_FEATURES`` evenly
    strided positions, fp32."""
    flat = spread_rows(tensor.detach(), rows).reshape(min(rows, tensor.shape[0]), -1)
    width = flat.shape[1]
    if width > _MAX_FEATURES:
        flat = flat[:, :: math.ceil(width / _MAX_FEATURES)]
    return flat.float()


class _Row:
    """One row of the step's statistics, by the measured tensors it comes from.

    Mutable: a root that returns a child's tensor adopts the child's row and
    gives it its own input.
    """

    __slots__ = ("output", "input", "spread", "zeros")

    def __init__(self, output: int, input: int | None, spread: bool, zeros: bool) -> None:
        self.output = output  # the output's rows among the pass's measured tensors
        self.input = input  # the input's (its spread is the row's in_spread)
        self.spread = spread  # out_spread, in_spread, out_rms, out_mean
        self.zeros = zeros  # zero_fraction, dead_fraction


_ROW_FIELDS = attrgetter("output", "input", "spread", "zeros")
_SHAPE_AND_DEVICE = attrgetter("shape", "device")
# Reduction plans kept per sampler: a deep model's window of modules turns
# through a few layouts; a model whose shapes keep changing starts over.
_PLANS_KEPT = 16


class _ReducePlan(NamedTuple):
    """How one layout of a pass's measured tensors is reduced: which are laid side by
    side (one count of rows and device each), the measured tensor each of their
    positions belongs to and each one's width, and where each row's fields are found."""

    groups: list[tuple[list[int], torch.Tensor, torch.Tensor]]
    picks: torch.Tensor


class _PendingRows:
    """A sampled pass's measured tensors, reduced together when the step takes them.

    Every measured output (and the inputs whose spread is not an earlier
    output's) is kept as a small fp32 copy; at the step boundary the copies
    with the same rows are laid side by side, each position's statistics
    across the rows are taken in one set of kernels, and one ``index_add``
    sums each tensor's positions: about twenty kernels for the whole pass,
    whatever its modules' shapes, instead of a dozen small kernels per module
    as it is called. Summing within each tensor's own positions keeps a NaN
    in one module's output out of every other module's row. A copy is at
    most ``rows`` x ``_MAX_FEATURES`` values, and they live for one pass.
    The layout (shapes and rows) repeats from one sampled step to the next:
    the grouping and the index tensors are worked out once per layout, in
    ``plans``.
    """

    def __init__(self, plans: dict[tuple[Any, ...], _ReducePlan]) -> None:
        self.tensors: list[torch.Tensor] = []
        self.rows: list[_Row] = []
        self._plans = plans

    def add(self, rows: torch.Tensor) -> int:
        self.tensors.append(rows.clone())
        return len(self.tensors) - 1

    def out_of(self, slot: int) -> int:
        return self.rows[slot].output

    def reduce(self) -> torch.Tensor | None:
        """(rows, len(FIELDS)) statistics, NaN where a row has no such value."""
        if not self.rows:
            return None
        tensors = self.tensors
        key = (tuple(map(_SHAPE_AND_DEVICE, tensors)), tuple(map(_ROW_FIELDS, self.rows)))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            plan = self._plans[key] = self._plan()
        parts = []
        for members, owners, widths in plan.groups:
            x = torch.cat([tensors[i] for i in members], dim=1)  # (rows, every position)
            rows = x.shape[0]
            mean = x.mean(dim=0)
            # Per position, across the rows: the (biased) std, written out
            # (Tensor.std takes ~10x longer on CPU for these short, wide
            # shapes); the mean square from it (no square of x); the share
            # of zeros, and whether all are zero (that share exactly 1).
            std = (x - mean).square_().mean(dim=0)
            mean_square = std + mean.square()
            std.sqrt_()
            zeros = (x == 0).sum(dim=0).div(rows)
            per_position = torch.stack([std, mean_square, mean, zeros, (zeros == 1.0).float()], 1)
            # Each tensor's mean over its own positions: spread, rms (its root
            # below), mean, zero_fraction, dead_fraction.
            sums = per_position.new_zeros((len(members), 5)).index_add_(0, owners, per_position)
            stats = sums.div_(widths)
            stats[:, 1].sqrt_()
            parts.append(stats)
        device = parts[0].device
        table = torch.cat([*(p.to(device) for p in parts), parts[0].new_full((1, 5), _NAN)])
        picks = plan.picks
        if picks.device != device:
            picks = picks.to(device)
        return table.reshape(-1)[picks].reshape(len(self.rows), len(FIELDS))

    def _plan(self) -> _ReducePlan:
        tensors = self.tensors
        by_rows: dict[tuple[int, torch.device], list[int]] = {}
        for i, tensor in enumerate(tensors):
            by_rows.setdefault((tensor.shape[0], tensor.device), []).append(i)
        groups = []
        for (_, device), members in by_rows.items():
            widths = [tensors[i].shape[1] for i in members]
            owners = torch.repeat_interleave(torch.arange(len(members)), torch.tensor(widths))
            groups.append(
                (
                    members,
                    owners.to(device),
                    torch.tensor(widths, dtype=torch.float32, device=device).unsqueeze(1),
                )
            )
        order = [i for members, _, _ in groups for i in members]
        where = {tensor: position for position, tensor in enumerate(order)}
        nan = len(order)
        # (measured tensor, its field) for each of FIELDS, in their order.
        picks: list[int] = []
        for row in self.rows:
            out = where[row.output]
            inp = where[row.input] if row.input is not None else nan
            spread_at = out if row.spread else nan
            zeros_at = out if row.zeros else nan
            picks += [spread_at * 5, inp * 5, spread_at * 5 + 1, spread_at * 5 + 2]
            picks += [zeros_at * 5 + 3, zeros_at * 5 + 4]
        return _ReducePlan(groups, torch.tensor(picks, device=tensors[0].device))


class _SampledPassHook:
    """The global forward hook of a sampled pass: this pass's modules, picked out by identity.

    Global, so nothing is stored on the modules: the model saves, pickles and
    deep-copies exactly as without trainwatch. While it is installed every
    module call in the process comes through it, so a module outside the
    pass's window is turned away with one dict lookup, before anything else.
    A module of the window is handed on through a :class:`WeakHook`, which
    holds the sampler weakly and reports a failure, as every trainwatch hook.
    """

    __slots__ = ("positions", "wrapper", "deliver")

    def __init__(self, sampler: ActivationSampler, positions: dict[int, int]) -> None:
        self.positions = positions  # id(module) -> its index, for this pass's modules
        # A hook lasts one pass, and no wrapper exists before dynamo is loaded.
        self.wrapper = wrapper_class()
        self.deliver = WeakHook(sampler, "module_called")

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling():  # first: dynamo folds it, and traces nothing more
            return None
        position = self.positions.get(id(module))
        if position is None:
            if self.wrapper is None or type(module) is not self.wrapper:
                return None
            position = self.positions.get(id(unwrap(module)))  # torch.compile's wrapper
            if position is None:
                return None
        if transform_level() is not None:
            # A part called inside vmap/grad (an ensemble's template under
            # functional_call): its outputs are wrapped tensors that exist only
            # inside the transform; the model's own output is measured outside.
            return None
        return self.deliver(position, module, args, output)


class ActivationSampler:
    def __init__(
        self, model: nn.Module, rows: int, spread: bool, zeros: bool, on_error: Any
    ) -> None:
        self.rows = rows
        self.spread = spread  # constant_output wants spreads
        self.zeros = zeros  # dead_units wants zero fractions
        self.active = False  # this pass is sampled
        self.enabled = True
        self._watched: dict[int, int] = {}
        self._ids: dict[int, int] = {}  # a watched module's index -> its id
        self._order: list[int] = []
        self._turn = 0
        self._window: set[int] | None = None  # this pass's modules; None: all of them
        self._on_error = on_error
        self.handles = HookGroup()
        self._plans: dict[tuple[Any, ...], _ReducePlan] = {}
        # What the loss compares the measured model output with (set by the owner).
        self.target_look: OutputTargetLook | None = None
        self._names: list[str] = []
        self._relu: list[bool] = []
        self.attach(model)
        self._reset()

    def attach(self, model: nn.Module) -> None:
        self.detach()
        self._names, self._relu = [], []
        watched: dict[int, int] = {}
        for index, (name, module) in enumerate(model.named_modules()):
            relu = isinstance(module, RELU_FAMILY)
            self._names.append(user_name(name))
            self._relu.append(relu)
            if not self.spread and not relu:
                continue
            watched[id(module)] = index
        self._watched = watched
        self._ids = {index: key for key, index in watched.items()}
        # The modules other than the model itself, in the order they are taken in turn.
        self._order = sorted(index for index in watched.values() if index != 0)
        self._turn = 0

    def start_pass(self, sampled: bool, hook_modules: bool, every_module: bool = True) -> None:
        """A pass begins; a sampled one hooks every module, for its duration only.

        Not around a compiled graph (no module is seen inside it, and a global
        hook that comes and goes would make dynamo recompile): there the
        model's own output is measured when the pass ends.

        Past the first steps (``every_module`` False) a sampled pass measures
        the model's output and at most ``_PER_PASS`` other modules, the next
        ones in turn: a sampled step then costs the same at any depth, and a
        deep model's modules are each measured every few sampled steps.
        """
        self.active = sampled
        if not sampled:
            return
        if every_module or len(self._watched) <= _PER_PASS + 1:
            self._window = None
            positions = self._watched
        else:
            order = self._order
            start = self._turn % len(order)
            chosen = (order + order)[start : start + _PER_PASS]
            self._turn = start + _PER_PASS
            self._window = {0, *chosen}
            ids = self._ids
            positions = {ids[index]: index for index in self._window if index in ids}
        if hook_modules and not self.handles:
            self.handles.add(register_module_forward_hook(_SampledPassHook(self, positions)))

    def module_called(self, position: int, module: nn.Module, args: Any, output: Any) -> None:
        """A module of this pass's window has been called (from the pass's hook)."""
        if self.active and not quiet.replaying():
            self.after_forward(position, module, args, output)

    def end_pass(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.active and not self.handles:
            self.after_forward(0, module, args, output)  # the model, around its compiled graph
        self.outputs.clear()
        self.active = False
        if self.handles:
            self._unhook()

    def _unhook(self) -> None:
        self.handles.remove_all()

    def detach(self) -> None:
        self.active = False
        self._unhook()

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self.active = False
        self._unhook()
        self._reset()
        if self.target_look is not None:
            self.target_look.take()  # nothing of this step is handed over
        self._on_error("activation sampler", exc)

    def _reset(self) -> None:
        self._pending = _PendingRows(self._plans)
        self._keys: list[tuple[int, str, bool]] = []  # (module index, output path, primary)
        self._done: set[int] = set()
        self._with_spread: set[int] = set()  # rows whose spread was measured
        # Output tensors measured in this pass, weakly, with the version they
        # had: a container that returns its child's tensor is not measured
        # twice; one changed in place since is.
        self.outputs: dict[int, _Measured] = {}
        # The model's primary output measured in this pass, until its pass ends: the
        # loss's target for it is looked at (``collect/output_target.py``).
        self.model_output: torch.Tensor | None = None

    def after_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if index in self._done or not torch.is_grad_enabled():
            return  # the first call of a step is enough (recurrent cells, eval passes)
        leaves = _batched_outputs(output)
        if not leaves:
            return
        self._done.add(index)
        inp = _first_input(args)
        batch = inp.shape[0] if inp is not None and inp.dim() > 0 else None
        if len(leaves) == 1:
            primary = leaves[0][1]
        else:
            batched = [t for _, t in leaves if t.shape[0] == batch] or [t for _, t in leaves]
            primary = next((t for t in batched if t.requires_grad), batched[0])
        relu = self._relu[index]
        in_spread: torch.Tensor | None = None
        for path, out in leaves:
            is_primary = out is primary
            spread = self.spread and out.shape[0] == batch
            zeros = self.zeros and relu and is_primary
            if not (spread or zeros):
                continue
            seen = self.outputs.get(id(out))
            if seen is not None and seen.ref() is not out:
                seen = None
            if seen is not None and seen.version == version_of(out):
                # Already measured, unchanged: a container passing a child's output on.
                if index == 0 and is_primary and spread:
                    self._adopt_as_model_output(seen.slot, path, inp)
                    self.model_output = out
                continue
            if spread and in_spread is None:
                if seen is not None and out is inp:
                    # Changed its own input in place: that input was measured before.
                    in_spread = self._pending.out_of(seen.slot)
                else:
                    in_spread = self._measured_spread(inp)
                    if in_spread is None:
                        in_spread = self._pending.add(_rows(inp, self.rows))
            self._measure(index, path, is_primary, out, in_spread if spread else None, zeros)
            if index == 0 and is_primary and spread:
                self.model_output = out

    def _measured_spread(self, tensor: torch.Tensor | None) -> int | None:
        """The spread already taken of ``tensor`` as an earlier module's output, unchanged
        since (in a chain, each module's input is the one before's output)."""
        if tensor is None:
            return None
        seen = self.outputs.get(id(tensor))
        if seen is None or seen.ref() is not tensor or seen.version != version_of(tensor):
            return None
        return self._pending.out_of(seen.slot) if seen.slot in self._with_spread else None

    def _adopt_as_model_output(self, slot: int, path: str, inp: torch.Tensor | None) -> None:
        """The root returns a child's tensor: its row is reported as the model's output."""
        self._keys[slot] = (0, path, True)
        if inp is not None and self.spread:
            self._pending.rows[slot].input = self._pending.add(_rows(inp, self.rows))

    def _measure(
        self,
        index: int,
        path: str,
        primary: bool,
        out: torch.Tensor,
        in_spread: int | None,
        zeros: bool,
    ) -> None:
        """The output's rows, copied (a later in-place op must not change them), to be
        reduced with the others of the pass when the step takes them."""
        spread = in_spread is not None
        pending = self._pending
        measured = pending.add(_rows(out, self.rows))
        slot = len(self._keys)
        pending.rows.append(_Row(measured, in_spread, spread, zeros))
        if spread:
            self._with_spread.add(slot)
        self.outputs[id(out)] = _Measured(weakref.ref(out), slot, version_of(out))
        self._keys.append((index, path, primary))

    def take(self) -> tuple[list[RowKey], torch.Tensor | None]:
        """Hand over this step's samples (whose each row is, one (M, 6) device tensor)."""
        if not self._keys and not self._done:
            return [], None  # not a sampled step
        taken = self._keys
        keys = list(
            map(
                RowKey,
                map(self._names.__getitem__, map(itemgetter(0), taken)),
                map(itemgetter(1), taken),
                map(itemgetter(2), taken),
            )
        )
        stats = self._pending.reduce()
        self._reset()
        if self.target_look is not None and stats is not None:
            stats = self._with_pass_target(self.target_look, keys, stats)
        return keys, stats

    @staticmethod
    def _with_pass_target(
        look: OutputTargetLook, keys: list[RowKey], stats: torch.Tensor
    ) -> torch.Tensor:
        """The rows, and the spread of the model output's loss target on its pass as one
        more (NaN where no loss op named one)."""
        target = look.take()
        if target is None:
            return stats
        keys.append(RowKey(PASS_TARGET, "", True))
        row = stats.new_full((1, len(FIELDS)), _NAN)
        row[0, 0] = target.to(row.device) if isinstance(target, torch.Tensor) else target
        return torch.cat([stats, row])

    @staticmethod
    def unpack(keys: list[RowKey], values: list[float]) -> list[ActivationStats]:
        found = []
        width = len(FIELDS)
        # NaN (no such value for the row) becomes None; NaN is the one value unequal
        # to itself. The positions are found in C, and only they are visited.
        values = list(values)
        for position in compress(range(len(values)), map(ne, values, values)):
            values[position] = None
        for i, (module, output, primary) in enumerate(keys):
            row = values[i * width : (i + 1) * width]
            if len(row) < width:
                break
            found.append(ActivationStats(module, output, primary, *row))
        return found
