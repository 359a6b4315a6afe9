"""Parts of the model called on their own in a no-grad block: an evaluation through its parts.

The model's passes are seen from hooks on its root alone (``collect/passes.py``).
An evaluation that calls the model's parts instead (``model.decode(model.encode(x))``,
embeddings from ``model.encode(x)`` for a retrieval metric, a greedy decoding
loop over ``model.decoder`` and ``model.generator``) calls no hooked module, so
one run with dropout or batch norm in training mode went unseen. Hooking every
part would cost each training pass a call per part.

Instead a ``no_grad`` or ``inference_mode`` block entered while the model is in
training mode, has trained, holds dropout or batch norm and is not in a pass of
its own is looked into at the 1st, 2nd, 4th, 8th... entry from its line of the
script and the call that led there (:mod:`trainwatch.late_models`): a global
forward pre-hook for the block's duration sees its outermost module calls. A
part of the model called there, with dropout or batch norm in training mode,
is followed from then on: each of its calls on its own without gradients is
one of the model's passes, this very call the first (its calls inside the
model's passes, or with gradients, cost two early returns). The evaluation judge
(``collect/eval_passes.py``) sees those passes as it sees the whole model's,
so a part called under ``no_grad`` at every step (a target computed with
``model.encode(x2)``) is training, and one called now and then is an
evaluation. A part in eval mode, or holding no such module, is never
followed: a healthy evaluation leaves no hook behind. Nor is a frozen part (a
teacher, a momentum encoder or EMA copy kept inside the model), which runs
under ``no_grad`` once or once per view a step: a large one called there is
told to the mode watch instead (``ModeWatch.part_called``), whose frozen-part
check (is a teacher run in training mode?) sees the model's passes only. For
that, a model holding a large frozen part is looked into from its first step,
before its first training pass: the loop calls the teacher first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

from trainwatch.collect import quiet
from trainwatch.collect.eval_passes import EvalPassJudge
from trainwatch.collect.modes import ModeWatch
from trainwatch.collect.passes import ModelPasses
from trainwatch.fast_paths import hook_module
from trainwatch.hooks import WeakHook
from trainwatch.late_models import NoGradLookout


class LoneParts:
    """Looks into no-grad blocks for parts of one model called on their own."""

    def __init__(
        self,
        model: nn.Module,
        passes: ModelPasses,
        modes: ModeWatch,
        judge: EvalPassJudge,
        module_names: Callable[[], dict[int, str]],
        skip_dropout: bool,
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._model = weakref.ref(model)
        self._passes = passes
        self._modes = modes
        self._judge = judge
        self._module_names = module_names  # the model's modules by id, with their names
        self._skip_dropout = skip_dropout
        self._on_error = on_error
        self._lookout = NoGradLookout(self)

    def follow(self) -> None:
        """Look from now on (the model holds dropout or batch norm)."""
        self._lookout.install()

    # -- the lookout's watcher ---------------------------------------------------
    def look_wanted(self) -> bool:
        model = self._model()
        return (
            model is not None
            and not (quiet.anywhere and quiet.replaying())  # trainwatch's own re-run
            and model.training
            # Before the first training pass only for a model with a large frozen
            # part: a teacher called by the loop before the model, from step 0.
            and (self._judge.trained or bool(self._modes.frozen_parts))
            and not self._passes.in_pass
            and bool(self._modes.listed)
        )

    def look(self) -> _Look:
        look = _Look(self, self._module_names())
        look.resume()
        return look

    def looked(self, look: _Look) -> None:
        look.end()

    def lookout_failed(self, exc: BaseException) -> None:
        self._on_error("lone parts", exc)

    # -- an outermost module call in the block -----------------------------------
    def called(self, module: nn.Module, args: Any, names: dict[int, str]) -> None:
        passes = self._passes
        if passes.in_pass or torch.is_grad_enabled():
            return  # inside one of the model's passes, or gradients back on
        name = names.get(id(module))
        if not name or passes.hooks(module):
            return  # not the model's, the model itself, or a part already followed
        if self._modes.part_called(name):
            return  # a teacher or frozen backbone inside the model: the frozen-part check's
        if not self._judge.trained:
            return  # (looked into for its frozen parts only)
        part = (name, module)
        if self._modes.in_mode(True, skip_dropout=self._skip_dropout, part=part) is None:
            return  # nothing of it depends on the mode, or it is in eval mode
        if _frozen(module):
            return  # frozen, if too small to be a frozen part of its own: never followed
        passes.hook(module, nograd_only=True)
        passes.started(module, args)  # this very call is the part's first pass

    def fail(self, exc: BaseException) -> None:
        self.detach()
        self._on_error("lone parts", exc)

    def detach(self) -> None:
        self._lookout.remove()


class _Look:
    """One look into a block: a global forward pre-hook that sees its outermost calls.

    Each call it sees pauses it until that call returns (a one-shot forward
    hook on the module called): what runs inside is no outermost call, and
    runs at no cost of ours.
    """

    def __init__(self, parts: LoneParts, names: dict[int, str]) -> None:
        self._parts = parts
        self._names = names  # the model's modules by id, with their names
        self._seeing: Any = None  # the global pre-hook's handle, while it is on
        self._paused: Any = None  # the one-shot hook's handle, while a call runs
        self._open = True

    def resume(self, *_: Any) -> None:
        if self._paused is not None:
            self._paused.remove()
            self._paused = None
        if self._open and self._seeing is None:
            self._seeing = register_module_forward_pre_hook(WeakHook(self, "called"))

    def called(self, module: nn.Module, args: Any) -> None:
        if self._paused is not None or isinstance(module, torch.jit.ScriptModule):
            return  # a call already under way; TorchScript takes no hooks (nor calls any)
        self._seeing.remove()
        self._seeing = None
        try:
            self._parts.called(module, args, self._names)
        finally:
            # After the part's own hooks, if it was just followed: what its pass's
            # end runs (a re-run of the model by trainwatch) is not seen either.
            # A transformer layer called alone keeps its fast path (see fast_paths).
            hook = WeakHook(self, "resume")
            self._paused = hook_module(module, hook, in_layer=False, always_call=True)

    def end(self) -> None:
        self._open = False
        for handle in (self._seeing, self._paused):
            if handle is not None:
                handle.remove()
        self._seeing = self._paused = None

    def fail(self, exc: BaseException) -> None:
        self.end()
        self._parts.fail(exc)


def _frozen(module: nn.Module) -> bool:
    """Whether ``module`` holds parameters and trains none of them."""
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)
