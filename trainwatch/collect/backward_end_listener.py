"""A look at each backward's end that only some steps pay for.

Some checks need what a backward leaves before the loop touches the gradients
(a drop to ``None``, a clip, noise added in place), but only around a finding:
after a jump, over the first steps, while ``zero_gradient`` asks. Each request
covers the next few optimizer steps of the process (every watched model's); a
request comes as a rule judges a step, which may be read back a step late (a
lagged frame), so a few, not one. The listener is on the tracker's
backward-end callback while a request stands and goes at the first backward
past it: the usual step queues no call at its backward's end.
"""

from __future__ import annotations

import weakref

from torch.utils.hooks import RemovableHandle

from trainwatch.collect.accumulation import GradResetTracker
from trainwatch.hooks import WeakHook
from trainwatch.process_steps import PROCESS_STEPS


class BackwardEndListener:
    """Listens at each backward's end over the ``steps`` optimizer steps after each
    :meth:`request`; :meth:`at_backward_end` says what to do there."""

    steps = 4

    def __init__(self, tracker: GradResetTracker) -> None:
        self._tracker = weakref.ref(tracker)
        self._until = -1
        self._listener: RemovableHandle | None = None
        self.listening = False  # a plain attribute: read at step boundaries

    def request(self) -> None:
        """Listen at the backward passes' end of the next steps."""
        self._until = PROCESS_STEPS.taken + self.steps
        tracker = self._tracker()
        if self._listener is None and tracker is not None:
            self._listener = tracker.on_backward_end(WeakHook(self, "_backward_ended"))
            self.listening = True

    def _backward_ended(self) -> None:
        tracker = self._tracker()
        if tracker is None or PROCESS_STEPS.taken > self._until:
            self.stop()
            return
        tracker.note_asked()
        self.at_backward_end(tracker)

    def at_backward_end(self, tracker: GradResetTracker) -> None:
        """What a backward within a request does besides having the tracker note
        what it left (nothing here)."""

    def past_request(self) -> bool:
        """Whether the last step a request covers was taken."""
        return PROCESS_STEPS.taken >= self._until

    def stop(self) -> None:
        self.listening = False
        if self._listener is not None:
            self._listener.remove()
            self._listener = None

    def detach(self) -> None:
        """The step pipeline's parts take their hooks off through ``detach()``."""
        self.stop()

    def fail(self, exc: BaseException) -> None:
        """A WeakHook's target: knowing nothing, it looks at nothing (judged as before)."""
        self.stop()
