"""Finds the tensors inside whatever a module returns.

Real models return tensors, tuples, lists, dicts, dataclasses and named
tuples, nested (a Hugging Face-style ``ModelOutput`` is an ``OrderedDict``
subclass and a dataclass at once), and mix in values that are not tensors
(``None``, a count, a string). Every check walks them here, each takes the
leaves it applies to and silently skips the rest:

- ``tensor_leaves``: every tensor, with its path (``"logits"``,
  ``"hidden.0"``); the broadcast audit follows all of them into the loss.
- ``floating_tensors``: real floating tensors with values (not empty, not
  sparse): what the activation statistics apply to. Integer and bool tensors
  cannot hold a NaN/Inf, and complex ones have no single spread.
- ``inexact_tensors``: floating and complex ones: what the trigger's NaN/Inf
  check reads of a pass's output (``inexact_list``), and where a replay looks
  for the birth of a NaN/Inf. A complex tensor (an FFT's spectrum, the
  product of a complex weight) holds it before ``.real``, ``.abs()`` or
  ``view_as_real`` hands it on to a real one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, MutableSequence, MutableSet
from itertools import chain
from typing import Any

import torch

# Deep enough for a dict of tuples of dataclasses of lists; a bound, so a
# self-referencing object cannot recurse forever.
_MAX_DEPTH = 6

# Grad mode switched by hand on hot paths (a pass's output check, the step's
# norms, a sampled module's rows): torch.no_grad()'s context object costs four
# Python calls each time, a detach one op more.
set_grad_enabled = torch._C._set_grad_enabled


_PLAIN = {torch.Tensor}


def all_plain(values: Iterable[Any]) -> bool:
    """Every value a plain ``torch.Tensor`` (so none is None, none a subclass or a
    shard), told in one C pass: the usual step's gradients, with no Python per one."""
    return set(map(type, values)) == _PLAIN


def tensor_leaves(value: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with its dotted path, in the structure's order."""
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth >= _MAX_DEPTH or value is None or isinstance(value, (str, bytes, int, float)):
        return
    if isinstance(value, Mapping):  # dicts, OrderedDicts, ModelOutput-style hybrids, UserDicts
        items: Any = value.items()
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        items = zip(value._fields, value)
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value))
    else:
        return
    for key, item in items:
        yield from tensor_leaves(item, f"{path}.{key}" if path else str(key), depth + 1)


_STRIDED = torch.strided


def is_checkable_float(tensor: torch.Tensor) -> bool:
    """A real floating tensor with values in ordinary (strided) storage."""
    return tensor.is_floating_point() and tensor.layout == torch.strided and tensor.numel() > 0


def floating_list(value: Any) -> list[torch.Tensor]:
    """``floating_tensors`` as a list, with no walk for the usual plain tensor output."""
    if type(value) is torch.Tensor:
        checkable = value.is_floating_point() and value.layout is _STRIDED and value.numel() > 0
        return [value] if checkable else []
    return list(floating_tensors(value))


def inexact_list(value: Any) -> tuple[list[torch.Tensor], bool]:
    """``inexact_tensors`` as a list, with whether any of them is complex, and no walk
    for the usual plain tensor output: what the trigger checks of a model's pass. A
    model may hand on a complex tensor (an FNO or a complex layer's output, its loss
    ``(out - target).abs()``), whose NaN/Inf must count there as a real one's does."""
    if type(value) is torch.Tensor:
        if value.is_floating_point() and value.layout is _STRIDED and value.numel() > 0:
            return [value], False
        if value.is_complex() and value.layout is _STRIDED and value.numel() > 0:
            return [value], True
        return [], False
    found: list[torch.Tensor] = []
    complex_ = False
    for _, tensor in tensor_leaves(value):
        if is_checkable_float(tensor):
            found.append(tensor)
        elif is_checkable_inexact(tensor):
            found.append(tensor)
            complex_ = True
    return found, complex_


def floating_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The real floating tensors with values in ``value``, in the structure's order."""
    for _, tensor in tensor_leaves(value):
        if is_checkable_float(tensor):
            yield tensor


def is_checkable_inexact(tensor: torch.Tensor) -> bool:
    """A floating or complex tensor with values in ordinary (strided) storage: one
    a NaN/Inf can be in. A complex value is non-finite when either part is."""
    return (
        (tensor.is_floating_point() or tensor.is_complex())
        and tensor.layout == torch.strided
        and tensor.numel() > 0
    )


