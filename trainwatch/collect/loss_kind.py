"""The kind of a step's loss: which autograd ops lead from it back to the model's output.

A loss whose computation changes mid-run with no other sign of a new phase (a
curriculum that adds an auxiliary term at epoch N, a loss weight warm-up that
first enables a term, a ``loss_fn`` swapped by a callback) would otherwise be
audited for broadcasting only at the next sampled recheck, hundreds of steps
later. Its graph shows the change: the root handed to ``backward`` is walked
back through ``next_functions`` to the nodes the model's last pass of the
step made (autograd numbers its nodes as it makes them: those of the loss
come after the pass's output), and the set of their types
(``MseLossBackward0``, ``AddBackward0``...) is the loss's kind. Types, not
how many of each: a loss that loops over a varying number of objects keeps
its kind; a term made of ops the loss already had, or a change to the target
alone (no gradient flows through it, so it is no node of the graph), is not
seen (the sampled rechecks still audit it).

The kind is read only where a function mode follows the loss to the step
boundary, at its ``backward``: the class target look's sampled steps (its first
``backward``; ``collect/class_targets.py``) and the broadcast audit's steps
(each one; ``collect/broadcast.py``). No healthy step pays for it. A run with no
class loss, whose look would slow down to every 80th step, keeps it every
``broadcast.loss_kind_every`` (10) steps while kinds are read.

``LossKinds`` learns the kinds a run's loss takes: the first one, those seen
while the audit followed the loss, and each new one found after them. A new
kind found on a step the audit did not follow arms the audit from the next
step, step by step, until a step with that kind has been audited or ``WAIT``
steps went by. A loop whose loss legitimately varies (mixup applied with
p=0.5, tasks drawn per batch, a term present only on some batches) shows each
of its kinds once, then nothing new; at most ``WAITS`` waits come in a run,
and no more than ``MAX_KINDS`` kinds are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import torch

# Nodes walked from a root at most: a loss over every parameter (an L2 term)
# reaches hundreds of leaves; its first ones are enough to tell its kind.
MAX_NODES = 256
# Steps a wait lasts at most: a branch taken on half the batches (mixup) comes
# again within a few steps, a task drawn one batch in 20 within 50 but for one
# time in 13.
WAIT = 50
# Waits a run: a loss that keeps showing new kinds is left to the rechecks.
WAITS = 8
# Kinds remembered at most.
MAX_KINDS = 64


# Handed a loss at its ``backward``: its roots, the number of the latest node of the
# step's passes, and whether the broadcast audit followed it.
KindReader = Callable[[Sequence[torch.Tensor], int, bool], None]

_grad_fn = attrgetter("grad_fn")
_first = itemgetter(0)  # of a (node, input number) edge


def node_number(tensor: torch.Tensor) -> int:
    """The sequence number of the autograd node that made ``tensor`` (-1 for none):
    the nodes of a loss computed from it come after it."""
    node = tensor.grad_fn
    return -1 if node is None else node._sequence_nr()


def backward_roots(args: Any, kwargs: dict[str, Any]) -> Sequence[torch.Tensor]:
    """The tensors a ``backward`` call starts from: ``loss.backward()``'s ``loss``,
    ``torch.autograd.backward(tensors)``'s tensor or sequence of them."""
    first = args[0] if args else kwargs.get("tensors")
    if isinstance(first, torch.Tensor):
        return (first,)
    if isinstance(first, (list, tuple)):
        return [item for item in first if isinstance(item, torch.Tensor)]
    return ()


def loss_kind(roots: Sequence[torch.Tensor], after: int) -> frozenset[str]:
    """The types of the autograd nodes from ``roots`` back to those numbered up to
    ``after`` (the model's pass and what came before it), ``MAX_NODES`` at most."""
    found: set[str] = set()
    visited: set[Any] = set()
    stack = list(map(_grad_fn, roots))
    while stack:
        node = stack.pop()
        # An accumulator (a parameter the loss reads itself) has the largest number.
        if node is None or node in visited or node._sequence_nr() <= after:
            continue
        visited.add(node)
        found.add(node.name())
        if len(visited) >= MAX_NODES:
            break
        stack.extend(map(_first, node.next_functions))
    return frozenset(found)


class LossKinds:
    """The kinds of loss a run has shown, and the new one waiting for its audit."""

    def __init__(self) -> None:
        self.known: set[frozenset[str]] = set()
        # A kind first found on a step the audit did not follow; None when none waits.
        self.waiting: frozenset[str] | None = None
        self.waits_left = WAITS
        # The step count at the boundary that armed the audit for it (None: not
        # armed yet, the boundary of the step it was found at is still to come).
        self._since: int | None = None

    @property
    def exhausted(self) -> bool:
        """No wait left and none going on: nothing more to look for this run."""
        return self.waits_left <= 0 and self.waiting is None

    def seen(self, kind: frozenset[str], audited: bool) -> bool:
        """A step's loss had ``kind`` (``audited``: the audit followed it). Whether it
        is a new kind the audit did not follow, which starts a wait."""
        known = self.known
        if kind in known:
            if audited and kind == self.waiting:
                self.waiting = None  # its loss ran under the audit
                self._since = None
            return False
        first = not known
        if len(known) < MAX_KINDS:
            known.add(kind)
        if first or audited or self.waiting is not None or self.waits_left <= 0:
            # The run's own loss (its first steps are audited), or seen by the audit.
            return False
        self.waiting = kind
        self.waits_left -= 1
        self._since = None
        return True

    def keep_armed(self, now: int) -> bool:
        """At a step boundary while a kind waits: whether to audit the next step too.

        The boundary of the step it was found at arms it; a later step with that
        kind, audited, ends the wait (``seen``); so does ``WAIT`` steps."""
        if self.waiting is None:
            return False
        since = self._since
        if since is None:
            self._since = now
            return True
        if now - since >= WAIT:
            self.waiting = None
            self._since = None
            return False
        return True
