"""Whether any backward pass ran in the process between two steps of one optimizer.

A step whose optimizer's parameters hold no gradient at all, with no backward
reaching the watched model since its last step, is either a batch skipped
before its backward (a loss found NaN, a batch left empty by a filter: the loop
still calls ``optimizer.step()``, which updates nothing) or a model cut off
whole while training goes on elsewhere: a copy made after the optimizer was
built (``model = copy.deepcopy(best)``), whose backward the watched model
never sees, or a generator whose loss reads its output ``.detach()``ed. The
first says nothing of any layer; the others are what ``zero_gradient`` tells.
What tells them apart is a backward anywhere in the process, watched or not.

So after such a step, until the optimizer's next step, the outputs of module
calls made with gradients on (any module: the copy's, another model's, a loss
module's) get a tensor hook, a few per step at most, and the first one that
backward reaches answers the question and takes the look off. Nothing is
looked at on the usual step: the look is armed only on such a step, and goes
by itself once a later step came without re-arming it.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.utils.hooks import RemovableHandle

from trainwatch.collect.tensors import tensor_leaves
from trainwatch.hooks import WeakHook, hook_pass_tensor
from trainwatch.process_steps import PROCESS_STEPS

# Module outputs hooked per look at most: the first calls of a pass with
# gradients lie upstream of the rest of its graph, so a backward through that
# pass reaches them.
_HOOKED_PER_LOOK = 16


class BackwardsAnywhere:
    """One look at a time: armed for an optimizer at a step, read at its next."""

    def __init__(self) -> None:
        self._handle: RemovableHandle | None = None
        # The optimizer and the monitor's step the look was armed at (None: none).
        self._armed: tuple[int, int] | None = None
        self._taken = 0  # PROCESS_STEPS.taken when armed
        self._look = 0  # which look a tensor hook belongs to (a graph kept past its look)
        self._hooked = 0
        self._seen = False
        self._answer: bool | None = None  # the latest look's answer

    def look(self, index: int, now: int) -> bool | None:
        """Whether a backward ran since optimizer ``index``'s step before ``now`` (None:
        no look covered that time: not armed then, armed for another optimizer or
        step, or lapsed); the look is armed again, for its step after ``now``. The
        same step gathered again gets the same answer."""
        if self._armed == (index, now):
            return self._answer
        answer = None
        if self._armed == (index, now - 1) and PROCESS_STEPS.taken <= self._taken + 1:
            answer = self._seen
        self._answer = answer
        self._arm(index, now)
        return answer

    def _arm(self, index: int, now: int) -> None:
        self._armed = (index, now)
        self._taken = PROCESS_STEPS.taken
        self._look += 1
        self._hooked = 0
        self._seen = False
        if self._handle is None:
            self._handle = register_module_forward_hook(WeakHook(self, "module_ran"))

    def module_ran(self, module: object, args: object, output: object) -> None:
        if self._seen or PROCESS_STEPS.taken > self._taken + 1:
            self.stop()  # answered, or a later step went by without arming it again
            return
        if self._hooked >= _HOOKED_PER_LOOK or not torch.is_grad_enabled():
            return
        for _, tensor in tensor_leaves(output):
            if tensor.grad_fn is not None:
                hook_pass_tensor(tensor, WeakHook(self, "backward_ran", self._look))
                self._hooked += 1
                return

    def backward_ran(self, look: int, grad: torch.Tensor) -> None:
        if look == self._look:
            self._seen = True
            self.stop()

    def detach(self) -> None:
        """No look goes on (the monitor closes)."""
        self._armed = None
        self.stop()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def fail(self, exc: BaseException) -> None:
        """A hook failed: no look goes on (the steps are counted as before)."""
        self.detach()
