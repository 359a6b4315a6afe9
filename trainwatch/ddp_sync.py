"""Parameters trainable now that DDP does not all-reduce: a layer unfrozen after wrapping.

``DistributedDataParallel`` builds its reducer once, from the parameters that
required grad when it was constructed. A layer frozen then and unfrozen later
(a staged fine-tune; Lightning's ``BaseFinetuning`` freezes before its DDP
strategy wraps the model) gets its gradient on each rank and is never
averaged: every rank trains its own copy and the copies drift apart, with no
error. DDP's logging data holds how many parameters its reducer took; the
parameters trainable now are counted the way DDP counted them. Asked at
setup audits only (attach, a ``requires_grad`` flip), never on a step.
"""

from __future__ import annotations

import gc
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


def sync_gap(root: nn.Module) -> SyncGap | None:
    """How the model's DDP wrapper falls short, if every wrapper of it does.

    The wrapper is the model itself, or one holding it (a script watching the
    module it wraps, Lightning's strategy): found by one scan of live objects.
    A wrapper built again after the unfreeze syncs them all, and an older one
    still alive beside it says nothing.
    """
    wrapped = isinstance(root, DistributedDataParallel)
    gap = _gap(root) if wrapped else None
    if wrapped and gap is None:
        return None
    inner = unwrap(root.module) if wrapped else root
    for wrapper in _wrappers_of(inner, root):
        found = _gap(wrapper)
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


def parameter_names(root: nn.Module) -> tuple[list[str], set[str]]:
    """The model's trainable parameter names, in order, and its frozen ones."""
    trainable: list[str] = []
    frozen: set[str] = set()
    for raw, param in root.named_parameters():
        name = user_name(raw)
        if param.requires_grad:
            trainable.append(name)
        else:
            frozen.add(name)
    return trainable, frozen
