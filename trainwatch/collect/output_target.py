"""What the loss asks of the model's sampled output: the spread of its target on that pass.

constant_output holds the model's output to the spread of its loss target.
The broadcast audit measures that once, on the run's first steps, and for the
first loss that compares an output with something: a run-wide reference. A
model called on several batches in one step may be asked different things on
each. A physics-informed network's boundary pass evaluates it at the boundary
points, where the condition (``u(0) = u(1) = 0``) asks the same value of every
point: an output that converges to one value there is trained, not collapsed,
while the network still varies across the domain.

So on a sampled step the model output the sampler measured (the first pass
with gradients' primary output) is followed, by identity and through the ops
that only reshape it, into the ops that consume it with gradient, from the
end of its pass to the step boundary (a ``TorchFunctionMode``, paused while
the model runs again: its own ops are not the loss). Each consuming op says
what it compares the output with:

- a difference or a regression loss (``out - y``, ``mse_loss(out, y)``...)
  with an operand not derived from the output: that operand's spread across
  the batch, on the sampled rows (0 for a number or a tensor broadcast over
  the batch);
- a penalty on the output alone (``out.pow(2)``, ``out.square()``,
  ``out.abs()``): its target is 0, the same for every row;
- any other op (a cross-entropy, a sum for ``autograd.grad``, a product with
  another tensor): the target is not known.

The pass's target spread is the largest its consumers name, and known only
when every consumer names one: an output that also enters a loss whose
target is unknown is judged as before. Sampled steps only, from
constant_output's ``warmup`` on (before it the output is held to no relative
level); other steps pay nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from trainwatch.collect import quiet
from trainwatch.collect.activations import _rows
from trainwatch.collect.broadcast import _KEEPS_LABELS, _REGRESSION, _call, _stack_is_ours_to_use
from trainwatch.collect.mode_stack import enter_loss_mode
from trainwatch.collect.mode_stack import leave as leave_mode
from trainwatch.collect.tensors import tensor_leaves

# Ops that compare the output with 0 alone: a penalty that pulls every row to 0.
_PENALTIES = frozenset({"pow", "__pow__", "square", "abs", "__abs__"})
# Output tensors followed at most (the output and what reshapes it).
_MAX_FOLLOWED = 64


class _OutputTargetMode(TorchFunctionMode):
    def __init__(self, look: OutputTargetLook) -> None:
        super().__init__()
        self.look = weakref.ref(look)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = _call(func, args, kwargs)  # a loss's own warnings still name the user's line
        look = self.look()
        if look is not None and look.followed and not quiet.replaying():
            try:
                look.op_seen(func, args, kwargs, out)
            except Exception as exc:  # never break the user's loss
                look.fail(exc)
        return out


class OutputTargetLook:
    """Follows a sampled step's model output into the loss; hands over its target's spread."""

    def __init__(self, rows: int, on_error: Callable[[str, BaseException], None]) -> None:
        self.rows = rows
        self._on_error = on_error
        self._mode = _OutputTargetMode(self)
        self._depth: int | None = None  # on the mode stack
        # The output and the tensors that only reshape it, by id.
        self.followed: dict[int, weakref.ref[torch.Tensor]] = {}
        self._spreads: list[torch.Tensor | float] = []
        self._unknown = False
        self.broken = False

    # -- the span: from the sampled pass's end to the step boundary ------------
    def pass_ends(self, output: torch.Tensor | None) -> None:
        """A pass with gradients of a sampled step ended; ``output``: the model output the
        sampler measured in it (the step's first such pass), else None."""
        if self.broken:
            return
        if output is not None and not self.followed and output.requires_grad:
            self.followed[id(output)] = weakref.ref(output)
        if self._depth is not None:
            self.pause()  # taken off along with a mode above it, perhaps
        if self.followed and not self._unknown and self._depth is None:
            if _stack_is_ours_to_use():
                enter_loss_mode(self._mode)
                self._depth = torch._C._len_torch_function_stack()

    def pause(self) -> None:
        """The model runs again (its own ops are not the loss), or the step ends."""
        if self._depth is not None and leave_mode(self._mode):
            self._depth = None
        # Otherwise a mode entered after ours is still on top: ours leaves with it.

    def take(self) -> torch.Tensor | float | None:
        """At the step boundary: the target's spread (a device scalar, or 0.0 for a
        constant target), or None where the output's target is not known."""
        self.pause()
        spreads, unknown = self._spreads, self._unknown
        self.followed = {}
        self._spreads, self._unknown = [], False
        if unknown or not spreads:
            return None
        tensors = [s for s in spreads if isinstance(s, torch.Tensor)]
        if not tensors:
            return 0.0
        return torch.stack(tensors).max() if len(tensors) > 1 else tensors[0]

    def fail(self, exc: BaseException) -> None:
        self.broken = True
        self.followed = {}
        self._spreads, self._unknown = [], False
        self.pause()
        self._on_error("output target look", exc)

    def detach(self) -> None:
        self.broken = True
        self.followed = {}
        self.pause()

    # -- inside the mode ----------------------------------------------------------
    def _follows(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        ref = self.followed.get(id(value))
        return ref is not None and ref() is value

    def op_seen(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """An op of the loss: one that takes the output with gradient says its target."""
        operands = [*args, *kwargs.values()]
        if not any(map(self._follows, operands)):
            return
        results = [t for _, t in tensor_leaves(out)]
        if not any(t.requires_grad for t in results):
            return  # a look at the values (a detached copy, a metric): no loss
        name = getattr(func, "__name__", "") or ""
        if name in _KEEPS_LABELS:
            for tensor in results:
                if len(self.followed) < _MAX_FOLLOWED:
                    self.followed[id(tensor)] = weakref.ref(tensor)
            return
        spread = self._target_spread(name, args, kwargs)
        if spread is None:
            self._unknown = True
            self.pause()  # nothing more to learn this step
        else:
            self._spreads.append(spread)

    def _target_spread(
        self, name: str, args: Any, kwargs: dict[str, Any]
    ) -> torch.Tensor | float | None:
        """What the op compares the output with, as a spread across the batch; None: unknown."""
        if name in _PENALTIES:
            exponent = args[1] if len(args) > 1 else kwargs.get("exponent", None)
            alone = len(args) == 1 and not kwargs
            if self._follows(args[0] if args else None) and (
                alone or isinstance(exponent, (int, float))
            ):
                return 0.0
            return None
        if name not in _REGRESSION:
            return None
        pair = list(args[:2])
        for key in ("input", "target", "other"):
            if len(pair) < 2 and key in kwargs:
                pair.append(kwargs[key])
        if len(pair) != 2:
            return None
        first, second = map(self._follows, pair)
        if first == second:
            return None  # the output against itself (a smoothness term): no target
        output, target = (pair[0], pair[1]) if first else (pair[1], pair[0])
        if isinstance(target, (int, float)):
            return 0.0
        if not isinstance(target, torch.Tensor) or target.is_complex():
            return None
        if target.dim() == 0 or target.shape[0] == 1:
            return 0.0  # one value broadcast over the batch
        if output.dim() == 0 or target.shape[0] != output.shape[0]:
            return None
        return _spread(target, self.rows)


def _spread(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The spread across ``rows`` rows, as the sampler measures an output's (a device scalar)."""
    values = _rows(tensor, rows)
    return (values - values.mean(dim=0)).square().mean(dim=0).sqrt().mean()
