"""Sampled output statistics per module: spread across the batch, and zero fractions.

A standard deviation over the batch of every module's output costs 1.5-2.6x
a training step (FACTS.md), so it is taken only on sampled steps (the first
few, then every N), on the forward passes with gradients of those steps, on
at most ``rows`` rows of the batch and at most ``_MAX_FEATURES`` positions
(a strided view): the cost per module is bounded whatever the layer's size.
On other steps each hook returns after one attribute test. The numbers stay
on the device and join the step's single readback.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

from trainwatch.collect import quiet
from trainwatch.record import ActivationStats

_MAX_FEATURES = 1024
_NAN = float("nan")
# Stats per module, in this order, in one row of the step's tensor.
FIELDS = ("out_spread", "in_spread", "out_rms", "out_mean", "zero_fraction", "dead_fraction")

# The pseudo-module name under which the loss target's spread is handed over.
TARGET = "<loss target>"

# Modules whose output is exactly zero where a unit is inactive.
RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.Threshold)


def _first_tensor(value: Any, depth: int = 0) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.layout == torch.strided and value.numel() > 0 else None
    if isinstance(value, dict) and depth < 3:
        value = list(value.values())
    if isinstance(value, (tuple, list)) and depth < 3:
        for item in value:
            found = _first_tensor(item, depth + 1)
            if found is not None:
                return found
    return None


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Up to ``rows`` rows, at most ``_MAX_FEATURES`` evenly strided positions, fp32."""
    flat = tensor.detach()[:rows].reshape(min(rows, tensor.shape[0]), -1)
    width = flat.shape[1]
    if width > _MAX_FEATURES:
        flat = flat[:, :: math.ceil(width / _MAX_FEATURES)]
    return flat.float()


def _spread(rows: torch.Tensor) -> torch.Tensor:
    """Mean over positions of the (biased) std across rows.

    Written out: ``Tensor.std(dim=0)`` takes ~10x longer on CPU for these
    short, wide shapes.
    """
    return (rows - rows.mean(dim=0)).square().mean(dim=0).sqrt().mean()


class _Hook:
    """One global forward hook for the sampled modules, picked out by identity.

    Global, so nothing is stored on the modules: the model saves, pickles and
    deep-copies exactly as without trainwatch.
    """

    __slots__ = ("index", "sampler")

    def __init__(self, sampler: ActivationSampler, index: dict[int, int]) -> None:
        self.sampler = weakref.ref(sampler)
        self.index = index

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        sampler = self.sampler()
        if sampler is None or not sampler.active or quiet.replaying():
            return None
        position = self.index.get(id(module))
        if position is not None:
            try:
                sampler.after_forward(position, module, args, output)
            except Exception as exc:  # never break the user's forward
                sampler.fail(exc)
        return None


class ActivationSampler:
    def __init__(
        self, model: nn.Module, rows: int, spread: bool, zeros: bool, on_error: Any
    ) -> None:
        self.rows = rows
        self.spread = spread  # constant_output wants spreads
        self.zeros = zeros  # dead_units wants zero fractions
        self.active = False  # this pass is sampled
        self.enabled = True
        self._on_error = on_error
        self._handles: list[Any] = []
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
            self._names.append(name)
            self._relu.append(relu)
            if not self.spread and not relu:
                continue
            watched[id(module)] = index
        self._handles.append(register_module_forward_hook(_Hook(self, watched)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.active = False

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self.active = False
        self._reset()
        self._on_error("activation sampler", exc)

    def _reset(self) -> None:
        self._stats: list[torch.Tensor] = []
        self._modules: list[int] = []
        self._done: set[int] = set()
        # Output tensors measured in this pass, weakly: a container that
        # returns its child's tensor is not measured twice.
        self._outputs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def end_pass(self) -> None:
        self._outputs.clear()

    def after_forward(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if index in self._done or not torch.is_grad_enabled():
            return  # the first call of a step is enough (recurrent cells, eval passes)
        out = _first_tensor(output)
        if out is None or not out.is_floating_point() or out.dim() == 0 or out.shape[0] < 2:
            return
        self._done.add(index)
        seen = self._outputs.get(id(out))
        if seen is not None and seen[0]() is out:
            if index == 0:  # the root returns a child's tensor: report it as the model's
                slot = seen[1]
                self._modules[slot] = 0
                inp = _first_tensor(args)
                if self.spread and inp is not None and inp.dim() > 0:
                    if inp.shape[0] == out.shape[0]:
                        row = self._stats[slot].clone()
                        row[1] = _spread(_rows(inp, self.rows))
                        self._stats[slot] = row
            return
        relu = self._relu[index]
        if not self.spread and not relu:
            return
        rows = _rows(out, self.rows)
        values = [_NAN] * len(FIELDS)
        stats: list[torch.Tensor | float] = list(values)
        if self.spread:
            stats[0] = _spread(rows)
            stats[2] = rows.square().mean().sqrt()
            stats[3] = rows.mean()
            inp = _first_tensor(args)
            if inp is not None and inp.dim() > 0 and inp.shape[0] == out.shape[0]:
                stats[1] = _spread(_rows(inp, self.rows))
        if self.zeros and relu:
            zero = rows == 0
            stats[4] = zero.float().mean()
            stats[5] = zero.all(dim=0).float().mean()
        # new_full, not torch.tensor(nan): torch.tensor(float, device=...) keeps
        # a few bytes alive per call, which a long run's sampled steps add up.
        row = torch.stack(
            [s.reshape(()) if isinstance(s, torch.Tensor) else rows.new_full((), s) for s in stats]
        )
        self._outputs[id(out)] = (weakref.ref(out), len(self._modules))
        self._modules.append(index)
        self._stats.append(row)

    def take(self) -> tuple[list[str], torch.Tensor | None]:
        """Hand over this step's samples (module names, one (M, 6) device tensor)."""
        names = [self._names[i] for i in self._modules]
        stats = torch.stack(self._stats) if self._stats else None
        self._reset()
        return names, stats

    @staticmethod
    def unpack(names: list[str], values: list[float]) -> list[ActivationStats]:
        found = []
        width = len(FIELDS)
        for i, name in enumerate(names):
            row = values[i * width : (i + 1) * width]
            if len(row) < width:
                break
            fields = {k: (None if math.isnan(v) else v) for k, v in zip(FIELDS, row)}
            found.append(ActivationStats(name, **fields))
        return found
