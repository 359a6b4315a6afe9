"""The sums the per-module checks take: one per tensor and pass, and their verdicts.

One module's output is the next one's input, and one gradient reaches the
hooks of two modules: each tensor is summed once, found again by identity
and version counter, so a tensor changed in place since (``ReLU(inplace=True)``,
``x += r``) gets a new sum. A sum is read on the host only where that costs
no sync; its verdict, once read, is kept beside it in the step's state.
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING

import torch

from trainwatch.collect.tensors import finite_or_mask, real_parts, version_of

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe

MAX_SUMS = 20000  # per step; past it, checks pause until the next step


def reads_now(probe: NonfiniteProbe, tensor: torch.Tensor) -> bool:
    """Whether a value may be read on the host now: in a replay (it runs only once
    something is off), and on CPU when verdicts are taken as passes end."""
    if not probe.on_the_spot:
        return False
    return probe._replaying or (not probe.at_step and tensor.device.type == "cpu")


def checked_sum(probe: NonfiniteProbe, tensor: torch.Tensor) -> torch.Tensor:
    """One reduction that any NaN/Inf turns NaN/Inf.

    On the spot an fp32 sum will do: a sum that overflows is caught by the
    exact check that follows. Judged later there is no exact check, so the
    sum is taken in fp64, where finite fp32/fp16/bf16 values cannot overflow.
    A complex tensor is summed over the magnitudes of both its parts (a plain
    sum to a real dtype drops the imaginary part): a NaN/Inf in either makes
    it NaN/+inf, never -inf, so no complex value passes for a mask.
    """
    exact = reads_now(probe, tensor)
    values = tensor.detach()
    if values.is_complex():
        values = real_parts(values).abs()
    return values.sum(dtype=torch.float32 if exact else torch.float64)


def output_code(tensor: torch.Tensor) -> torch.Tensor:
    """A pass output's fp64 sum, read at the step boundary (see ``checked_sum``): NaN/+inf
    where it holds one, -inf where its only non-finite values are a mask's -inf. A
    complex output's is over the magnitudes of both its parts: never -inf."""
    values = tensor.detach()
    if values.is_complex():
        values = real_parts(values).abs()
    return values.sum(dtype=torch.float64)


def sum_index(probe: NonfiniteProbe, tensor: torch.Tensor) -> int:
    """The index of this tensor's sum in the step's sums, taken now if not yet."""
    known = probe._this_pass.known.get(id(tensor))
    version = version_of(tensor)
    if known is not None and known[0]() is tensor and known[2] == version:
        return known[1]
    index = len(probe._this_step.sums)
    probe._this_step.sums.append(checked_sum(probe, tensor))
    probe._this_step.finite.append(None)
    probe._this_pass.known[id(tensor)] = (weakref.ref(tensor), index, version)
    return index


def unchanged(probe: NonfiniteProbe, index: int, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds the values its sum ``index`` was taken of."""
    known = probe._this_pass.known.get(id(tensor))
    return known is not None and known[1] == index and known[2] == version_of(tensor)


def is_finite(probe: NonfiniteProbe, index: int, tensor: torch.Tensor | None = None) -> bool:
    """Exact verdict for a CPU sum; a non-finite sum of finite values is an overflow.

    A sum of -inf (-inf entries, no NaN, no +inf) is a mask made in the
    forward, with or without grad: judged finite (see ``finite_or_mask``).
    """
    step = probe._this_step
    verdict = step.finite[index]
    if verdict is None:
        value = float(step.sums[index])
        verdict = math.isfinite(value) or value == -math.inf
        if not verdict and tensor is not None:
            verdict = finite_or_mask(tensor)
        step.finite[index] = verdict
    return verdict


def exactly_finite(probe: NonfiniteProbe, indices: list[int], tensors: list[torch.Tensor]) -> bool:
    """No -inf either, masks included (read in a replay only)."""
    for index, tensor in zip(indices, tensors):
        if not math.isfinite(float(probe._this_step.sums[index])) and not bool(
            torch.isfinite(tensor.detach()).all()
        ):
            return False
    return True


def grad_index(probe: NonfiniteProbe, grad: torch.Tensor) -> int | None:
    """The sum of this gradient: one module's output is the next one's input,
    so the same gradient reaches two hooks and is summed once."""
    known = probe._this_pass.grad_known.get(id(grad))
    version = version_of(grad)
    # Autograd may accumulate into a gradient buffer it already handed to a
    # hook: the same tensor, new values, a new version.
    if known is not None and known[0]() is grad and known[2] == version:
        return known[1]
    if len(probe._this_step.grad_sums) > MAX_SUMS:
        return None
    total = checked_sum(probe, grad)
    index = len(probe._this_step.grad_sums)
    probe._this_step.grad_sums.append(total)
    probe._this_step.grad_ok.append(None)
    if not probe._replaying:
        probe._this_pass.grads.append(total)
    probe._this_pass.grad_known[id(grad)] = (weakref.ref(grad), index, version)
    return index


def grad_finite(probe: NonfiniteProbe, index: int, grad: torch.Tensor) -> bool:
    """Exact verdict for a gradient's sum, read once and kept."""
    verdict = probe._this_step.grad_ok[index]
    if verdict is None:
        verdict = math.isfinite(float(probe._this_step.grad_sums[index])) or bool(
            torch.isfinite(grad).all()
        )
        probe._this_step.grad_ok[index] = verdict
    return verdict
