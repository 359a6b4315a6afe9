"""Sees whether backward added onto gradients that a step had already used.

After a step uses a parameter's gradient the tracker remembers that tensor and
its version counter. Every reset leaves a trace the tracker can see without
reading any value: ``zero_grad()`` either replaces ``.grad`` (``None``, then a
new tensor) or zeroes it in place (the version counter moves). If instead the
next backward accumulates into the same tensor with the same version, the old
values are still in it; if nothing resets it before the step that uses it,
that step applies stale gradients again: the missing ``zero_grad`` bug.

Deciding at the *use* (the next step of the same optimizer), not at the
accumulation, keeps the tracker silent on a GAN, where the generator's
backward legitimately adds onto the discriminator's old gradients that are
reset before the discriminator's next step.

Legacy code that zeroes through ``p.grad.data.zero_()`` leaves no version
trace, so each suspect also gets one device-side max|g| taken just before the
accumulation: stale *and* non-zero is the bug. It runs only for suspects,
so healthy training pays nothing for it.

No hook per parameter (a Python call per parameter per backward): the look
happens once per backward pass, when the gradient first reaches the model's
output (one tensor hook there; one hook on one parameter for backward passes
that come another way), as one loop over the parameters; and once when that
backward ends, to note what it reached.

Which output: the one backward reaches first, before any parameter behind any
output accumulates. A loss may leave the first output out (an actor-critic's
value warm-up, a metric head), and a head whose output backward reaches
before the hooked one accumulates before the look (it would pass for reset).
So the first passes hook every output (``_learning_pass_ends``), and the one
reached first is the one hooked from then on: the first output as usual
(``pass_ends``), or another (``_targeted_pass_ends``). A step boundary with no
hook fired since the last, whose gradients were added onto in place, had a
backward come another way: the outputs are learned again (``arm``).
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import and_, attrgetter, eq, is_, is_not, ne
from typing import Any

import torch
from torch.autograd import Variable
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.between_backwards import BetweenBackwards
from trainwatch.collect.moved_between_backwards import MovedBetweenBackwards
from trainwatch.collect.other_backward import OtherBackwardLook
from trainwatch.collect.tensors import all_plain, floating_list, local_part
from trainwatch.hooks import WeakHook, hook_pass_tensor
from trainwatch.process_steps import PROCESS_STEPS


def _max_abs(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """max|g| of each gradient, fp32, in one batched kernel per device."""
    if any(type(g) is not torch.Tensor for g in grads):
        return [_max_abs_of_shard(g) for g in grads]
    try:
        return list(torch._foreach_norm(grads, math.inf, dtype=torch.float32))
    except (TypeError, RuntimeError):  # older torch, mixed devices
        return [torch.linalg.vector_norm(g.float(), ord=math.inf) for g in grads]


def _max_abs_of_shard(grad: torch.Tensor) -> torch.Tensor:
    """max|g| of this rank's part of a DTensor (FSDP2); 0 where it holds none."""
    local = local_part(grad)
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=local.device)
    return torch.linalg.vector_norm(local.detach().float(), ord=math.inf)


_GRAD = attrgetter("grad")
_PARAM = attrgetter("param")
_VERSION = attrgetter("_version")
_CDATA = attrgetter("_cdata")
_ACCUMULATED = attrgetter("accumulated")


def _never(_: object = None) -> bool:
    return False


_swap_mode = getattr(torch.__future__, "get_swap_module_params_on_conversion", _never)
try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _wrapper_subclass
except ImportError:  # pragma: no cover - other torch versions
    _wrapper_subclass = _never


def _rewire_hooks(param: torch.Tensor) -> None:
    """Reconnect a swapped parameter's tensor hooks (trainwatch's and the user's).

    ``torch.utils.swap_tensors`` (``module.to()`` in swap mode) keeps a
    tensor's Python tables of hooks but not the autograd hooks that call
    them: after the swap no hook of that parameter fires. Assigning each
    table back to the tensor wires it to autograd again; every handle stays valid.
    """
    hooks = param._backward_hooks
    if hooks is not None:
        param._backward_hooks = hooks
    after = getattr(param, "_post_accumulate_grad_hooks", None)
    if after is not None:
        param._post_accumulate_grad_hooks = after


class _ParamState:
    """One parameter, and the gradient tensor the last step used, recognised later.

    That gradient is kept as a weak reference, which is exact; but PyTorch
    refuses to swap a tensor that has one (``torch.utils.swap_tensors``:
    ``module.to()`` in swap mode, and wrapper subclasses such as DTensor
    always), so those are recognised by their id and their C++ tensor
    instead (``grad_key``). Only a gradient set to ``None`` and then replaced
    by hand with a new one that lands at both of the old addresses could pass
    for the old one.
    """

    __slots__ = (
        "param",
        "impl",
        "armed",
        "reset",
        "accumulated",
        "grad_ref",
        "grad_key",
        "version",
        "content",
        "seen",
        "end_version",
        "start_version",
        "added",
        "perturbed",
    )

    def __init__(self, param: torch.Tensor) -> None:
        # Held strongly (the monitor's layer map holds it too): a weak
        # reference would stop module.to() from swapping it.
        self.param = param
        self.impl = param._cdata  # changes only when the parameter is swapped
        self.seen = False  # backward reached it since the last step boundary
        self.end_version = -1  # its gradient's version when that backward ended
        self.armed = False
        self.reset = False
        self.accumulated = False
        self.grad_ref: weakref.ref[torch.Tensor] | None = None
        self.grad_key: tuple[int, int] | None = None
        self.version = -1
        self.content: torch.Tensor | None = None
        # A stale gradient's version as a backward began, and whether a backward
        # since wrote into it (torch.autograd.grad reaches the model and writes
        # nothing: its gradients are the loop's to assign).
        self.start_version = -1
        self.added = False
        # Armed as a backward began, not by a step: the previous backward's gradient,
        # its weight moved since (SAM's perturbation; see MovedBetweenBackwards).
        self.perturbed = False


# Written out in each loop over the parameters instead of called (a call per
# parameter per step is what the loops exist to avoid):
#   same = grad is not None and (
#       (state.grad_ref is not None and state.grad_ref() is grad)
#       or (state.grad_key is not None and state.grad_key == (id(grad), grad._cdata)))


class _Probe:
    """What a later call of the step's backward hooks asks before the look at what a
    backward cancels (see ``GradResetTracker._cancel_probe``): a stand-in with a
    fixed ``grad``."""

    __slots__ = ("grad",)

    def __init__(self, grad: object) -> None:
        self.grad = grad


