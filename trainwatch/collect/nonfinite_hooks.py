"""The global module hooks a non-finite check runs from, and how they come off.

Module hooks are global and pick out the watched model's modules by identity
(nothing is stored on the modules, so a model saves, pickles and deep-copies
as usual); they exist only in deferred mode and during a replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from trainwatch.hooks import KwargsHookHandle, WeakHook

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe


def register_global_hooks(probe: NonfiniteProbe) -> list[Any]:
    """Hooks on every module call in the process, for the probe to pick out its model's.

    Global, not per module: hooks stored on the modules would travel with
    ``torch.save(model)``, ``pickle`` and ``copy.deepcopy(model)`` (an EMA or
    teacher copy would then report into this monitor). They exist only in
    deferred mode and while a replay runs.
    """
    handles: list[Any] = [register_module_forward_pre_hook(WeakHook(probe, "module_starts"))]
    after = WeakHook(probe, "module_ends")
    try:
        handle = register_module_forward_hook(after, with_kwargs=True, always_call=True)
        handles.append(KwargsHookHandle(handle))
    except TypeError:  # torch < 2.6: global hooks see positional arguments only
        handles.append(register_module_forward_hook(after, always_call=True))
    return handles
