"""Gradients thrown away before any step applied them: a ``step()`` forgotten.

An actor-critic loop that runs ``critic_opt.zero_grad(); critic_loss.backward()``
and never ``critic_opt.step()`` (or steps ``actor_opt`` a second time where
``critic_opt.step()`` belongs, a copy-paste slip) resets the critic's gradients
at every iteration and writes new ones: each backward's gradient is thrown
away without an update. Waiting for other optimizers to take many steps before
calling such an optimizer idle tells it late; the gradients say it within
four iterations.

A gradient is lost when a backward writes a new gradient tensor into a
parameter whose previous one is gone (or the parameter is found holding none):
the loop reset it (``zero_grad()`` sets it to ``None``) while its optimizer
never stepped. :data:`LOSSES` losses, some optimizer step of the process
between the first lost gradient's write and the last loss (training goes on
meanwhile: a diagnostic backward repeated between two steps is no training),
and every gradient seen finite, are the evidence; none of these loses enough:

- gradient accumulation adds onto the same tensor (its step comes later);
- an optimizer stepped every second or third iteration loses at most two
  gradients before its first step;
- a GradScaler's skipped steps throw away non-finite gradients (the count
  starts again after them);
- a learning-rate warm-up from 0 steps all the same, and the watch ends at
  the first step.

A loop that resets gradients in place (``zero_grad(set_to_none=False)``)
keeps the tensor: no loss is seen, and the longer wait of
:mod:`trainwatch.collect.idle_optimizer` tells it.

The gradients are looked at where the caller looks (another optimizer's step,
a pass of the model); each backward's writes are followed once the optimizer
stayed idle across another's step (a parameter frozen then, as Lightning's
``toggle_optimizer`` freezes the others around each step, is followed at the
looks alone). A healthy loop steps every optimizer within its first iteration
and never gets that far; the hooks come off at the first write after the
optimizer's first step, once told, or when the caller stops looking.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from trainwatch.hooks import WeakHook
from trainwatch.process_steps import PROCESS_STEPS

# Gradients lost with no step of their optimizer before it is told: one more than
# an optimizer stepped every third iteration loses before its first step (a delayed
# update written ``(it + 1) % 3 == 0``, its loss's backward run at every iteration).
LOSSES = 3

# Per parameter (by id): the parameter, the gradient last seen on it (weakly;
# None: none to lose) and the process's step count from which a step counts as
# coming after that gradient was written.
_Seen = tuple[torch.Tensor, "weakref.ref[torch.Tensor] | None", int]


def _finite(grad: torch.Tensor) -> torch.Tensor:
    """Whether every value of ``grad`` is finite, as a 0-d tensor on its device (no sync)."""
    values = grad._values() if grad.is_sparse else grad
    return torch.isfinite(values).all()


class LostGradients:
    """Follows the gradients of one optimizer that has not stepped yet.

    ``stepped()`` says whether it stepped since (its watch ends); ``found(params,
    losses)`` is told once, with the parameters whose gradients were lost
    :data:`LOSSES` times.
    """

    def __init__(
        self,
        stepped: Callable[[], Any],
        found: Callable[[list[torch.Tensor], int], None],
    ) -> None:
        self._stepped = stepped
        self._found = found
        self._seen: dict[int, _Seen] = {}
        # Per parameter (by id): its gradients lost, and the process's step count
        # before which the first of them was written.
        self._lost: dict[int, tuple[int, int]] = {}
        # Per device, whether every gradient seen since the count last started was
        # finite (0-d bool tensors, read only when a finding is due).
        self._all_finite: dict[torch.device, torch.Tensor] = {}
        self._hooks: dict[int, RemovableHandle] = {}
        self._queued = False  # a judgement waits for the current backward's end
        self.done = False

    def look(self, params: Iterable[torch.Tensor], written_before: int, follow: bool) -> None:
        """The gradients ``params`` hold now, each written before the process's step
        count was ``written_before`` (where the caller looks at a step: that step
        came after them). A parameter whose gradient is not the one last seen here
        lost that one. ``follow``: the optimizer stayed idle across a step of
        another (not merely stepping after it in the same iteration), so each
        backward's writes are followed from now on."""
        if self.done:
            return
        if self._stepped():
            self.detach()
            return
        params = list(params)
        due = False
        for param in params:
            grad = param.grad
            before = self._seen.get(id(param))
            if before is not None and before[1] is not None and before[1]() is grad:
                continue  # the gradient seen before, kept
            if grad is not None:
                self._note_finite(grad)
            due = self._note(param, grad, written_before, before) or due
        if follow:
            self._follow(params)
        if due:
            self._judge()

    def _note(
        self,
        param: torch.Tensor,
        grad: torch.Tensor | None,
        written_before: int,
        before: _Seen | None,
    ) -> bool:
        """``param`` holds ``grad``, not what was seen before (which was lost, if it
        was a gradient); whether the losses are evidence now: :data:`LOSSES` of
        them, and a step of the process since the first lost one was written."""
        key = id(param)
        self._seen[key] = (param, None if grad is None else weakref.ref(grad), written_before)
        if before is None or before[1] is None:
            return False
        losses, first = self._lost.get(key, (0, before[2]))
        self._lost[key] = (losses + 1, first)
        return losses + 1 >= LOSSES and PROCESS_STEPS.taken > first

    def _note_finite(self, grad: torch.Tensor) -> None:
        flag = _finite(grad)
        held = self._all_finite.get(flag.device)
        self._all_finite[flag.device] = flag if held is None else held & flag

    def _follow(self, params: list[torch.Tensor]) -> None:
        """Each backward's write into ``params`` from now on (those trainable now)."""
        hooks = self._hooks
        for param in params:
            if id(param) not in hooks and param.requires_grad:
                hooks[id(param)] = param.register_post_accumulate_grad_hook(
                    WeakHook(self, "_written")
                )

    def _written(self, param: torch.Tensor) -> None:
        """A backward wrote ``param``'s gradient: onto the one seen (accumulated, kept
        for a later step) or into a new tensor (the one seen was lost)."""
        if self.done:
            return
        if self._stepped():
            self.detach()
            return
        grad = param.grad
        if grad is None:
            return
        self._note_finite(grad)
        before = self._seen.get(id(param))
        if before is not None and before[1] is not None and before[1]() is grad:
            return  # added onto: nothing lost (an accumulation, or another loss's backward)
        if self._note(param, grad, PROCESS_STEPS.taken, before) and not self._queued:
            self._queued = True  # judged once every parameter of this backward is written
            Variable._execution_engine.queue_callback(WeakHook(self, "_backward_ended"))

    def _backward_ended(self) -> None:
        self._queued = False
        if not self.done:
            self._judge()

    def _judge(self) -> None:
        """Losses enough: told if every gradient seen was finite. A GradScaler's
        skipped steps (or a loop skipping non-finite gradients) throw away
        gradients with an Inf or NaN: the count starts again, from the gradients
        held now (their loss would be the first)."""
        if not all(bool(flag) for flag in self._all_finite.values()):
            self._all_finite = {}
            self._lost = {}
            self._seen = {key: (seen[0], None, seen[2]) for key, seen in self._seen.items()}
            return
        taken = PROCESS_STEPS.taken
        counts = {
            key: losses
            for key, (losses, first) in self._lost.items()
            if losses >= LOSSES and taken > first
        }
        lost = [seen[0] for key, seen in self._seen.items() if key in counts]
        losses = max(counts.values())
        self.detach()
        self._found(lost, losses)

    def detach(self) -> None:
        """The watch ends: hooks off, nothing held."""
        self.done = True
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = {}
        self._seen = {}
        self._lost = {}
        self._all_finite = {}

    def fail(self, exc: BaseException) -> None:
        """A WeakHook's target: knowing nothing more, it looks at nothing."""
        self.detach()


class LostGradientWatches:
    """The watches of a model's optimizers (by index), detached with the model's
    other parts."""

    def __init__(self) -> None:
        self.by_index: dict[int, LostGradients] = {}

    def end(self, index: int) -> None:
        """Optimizer ``index``'s watch ends (kept, done: it is not made again)."""
        watch = self.by_index.get(index)
        if watch is not None:
            watch.detach()

    def detach(self) -> None:
        for watch in self.by_index.values():
            watch.detach()
        self.by_index = {}
