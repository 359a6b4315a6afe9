"""Which layers have never been called in a forward pass since watching began.

A layer that is defined but never called (an unused pooler, a head kept for
another task, an auxiliary head whose loss was dropped) gets no gradient,
exactly like a layer cut out of the graph by a ``.detach()``. The two need
different advice: the first wants freezing, leaving out of the optimizer or
calling, and breaks DDP at its second iteration; the second is a cut in the graph.

A layer counts as never called only when the module holding it *was* called:
inside a compiled region hooks are not run, so there nothing is claimed, and
the plain ``zero_gradient`` warning stands. One global pre-forward hook does
the work, on the passes of sampled steps only (the first few, then every
``_EVERY``-th): a hook on every module call costs every call in the process.
It is not installed at all once every tracked module has been seen.

Modules put into the model after it ran (adapters wrapped around its layers,
a head added for a second phase) are judged on calls seen since: the holder
of a new module is looked for again, on the next passes whatever the step,
and until it is seen called anew, the new module is claimed neither called
nor uncalled. A holder seen before the new module existed says nothing of it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.passes import ModelPasses
from trainwatch.compiled import is_wrapper, unwrap, user_name
from trainwatch.hooks import WeakHook


def runs_distributed(model: nn.Module) -> str:
    """How the model trains under DDP, whose reducer waits for every parameter.

    ``"find_unused"``: a DistributedDataParallel model built with
    ``find_unused_parameters=True`` (it copes with an unused layer);
    ``"ddp"``: another DDP model, or an initialised process group (a launcher
    wraps the model itself); ``""``: not distributed. Asked only when a layer
    was found never called, so the usual step pays nothing.
    """
    if isinstance(model, DistributedDataParallel):
        return "find_unused" if model.find_unused_parameters else "ddp"
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    # The model inside a DistributedDataParallel wrapper (the Hugging Face
    # Trainer's, or a script watching the module it then wraps): the wrapper's
    # own flag (one scan of live objects; the pipeline keeps the answer).
    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel) and obj.module is model:
            return "find_unused" if obj.find_unused_parameters else "ddp"
    return "ddp"


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


# Modules whose children hold weights the holder's own code reads without
# calling them: nn.MultiheadAttention's ``out_proj`` goes to
# F.multi_head_attention_forward as a weight, so it is never called at all.
_READS_CHILDREN_WEIGHTS = (nn.MultiheadAttention,)


def weights_read_by_holder(model: nn.Module) -> dict[int, nn.Module]:
    """The modules whose holder reads their weights instead of calling them, by id,
    each with that holder: whether they ran is whether it did."""
    return {
        id(child): holder
        for holder in model.modules()
        if isinstance(holder, _READS_CHILDREN_WEIGHTS)
        for child in holder.modules()
        if child is not holder
    }


# Holders of modules that are never called themselves.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)

_FIRST_STEPS = 5
_EVERY = 25
# Passes looked at, whatever the step, after modules were put into a model that ran.
_RECHECK_PASSES = 5


class CallTracker:
    def __init__(self, step_of: Callable[[], int] = lambda: 0) -> None:
        self._step_of = step_of
        self._waiting: dict[int, str] = {}  # id(module) -> user name, not called yet
        self._keep: dict[int, nn.Module] = {}  # keeps the ids valid
        self._seen_names: set[str] = set()
        # Tracked modules seen so far: it changes only when a new one is seen.
        self.seen_count = 0
        self._layers: set[str] = set()
        self._handle: RemovableHandle | None = None
        self._open = True
        # The passes it listens to while some tracked module is still waiting.
        self._passes: ModelPasses | None = None
        # Holder name -> the modules put under it after it was seen called, until
        # it is seen called again (see _recheck_holders).
        self._stale: dict[str, set[str]] = {}
        self._recheck = 0  # passes still to look at whatever the step

    def track(self, model: nn.Module, layers: Iterable[str]) -> None:
        """Wait for a first call of each named layer and of the modules holding it."""
        if not self._open:
            return
        new_layers = set(layers) - self._layers
        self._layers |= new_layers
        added: list[str] = []  # waited for, put into a model already seen running
        wanted = set()
        for name in new_layers:
            while True:
                wanted.add(name)
                if not name:
                    break
                name = _parent(name)
        read_not_called = weights_read_by_holder(model)
        for raw, module in model.named_modules():
            name = user_name(raw)
            if is_wrapper(module) or name not in wanted or name in self._seen_names:
                continue
            if id(module) in read_not_called:
                continue  # its weights are used by its holder's code, never by a call of it
            if isinstance(module, _CONTAINERS):
                # Never called itself. Its children are never claimed uncalled
                # either (their holder is never seen): a rare expert of a
                # mixture, skipped on the steps watched, is not an unused head.
                continue
            self._waiting.setdefault(id(module), name)
            self._keep[id(module)] = module
            if self._seen_names:
                added.append(name)
        if added:
            self._recheck_holders(model, added)

    def _recheck_holders(self, model: nn.Module, added: list[str]) -> None:
        """Modules put into a model that already ran wait for their holder's next call.

        The holder may be another module under the same name (a layer wrapped
        by an adapter): the one there now is waited for.
        """
        holders = {_parent(name) for name in added if name}
        holders &= self._seen_names
        if not holders:
            return
        for raw, module in model.named_modules():
            name = user_name(raw)
            if name in holders and not is_wrapper(module):
                self._waiting[id(module)] = name
                self._keep[id(module)] = module
        for name in added:
            if name and _parent(name) in holders:
                self._stale.setdefault(_parent(name), set()).add(name)
        self._recheck = _RECHECK_PASSES

    def listen(self, passes: ModelPasses) -> None:
        """Hear the model's passes while a tracked module waits for its first call.

        Once every one has been seen, it stops listening: the passes of a
        model whose layers are all called pay nothing for it.
        """
        self._passes = passes
        if self._waiting and self._open and not passes.listens(self):
            passes.subscribe("call tracker", self)

    def _stop_listening(self) -> None:
        passes = self._passes
        if passes is not None and passes.listens(self):
            passes.unsubscribe(self)

    # -- the model's passes (ModelPasses) ----------------------------------
    def pass_starts(self, module: nn.Module) -> None:
        if not self._waiting or self._handle is not None:
            return
        step = self._step_of()
        if (step >= _FIRST_STEPS and step % _EVERY and not self._recheck) or is_wrapper(module):
            return  # inside a compiled graph no call is seen (and a hook would recompile)
        self.seen(unwrap(module))  # its own hooks are already running
        if self._waiting:
            self._handle = register_module_forward_pre_hook(WeakHook(self, "seen"))

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._handle is not None:
            self._unhook()
            if self._recheck:
                self._recheck -= 1

    def seen(self, module: nn.Module, args: Any = None) -> None:
        name = self._waiting.pop(id(module), None)
        if name is None:
            return
        del self._keep[id(module)]
        self._seen_names.add(name)
        self.seen_count += 1
        if self._stale:
            self._stale.pop(name, None)  # called since the modules under it were put in
        if not self._waiting:
            self._recheck = 0
            self._unhook()
            self._stop_listening()

    def fail(self, exc: BaseException) -> None:
        """Knowing nothing, it claims nothing: every layer counts as called."""
        self.detach()

    def never_called(self) -> frozenset[str]:
        """Layers not called although the module holding them was."""
        if not self._waiting:
            return frozenset()
        return frozenset(
            name
            for name in self._waiting.values()
            if name in self._layers and name and name not in self._seen_names and self._held(name)
        )

    def _held(self, name: str) -> bool:
        """Whether the module holding ``name`` was seen called since ``name`` was put in."""
        holder = _parent(name)
        return holder in self._seen_names and name not in self._stale.get(holder, ())

    def ran(self, name: str) -> bool | None:
        """Whether the module ``name`` (or the nearest tracked module holding it) was called.

        False only where a call would have been seen: the module holding it
        was seen called and it was not (as :meth:`never_called` claims), or it
        is a part hooked as a pass and never one. None where nothing can be said: not
        tracked (a container's child, nothing with parameters above it), no
        pass seen (compiled code), the tracker off. Asked on rare paths only
        (it walks the waiting modules).
        """
        if not self._open:
            return None
        waiting = {name: key for key, name in self._waiting.items()}
        while True:
            if name in self._seen_names:
                return True
            key = waiting.get(name)
            if key is not None:
                if (name and self._held(name)) or self._a_pass(key):
                    return False
                return None
            if not name:
                return None
            name = _parent(name)

    def _a_pass(self, key: int) -> bool:
        """Whether the waiting module is itself hooked as one of the model's passes
        (a part of a model only ever called through its parts), passes having been
        seen: a call of it would have been one of them."""
        passes = self._passes
        return self.seen_count > 0 and passes is not None and passes.hooks(self._keep[key])

    def _unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def detach(self) -> None:
        self._open = False
        self._unhook()
        self._waiting.clear()
        self._keep.clear()
        self._stale.clear()
