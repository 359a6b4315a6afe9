"""Catching the optimizer that trains a watched model without its monitor's knowing.

The step pipeline tells when the weights kept moving while no watched
optimizer stepped (``trainwatch.collect.unwatched_updates`` looks). The
optimizer doing it is then looked for at the next optimizer steps of the
process, through one global pre-step hook held until it is found: one that
holds the model's parameters and is not watched is told of and watched from
that very step on, as ``trainwatch run`` does. Told a second time before any
such step came, no optimizer over the model's parameters stepped at all:
something else writes the weights (a hand-written update), told as such.

A monitor owns one of these; it reaches the monitor only weakly (a monitor
dropped without ``close()`` is still collected, and its hooks go quiet).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.unwatched_updates import RemoveAtNextPass, holds_any
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.optimizer_wrappers import inner_optimizer, takes_step_hooks

if TYPE_CHECKING:
    from trainwatch.dispatch import Dispatcher
    from trainwatch.guard import Guard
    from trainwatch.step_pipeline import StepPipeline


class UnwatchedOptimizerCatch:
    """Looks for the optimizer training the model unwatched, and has it watched."""

    def __init__(
        self,
        pipeline: StepPipeline,
        optimizers: list[Optimizer],
        dispatcher: Dispatcher,
        guard: Guard,
        handles: HookGroup,
        *,
        closed: Callable[[], bool],
        watch: Callable[[Optimizer], None],
        on_hook_error: Callable[[BaseException], None],
    ) -> None:
        self._pipeline = pipeline
        self._optimizers = optimizers  # the monitor's own list: the watched ones
        self._dispatcher = dispatcher
        self._guard = guard
        self._handles = handles  # the monitor's: close() takes the global hook off too
        self._closed = closed
        self._watch = watch  # the monitor's add_optimizer
        self._on_hook_error = on_hook_error
        self._hook: RemovableHandle | None = None
        # The backward passes counted when the weights were found moving (None: not looking).
        self._passes: int | None = None

    def weights_moved(self, passes: int) -> None:
        """The weights kept moving for ``passes`` passes while no watched optimizer
        stepped: the first time, the look for the optimizer begins; the next, with
        no optimizer step over the model's parameters come since, it ends and a
        hand-written update is told."""
        if self._passes is None:
            self._passes = passes
            self._hook = self._handles.add(
                register_optimizer_step_pre_hook(WeakHook(self, "optimizer_steps"))
            )
            return
        self._end_look()
        if self._hook is not None:
            self._hook.remove()
        alerts = self._pipeline.unwatched_alerts(passes, None)
        if alerts:
            self._dispatcher.publish(alerts, may_halt=False)

    def optimizer_steps(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """A step of some optimizer while the one training the model unwatched is
        looked for: one holding the model's parameters, not watched, is it."""
        if self._closed() or self._passes is None:
            return
        self._guard.run("unwatched updates", self._adopt, optimizer)

    def fail(self, exc: BaseException) -> None:
        """The global hook failed: reported as the monitor's own step hooks' failure."""
        self._on_hook_error(exc)

    def _adopt(self, optimizer: Optimizer) -> None:
        inner = inner_optimizer(optimizer)
        if any(opt is inner for opt in self._optimizers):
            self._stop_catching()  # watched steps came back: nothing to look for now
            return
        if not takes_step_hooks(inner) or not holds_any(inner, self._pipeline.layers.__contains__):
            return  # another model's, or one no hook can follow
        passes = self._passes
        self._stop_catching()
        alerts = self._pipeline.unwatched_alerts(passes or 0, inner)
        if alerts:
            self._dispatcher.publish(alerts, may_halt=False)
        # Watched from this step on: its per-instance hooks run after the global
        # ones, so this step is gathered and counted too.
        self._watch(inner)

    def _stop_catching(self) -> None:
        """The catch ends from inside a global step hook, while PyTorch iterates over
        them: the hook goes at the model's next pass. The weights are looked at
        afresh (a later phase's optimizer is looked for too)."""
        self._passes = None
        if self._pipeline.unwatched is not None:
            self._pipeline.unwatched.restart()
        passes = self._pipeline.passes
        passes.subscribe("unwatched updates", RemoveAtNextPass(passes, self._hook))

    def _end_look(self) -> None:
        """No optimizer to find: the weights are looked at no more."""
        self._passes = None
        if self._pipeline.unwatched is not None:
            self._pipeline.unwatched.detach()
