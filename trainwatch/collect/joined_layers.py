"""Layers that join the loss after the broadcast audit's steps: their loss is audited
when they come again.

A multi-task loop draws one task per step, and a rare task's head gets its first
gradient long after the audit of the run's first steps; a curriculum stage or an
auxiliary loss switched on later does the same. The loss code that reaches such a
layer never ran under the audit, and a ``(N, 1) - (N,)`` there goes unseen until a
sampled recheck happens to fall on a step of that task.

The audit has to be on before the loss runs, but a layer's first gradient is only
known at that step's boundary, after its loss ran. So from the next step the audit
is armed one step at a time, until a step where one of the joined layers gets a
gradient again (its loss then ran under the audit), or ``WAIT`` steps went by. A
layer joining on a step the audit watched (the run's first steps, a new phase's,
a sampled one, one of such a wait) was seen: nothing to do. At most ``WAITS``
waits a run, so a multi-task loop is audited a few steps more, not at every step.

A layer's first gradient is seen only where the set of parameters with gradients
changes (a new gradient layout, see ``collect/small_norms.py``): a step whose
layout was seen before asks nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainwatch.layers import ParamInfo

# Steps a wait lasts at most: a task drawn one step in 20 comes again within
# 100 steps but for one time in 170.
WAIT = 100
# Waits a run: layers joining in more separate steps than this (experts routed to
# for the first time, one by one) are left to the sampled rechecks.
WAITS = 8


class JoinedLayers:
    """The layers that ever had a gradient, and those waiting for their loss's audit."""

    def __init__(self) -> None:
        # Owners of the parameters seen with a gradient, by module name: bounded
        # by the model's size.
        self.graded: set[str] = set()
        # Joined on a step the audit did not watch; empty when none waits.
        self.waiting: set[str] = set()
        self.waits_left = WAITS
        # The step count at the boundary that armed the audit for them (None: not
        # armed yet, the boundary they joined at is still to come).
        self._since: int | None = None

    @property
    def exhausted(self) -> bool:
        """No wait left and none going on: nothing more to look for this run."""
        return self.waits_left <= 0 and not self.waiting

    def new_layout(self, present: Sequence[ParamInfo], audited: bool) -> bool:
        """A step's gradients reached a set of parameters not seen together before:
        whether one of their layers joined now with its loss unaudited (``audited``:
        the audit watched this step), which starts a wait."""
        owners = {info.owner for info in present if info.in_model}
        joined = owners - self.graded
        if not joined:
            return False
        self.graded |= joined
        if audited or self.waiting or self.waits_left <= 0:
            # Seen by the audit (the run's first gradients come in its first steps);
            # or a wait already arms it, and it watches the next step of these too.
            return False
        self.waiting = joined
        self.waits_left -= 1
        self._since = None
        return True

    def keep_armed(self, present: Sequence[ParamInfo], now: int) -> bool:
        """At a step boundary while layers wait: whether to audit the next step too.

        The boundary they joined at arms it; a later step where one of them got a
        gradient had its loss audited, and ends the wait; so does ``WAIT`` steps."""
        since = self._since
        if since is None:
            self._since = now
            return True
        if now > since:
            waiting = self.waiting
            if any(info.owner in waiting for info in present) or now - since >= WAIT:
                self.waiting = set()
                self._since = None
                return False
        return True
