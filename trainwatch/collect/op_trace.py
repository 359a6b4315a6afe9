"""Names the operation (and the user's source line) that made the first NaN/Inf.

Runs only after a module was caught producing a non-finite output from finite
inputs: the module is re-run on the inputs it saw under a dispatch-level
trace that checks every aten op's result. Healthy steps never pay for it. The
re-run must not change training: no autograd, the global RNG forked and
restored, the module's buffers (BatchNorm running stats) put back, and its
inputs copied (a module that changes its input in place changes the copy).
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from trainwatch.collect import quiet
from trainwatch.collect.rerun_effects import UndoneEffects, call_arguments
from trainwatch.collect.tensors import (
    detached_copies,
    inexact_tensors,
    only_negative_inf,
    tensor_leaves,
)
from trainwatch.compiled import OutOfGraphDispatchMode, eager
from trainwatch.rng import PassDraws, drawing_as_at, forked_rngs

# Frames that are never the user's line: PyTorch's and trainwatch's own.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRAINWATCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_SKIP_DIRS = (_TORCH_DIR, _TRAINWATCH_DIR)
_BUFFERS = attrgetter("_buffers")  # a module's buffer table (empty: falsy)
# trainwatch's function modes (the loss audits) hand each op on from these: a
# frame of theirs between the op and the user's line is no re-run of trainwatch's.
_PASS_THROUGH = frozenset({"__torch_function__", "_call"})

# Ops whose output is uninitialised memory: it may hold NaN bits by chance
# (a freed block reused), which the op did not make. The op that fills it
# (a copy, an out= kernel) is judged instead.
_UNINITIALISED = frozenset(
    getattr(torch.ops.aten, name)
    for name in ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")
    if hasattr(torch.ops.aten, name)
)


@dataclass(frozen=True)
class OpFinding:
    op: str  # e.g. "aten::div"
    source: str | None  # "path/to/file.py:123", the user's line that called it
    kind: str  # "nan" or "inf"
    # The op's own non-finite output (an exp's Inf inside a forward, not the
    # module's output it later turned into a NaN).
    count: int | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    # The op's own inputs held -inf (a mask built inside the module, such as
    # attention's padding mask): a softmax over a row entirely -inf makes NaN.
    inputs_masked: bool = False


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _mutates_an_input(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    if "batch_norm" in schema.name:
        # native_batch_norm updates the running statistics in place without
        # saying so in its schema.
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _user_line() -> str | None:
    """The innermost line of the user's code below the op, past the mode that saw it.

    Past the trace's own frames and PyTorch's, a frame of trainwatch's means
    the op ran in one of PyTorch's own modules that trainwatch re-ran (a replay
    of ``nn.Linear``): no line of the user's called it there, and the loop's
    line further out (where the whole model was called) would mislead.
    """
    frames = reversed(traceback.extract_stack())
    in_mode = True  # the mode's own frames (trainwatch's), innermost
    for frame in frames:
        name = frame.filename
        if in_mode and name.startswith(_TRAINWATCH_DIR):
            continue
        in_mode = False
        if name.startswith(_TORCH_DIR) or "<frozen" in name:
            continue
        if frame.name in _PASS_THROUGH and name.startswith(_TRAINWATCH_DIR):
            continue  # a function mode of trainwatch's (a loss audit) passing the op on
        return None if name.startswith(_TRAINWATCH_DIR) else f"{name}:{frame.lineno}"
    return None


def _only_negative_inf(tensors: list[torch.Tensor]) -> bool:
    return all(only_negative_inf(t) for t in tensors)


def _judge_inputs(args: Any, kwargs: Any, func: Any = None) -> tuple[bool, bool]:
    """(all finite, finite or masks) for an op's floating and complex inputs.

    A complex input is finite only where both its parts are: ``view_as_real``
    or ``.abs()`` of a spectrum that already held a NaN made nothing.
    """
    schema = getattr(func, "_schema", None)
    if schema is not None and "batch_norm" in schema.name and len(args) > 5 and args[5] is True:
        # Training-mode batch norm does not read its running statistics (it
        # updates them): poisoned ones are no input of this op.
        args, kwargs = args[:3], {}
    if kwargs and "out" in kwargs:
        # Written, not read: an ``out=`` buffer fresh from ``empty`` may hold NaN bits.
        kwargs = {name: value for name, value in kwargs.items() if name != "out"}
    inputs = list(inexact_tensors([args, kwargs]))
    finite = _all_finite(inputs)
    return finite, finite or _only_negative_inf(inputs)


def _scalars(value: Any) -> Iterator[float]:
    """The Python numbers among an op's arguments (``masked_fill``'s value, ``full``'s fill)."""
    if isinstance(value, float):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _scalars(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _scalars(item)


def _indicator(tensor: torch.Tensor) -> bool:
    """Only zeros and ones: a boolean mask turned into numbers (``mask.float()``)."""
    if tensor.numel() == 0:
        return False
    values = tensor.detach()
    return bool(((values == 0) | (values == 1)).all())


def _at_dtype_minimum(tensor: torch.Tensor) -> bool:
    """Holds values within 1% of the dtype's lowest finite number: an additive mask
    written with ``torch.finfo(dtype).min`` rather than -inf (a score that is
    merely large, -60000 in fp16, is not one)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    return bool((tensor.detach() <= torch.finfo(tensor.dtype).min * 0.99).any())


def mask_arithmetic(args: Any, kwargs: Any) -> bool:
    """Whether an op that made -inf from finite inputs was building a mask.

    Masks are -inf on purpose: a fill or select with a -inf scalar (``full``,
    ``masked_fill``, ``where``), the log of a 0/1 indicator
    (``log(mask.float())``), or dtype-minimum masks added together (their
    sum overflows to -inf). A -inf made any other way (the log of a count
    that can be 0, a division by a zero standard deviation) is arithmetic.
    """
    if any(not math.isfinite(value) for value in _scalars([args, kwargs])):
        return True
    tensors = [t for _, t in tensor_leaves([args, kwargs]) if t.layout == torch.strided]
    if tensors and all(_indicator(t) for t in tensors if t.dtype != torch.bool):
        return True
    return any(_at_dtype_minimum(t) for t in tensors)


class _FirstNonfinite(OutOfGraphDispatchMode):
    """The first op making NaN/+inf from inputs that were finite or masks.

    An op making only -inf is kept as the answer only when nothing worse
    follows: a module that builds a causal mask and then divides by zero is
    named by its division, not by its mask. A -inf made by arithmetic from
    finite inputs (not a mask, see ``mask_arithmetic``) that a NaN/+inf then
    consumes is the origin: the op that made it is named, not the one where
    it turned into a NaN (``-inf - -inf``). Complex results and inputs are
    judged like real ones: the FFT whose spectrum overflowed is named, not the
    ``view_as_real`` or ``.real`` that later handed its NaN to a real tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: OpFinding | None = None
        self.masklike: OpFinding | None = None
        self.made_negative_inf: OpFinding | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # An in-place op (sqrt_) overwrites its input: judge that input before it runs.
        before = None
        masking = None
        if self.found is None and _mutates_an_input(func):
            before = _judge_inputs(args, kwargs, func)
            masking = mask_arithmetic(args, kwargs)
        out = func(*args, **(kwargs or {}))
        if self.found is None and getattr(func, "overloadpacket", None) not in _UNINITIALISED:
            results = list(inexact_tensors(out))
            if results and not _all_finite(results):
                finite, finite_or_masks = before or _judge_inputs(args, kwargs, func)
                if finite_or_masks:
                    bad = next(t for t in results if not bool(torch.isfinite(t).all()))
                    kind = "nan" if bool(torch.isnan(bad).any()) else "inf"
                    name = func._schema.name if hasattr(func, "_schema") else str(func)
                    finding = OpFinding(
                        name,
                        _user_line(),
                        kind,
                        int((~torch.isfinite(bad)).sum()),
                        tuple(bad.shape),
                        str(bad.dtype),
                        inputs_masked=not finite,
                    )
                    if not _only_negative_inf(results):
                        # A NaN/+inf from a -inf this re-run made by arithmetic: that op.
                        made = self.made_negative_inf
                        self.found = finding if finite or made is None else made
                    elif finite:
                        self.masklike = self.masklike or finding
                        if masking is None:
                            masking = mask_arithmetic(args, kwargs)
                        if self.made_negative_inf is None and not masking:
                            self.made_negative_inf = finding
        return out

    @property
    def answer(self) -> OpFinding | None:
        return self.found or self.masklike


def trace_negative_inf_maker(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> OpFinding | None:
    """Re-run a module whose output held -inf, from finite inputs: the op whose own
    arithmetic made it, or None when only mask building did (``mask_arithmetic``)."""
    tracer = _FirstNonfinite()
    _rerun(module, args, kwargs, tracer)
    return tracer.made_negative_inf


def trace_negative_inf_turned_nonfinite(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> OpFinding | None:
    """Re-run a module that ran on finite inputs: the op whose arithmetic made a
    -inf that a NaN/+inf then came from, or None (no such -inf, or only masks)."""
    tracer = _FirstNonfinite()
    _rerun(module, args, kwargs, tracer)
    made = tracer.made_negative_inf
    return made if made is not None and tracer.found is made else None


@contextmanager
def swapped_buffers(
    module: nn.Module, modules: Iterable[nn.Module] | None = None
) -> Iterator[None]:
    """Give a re-run copies of the buffers (BatchNorm running stats).

    The originals are put back by reference: an in-place restore would bump
    version counters that autograd checks in the real backward. Modules
    without buffers (most of a deep model) are passed over in a C loop.
    ``modules``: ``module.modules()``, where the caller has them already.
    """
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    subs = module.modules() if modules is None else modules
    for buffers in filter(None, map(_BUFFERS, subs)):
        for name, buf in list(buffers.items()):
            if buf is not None:
                swapped.append((buffers, name, buf))
                buffers[name] = buf.detach().clone()
    try:
        yield
    finally:
        for buffers, name, original in swapped:
            buffers[name] = original


@contextmanager
def _null() -> Iterator[None]:
    yield


def trace_first_nonfinite_op(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rng: PassDraws = None,
) -> OpFinding | None:
    """Re-run ``module(*args, **kwargs)`` and return the first op that made a NaN/Inf.

    ``rng``: the CPU generator's state as the call began (with those of the
    model's own generators), so the re-run draws what the call drew (a dropout
    mask inside the module).
    """
    tracer = _FirstNonfinite()
    _rerun(module, args, kwargs, tracer, rng)
    return tracer.answer


def _rerun(
    module: nn.Module,
    args: Any,
    kwargs: Any,
    tracer: _FirstNonfinite,
    rng: PassDraws = None,
) -> None:
    """Run ``module`` once more under ``tracer``, leaving training as it was."""
    devices = [
        t.device.index or 0
        for t in inexact_tensors([list(args), kwargs])
        if t.device.type == "cuda"
    ]
    with torch.no_grad():
        args, kwargs = detached_copies((args, kwargs))
    try:
        with (
            UndoneEffects(module.modules(), call_arguments(args, kwargs)),
            swapped_buffers(module),
            forked_rngs(devices=sorted(set(devices))),
            torch.no_grad(),
            quiet.replay(),
            eager(),
            drawing_as_at(rng),
            tracer,
        ):
            module(*args, **kwargs)
    except Exception:
        pass  # what the trace found before the failure still stands
