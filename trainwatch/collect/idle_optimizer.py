"""An optimizer that holds the model but never steps, while training goes on elsewhere.

A domain-adversarial or GAN loop with two models and two optimizers that
forgets one ``opt.step()`` trains one model and not the other: the forgotten
one's gradients pile up at every backward and its weights never move. Its
monitor counts its steps from that optimizer's step hooks, which never run,
so no rule ever judged it. Seen from the model's own passes instead: a model
whose optimizer has not stepped once while the process took
:data:`PATIENCE` optimizer steps of other models, and whose parameters hold
gradients that some backward wrote since a look a few steps before, is
reported once (``not_optimized``): a ``.grad`` merely left behind (one
diagnostic backward, a saliency map, before another model trains beside it)
is no training.

Over the first :data:`LOOK_AHEAD` of those steps, the model's passes look at
its gradients for ones the loop throws away unapplied (``critic_opt.zero_grad();
critic_loss.backward()`` and no ``critic_opt.step()``): twice is a
forgotten step, told then, within a few iterations (see
:mod:`trainwatch.collect.lost_gradients`); the wait above is for loops where
that does not show (gradients reset in place).

It listens to the passes only until the model's first step: a model that
trains pays nothing for it from then on.

An optimizer that stepped and then stopped is the step pipeline's to judge;
here are the notes it takes of the gradients, to tell those some backward
still writes from those merely left behind.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainwatch import registry
from trainwatch.collect.lost_gradients import LostGradients
from trainwatch.process_steps import PROCESS_STEPS
from trainwatch.weak import weak_callback

# Optimizer steps of other models in this process before a model whose own
# optimizer never stepped is told (a GAN's critic steps 5 times per generator
# step: its generator still steps within a few).
PATIENCE = 20
# Steps of other models from which a model whose optimizer never stepped has its
# gradients' writes listened for, a quarter of PATIENCE before it is judged.
LOOK_AHEAD = PATIENCE - PATIENCE // 4
# Steps since one of a model's optimizers last stepped, while another steps, from
# which parameters only it holds that still get gradients are never updated (long
# enough for phases that alternate every few tens of steps).
STOPPED_STEPPING = 100
# Steps idle from which such an optimizer's gradients are noted, one look (every
# quarter of STOPPED_STEPPING) before it is judged: the gradients it is judged on
# must have been written since (a .grad merely left behind is no training).
STOPPED_LOOK_AHEAD = STOPPED_STEPPING - STOPPED_STEPPING // 4

_GRAD = attrgetter("grad")
_VERSION = attrgetter("_version")  # a tensor's in-place write counter

# Per parameter (by id), its gradient then and that gradient's write counter.
GradientsSeen = dict[int, tuple[weakref.ref, int]]


def gradients_seen(params: list[torch.Tensor]) -> GradientsSeen:
    """The gradients these parameters hold now (each has one), gathered in C.

    Weak references: a gradient replaced since (``zero_grad()`` to None, then a
    backward) is not kept alive by the note.
    """
    grads = list(map(_GRAD, params))
    return dict(zip(map(id, params), zip(map(weakref.ref, grads), map(_VERSION, grads))))


def fresh_gradients(
    params: list[torch.Tensor], before: GradientsSeen, now: GradientsSeen
) -> list[torch.Tensor]:
    """Those of ``params`` whose gradient some backward wrote between two notes.

    A backward writes a gradient in place (its write counter moves) or as a
    new tensor (another object); one left untouched since the earlier note
    (the first phase's head, which no later ``zero_grad()`` reaches) is not
    fresh, nor is one the earlier note lacks (a first look only notes).
    """
    fresh = []
    for p in params:
        key = id(p)
        then = before.get(key)
        if then is None:
            continue
        ref, version = now[key]
        if then[0]() is not ref() or then[1] != version:
            fresh.append(p)
    return fresh


class IdleOptimizer:
    """Watches one model's passes for an optimizer that never steps."""

    def __init__(
        self,
        model: nn.Module,
        optimizers: list[Any],
        steps_taken: Callable[[], int],
        found: Callable[[int, list[nn.Parameter]], None],
        lost: Callable[[int, int, list[torch.Tensor], int], None],
    ) -> None:
        self._model = model
        self._optimizers = optimizers  # the monitor's own list
        self._steps_taken = steps_taken
        self._found = found
        # Told ``(since, steps, params, losses)`` where the gradients are thrown away.
        self._lost_found = lost
        self._since = PROCESS_STEPS.taken
        # The watch for gradients thrown away (made at the first look; kept once
        # done, so it is made once) and the step it dates a finding at.
        self._lost: LostGradients | None = None
        self._lost_since = 0
        self._lost_params: list[torch.Tensor] = []
        # From the look ahead on: ids of the trainable parameters whose gradient
        # some backward wrote since (None: not listening).
        self._written: set[int] | None = None
        self._listening: list[RemovableHandle] = []
        self.done = False

    def pass_starts(self, module: nn.Module) -> None:
        if self.done or not self._optimizers:
            return
        elapsed = PROCESS_STEPS.taken - self._since
        if elapsed < LOOK_AHEAD:
            if elapsed and not self._steps_taken():
                self._look_for_lost()
            return
        if self._steps_taken():
            return
        if self._lost is not None and not self._lost.done:
            self._lost.detach()  # past the look ahead: the longer wait takes over
        written = self._written
        if written is None:
            self._listen()
            return
        if PROCESS_STEPS.taken - self._since < PATIENCE:
            return
        held = [p for p in self._model.parameters() if p.requires_grad and id(p) in written]
        self._stop_listening()
        if not held:
            self._since = PROCESS_STEPS.taken  # no backward reaches it (now): wait again
            return
        self.done = True
        self._found(PROCESS_STEPS.taken - self._since, held)

    def _look_for_lost(self) -> None:
        """Another model stepped since this one was watched, and its optimizer never
        did: its gradients looked at for ones thrown away unapplied."""
        lost = self._lost
        if lost is None:
            lost = self._lost = LostGradients(self._steps_taken, weak_callback(self._lost_seen))
            self._lost_since = max(PROCESS_STEPS.now - 1, 0)  # the first step it missed
            self._lost_params = self._own_params()
        # Looked at as a pass starts: only a step from now comes after what they hold.
        # Idle across another model's step already: its writes are followed.
        lost.look(self._lost_params, PROCESS_STEPS.taken, True)

    def _own_params(self) -> list[torch.Tensor]:
        """The model's parameters its optimizers hold and no other watched model's
        optimizer does (a trunk shared with a model that trains is updated there)."""
        ours = {id(p) for opt in self._optimizers for g in opt.param_groups for p in g["params"]}
        others = {
            id(p)
            for owner in registry.owners()
            for opt in owner.optimizers
            if not any(opt is mine for mine in self._optimizers)
            for g in opt.param_groups
            for p in g["params"]
        }
        return [p for p in self._model.parameters() if id(p) in ours and id(p) not in others]

    def _lost_seen(self, params: list[torch.Tensor], losses: int) -> None:
        if self.done:
            return
        self.done = True
        self._stop_listening()
        steps = PROCESS_STEPS.taken - self._since
        self._lost_found(self._lost_since, steps, params, losses)

    def _listen(self) -> None:
        """Note each write of a trainable parameter's gradient from now on.

        Whatever order the loop resets them in (``zero_grad()`` before the
        forward leaves none to see as a pass starts), a gradient is written by
        a backward; one merely left behind is not. The hooks hold the set only,
        not the monitor or the model.
        """
        written: set[int] = set()
        note = written.add
        self._written = written
        self._listening = [
            p.register_post_accumulate_grad_hook(lambda param: note(id(param)))
            for p in self._model.parameters()
            if p.requires_grad
        ]

    def _stop_listening(self) -> None:
        for handle in self._listening:
            handle.remove()
        self._listening = []
        self._written = None

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        return None

    def detach(self) -> None:
        self.done = True
        self._stop_listening()
        if self._lost is not None:
            self._lost.detach()