def inexact_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The floating and complex tensors with values in ``value``, in the structure's order.

    Only where a NaN/Inf has been seen already (a replay, an op trace) or every
    module is checked: left out, a complex tensor's NaN would be found first in
    the real tensor a view or ``.abs()`` makes of it, and that op blamed.
    """
    for _, tensor in tensor_leaves(value):
        if is_checkable_inexact(tensor):
            yield tensor


def real_parts(tensor: torch.Tensor) -> torch.Tensor:
    """A complex tensor's real and imaginary parts as one real tensor (a view, a
    last dimension of 2; a conjugate view resolved first); any other as it is."""
    if tensor.is_complex():
        return torch.view_as_real(tensor.resolve_conj())
    return tensor


def input_range(tensors: Iterable[torch.Tensor]) -> tuple[float, float] | None:
    """The smallest and largest value of a pass's floating inputs, for a message.

    Scalars are left out: a 0-d argument is a setting or a count (a temperature,
    the ``num_items_in_batch`` the Hugging Face Trainer hands a model), not data;
    told as the input range it reads as if the data were constant. A complex
    input's range is that of its real and imaginary parts.
    """
    data = [real_parts(t.detach()) for t in tensors if t.dim() > 0 and t.numel() > 0]
    if not data:
        return None
    return min(float(t.min()) for t in data), max(float(t.max()) for t in data)


def detached_copies(value: Any, memo: dict[int, Any] | None = None, depth: int = 0) -> Any:
    """``value`` with each tensor in it replaced by a detached copy.

    trainwatch's re-runs of a module (a NaN replay, an op trace) are handed
    these: a module that changes its input in place (an in-place
    normalisation, ``x.relu_()``) must not change the user's batch a second
    time, nor bump the version counter of a tensor the user's backward needs.
    A tensor found twice gets one copy (``memo``), as aliasing goes.
    Tuples, lists, named tuples and dicts are rebuilt; other mappings,
    sequences and sets a forward can change (a ``deque`` it ``popleft``s)
    and dataclasses are shallow-copied with their tensors replaced, so a
    re-run that empties one leaves the next re-run its items; any other
    object (or one that cannot be copied) is passed on as it is.
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.detach().clone()
        return memo[id(value)]
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(detached_copies(item, memo, depth + 1) for item in value))
    if type(value) in (tuple, list):
        return type(value)(detached_copies(item, memo, depth + 1) for item in value)
    if type(value) is dict:
        return {key: detached_copies(item, memo, depth + 1) for key, item in value.items()}
    if isinstance(value, (Mapping, MutableSequence, MutableSet)) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    ):
        return _rebuilt(value, memo, depth)
    return value