_NO_PROBE = _Probe(None)  # the look is not looked for (off, settled, or no parameter to ask)
_LOOKING = _Probe(True)  # the look runs: every later backward goes to it

# No weight moved since the previous backward (see MovedBetweenBackwards).
_NONE_MOVED: frozenset[int] = frozenset()

# ``left`` after a step boundary while zero_grad() between backward passes is
# looked for: nothing noted (as None), but the boundary's checks still run.
_NOTHING_LEFT: dict[int, tuple[int, int]] = {}


class _Gone:
    pass


# A weak reference whose object is gone: what a snapshot holds for a parameter
# that had no gradient when it was taken (no gradient of it can be that one).
_NO_GRADIENT = weakref.ref(_Gone())

# What backward reached since the last step boundary, in a loop without an
# optimizer: nothing yet (arm's snapshot taken, the states' notes not written).
_NOTHING_REACHED = ()


class _VersionsBeforeClip(list):
    """A snapshot's versions taken where backward ended (``trainwatch run`` without an
    optimizer): the loop may still clip the gradients in place before it uses
    them, so a gradient written in place since is not taken for reset."""


def _all_reset(snapshot: tuple[Sequence[torch.Tensor], list, list[int]]) -> bool:
    """Every gradient of the snapshot was reset (set to None, replaced or zeroed in
    place), told in C loops; False where any may not have been."""
    params, refs, versions = snapshot
    now = list(map(_GRAD, params))
    if all(map(is_, now, repeat(None))):
        return True  # zero_grad(), set_to_none
    if any(map(is_, now, repeat(None))):
        return False  # some set to None, some not: one by one
    if not any(map(is_, map(weakref.ref.__call__, refs), now)):
        return True  # every one a new tensor
    if type(versions) is _VersionsBeforeClip:
        return False  # written in place: perhaps only clipped
    return not any(map(eq, map(_VERSION, now), versions))  # zeroed in place


def _added_in_place(snapshot: tuple[Sequence[torch.Tensor], list, list[int]]) -> bool:
    """Some gradient of the snapshot is the same tensor, written since (in C loops)."""
    params, refs, versions = snapshot
    now = list(map(_GRAD, params))
    held = map(is_not, now, repeat(None))
    same = list(map(and_, held, map(is_, map(weakref.ref.__call__, refs), now)))
    return any(map(ne, map(_VERSION, compress(now, same)), compress(versions, same)))


def _arm_state(state: _ParamState, grad: torch.Tensor | None, swap: bool) -> None:
    """One parameter's state armed on the gradient a step just used (or on none):
    what a later backward finds is judged against it."""
    state.seen = state.reset = state.accumulated = state.added = False
    state.perturbed = False
    state.content = None
    if grad is None:
        state.armed = False
        state.grad_ref = state.grad_key = None
        return
    state.armed = True
    state.version = grad._version
    if swap or (type(grad) is not torch.Tensor and _wrapper_subclass(grad)):
        state.grad_ref, state.grad_key = None, (id(grad), grad._cdata)
    else:
        state.grad_ref, state.grad_key = weakref.ref(grad), None


def _state_added(state: _ParamState) -> bool:
    """The gradient the last step used is still there, written since."""
    grad = state.param.grad
    if not state.armed or grad is None:
        return False
    same = (state.grad_ref is not None and state.grad_ref() is grad) or (
        state.grad_key is not None and state.grad_key == (id(grad), grad._cdata)
    )
    return same and grad._version != state.version


class _ClosureStep:
    """An optimizer step with a closure in progress, and where the weights stood when
    its latest backward ended (None: no backward of it has ended yet)."""

    __slots__ = ("params", "whole", "taken", "weights")

    def __init__(self, params: Sequence[torch.Tensor], whole: bool) -> None:
        self.params = params
        self.whole = whole
        self.taken = PROCESS_STEPS.taken  # moves at the step's end
        self.weights: list[int] | None = None

    def live(self) -> bool:
        """The step has not ended (no step boundary since it began)."""
        return self.taken == PROCESS_STEPS.taken

    def same_evaluation(self, accumulated: bool) -> bool:
        """A backward that begins with the weights where the previous one of this step
        left them belongs to the same evaluation of the closure (micro-batches summed
        into one gradient): by design onto the previous one's gradients. Not once an
        accumulation was found: the stale gradients stay followed to the boundary."""
        return (
            self.weights is not None
            and not accumulated
            and self.live()
            and list(map(_VERSION, self.params)) == self.weights
        )


