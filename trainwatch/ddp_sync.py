"""Where DDP's reducer and the parameters trainable now disagree: a layer unfrozen,
or frozen, after wrapping.

``DistributedDataParallel`` builds its reducer once, from the parameters that
required grad when it was constructed. A layer frozen then and unfrozen later
(a staged fine-tune; Lightning's ``BaseFinetuning`` freezes before its DDP
strategy wraps the model) gets its gradient on each rank and is never
averaged: every rank trains its own copy and the copies drift apart, with no
error. The mirror, a layer frozen after wrapping, never gets the gradient the
reducer waits for: without ``find_unused_parameters=True`` the next forward
fails ("Expected to have finished reduction in the prior iteration"). DDP's
logging data holds how many parameters its reducer took; the parameters
trainable now are counted the way DDP counted them. Asked at setup audits
only (attach, a ``requires_grad`` flip), never on a step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainwatch.compiled import unwrap, user_name


@dataclass
class SyncGap:
    """A DDP wrapper whose reducer holds fewer parameters than are trainable now."""

    synced: int  # parameter tensors DDP's reducer all-reduces
    trainable: int  # parameter tensors DDP would take if wrapped now
    find_unused: bool


def sync_gaps(root: nn.Module) -> tuple[SyncGap | None, SyncGap | None]:
    """How the model's DDP wrapper falls short, and how it waits for more than
    trains, each if every wrapper of it does.

    The wrapper is the model itself, or one holding it (a script watching the
    module it wraps, Lightning's strategy): found by one scan of live objects.
    A wrapper built again after the unfreeze (or the freeze) matches them all,
    and an older one still alive beside it says nothing.
    """
    wrapped = isinstance(root, DistributedDataParallel)
    if wrapped and _gap(root) is None and _waits(root) is None:
        return None, None
    inner = unwrap(root.module) if wrapped else root
    wrappers = ([root] if wrapped else []) + _wrappers_of(inner, root)
    return _every(wrappers, _gap), _every(wrappers, _waits)


def _every(
    wrappers: list[DistributedDataParallel],
    gap_of: Callable[[DistributedDataParallel], SyncGap | None],
) -> SyncGap | None:
    gap = None
    for wrapper in wrappers:
        found = gap_of(wrapper)
        if found is None:
            return None
        gap = gap or found
    return gap


def _wrappers_of(inner: nn.Module, seen: nn.Module) -> list[DistributedDataParallel]:
    return [
        obj
        for obj in gc.get_objects()
        # (type(), not isinstance: a deprecated torch object warns when asked its class)
        if issubclass(type(obj), DistributedDataParallel)
        and obj is not seen
        and unwrap(obj.module) is inner
    ]


def _gap(ddp: DistributedDataParallel) -> SyncGap | None:
    synced = _synced(ddp)
    if synced is None:
        return None
    trainable = _trainable(ddp)
    if trainable <= synced:
        return None
    return SyncGap(synced, trainable, bool(ddp.find_unused_parameters))


def _waits(ddp: DistributedDataParallel) -> SyncGap | None:
    """A reducer waiting for gradients of parameters frozen since it was built.

    ``find_unused_parameters=True`` copes; so does ``static_graph=True`` with a
    freeze before the first iteration, and a freeze after it cannot be told
    apart here: both are left alone.
    """
    if ddp.find_unused_parameters or getattr(ddp, "static_graph", False):
        return None
    synced = _synced(ddp)
    if synced is None:
        return None
    trainable = _trainable(ddp)
    if trainable >= synced:
        return None
    return SyncGap(synced, trainable, False)


def _synced(ddp: DistributedDataParallel) -> int | None:
    """The reducer's parameter count (None: no reducer, every all-reduce delayed)."""
    if getattr(ddp, "logger", None) is None or not hasattr(ddp, "_get_ddp_logging_data"):
        return None
    count = ddp._get_ddp_logging_data().get("num_parameter_tensors")
    return count if isinstance(count, int) else None


def _trainable(ddp: DistributedDataParallel) -> int:
    """As DDP's ``_build_params_for_reducer`` counts: requiring grad, not ignored, once each."""
    ignored = getattr(ddp, "parameters_to_ignore", ())
    seen: set[int] = set()
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param.requires_grad and f"{module_name}.{param_name}" not in ignored:
                seen.add(id(param))
    return len(seen)


def reducer_names(ddp: DistributedDataParallel) -> list[str] | None:
    """The reducer's parameters, by its index, where the counts show which they are.

    DDP's error for a parameter without a gradient lists reducer indices, not
    names. The reducer took, in ``named_modules`` order, the parameters that
    required grad then: those trainable now when it holds as many (a layer
    unused on a step), every one it may take when it holds that many (a layer
    frozen after wrapping); None when neither count matches.
    """
    synced = _synced(ddp)
    if synced is None:
        return None
    ignored = getattr(ddp, "parameters_to_ignore", ())
    taken: list[str] = []
    trainable: list[str] = []
    seen: set[int] = set()
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if f"{module_name}.{param_name}" in ignored or id(param) in seen:
                continue
            seen.add(id(param))
            name = user_name(f"{module_name}.{param_name}" if module_name else param_name)
            taken.append(name)
            if param.requires_grad:
                trainable.append(name)
    return next((names for names in (trainable, taken) if len(names) == synced), None)


def parameter_names(root: nn.Module) -> tuple[list[str], list[str]]:
    """The model's trainable parameter names, and its frozen ones, each in order."""
    trainable: list[str] = []
    frozen: list[str] = []
    for raw, param in root.named_parameters():
        (trainable if param.requires_grad else frozen).append(user_name(raw))
    return trainable, frozen