def _rebuilt(value: Any, memo: dict[int, Any], depth: int) -> Any:
    try:
        rebuilt = copy.copy(value)
        if isinstance(value, Mapping):
            for key, item in value.items():
                rebuilt[key] = detached_copies(item, memo, depth + 1)
        elif isinstance(value, MutableSequence):
            for index, item in enumerate(value):
                rebuilt[index] = detached_copies(item, memo, depth + 1)
        elif isinstance(value, MutableSet):
            rebuilt.clear()
            for item in value:
                rebuilt.add(detached_copies(item, memo, depth + 1))
        if dataclasses.is_dataclass(value):
            for field in dataclasses.fields(value):
                item = detached_copies(getattr(value, field.name, None), memo, depth + 1)
                object.__setattr__(rebuilt, field.name, item)
    except Exception:  # immutable or uncopyable: the replay gets the original
        return value
    return rebuilt


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter; None for inference tensors, which keep none.

    Telling "the same tensor" from "the same tensor, changed in place since"
    (``nn.ReLU(inplace=True)``, ``x += residual``) needs both identity and this.
    """
    return None if tensor.is_inference() else tensor._version


def only_negative_inf(tensor: torch.Tensor) -> bool:
    """No NaN and no +inf: whatever is not finite is -inf, what a mask is made of
    (``torch.full(..., -inf)``, ``masked_fill``). No complex value is a mask: one
    is this only where both its parts are finite everywhere."""
    values = tensor.detach()
    if values.is_complex():
        return bool(torch.isfinite(values).all())
    return not bool((torch.isnan(values) | torch.isposinf(values)).any())


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's (FSDP2) local shard.

    A reduction over a whole DTensor is a collective; checking what this rank
    holds must never be one.
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def non_leaf(tensor: torch.Tensor) -> bool:
    """Made by autograd in this pass: a tensor hook on it goes when the graph goes."""
    return tensor.requires_grad and tensor.grad_fn is not None


# Up to this many elements, a CPU tensor's values are read as Python floats
# and checked one by one: cheaper than a sum and its read (a batch-of-one
# policy's logits, a value head's output), and no op at all.
_READ_AS_FLOATS = 16


def finite_exact(tensor: torch.Tensor, masks: bool = True) -> bool:
    """Whether every value is finite (or a deliberate -inf mask, see ``finite_or_mask``).

    A small CPU tensor is read as floats; any other gets one fp32 sum, and the
    exact elementwise check only when that sum is not finite. ``masks=False``
    lets no -inf pass as a mask: a gradient is never one.
    """
    if type(tensor) is torch.Tensor and tensor.is_cpu and tensor.numel() <= _READ_AS_FLOATS:
        values = tensor.tolist()
        dims = tensor.dim()
        if dims == 0:
            values = (values,)
        elif dims == 2:  # a batch of one's row
            values = chain.from_iterable(values)
        else:
            for _ in range(dims - 1):
                values = chain.from_iterable(values)
        if all(map(math.isfinite, values)):
            return True
        return masks and finite_or_mask(tensor)
    # Outside autograd by grad mode (see set_grad_enabled), at every pass.
    grad = torch.is_grad_enabled()
    if grad:
        set_grad_enabled(False)
    try:
        total = tensor.sum(dtype=torch.float32)
    finally:
        if grad:
            set_grad_enabled(True)
    if math.isfinite(float(total)):
        return True
    if not masks:  # the sum may overflow where every value is finite
        return bool(torch.isfinite(tensor.detach()).all())
    if float(total) == -math.inf and not is_weight(tensor):
        # No NaN and no +inf (either makes the sum NaN/+inf): -inf entries, or
        # finite ones past fp32's range. A masked output is judged by its sum.
        return True
    return finite_or_mask(tensor)


def finite_inexact(tensor: torch.Tensor) -> bool:
    """``finite_exact`` for a floating or a complex tensor: a complex one is finite where
    both parts of every value are (no complex value is a mask)."""
    if tensor.is_complex():
        return finite_exact(real_parts(tensor.detach()), masks=False)
    return finite_exact(tensor)


def finite_or_mask(tensor: torch.Tensor) -> bool:
    """Finite, or a mask: its only non-finite entries -inf, and it is no weight.

    A forward pass makes -inf on purpose, with or without grad: causal and
    padding masks (``torch.full``, ``masked_fill``) and invalid-action
    masking, where ``logits.masked_fill(~legal, -inf)`` carries the logits'
    grad into a ``Categorical`` or a ``log_softmax``. A -inf alone harms
    nothing; what it turns into is caught where it shows: a NaN/+inf that
    follows (softmax of a row of nothing but -inf, ``-inf * 0``, a BatchNorm
    after ``log(0)``, whose -inf is then traced to the op that made it), a
    non-finite loss, a non-finite gradient. NaN or +inf is never a mask, and
    neither is a -inf in a weight (a leaf autograd trains): masks are made by
    ops, never written by an optimizer.
    """
    # Detached: inside a checkpoint's recomputation, any op that saves a
    # tensor for backward (isfinite's abs does) breaks the recompute's match.
    if bool(torch.isfinite(tensor.detach()).all()):
        return True
    return not is_weight(tensor) and only_negative_inf(tensor)


def is_weight(tensor: torch.Tensor) -> bool:
    """A leaf autograd trains (a parameter): written by an optimizer, never a mask."""
    return tensor.requires_grad and tensor.is_leaf


def spread_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Up to ``rows`` rows evenly strided over the batch (a view).

    Not the first rows: a batch in order (a full-batch fit on ``linspace``
    inputs, a time series, data sorted by a column) holds neighbours there,
    whose outputs vary little even where the model follows its input well.
    """
    n = tensor.shape[0]
    if n <= rows:
        return tensor
    stride = n // rows
    return tensor[: stride * rows : stride]
