"""The global module hooks a non-finite check runs from, and how they come off.

Module hooks are global and pick out the watched model's modules by identity
(nothing is stored on the modules, so a model saves, pickles and deep-copies
as usual); they exist only in deferred mode and during a replay. A replay
alone also places a pre-hook on each checked module, for the keyword
arguments a global pre-hook is not shown; they come off as it ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from trainwatch.fast_paths import hook_module, layer_members
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


def register_keyword_hooks(probe: NonfiniteProbe) -> list[Any]:
    """A pre-hook with keywords on each of the model's checked modules, for a replay.

    A global pre-hook sees a call's positional arguments only; a module handed
    a list by keyword (``self.pool(items=parts)``) that its forward empties
    would be judged, and re-run under the op trace, on what it left behind.
    Each checked module's own pre-hook keeps its keyword arguments as the call
    received them (``module_keywords``). Placed for a replay's duration only
    (cost is no object there), through ``hook_module`` like every per-module
    hook, so a transformer layer's fast path stays what it was.
    """
    refs = probe._modules
    root = refs[0]() if refs else None
    if root is None:
        return []
    in_layers = layer_members(root)
    hook = WeakHook(probe, "module_keywords")
    handles: list[Any] = []
    for index, ref in enumerate(refs):
        module = ref()
        if module is None or index not in probe._checkable:
            continue
        handles.append(
            hook_module(module, hook, pre=True, in_layer=id(module) in in_layers, with_kwargs=True)
        )
    return handles
