"""Whether the model's passes read some of its own parameters at all.

A parameter a module holds beside its submodules (classifier-free guidance's
learned null embedding, a learned token) is read by that module's own code,
which may read it on some steps only: the null embedding on the batches whose
condition is dropped, the first of them at step 5 or 30. No call hook shows
that (the module runs every step), and autograd's graph holds no trace of a
parameter read through a ``.detach()``: a pass that never read it and a pass
that read it cut off look alike. So, while ``zero_gradient`` has such a
parameter without a gradient from the first step, each pass of the model with
gradients runs under a ``TorchFunctionMode`` that notes which of those
parameters some op was handed (a ``.detach()``, an ``expand``, an add): read on
a step it got no gradient, it is cut off; never read, it is not used yet. A
healthy step pays nothing: no listener, no mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trainwatch.collect.broadcast import _stack_is_ours_to_use
from trainwatch.collect.mode_stack import enter as enter_mode
from trainwatch.collect.mode_stack import leave as leave_mode
from trainwatch.collect.passes import ModelPasses
from trainwatch.compiled import compiling, is_wrapper
from trainwatch.layers import LayerMap


class _ReadMode(TorchFunctionMode):
    """Notes the watched parameters handed to an op while its reads are on."""

    def __init__(self, reads: ParameterReads) -> None:
        super().__init__()
        self.reads = weakref.ref(reads)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        reads = self.reads()
        if reads is not None and reads.recording and getattr(func, "__name__", "") != "__get__":
            # (a property read, .shape or .dtype, hands over no values)
            reads.saw(args)
            if kwargs:
                reads.saw(kwargs.values())
        return func(*args, **(kwargs or {}))


class ParameterReads:
    """Notes, while asked, which of some parameters the model's passes with gradients read."""

    def __init__(self, passes: ModelPasses, layers: Callable[[], LayerMap | None]) -> None:
        self._passes = passes
        self._layers = layers  # the pipeline's map, rebuilt when the model changes
        self._names: frozenset[str] = frozenset()
        self._ids: dict[int, str] = {}  # the watched parameters' names, by id
        self._mode = _ReadMode(self)
        self._on_stack = False
        self.recording = False  # within a pass with gradients the mode watches
        self._read: set[str] = set()  # read since last taken
        # Per watched parameter, the passes with gradients watched since it was first asked.
        self._watched: dict[str, int] = {}

    def want(self, names: Collection[str]) -> None:
        """Watch the parameters ``names`` from the next pass on (none: stop)."""
        names = frozenset(names)
        if names == self._names:
            return
        self._names = names
        self._watched = {name: self._watched.get(name, 0) for name in names}
        layers = self._layers()
        self._ids = {}
        if names and layers is not None:
            for param in layers.parameters():
                name = layers.info(param).name
                if name in names:
                    self._ids[id(param)] = name
        if self._ids and not self._passes.listens(self):
            self._passes.subscribe("parameter reads", self)
        elif not self._ids:
            self.detach()

    @property
    def watching(self) -> bool:
        return bool(self._ids)

    def take(self) -> set[str]:
        """The watched parameters read by a pass since the last take (then forgotten)."""
        read, self._read = self._read, set()
        return read

    def watched(self, name: str) -> int:
        """How many passes with gradients were watched for ``name`` since first asked."""
        return self._watched.get(name, 0)

    def saw(self, values: Any) -> None:
        ids = self._ids
        for value in values:
            if isinstance(value, (list, tuple)):
                for item in value:  # torch.cat([token, x])
                    if id(item) in ids:
                        self._read.add(ids[id(item)])
            elif id(value) in ids:
                self._read.add(ids[id(value)])

    def pass_starts(self, module: nn.Module) -> None:
        if (
            self.recording
            or not torch.is_grad_enabled()
            or compiling()
            or is_wrapper(module)
            or getattr(module, "_compiled_call_impl", None) is not None
        ):
            return  # a compiled model's graph would be traced with the mode, or break
        self._leave()  # (one left on the stack under another mode at the last pass's end)
        if self._on_stack or not _stack_is_ours_to_use():
            return  # a mode of the user's below would be popped in ours' place
        enter_mode(self._mode)
        self._on_stack = True
        self.recording = True
        for name in self._watched:
            self._watched[name] += 1

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        self.recording = False
        self._leave()

    def _leave(self) -> None:
        if self._on_stack and leave_mode(self._mode):
            self._on_stack = False

    def detach(self) -> None:
        self.recording = False
        self._ids = {}
        self._names = frozenset()
        self._watched = {}
        self._read = set()
        if self._passes.listens(self):
            self._passes.unsubscribe(self)
        self._leave()