class GradResetTracker:
    def __init__(
        self, on_error: Callable[[str, BaseException], None], check_resets: bool = True
    ) -> None:
        # False: only what backward reached is followed (no stale-gradient check).
        self.check_resets = check_resets
        self._states: dict[int, _ParamState] = {}
        self._on_error = on_error
        self.enabled = True
        # Set by any backward that reached the model; the monitor uses it to
        # attribute a loss to the step that is being built rather than the one
        # just finished.
        self.backward_seen = False
        self._in_backward = False
        # Stale gradients this backward is adding to (none in a healthy step).
        self._stale: list[_ParamState] = []
        # Some parameter's gradient was accumulated onto since the last arm.
        self._any_accumulated = False
        # The last step's gradients as one snapshot (parameters, weak refs,
        # versions), taken in C loops instead of per-parameter writes; it is
        # written into the states only when the next backward finds one of them
        # not reset. ``_snapshot_reset``: that backward found them all reset.
        self._snapshot: tuple[Sequence[torch.Tensor], list, list[int]] | None = None
        self._snapshot_reset = False
        # The hook table of this step's output whose hook waits for a backward
        # (a weak reference: a dropped output frees its graph, and the table).
        self._hooked_output: weakref.ref[OrderedDict[int, Any]] | None = None
        self._impls: list[int] | None = None  # the parameters' C++ tensors at the last arm
        # The same for loops without an optimizer (``track_reached``), and what
        # backward reached since their last step boundary, kept as taken in C
        # loops while the states' own notes (``seen``, ``end_version``) wait:
        # _NOTHING_REACHED, or the parameters, whether each held a gradient as the
        # backward ended and its version; None: the states' notes are written.
        self._reach_impls: list[int] | None = None
        self._reach: tuple = _NOTHING_REACHED
        # Armed where backward ended (trainwatch run's hand-written updates): the
        # loop may still clip the gradients in place before it uses them, so a
        # moved version counter alone does not say they were reset.
        self._writes_may_follow = False
        # What each backward reached matters only to loops without an optimizer.
        self.track_reached = True
        # What the latest backward since the step left in the gradients: by the
        # parameter's id, its gradient's id and version as that backward ended
        # (None: not noted, as on the usual step; see note_left).
        self.left: dict[int, tuple[int, int]] | None = None
        self._fallback: RemovableHandle | None = None
        # One of each hook object, reused every pass.
        self._starts = WeakHook(self, "backward_starts")
        self._ends = WeakHook(self, "backward_ends")
        # On the outputs of passes made after a step's first backward found its
        # gradients reset (an accumulation loop's later micro-batches).
        self._later_starts = WeakHook(self, "later_backward_starts")
        # The model's passes, where zero_grad() between the backward passes of a
        # step is looked for (None: not looked for), and that look once started
        # (by a second backward pass of a step: see BetweenBackwards).
        self.follow_wipes: Any = None
        self.wipes: BetweenBackwards | None = None
        # A look that went idle (its second backward passes wrote none of an
        # optimizer's micro-batches: a GAN's discriminator backward reaching the
        # generator) starts again no sooner than this process step, each rest
        # twice as long as the one before.
        self._wipes_resume_at = 0
        self._wipes_rests = 0
        self._wipes_listener: RemovableHandle | None = None
        # Told when a backward through the model has ended (``on_backward_end``);
        # an OrderedDict, which RemovableHandle can refer to weakly.
        self._end_listeners: OrderedDict[int, Callable[[], None]] = OrderedDict()
        # The optimizer step with a closure in progress (None: none), and the
        # listener that arms its parameters at each of its backward passes' end.
        self._closure: _ClosureStep | None = None
        self._closure_listener: RemovableHandle | None = None
        # That step's accumulation was found between two of its own evaluations
        # (onto gradients the step itself had used, not the previous step).
        self.closure_evaluations_accumulated = False
        # Where a backward cancels the gradients an earlier one left while another
        # optimizer stepped (a GAN's generator fed the discriminator's loss through an
        # output not detached; see OtherBackwardLook): the model's optimizers (set by
        # the step pipeline), whether the look may still start (False once it settled),
        # the look once started, and its hooks.
        self.cancel_optimizers: Sequence[Any] = ()
        self.follow_cancels = False
        self.cancels: OtherBackwardLook | None = None
        self._cancels_hooks: list[RemovableHandle] = []
        # Asked by a later call of the hooks in a step whose first backward found its
        # gradients reset: its ``grad`` is None where that call cannot begin a later
        # backward. The usual step's second call is the fallback parameter's hook in
        # the same backward, before that parameter's gradient accumulates (None
        # after zero_grad()); a later backward finds the first one's gradient there.
        # A parameter or a stand-in (``_NO_PROBE``, ``_LOOKING``): one attribute
        # read, no call, on the usual step.
        self._fallback_param: torch.Tensor | None = None
        self._cancel_probe: Any = _NO_PROBE
        # The gradients each backward looked at one parameter at a time left, against
        # the weights' moves before the next (SAM's perturbation), and the states
        # that backward armed for it (see _arm_perturbed).
        self._moves = MovedBetweenBackwards()
        self._perturbed: list[_ParamState] = []
        # The model's passes (ModelPasses), told when this tracker's pass_ends changes.
        self._passes: weakref.ref[Any] | None = None
        # While learning which output backward reaches first, every output of a pass
        # is hooked; the one the usual pass_ends would have hooked is noted, by the
        # pass's module id and the output's place among its floating tensors.
        self._learning = False
        self._usual_key: tuple[int, int] | None = None
        # Per module id, the hook table waiting for a backward, and the process
        # step those waits began in (a pass a step later gets hooks anew).
        self._learning_waits: dict[int, weakref.ref[OrderedDict[int, Any]]] = {}
        self._learning_taken = -1
        self._reach_hooks: dict[tuple[int, int], WeakHook] = {}
        # The output to hook where it is not the usual one: (module id, place).
        self._target = (0, 0)
        self._learn()

    # -- lifecycle -------------------------------------------------------
    def attach(self, params: Iterable[torch.Tensor]) -> None:
        # Frozen parameters too: one frozen when watching began (a GAN's
        # discriminator while Lightning's toggle_optimizer trains the generator,
        # a backbone unfrozen later) trains once unfrozen, and must be armed then.
        for param in params:
            if id(param) not in self._states:
                self._states[id(param)] = _ParamState(param)
        if self._fallback is None and self._states:
            # One tensor hook on one parameter, for backward passes that do not
            # come through a pass the hooks see (a model compiled in place): the
            # last parameter's gradient (the head's) is usually made first. A
            # lazy module's parameter, or a frozen one, takes no hook.
            last = next(
                (
                    s.param
                    for s in reversed(self._states.values())
                    if s.param.requires_grad and not is_lazy(s.param)
                ),
                None,
            )
            if last is not None:
                self._fallback = last.register_hook(self._starts)
                self._fallback_param = last
                self._reprobe()

    def detach(self) -> None:
        self.stop_following()
        self.stop_cancels()
        self.__dict__.pop("pass_ends", None)  # a method of its own: no cycle stays
        if self._fallback is not None:
            self._fallback.remove()
            self._fallback = None
        self._fallback_param = None
        self._states.clear()
        self._reach = _NOTHING_REACHED  # lets the parameters go
        self._reach_impls = None

    def fail(self, exc: BaseException) -> None:
        self.enabled = False
        self._on_error("accumulation tracker", exc)

    def watch_passes(self, passes: Any) -> None:
        """Take the model's passes (ModelPasses) from now on."""
        self._passes = weakref.ref(passes)
        passes.subscribe("accumulation tracker", self, starts=False)

    def _use_pass_ends(self, method: Callable[..., None] | None) -> None:
        """Passes go to ``method`` from now on (None: the usual ``pass_ends``): a
        method swapped in, not a test at every pass."""
        if method is None:
            self.__dict__.pop("pass_ends", None)
        else:
            self.pass_ends = method  # type: ignore[method-assign]
        passes = self._passes() if self._passes is not None else None
        if passes is not None:
            passes.redispatch()

    # -- the model's passes (ModelPasses) ----------------------------------
    def pass_starts(self, module: object) -> None:
        return None

    def pass_ends(self, module: object, args: object, kwargs: object, output: object) -> None:
        """One tensor hook on the pass's output: backward reaching the model starts there.

        One waiting hook is enough until a backward starts: passes summed into one
        loss (a policy's batch-of-one passes) reach the parameters' accumulation
        only once every path has, so the first pass's hook still fires before
        any of them accumulates. An output dropped unused (an action chosen with
        grad on) leaves no waiting hook, and the next pass's output gets one.
        Once this step's gradients were all found reset, later backward passes
        of the step are accumulation by design, with a hook only to see whether
        each began on the previous one's gradients wiped (``_hook_later_pass``).
        """
        if not self.enabled or self._snapshot_reset or not torch.is_grad_enabled():
            if self._snapshot_reset and self.follow_wipes is not None:
                self._hook_later_pass(output)
            return
        hooked = self._hooked_output
        if hooked is not None and hooked() is not None:
            return
        for tensor in floating_list(output):
            if tensor.requires_grad and tensor.grad_fn is not None:
                # A tensor hook, though a pre-hook on the output's autograd node
                # would be cheaper to register: on torch 2.13 each node pre-hook
                # leaves about 8 bytes behind for good (traced over 2,000 passes).
                placed = hook_pass_tensor(tensor, self._starts)
                self._hooked_output = placed[0] if placed is not None else None
                return

    def _targeted_pass_ends(
        self, module: object, args: object, kwargs: object, output: object
    ) -> None:
        """``pass_ends`` where backward was seen to reach first an output other than
        the usual one (the first floating output of the first pass): that one.

        Passes of other modules (an actor's, where backward reaches the
        critic's first) get no hook; the learned output comes first, then the
        others as usual where it takes no gradient in this pass.
        """
        if not self.enabled or self._snapshot_reset or not torch.is_grad_enabled():
            if self._snapshot_reset and self.follow_wipes is not None:
                self._hook_later_pass(output, module)
            return
        if id(module) != self._target[0]:
            return
        hooked = self._hooked_output
        if hooked is not None and hooked() is not None:
            return
        tensors = floating_list(output)
        place = self._target[1]
        for tensor in tensors[place : place + 1] + tensors:
            if tensor.requires_grad and tensor.grad_fn is not None:
                placed = hook_pass_tensor(tensor, self._starts)
                self._hooked_output = placed[0] if placed is not None else None
                return

    def _learning_pass_ends(
        self, module: object, args: object, kwargs: object, output: object
    ) -> None:
        """``pass_ends`` while learning which output backward reaches first: every
        floating output of a module's pass gets a hook (one pass per module waits
        at a time, as the usual hook does), and the one ``pass_ends`` would have
        hooked is noted."""
        if not self.enabled or self._snapshot_reset or not torch.is_grad_enabled():
            if self._snapshot_reset and self.follow_wipes is not None:
                self._hook_later_pass(output)
            return
        waits = self._learning_waits
        if self._learning_taken != PROCESS_STEPS.taken:
            waits.clear()  # a new step: its passes are hooked anew
            self._learning_taken = PROCESS_STEPS.taken
        key = id(module)
        waiting = waits.get(key)
        if waiting is not None and waiting() is not None:
            return
        hooked = self._hooked_output
        usual = hooked is None or hooked() is None
        for place, tensor in enumerate(floating_list(output)):
            if tensor.requires_grad and tensor.grad_fn is not None:
                placed = hook_pass_tensor(tensor, self._reach_hook(key, place))
                table = placed[0] if placed is not None else None
                if table is not None and waits.get(key) is None:
                    waits[key] = table
                if usual:
                    self._hooked_output = table
                    self._usual_key = (key, place)
                    usual = False

    def _reach_hook(self, module: int, place: int) -> WeakHook:
        """The hook telling that backward reached output ``place`` of ``module``'s pass
        (one object per output, reused)."""
        hook = self._reach_hooks.get((module, place))
        if hook is None:
            hook = self._reach_hooks[(module, place)] = WeakHook(
                self, "output_reached", module, place
            )
        return hook

    def output_reached(self, module: int, place: int, grad: torch.Tensor | None = None) -> None:
        """Backward reached an output hooked while learning: the first one reached
        is the one hooked from now on; then the look as from any output."""
        if self._learning:
            self._learned((module, place))
        getattr(self, self._starts.method)(grad)  # as the usual hook: following too

    def _learn(self) -> None:
        """Hook every output of the passes until backward shows which it reaches first."""
        self._learning = True
        self._usual_key = None
        self._learning_waits.clear()
        self._use_pass_ends(self._learning_pass_ends)

    def _learned(self, key: tuple[int, int]) -> None:
        self._learning = False
        self._learning_waits.clear()
        if key == self._usual_key:
            self._use_pass_ends(None)
        else:
            self._target = key
            self._use_pass_ends(self._targeted_pass_ends)

    def _hook_later_pass(self, output: object, module: object = None) -> None:
        """A pass after the step's first backward (its gradients found reset): its
        backward is looked at as it begins, where zero_grad() between the backward
        passes is looked for. One hook per such pass, as on the step's first (on
        the learned output, where backward reaches another than the first)."""
        if not self.enabled or self.track_reached or not torch.is_grad_enabled():
            return
        if PROCESS_STEPS.taken < self._wipes_resume_at:
            return  # resting
        tensors = floating_list(output)
        if id(module) == self._target[0]:
            tensors = tensors[self._target[1] :] + tensors
        for tensor in tensors:
            if tensor.requires_grad and tensor.grad_fn is not None:
                hook_pass_tensor(tensor, self._later_starts)
                return

    # -- backward ----------------------------------------------------------
    def backward_starts(self, grad: torch.Tensor | None = None) -> None:
        """Before any parameter of the model accumulates: were last step's gradients reset?

        Once per backward pass (the first output hook to fire), one loop over
        the parameters in one call instead of a hook per parameter; the
        gradients' content is read only for suspects, in one batched kernel.
        """
        if not self.enabled:
            return
        self.backward_seen = True
        PROCESS_STEPS.backwards += 1
        self._hooked_output = None  # the next pass's output gets the hook
        if self._in_backward:
            return  # a second output of the same backward: parameters may have moved
        snapshot = self._snapshot
        # Asked without the stale-gradient check too: gradients found reset leave
        # backward's end nothing to note (see note_left).
        if snapshot is not None:
            if self._snapshot_reset:
                # A later call of the step's hooks (nothing stale: the first found
                # its gradients reset): it comes back here as cheaply (its pass's
                # hook has had its look), but for the look at what a later backward
                # adds onto (see OtherBackwardLook and _cancel_probe).
                if self._cancel_probe.grad is not None:
                    self._look_for_cancels(True)
                if self._end_listeners or self.track_reached:
                    self._in_backward = True
                    Variable._execution_engine.queue_callback(self._ends)
                return
            if _all_reset(snapshot):
                self._snapshot_reset = True  # later backward passes of the step too
                self._stale = []
                if self._end_listeners or self.track_reached:
                    self._in_backward = True
                    Variable._execution_engine.queue_callback(self._ends)
                # Else backward's end has nothing to note: no callback (one more
                # call into Python at every backward). A hook firing again in this
                # backward comes back here, as cheaply.
                return
        self._in_backward = True
        Variable._execution_engine.queue_callback(self._ends)
        left = self.left
        if (
            left is not None
            and left is not _NOTHING_LEFT
            and self.wipes is None
            and self.follow_wipes is not None
        ):
            # A second backward since the step, its first noted (the first steps,
            # several optimizers): looked at from here on.
            self._start_following(left)
        if self.follow_cancels:
            self._look_for_cancels(left is not None and left is not _NOTHING_LEFT)
        if not self.check_resets:
            return
        closure = self._closure
        if closure is not None and closure.same_evaluation(self._any_accumulated):
            self._stale = []
            return
        if snapshot is not None:
            if self.track_reached:
                self._write_reach()
            self._unpack_snapshot()
        moved = _NONE_MOVED
        first = PROCESS_STEPS.taken == self._moves.first_taken
        if not self.track_reached and (first or self._moves.noted is not None):
            # The first step (SAM's first pass), or after a backward that added onto
            # used gradients: what moved since the previous backward (an optimizer's
            # loop: each backward's end is noted).
            since = self._moves.starts(list(map(_PARAM, self._states.values())), first)
            if closure is None:  # a closure step's evaluations are looked at as such
                if since.kept:
                    self._arm_perturbed(since.kept)
                moved = since.moved
        suspects: list[_ParamState] = []
        stale: list[_ParamState] = []
        self._stale = stale
        for state in self._states.values():
            if not state.armed or state.reset:
                continue
            grad = state.param.grad
            same = grad is not None and (
                (state.grad_ref is not None and state.grad_ref() is grad)
                or (state.grad_key is not None and state.grad_key == (id(grad), grad._cdata))
            )
            if not same or (grad._version != state.version and not self._writes_may_follow):
                if moved and state.added and id(state.param) in moved:
                    # Added onto after a step used it, then reset, its weight moved in
                    # between: the stale sum moved the weights before this reset (SAM's
                    # perturbation made from it), used as a step would have used it;
                    # told at the step, as if still there.
                    continue
                state.reset = True
                state.content = None
                continue
            # Unchanged since the step, or (armed at backward's end, before the
            # loop's clip) written in place since: zeroed or only rescaled, its
            # content, read below, tells.
            stale.append(state)
            state.start_version = grad._version
            if not state.accumulated:
                state.accumulated = True
                self._any_accumulated = True
                if grad.layout == torch.strided and grad.numel() > 0:
                    suspects.append(state)
        if suspects:
            grads = [state.param.grad.detach() for state in suspects]
            for state, norm in zip(suspects, _max_abs(grads)):
                state.content = norm

    def later_backward_starts(self, grad: torch.Tensor | None = None) -> None:
        """A backward reaching a pass made after the step's first backward: a second
        backward pass of the step. From here on each backward is looked at (see
        BetweenBackwards); this one's predecessor was not, so it says nothing yet."""
        if (
            self.enabled
            and self.wipes is None
            and self.follow_wipes is not None
            and not self.track_reached
            and not self._in_backward
        ):
            self._start_following(None)
        self.backward_starts(grad)

    def following_starts(self, grad: torch.Tensor | None = None) -> None:
        """``backward_starts`` while zero_grad() between backward passes is looked
        for: first the look, before any gradient of this backward accumulates."""
        look = self.wipes
        if self.enabled and not self._in_backward and look is not None:
            try:
                look.starts()
            except Exception as exc:
                self.stop_following()
                self._on_error("reset between backwards", exc)
        self.backward_starts(grad)

    def _start_following(self, seed: dict[int, tuple[int, int]] | None) -> None:
        """Each backward is looked at as it begins and ends, until stop_following,
        from this one, a later backward of its run; ``seed``: what the one before
        it left, where noted (None: it says nothing)."""
        if PROCESS_STEPS.taken < self._wipes_resume_at:
            return  # resting after an idle look
        try:
            look = self.wipes = BetweenBackwards(self._states, self.follow_wipes, seed)
            self._starts.method = "following_starts"
            self._later_starts.method = "following_starts"
            self._wipes_listener = self.on_backward_end(self._wipes_backward_ended)
            self.follow_wipes.subscribe("reset between backwards", look, starts=False)
            self.arm = self._arm_following  # type: ignore[method-assign]
            look.starts()
        except Exception as exc:
            self.stop_following()
            self.follow_wipes = None
            self._on_error("reset between backwards", exc)

    def _arm_following(
        self, params: Sequence[torch.Tensor], whole: bool = False, writes_may_follow: bool = False
    ) -> None:
        """``arm``, leaving a note of nothing where it forgets the latest backward's:
        the step boundary of another optimizer stepping after the same backward
        passes (a backbone's and a head's) still judges them."""
        GradResetTracker.arm(self, params, whole, writes_may_follow)
        self.left = _NOTHING_LEFT

    def rest_following(self, steps: int) -> None:
        """Stop an idle look, and start none for ``steps`` process steps, then for
        twice as many after each later rest: a loop whose steps keep bringing a
        second backward that is no micro-batch pays for the look O(log steps) times."""
        self.stop_following()
        self._wipes_resume_at = PROCESS_STEPS.taken + steps * (1 << min(self._wipes_rests, 20))
        self._wipes_rests += 1

    def stop_following(self) -> None:
        """Back to the usual hooks; the look's next start begins afresh."""
        look, self.wipes = self.wipes, None
        if look is None:
            return
        self._starts.method = "backward_starts"
        self._later_starts.method = "later_backward_starts"
        self.__dict__.pop("arm", None)
        if self.left is _NOTHING_LEFT and self.cancels is None:
            self.left = None
        if self._wipes_listener is not None:
            self._wipes_listener.remove()
            self._wipes_listener = None
        if self.follow_wipes is not None and self.follow_wipes.listens(look):
            self.follow_wipes.unsubscribe(look)
        look.close()

    def _wipes_backward_ended(self) -> None:
        """What this backward left, for the next backward's look."""
        look = self.wipes
        if look is None or not self.enabled:
            return
        try:
            if self._snapshot_reset or not self.left:
                self.note_left()  # not noted by backward_ends on this path
            look.ended(self.left)  # type: ignore[arg-type]
        except Exception as exc:
            self.stop_following()
            self._on_error("reset between backwards", exc)

    # -- a backward cancelling what an earlier one left ------------------------
    def _look_for_cancels(self, later: bool) -> None:
        """A backward begins: the look sees it before it adds anything; where none
        runs yet, a later backward since the model's last step (``later``) starts it."""
        look = self.cancels
        if look is None:
            if later:
                self.start_cancels()
            return
        try:
            look.starts()
        except Exception as exc:
            self.cancels_failed(exc)

    def look_for_cancels(self, optimizers: Sequence[Any]) -> None:
        """The look may start from now on, judged at ``optimizers``' steps (the model's)."""
        self.cancel_optimizers = optimizers
        self.follow_cancels = True
        self._reprobe()

    def _reprobe(self) -> None:
        if not self.follow_cancels:
            self._cancel_probe = _NO_PROBE
        elif self.cancels is not None:
            self._cancel_probe = _LOOKING
        else:
            param = self._fallback_param
            self._cancel_probe = param if param is not None else _NO_PROBE

    def start_cancels(self) -> None:
        """Look at each backward and each optimizer step of the process from now on,
        until the look settles (``stop_cancels``). Not without an optimizer of the
        model: its steps are where the look judges."""
        if self.cancels is not None or not self.follow_cancels or not self.enabled:
            return
        if not self.cancel_optimizers or self.track_reached:
            return
        try:
            self.cancels = OtherBackwardLook(self._states, self.cancel_optimizers)
            self._cancels_hooks = [
                self.on_backward_end(self._cancels_backward_ended),
                register_optimizer_step_post_hook(WeakHook(self, "cancels_optimizer_stepped")),
            ]
            self._reprobe()
            if self.left is None:
                self.left = _NOTHING_LEFT  # the model's next step gathers with the look
        except Exception as exc:
            self.cancels_failed(exc)

    def start_cancels_if_left_aside(self, params: Sequence[torch.Tensor]) -> None:
        """An optimizer of the model is about to step ``params`` while the latest
        backward left gradients on parameters it does not hold (another optimizer's,
        in a model with several): those may be added onto before their own step."""
        left = self.left
        if left and not set(left).issubset(map(id, params)):
            self.start_cancels()

    def cancels_optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Any optimizer of the process stepped (a global post-step hook, after the
        optimizer's own: the model's step has armed its gradients)."""
        look = self.cancels
        if look is None or not self.enabled:
            return
        try:
            look.stepped(optimizer)
        except Exception as exc:
            self.cancels_failed(exc)
            return
        if self.left is None:
            self.left = _NOTHING_LEFT  # the model's next step gathers with the look

    def _cancels_backward_ended(self) -> None:
        look = self.cancels
        if look is None or not self.enabled:
            return
        try:
            look.ended()
        except Exception as exc:
            self.cancels_failed(exc)

    def stop_cancels(self) -> None:
        """The look stops for good (settled, told, or failed)."""
        self.follow_cancels = False
        look, self.cancels = self.cancels, None
        self._reprobe()
        hooks, self._cancels_hooks = self._cancels_hooks, []
        for handle in hooks:
            handle.remove()
        if look is not None and self.left is _NOTHING_LEFT and self.wipes is None:
            self.left = None

    def cancels_failed(self, exc: BaseException) -> None:
        self.stop_cancels()
        self._on_error("other optimizer's backward", exc)

    def on_backward_end(self, callback: Callable[[], None]) -> RemovableHandle:
        """Call ``callback`` when each backward that reached the model has ended, every
        gradient of it in place (after this tracker's own notes of it)."""
        handle = RemovableHandle(self._end_listeners)
        self._end_listeners[handle.id] = callback
        return handle

    def backward_ends(self) -> None:
        """The versions this backward's accumulations left on stale gradients, and (for
        loops without an optimizer) what it reached; then the listeners."""
        try:
            self._in_backward = False
            if not self.enabled:
                return
            added = False
            for state in self._stale:
                grad = state.param.grad
                if grad is not None and (
                    (state.grad_ref is not None and state.grad_ref() is grad)
                    or (state.grad_key is not None and state.grad_key == (id(grad), grad._cdata))
                ):
                    if grad._version != state.start_version:
                        state.added = added = True  # this backward added onto the stale values
                    state.version = grad._version  # the next backward compares with this
            if not self.track_reached:
                if not self._snapshot_reset:
                    self.note_left()
                    # After the first step, only a backward that added onto used
                    # gradients with one optimizer over the whole model (arm's snapshot
                    # path set _impls): a GAN's generator backward adds onto the
                    # discriminator's by design at every step, and pays nothing here.
                    first = PROCESS_STEPS.taken == self._moves.first_taken
                    if self.check_resets and (first or (added and self._impls is not None)):
                        params = list(map(_PARAM, self._states.values()))
                        self._moves.ended(params, self.left, first)
                        if self._perturbed:
                            self._perturbed_ended()
                return
            if self._snapshot_reset and self._reach is _NOTHING_REACHED:
                # The usual step's only backward, its gradients all found reset as it
                # began: what it reached is every gradient held now, noted in C loops.
                params = list(map(_PARAM, self._states.values()))
                grads = list(map(_GRAD, params))
                self._reach = (
                    params,
                    list(map(is_not, grads, repeat(None))),
                    list(map(getattr, grads, repeat("_version"), repeat(-1))),
                )
                return
            self._write_reach()
            stale = {id(state) for state in self._stale}
            for state in self._states.values():
                grad = state.param.grad
                if grad is None:
                    continue
                # (Found all reset as the step's first backward began: none untouched.)
                if state.armed and not state.reset and not self._snapshot_reset:
                    same = (state.grad_ref is not None and state.grad_ref() is grad) or (
                        state.grad_key is not None and state.grad_key == (id(grad), grad._cdata)
                    )
                    if same and grad._version == state.version and id(state) not in stale:
                        continue  # untouched since the step used it
                state.seen = True
                state.end_version = grad._version
        finally:
            if self._end_listeners:
                for callback in list(self._end_listeners.values()):
                    callback()  # each guards itself; a halt passes through

    # -- optimizer steps with a closure ----------------------------------
    def closure_step_begins(self, params: Sequence[torch.Tensor], whole: bool) -> None:
        """An optimizer step with a closure (LBFGS) begins: it evaluates the closure,
        moves the weights and evaluates it again, all inside ``step()``.

        Each evaluation uses the gradients its backward made, which the next
        one must find reset: a backward that begins on gradients the previous
        evaluation left, with the weights moved since, adds onto gradients
        already used (``zero_grad()`` missing from the closure). So each
        backward of this step arms ``params`` as it ends, as a step boundary
        does; the step boundary after ``step()`` reads what was found. Paid by
        closure steps only, one arm per backward.
        """
        self.closure_evaluations_accumulated = False
        if not self.enabled or not self.check_resets:
            return
        self._closure = _ClosureStep(params, whole)
        if self._closure_listener is None:
            self._closure_listener = self.on_backward_end(self._closure_backward_ended)

    def _closure_backward_ended(self) -> None:
        """A backward ended: inside the closure step, its gradients are armed as used
        (the next evaluation must find them reset); once the step is over, or once
        its accumulation was found (the step boundary reads it), the listener goes."""
        closure = self._closure
        if closure is None or not closure.live() or self._any_accumulated:
            # Found after one of the step's own arms: between two evaluations.
            self.closure_evaluations_accumulated = (
                closure is not None and closure.live() and closure.weights is not None
            )
            self.closure_step_over()
            return
        # The arm is no step boundary: the loss stays this step's, and what this
        # backward left stays noted for the step (a gradient the loop drops after it).
        seen, left = self.backward_seen, self.left
        self.arm(closure.params, whole=closure.whole)
        self.backward_seen, self.left = seen, left
        closure.weights = list(map(_VERSION, closure.params))

    def closure_step_over(self) -> None:
        """No closure step in progress any more."""
        self._closure = None
        if self._closure_listener is not None:
            self._closure_listener.remove()
            self._closure_listener = None

    def _arm_perturbed(self, kept: Sequence[int]) -> None:
        """The previous backward's gradients, left as it left them while every weight
        they belong to moved in place (SAM's perturbation made from them), armed as a
        step's would be: this backward adding onto them is told at the step that
        applies the sum. Those a step armed and no reset reached stay as they are."""
        states = self._states
        swap = _swap_mode()
        armed = []
        for pid in kept:
            state = states.get(pid)
            grad = state.param.grad if state is not None else None
            if grad is None or (state.armed and not state.reset):
                continue
            state.armed = state.perturbed = True
            state.reset = state.accumulated = state.added = False
            state.content = None
            state.version = grad._version
            if swap or (type(grad) is not torch.Tensor and _wrapper_subclass(grad)):
                state.grad_ref, state.grad_key = None, (id(grad), grad._cdata)
            else:
                state.grad_ref, state.grad_key = weakref.ref(grad), None
            armed.append(state)
        self._perturbed = armed

    def _perturbed_ended(self) -> None:
        """The backward that began on gradients armed by ``_arm_perturbed`` ended: where
        it wrote none of them (``torch.autograd.grad``, first-order MAML adapting the
        weights in place), they were no step's and are followed no more."""
        armed, self._perturbed = self._perturbed, []
        if any(state.added for state in armed):
            return
        for state in armed:
            state.armed = state.perturbed = state.accumulated = False
            state.content = None
            state.grad_ref = state.grad_key = None
        self._any_accumulated = any(map(_ACCUMULATED, self._states.values()))

    def perturbed(self, param: torch.Tensor) -> bool:
        """The gradients backward added onto at ``param`` were used by moving the
        weights between two backward passes, not by a step (see _arm_perturbed)."""
        state = self._states.get(id(param))
        return state is not None and state.perturbed

    def note_left(self) -> None:
        """Which gradients this backward left, each tensor's id and version, in C loops.

        Only where the gradients were not all found reset as it began (the first
        step, a step whose gradients the loop did not reset in the usual place,
        several optimizers): the usual step notes nothing. The step boundary
        compares them with what it finds (``rewritten_since_backward``). Noted
        again after a clip whose step was gathered before it, so that the step
        compares with the clipped gradients.
        """
        params = list(map(_PARAM, self._states.values()))
        grads = list(map(_GRAD, params))
        held = list(map(is_not, grads, repeat(None)))
        kept = list(compress(grads, held))
        self.left = dict(
            zip(compress(map(id, params), held), zip(map(id, kept), map(_VERSION, kept)))
        )

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter followed, in the order attached (C loops)."""
        return list(map(_PARAM, self._states.values()))

    def note_asked(self) -> None:
        """As a backward ends, for a look that asks for a while (collect.dropped_gradients,
        through ``on_backward_end``): what it left, noted on the usual step too."""
        if self.enabled and not self.track_reached:
            self.note_left()

    # -- step boundary ---------------------------------------------------
    def rewritten_since_backward(self, params: Sequence[torch.Tensor]) -> bool:
        """The latest backward left gradients on some of ``params``, and every one of
        them was set to None, replaced or written in place since it ended.

        ``zero_grad()`` between ``backward()`` and ``step()`` does that, and so
        does clipping every gradient in place (which the norms tell apart: it
        leaves them non-zero). Asked only when that backward's gradients were
        noted (``left``): C loops over the step's parameters.
        """
        left = self.left
        if not left:
            return False
        before = list(map(left.get, map(id, params)))
        if before.count(None) == len(before):
            return False  # that backward left none of them a gradient
        grads = list(map(_GRAD, params))
        now = zip(map(id, grads), map(getattr, grads, repeat("_version"), repeat(-1)))
        return not any(map(eq, before, now))

    def suspects(
        self, params: Iterable[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Parameters about to be used with stale values still in their gradient.

        Each comes with a device scalar (max|g| before the first stale
        accumulation) that must be non-zero for the suspicion to hold; None
        where it could not be taken (sparse gradients): then the version
        evidence alone decides.
        """
        if not self.enabled or not self._any_accumulated:
            return []  # the healthy step: no loop
        found = []
        states = self._states
        for param in params:
            state = states.get(id(param))
            if state is None or not state.armed or state.reset or not state.accumulated:
                continue
            grad = param.grad
            if grad is None or (not state.added and state.grad_ref is not None):
                # No backward wrote into it since the step: a gradient left over,
                # not added onto (a head replaced in the model, whose old weight
                # the optimizer still holds and model.zero_grad() no longer
                # resets). Told by the version counter of a plain tensor; a
                # wrapper's (FSDP2's DTensor, added into through its local shard
                # or after backward's end) shows no such move, so there the
                # tensor itself stands as evidence.
                continue
            # A gradient replaced since by the loop (DP-SGD's p.grad = clipped + noise,
            # made from the stale sum) still carries the stale values its content,
            # read before they were added onto, says were there, once a backward
            # did add onto them (torch.autograd.grad writes nothing: its gradients
            # assigned to p.grad are fresh); without that reading (a sparse
            # gradient) the tensor itself must be the one.
            if (state.content is not None and state.added) or (
                (state.grad_ref is not None and state.grad_ref() is grad)
                or (state.grad_key is not None and state.grad_key == (id(grad), grad._cdata))
            ):
                found.append((param, state.content))
        return found

    def rewritten(self) -> list[torch.Tensor]:
        """Parameters backward reached whose gradient was changed in place after it
        ended (zeroed by hand, clipped), before the step boundary.

        Without an optimizer, ``p.grad.zero_()`` may come before ``monitor.step()``:
        an all-zero gradient that was rewritten is a reset, not a dead signal.
        """
        reach = self._reach
        if reach is _NOTHING_REACHED:
            return []
        if reach is not None:
            # The usual step, told in C loops: every gradient reset to None since,
            # or each as its backward left it.
            now = list(map(_GRAD, reach[0]))
            if all(map(is_, now, repeat(None))):
                return []
            if list(map(getattr, now, repeat("_version"), repeat(-1))) == reach[2]:
                return []
            self._write_reach()
        found = []
        for state in self._states.values():
            if state.seen:
                grad = state.param.grad
                if grad is not None and grad._version != state.end_version:
                    found.append(state.param)
        return found

    def _unpack_snapshot(self) -> None:
        """The states as the per-parameter arm would have left them."""
        params, refs, versions = self._snapshot  # type: ignore[misc]
        self._snapshot = None
        states = self._states
        for param, ref, version in zip(params, refs, versions):
            state = states.get(id(param))
            if state is None:
                continue
            state.seen = state.reset = state.accumulated = state.added = False
            state.perturbed = False
            state.content = None
            state.armed = True
            state.version = version
            state.grad_ref, state.grad_key = ref, None

    def _backward_unseen(self, params: Sequence[torch.Tensor], whole: bool) -> None:
        """No hook saw a backward since the last step boundary: where one came all the
        same, adding onto the gradients in place, it reached the model another way
        than through the hooked output (the loss changed which outputs it uses): the
        outputs are learned again, and the next step is looked at from the one
        backward reaches first. Only with one optimizer over the whole model (with
        several, another's step may come after the same backward)."""
        if not whole or not self.enabled or not self.check_resets or self._learning:
            return
        if self._snapshot is not None:
            added = _added_in_place(self._snapshot)
        else:
            added = any(_state_added(state) for state in self._states.values())
        if added:
            self._learn()

    def _write_reach(self) -> None:
        """What backward reached, kept as taken (``_reach``), written into the states."""
        reach, self._reach = self._reach, None
        if reach is None:
            return
        states = self._states
        if reach is _NOTHING_REACHED:
            for state in states.values():
                state.seen = False
            return
        for param, held, version in zip(*reach):
            state = states.get(id(param))
            if state is not None:
                state.seen = held
                if held:
                    state.end_version = version

    def all_reached(self, params: Sequence[torch.Tensor]) -> bool:
        """Backward reached every one of ``params`` since the last step boundary, told
        in C loops where the usual step kept what it reached (False where it did not
        say: ``reached``, one by one, tells)."""
        reach = self._reach
        if not reach:  # None, or nothing reached
            return False
        return all(reach[1]) and all(map(self._states.__contains__, map(id, params)))

    def reached(self, param: torch.Tensor) -> bool:
        """Backward accumulated into this parameter since the last step boundary."""
        if self._reach is not None:
            self._write_reach()
        state = self._states.get(id(param))
        return state is not None and state.seen

    def arm_beside(self, params: Sequence[torch.Tensor]) -> None:
        """A step the monitor does not watch has used these gradients (an optimizer
        the loop steps over the model, found before it is watched): they are watched
        for a reset as a watched step's would be, so the missing ``zero_grad()`` of
        that optimizer is told at its next step, watched by then. What the watched
        steps armed stays as they left it (their one snapshot written into the
        states first), and so does what the step boundary notes (the backward seen,
        the gradients it left): this step is no boundary of theirs."""
        if not self.enabled or not params:
            return
        if self._snapshot is not None:
            if self.track_reached:
                self._write_reach()
            self._unpack_snapshot()
        # The next backward is looked at, these gradients now among those armed.
        self._snapshot_reset = False
        swap = _swap_mode()
        states = self._states
        for param in params:
            state = states.get(id(param))
            if state is None:
                continue
            _arm_state(state, param.grad, swap)
        self._any_accumulated = any(map(_ACCUMULATED, states.values()))

    def arm(
        self, params: Sequence[torch.Tensor], whole: bool = False, writes_may_follow: bool = False
    ) -> None:
        """A step has just used these gradients: start watching for a reset.

        ``whole``: these are all the parameters any step uses (one optimizer),
        so the usual step (every gradient a plain tensor, no parameter
        swapped since) is kept as one snapshot instead of per-parameter writes.
        ``writes_may_follow``: the step was marked at backward's end, before
        the loop's own use of the gradients (a clip rescales them in place).
        """
        if not self._snapshot_reset and not self.backward_seen:
            self._backward_unseen(params, whole)  # no hook fired since the last arm
        self.backward_seen = False
        self.left = None
        self._writes_may_follow = writes_may_follow
        self._any_accumulated = False
        self._hooked_output = None
        if not self.enabled:
            return
        self._snapshot_reset = False
        swap = _swap_mode()
        if whole and not self.track_reached:
            grads = list(map(_GRAD, params))
            impls = list(map(_CDATA, params))
            # Every gradient a plain tensor (so none is None), no parameter swapped.
            if impls == self._impls and not swap and all_plain(grads):
                self._snapshot = (params, list(map(weakref.ref, grads)), list(map(_VERSION, grads)))
                return
            self._impls = impls
        if self.track_reached and not whole:
            # A loop without an optimizer, every parameter stepped by hand: the usual
            # step (every gradient a plain tensor, or none held, no parameter swapped)
            # is kept as one snapshot too, and nothing reached yet.
            grads = list(map(_GRAD, params))
            impls = list(map(_CDATA, params))
            if impls == self._reach_impls and not swap:
                if all_plain(grads):
                    refs = list(map(weakref.ref, grads))
                    versions = list(map(_VERSION, grads))
                    if writes_may_follow:
                        versions = _VersionsBeforeClip(versions)
                    self._snapshot = (params, refs, versions)
                    self._reach = _NOTHING_REACHED
                    return
                if all(map(is_, grads, repeat(None))):
                    count = len(grads)
                    self._snapshot = (params, [_NO_GRADIENT] * count, [-1] * count)
                    self._reach = _NOTHING_REACHED
                    return
            self._reach_impls = impls
            self._write_reach()  # states other than these keep what they noted
            self._reach = None  # the loop below notes these
        self._snapshot = None
        states = self._states
        for param in params:
            state = states.get(id(param))
            if state is None:
                continue
            if param._cdata != state.impl:
                # Swapped by module.to() since the last step: its hooks are
                # wired to autograd again (the user's too).
                _rewire_hooks(param)
                state.impl = param._cdata
            _arm_state(state, param.grad, swap)
        if not whole:
            # Another optimizer's parameters, not armed here, may still hold stale
            # gradients its own step has yet to find.
            self._any_accumulated = any(map(_ACCUMULATED, states.values()))
