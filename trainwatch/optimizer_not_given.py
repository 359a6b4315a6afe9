"""The optimizers a plain loop steps but never gave ``tw.watch``.

``tw.watch(model)`` without an optimizer expects ``monitor.step()`` after each
update. A loop that trains with torch optimizers and forgot both (none
passed, no ``monitor.step()``) would watch no step at all, and close saying
that no optimizer stepped. The optimizers are found instead the way
``trainwatch run`` finds them: at their steps, through one global pre-step
hook, paired with the model by the parameters they hold
(``trainwatch.collect.unwatched_updates.holds_any``, as the monitor's catch of
an optimizer built later does). One over another model's parameters only is
never taken.

Its first step cannot tell the two loops apart: ``monitor.step()`` comes
after ``optimizer.step()`` returns. So the first step of each optimizer over
the model is only seen and counted. Its next step, no ``monitor.step()``
having come, is the loop's second iteration where the steps show one
(:mod:`trainwatch.collect.first_iteration`: another optimizer stepped in
between, gradients beside it were thrown away unapplied, or no other
optimizer is there to step first): the loop marks no steps itself, and
every optimizer seen over the model is watched from that step on, as if it
had been passed (the steps seen so far are counted, so alerts name the
loop's own step), and one console line says so. A WGAN's critic steps five
times before the generator's first step; a loop that calls
``monitor.step()`` once per iteration calls it after the generator's, and
is left as it was, as any loop calling ``monitor.step()`` is: its steps are
its own marks, and the hook comes off. (A loop whose optimizer over the
model steps twice with nothing else stepping before its first
``monitor.step()``, an inner loop adapting the watched model itself, is
taken for one that forgot.)

Parameters of the model whose gradients the loop throws away between two
such steps are those of an optimizer the loop keeps but never steps
(``opt_d.zero_grad(); loss_d.backward()`` and ``opt_d.step()`` forgotten, the
discriminator frozen for the generator's step or not): that optimizer is
watched too, as if passed, and ``not_optimized`` tells it as it does with it
passed. Under ``tw.watch(G)`` beside ``tw.watch(D)``, each looking for its
optimizers, the steps of both are followed, and ``opt_d`` is watched by D's
monitor.

A loop may step several optimizers over parts of the model, not all before
one of them steps twice: a WGAN's critic five times to the generator's once,
an actor-critic agent whose actor starts after the critic's warm-up, a new
optimizer for a head unfrozen later. So the look goes on after the first
ones are watched, while some parameter of the model is in no watched
optimizer: each other optimizer found stepping the model is watched at its
own second step, as the first ones were. Its first step is counted where it
comes (the steps are numbered as with every optimizer passed,
``tw.watch(model, [opt_g, opt_d])``: each optimizer's step is one), and the
gradients it used are watched for a reset from there, so a missing
``opt_g.zero_grad()`` is told at its second step, as with it passed. Each is
said in one console line. The hook comes off once every parameter of the
model is in a watched optimizer (the usual loop's one optimizer over the
whole model: at its second step), once an optimizer the look did not find is
watched before it found one (handed to ``monitor.add_optimizer``), and at
close. While it lasts, a loop pays one call per optimizer step of the
process; a ``tw.watch(model, optimizer)`` never has it.

What was seen but never watched (a run of one step) is said at close
(:meth:`OptimizerNotGiven.closing_words`), so the note never says no optimizer
stepped when one did.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.first_iteration import FirstIteration, SeenStep, holders
from trainwatch.collect.unwatched_updates import RemoveAtNextPass, holds_any
from trainwatch.errors import WatchError
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.optimizer_wrappers import inner_optimizer, takes_step_hooks
from trainwatch.rules.trainable_parameters import common_module

if TYPE_CHECKING:
    from trainwatch.guard import Guard
    from trainwatch.step_pipeline import StepPipeline

_COMPONENT = "optimizer not given"
_PASS = (
    "Pass every optimizer the loop keeps, tw.watch(model, [opt_g, opt_d]), to have every "
    "step checked."
)

# The looks under way in the process (several monitors watched without an optimizer:
# tw.watch(G) beside tw.watch(D)); each follows the others' steps while they wait.
_LOOKS: weakref.WeakSet[OptimizerNotGiven] = weakref.WeakSet()


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
        watch: Callable[[Optimizer], None],
        step_not_watched: Callable[[], int],
        step_count: Callable[[], int],
        stepped_before: Callable[[Optimizer, int], None],
        note: Callable[[str], None],
        model_name: Callable[[], str | None],
    ) -> None:
        self._pipeline = pipeline
        self._optimizers = optimizers  # the monitor's own list: the watched ones
        self._guard = guard
        self._closed = closed
        self._steps_taken = steps_taken  # monitor.step() calls in this process
        self._adopt = adopt  # the monitor's: count the steps seen, watch the optimizers
        self._watch = watch  # the monitor's add_optimizer: one more, found later
        self._step_not_watched = step_not_watched  # counts one step, returns its number
        self._step_count = step_count  # the monitor's: the step under way
        self._stepped_before = stepped_before  # a watched one's step before it was
        self._note = note  # one console line
        self._model_name = model_name
        # Optimizers seen stepping the model's parameters, in the order met (weakly:
        # one the loop drops goes), and their steps seen, none of them watched.
        self._seen: list[weakref.ref[Optimizer]] = []
        self.steps_seen = 0
        # Before the first are watched: the steps seen, and what they show of the
        # loop's iterations. After: the step each one seen took, unwatched.
        self._iteration = FirstIteration()
        self._unchecked: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
        # True once the first ones found are watched: the loop marks no steps itself.
        self._watching = False
        # Per optimizer met: its param groups' count then, and whether it steps the
        # model (asked once, not at each of its steps).
        self._trains: weakref.WeakKeyDictionary[Optimizer, tuple[int, bool]] = (
            weakref.WeakKeyDictionary()
        )
        self._hook: RemovableHandle | None = handles.add(
            register_optimizer_step_pre_hook(WeakHook(self, "optimizer_steps"))
        )
        _LOOKS.add(self)

    @property
    def waiting(self) -> bool:
        """Whether the look has found nothing to watch yet, and the loop marks no step."""
        return (
            self._hook is not None
            and not self._watching
            and not self._optimizers
            and not self._closed()
            and not self._steps_taken()
        )

    def optimizer_steps(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """Some optimizer of the process is about to step (the global pre-step hook)."""
        if self._hook is None:
            return
        if self._watching:
            # Some found and watched, some of the model's parameters in none of them.
            # (Optimizers compare by identity; no name is left holding a watched one,
            # which adding another may find dropped by the loop and let go.)
            if optimizer in self._optimizers:
                return
            if self._closed():
                self._stop()
            elif self._steps_model(optimizer):
                self._guard.run(_COMPONENT, self._another_steps, optimizer)
            return
        if self._closed() or self._optimizers or self._steps_taken():
            # Closed, an optimizer watched, or the loop marks its own steps.
            self._stop()
            return
        if not self._steps_model(optimizer):
            if self._steps_another_waiting(optimizer):
                self._iteration.other_stepped(optimizer)
            return
        if any(ref() is optimizer for ref in self._seen):
            self._guard.run(_COMPONENT, self._seen_again, optimizer)
            return
        self._seen.append(weakref.ref(optimizer))
        self.steps_seen += 1
        self._guard.run(_COMPONENT, self._note_step, optimizer)

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

    def _own_params(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """The model's parameters among those ``optimizer`` holds."""
        layers = self._pipeline.layers
        return [p for group in optimizer.param_groups for p in group["params"] if p in layers]

    def _steps_another_waiting(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps the model of another look still waiting (the
        generator's optimizer, for the discriminator's monitor beside the generator's)."""
        return any(
            look is not self and look.waiting and look._steps_model(optimizer)
            for look in list(_LOOKS)
        )

    def _waiting_beside(self) -> list[OptimizerNotGiven]:
        return [look for look in list(_LOOKS) if look is not self and look.waiting]

    def _note_step(self, optimizer: Optimizer) -> None:
        """A step seen, unwatched (its place: the latest counted): the gradients it
        uses and those beside it, as they are (the loop may still turn out to call
        monitor.step(): nothing is armed before)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        beside = [p for p in self._pipeline.layers.parameters() if id(p) not in held]
        for look in self._waiting_beside():
            beside.extend(look._pipeline.layers.parameters())
        params = self._own_params(optimizer)
        self._iteration.seen(optimizer, self.steps_seen - 1, params, beside)

    def _seen_again(self, optimizer: Optimizer) -> None:
        """An optimizer seen steps again, no monitor.step() having come: watched from
        this step on where the steps show the loop's second iteration, else seen."""
        if self._iteration.second(optimizer, self.steps_seen):
            self._watch_seen(optimizer)
            return
        self.steps_seen += 1
        self._note_step(optimizer)

    def _watch_seen(self, stepping: Optimizer | None, unstepped: Sequence[Optimizer] = ()) -> None:
        """Every optimizer seen stepping the model is watched from this step on (the
        monitor's own step hooks run after the global ones, so this step is too),
        with those holding parameters whose gradients the loop threw away unapplied
        (``unstepped``, or found here); the look goes on for those stepping the rest
        of the model."""
        found = [opt for opt in (ref() for ref in self._seen) if opt is not None]
        iteration, self._iteration = self._iteration, FirstIteration()
        own, elsewhere = self._unstepped(iteration.lost, found)
        own.extend(opt for opt in unstepped if not any(opt is o for o in own))
        self._watching = True
        try:
            self._adopt(found, self.steps_seen)
        except WatchError:
            self._stop()
            return  # refused as tw.watch would have refused it: said at close
        idle = []
        for optimizer in own:
            try:
                self._watch(optimizer)
            except WatchError:
                continue  # refused as tw.watch would have refused it
            idle.append(optimizer)
        self._note(self._adopted_words(found, idle))
        first_seen = self._step_count() - self.steps_seen  # the number of the first
        for optimizer in found:
            seen = iteration.steps.get(optimizer)
            if seen is None:
                continue
            self._stepped_before(optimizer, first_seen + seen.place)
            if optimizer is not stepping:
                self._pipeline.tracker.arm_beside(_unchanged(seen))
        for look, optimizers in elsewhere:
            look._guard.run(_COMPONENT, look._watch_seen, None, optimizers)
        self._seen.clear()
        self.steps_seen = 0
        self._stop_if_covered()

    def _unstepped(
        self, lost: list[torch.Tensor], found: list[Optimizer]
    ) -> tuple[list[Optimizer], list[tuple[OptimizerNotGiven, list[Optimizer]]]]:
        """The optimizers holding ``lost`` (parameters whose gradients the loop threw
        away, no optimizer holding them having stepped): this model's, and those of
        each other look's model."""
        if not lost:
            return [], []
        by_param = holders(lost, found)
        layers = self._pipeline.layers
        looks = self._waiting_beside()
        own: list[Optimizer] = []
        elsewhere: dict[int, tuple[OptimizerNotGiven, list[Optimizer]]] = {}
        for param in lost:
            if param in layers:
                into = own
            else:
                look = next((lk for lk in looks if param in lk._pipeline.layers), None)
                if look is None:
                    continue
                into = elsewhere.setdefault(id(look), (look, []))[1]
            for optimizer in by_param.get(id(param), ()):
                if not any(optimizer is opt for opt in into):
                    into.append(optimizer)
        return own, list(elsewhere.values())

    def _another_steps(self, optimizer: Optimizer) -> None:
        """An optimizer not watched steps the model while others are: its first step is
        counted and its gradients armed; at its second it is watched."""
        if not any(ref() is optimizer for ref in self._seen):
            self._seen.append(weakref.ref(optimizer))
            step = self._unchecked[optimizer] = self._step_not_watched()
            params = self._own_params(optimizer)
            # Its NaN/Inf judged before it applies them (a new phase's first batch).
            self._pipeline.judge_unwatched_step(params, step)
            self._pipeline.tracker.arm_beside(params)
            return
        self._seen = [ref for ref in self._seen if ref() is not None and ref() is not optimizer]
        try:
            self._watch(optimizer)
        except WatchError:
            return  # refused as tw.watch would have refused it (never asked again)
        finally:
            self._trains[optimizer] = (len(optimizer.param_groups), False)
        unchecked = self._unchecked.pop(optimizer, None)
        if unchecked is not None:
            self._stepped_before(optimizer, unchecked)
        self._note(self._another_words(optimizer, self._step_count(), unchecked))
        self._stop_if_covered()

    def _stop_if_covered(self) -> None:
        """Every parameter of the model in a watched optimizer: nothing left to find."""
        held: set[int] = set()
        for optimizer in self._optimizers:
            for group in getattr(optimizer, "param_groups", ()):
                held.update(map(id, group["params"]))
        if all(id(param) in held for param in self._pipeline.layers.parameters()):
            self._stop()

    def _adopted_words(self, found: list[Optimizer], idle: list[Optimizer]) -> str:
        """The console line for the optimizers watched as the loop is found to mark no
        steps: those seen stepping (``found``), and those holding gradients the loop
        threw away that never stepped (``idle``)."""
        model = self._model_name() or "model"
        if not found:
            one = len(idle) == 1
            return (
                f"trainwatch: {self._named(idle)} {'holds' if one else 'hold'} the watched "
                f"{model}'s parameters but {'was' if one else 'were'} not passed to tw.watch, "
                "and the loop computes their gradients while the optimizers beside it step: "
                f"watching {'it' if one else 'them'}, as if passed. {_PASS}"
            )
        one = len(found) == 1
        skipped = self.steps_seen
        unchecked = "step 0" if skipped == 1 else f"steps 0-{skipped - 1}"
        them = "it" if one else "them"
        advice = f"Pass {them}, tw.watch(model, optimizer), to have every step checked."
        also = ""
        if idle:
            few = len(idle) == 1
            also = (
                f" {self._named(idle)}, not passed either, {'holds' if few else 'hold'} "
                "parameters whose gradients the loop computes and throws away, and "
                f"{'has' if few else 'have'} not stepped: watched too."
            )
            advice = _PASS
        return (
            f"trainwatch: {self._named(found)} {'steps' if one else 'step'} the watched "
            f"{model}'s parameters but {'was' if one else 'were'} not passed to tw.watch "
            f"(nor is monitor.step() called): watching {'it' if one else 'them'} from step "
            f"{skipped} on, as if passed; {unchecked} went unchecked.{also} {advice}"
        )

    def _named(self, optimizers: list[Optimizer]) -> str:
        """Their classes (``SGD and Adam``), each with the part of the model it holds
        where one class is there twice (``RMSprop over D and RMSprop over G``), or
        where one optimizer holds part of the model only (``Adam over G``)."""
        kinds = [type(opt).__name__ for opt in optimizers]
        if len(optimizers) > 1 and len(set(kinds)) == len(kinds):
            return " and ".join(kinds)
        whole = len(self._pipeline.layers.parameters())
        return " and ".join(
            kind if len(self._own_params(opt)) == whole else f"{kind} over {self._part(opt)}"
            for kind, opt in zip(kinds, optimizers)
        )

    def _another_words(self, optimizer: Optimizer, since: int, unchecked: int | None) -> str:
        model = self._model_name() or "model"
        went = "" if unchecked is None else f"; its step {unchecked} went unchecked"
        return (
            f"trainwatch: {type(optimizer).__name__} over {self._part(optimizer)} steps the "
            f"watched {model}'s parameters too, and was not passed to tw.watch either: "
            f"watching it from step {since} on, as if passed{went}. Pass every optimizer "
            "the loop steps, tw.watch(model, [opt_g, opt_d]), to have every step checked."
        )

    def _part(self, optimizer: Optimizer) -> str:
        """The innermost module holding every parameter of the model ``optimizer`` holds."""
        info = self._pipeline.layers.info
        owners = list(dict.fromkeys(info(p).owner for p in self._own_params(optimizer)))
        part = common_module(owners)
        return part if part else "the whole model"

    def _names(self, found: list[Optimizer] | None = None) -> str:
        if found is None:
            found = [opt for opt in (ref() for ref in self._seen) if opt is not None]
        kinds = dict.fromkeys(type(opt).__name__ for opt in found)  # in the order met
        return " and ".join(kinds)

    def _stop(self) -> None:
        """No more looking. Inside a global step hook (PyTorch iterates over them), the
        hook itself goes at the model's next pass."""
        hook, self._hook = self._hook, None
        _LOOKS.discard(self)
        self._iteration = FirstIteration()  # nor is any parameter held for it
        if hook is not None:
            passes = self._pipeline.passes
            passes.subscribe(_COMPONENT, RemoveAtNextPass(passes, hook))


def _unchanged(seen: SeenStep) -> list[torch.Tensor]:
    """The parameters whose gradient is still as ``seen`` found it: the same tensor,
    not written since (a GAN's generator, stepped after the critic and watched
    from the critic's next step, not reset yet)."""
    kept = []
    for param, then in zip(seen.params, seen.grads):
        grad = param.grad
        if then is not None and grad is not None and then[0]() is grad and grad._version == then[1]:
            kept.append(param)
    return kept
