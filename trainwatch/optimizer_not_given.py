"""The optimizer a plain loop steps but never gave ``tw.watch``.

``tw.watch(model)`` without an optimizer expects ``monitor.step()`` after each
update. A loop that trains with a torch optimizer and forgot both (no
optimizer passed, no ``monitor.step()``) would watch no step at all, and close
saying that no optimizer stepped. The optimizer is found instead
the way ``trainwatch run`` finds one: at its step, through one global pre-step
hook, paired with the model by the parameters it holds
(``trainwatch.collect.unwatched_updates.holds_any``, as the monitor's catch of
an optimizer built later does).

Its first step cannot tell the two loops apart: ``monitor.step()`` comes
after ``optimizer.step()`` returns. So the first step of each optimizer over
the model is only seen and counted. At the next step of one of them, no
``monitor.step()`` having come in between, the loop marks no steps itself:
every optimizer seen over the model is watched from that step on, as if it
had been passed (the steps seen so far are counted, so alerts name the
loop's own step), and one console line says so. A loop that calls
``monitor.step()`` is left as it was: its steps are its own marks, and the
hook comes off. It comes off too once an optimizer is watched (found, or
handed to ``monitor.add_optimizer``) and at close: a loop of hand-written
updates pays one call per optimizer step of the process while it lasts, and
a usual ``tw.watch(model, optimizer)`` never has it. (A loop whose
optimizer over the model steps twice before its first ``monitor.step()``, an
inner loop adapting the watched model itself, is taken for one that forgot.)

What was seen but never watched (a run of one step) is said at close
(:meth:`OptimizerNotGiven.closing_words`), so the note never says no optimizer
stepped when one did.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.unwatched_updates import RemoveAtNextPass, holds_any
from trainwatch.errors import WatchError
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.optimizer_wrappers import inner_optimizer, takes_step_hooks

if TYPE_CHECKING:
    from trainwatch.guard import Guard
    from trainwatch.step_pipeline import StepPipeline

_COMPONENT = "optimizer not given"


class OptimizerNotGiven:
    """Finds the optimizers stepping a model watched without one, and has them watched."""

    def __init__(
        self,
        pipeline: StepPipeline,
        optimizers: list[Optimizer],
        guard: Guard,
        handles: HookGroup,
        *,
        closed: Callable[[], bool],
        steps_taken: Callable[[], int],
        adopt: Callable[[list[Optimizer], int], None],
        note: Callable[[str], None],
        model_name: Callable[[], str | None],
    ) -> None:
        self._pipeline = pipeline
        self._optimizers = optimizers  # the monitor's own list: the watched ones
        self._guard = guard
        self._closed = closed
        self._steps_taken = steps_taken  # monitor.step() calls in this process
        self._adopt = adopt  # the monitor's: count the steps seen, watch the optimizers
        self._note = note  # one console line
        self._model_name = model_name
        # Optimizers seen stepping the model's parameters, in the order met (weakly:
        # one the loop drops goes), and their steps seen, none of them watched.
        self._seen: list[weakref.ref[Optimizer]] = []
        self.steps_seen = 0
        # Per optimizer met: its param groups' count then, and whether it steps the
        # model (asked once, not at each of its steps).
        self._trains: weakref.WeakKeyDictionary[Optimizer, tuple[int, bool]] = (
            weakref.WeakKeyDictionary()
        )
        self._hook: RemovableHandle | None = handles.add(
            register_optimizer_step_pre_hook(WeakHook(self, "optimizer_steps"))
        )

    def optimizer_steps(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Some optimizer of the process is about to step (the global pre-step hook)."""
        if self._hook is None:
            return
        if self._closed() or self._optimizers or self._steps_taken():
            # Closed, an optimizer watched, or the loop marks its own steps.
            self._stop()
            return
        if not self._steps_model(optimizer):
            return
        if any(ref() is optimizer for ref in self._seen):
            self._guard.run(_COMPONENT, self._watch_seen)  # its second step: watched from now
            return
        self._seen.append(weakref.ref(optimizer))
        self.steps_seen += 1

    def fail(self, exc: BaseException) -> None:
        """The hook failed: reported once, and the look ends."""
        self._guard.fail(_COMPONENT, exc)
        self._stop()

    def closing_words(self) -> str | None:
        """For the closing note of a monitor that watched no step: the optimizers seen
        stepping the model but never watched, with their steps (None: none seen)."""
        names = self._names()
        if not names:
            return None
        # Counted while the look lasts (it ends early only where watching failed).
        times = ""
        if self._hook is not None:
            times = " once" if self.steps_seen == 1 else f" {self.steps_seen} times"
        return (
            f"{names} stepped the model's parameters{times} without "
            "being passed to tw.watch, and monitor.step() was never called (pass "
            "the optimizer, tw.watch(model, optimizer), and each of its steps is watched)"
        )

    def _steps_model(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s steps are steps of the model: it holds some of the
        model's parameters and is no wrapper (the wrapped optimizer's own step runs
        these hooks too, and is what a watched wrapper counts)."""
        groups = len(optimizer.param_groups)
        known = self._trains.get(optimizer)
        if known is not None and known[0] == groups:
            return known[1]
        verdict = (
            inner_optimizer(optimizer) is optimizer
            and takes_step_hooks(optimizer)
            and holds_any(optimizer, self._pipeline.layers.__contains__)
        )
        self._trains[optimizer] = (groups, verdict)
        return verdict

    def _watch_seen(self) -> None:
        """Every optimizer seen stepping the model is watched from this step on (the
        monitor's own step hooks run after the global ones, so this step is too)."""
        found = [opt for opt in (ref() for ref in self._seen) if opt is not None]
        self._stop()
        try:
            self._adopt(found, self.steps_seen)
        except WatchError:
            return  # refused as tw.watch would have refused it: said at close
        self._note(self._adopted_words(found))
        self._seen.clear()
        self.steps_seen = 0

    def _adopted_words(self, found: list[Optimizer]) -> str:
        one = len(found) == 1
        skipped = self.steps_seen
        unchecked = "step 0" if skipped == 1 else f"steps 0-{skipped - 1}"
        model = self._model_name() or "model"
        return (
            f"trainwatch: {self._names(found)} {'steps' if one else 'step'} the watched "
            f"{model}'s parameters but {'was' if one else 'were'} not passed to tw.watch "
            f"(nor is monitor.step() called): watching {'it' if one else 'them'} from step "
            f"{skipped} on, as if passed; {unchecked} went unchecked. Pass "
            f"{'it' if one else 'them'}, tw.watch(model, optimizer), to have every step checked."
        )

    def _names(self, found: list[Optimizer] | None = None) -> str:
        if found is None:
            found = [opt for opt in (ref() for ref in self._seen) if opt is not None]
        kinds = dict.fromkeys(type(opt).__name__ for opt in found)  # in the order met
        return " and ".join(kinds)

    def _stop(self) -> None:
        """No more looking. Inside a global step hook (PyTorch iterates over them), the
        hook itself goes at the model's next pass."""
        hook, self._hook = self._hook, None
        if hook is not None:
            passes = self._pipeline.passes
            passes.subscribe(_COMPONENT, RemoveAtNextPass(passes, hook))
