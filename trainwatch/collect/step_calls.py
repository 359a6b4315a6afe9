"""Whether the layers that went without a gradient were called in this step's passes.

A layer skipped on some steps by design (a block stochastic depth drops, an
expert the router sent no token) gets no gradient on those steps, exactly
like a layer whose output a ``.detach()`` cuts off, which is called every
step. What tells them apart is whether the layer ran. Nothing is watched on
a model whose every parameter gets its gradient: a layer is followed only
from the step after it first went without one (the cheap trigger is the
step's own list of parameters with no gradient), and then only through one
global forward pre-hook installed for the model's passes and removed at the
step boundary, their backward included (a hook on the layer itself would
travel with the model into ``torch.save`` and ``copy.deepcopy``).
A layer called with gradients off inside a pass with gradients (``torch.no_grad()``
around it, a reentrant checkpoint whose inputs do not require grad) ran: it is
no layer skipped by design, and is noted apart for the cause it points to.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from trainwatch.collect import quiet
from trainwatch.collect.custom_functions import functions_through
from trainwatch.collect.tensors import tensor_leaves
from trainwatch.compiled import compiling, is_wrapper, unwrap
from trainwatch.hooks import WeakHook

# Steps a followed layer is seen running without a gradient before it counts as
# cut off (a .detach() after it) and is no longer followed.
_CALLED_CUT = 3


class StepCalls:
    """Listens to the model's passes while some layer is followed."""

    def __init__(self) -> None:
        # id(module) -> (a weak reference to it, its name)
        self._followed: dict[int, tuple[weakref.ref[nn.Module], str]] = {}
        self.following = False  # whether any layer is (a plain attribute: read every step)
        self._called: set[str] = set()
        # Followed layers called with gradients off inside a pass with gradients (a
        # torch.no_grad() block in forward, a reentrant checkpoint whose inputs do
        # not require grad): they ran, and backward cannot reach them.
        self._called_gradless: set[str] = set()
        self._in_pass = False  # a pass with gradients is in progress
        self._blind = False  # a pass ran where module calls are not seen (compiled)
        self._inner_calls = 0  # module calls seen inside the pass in progress
        self._passes = 0  # passes with gradients seen since the last step boundary
        self._handle: RemovableHandle | None = None
        # Layers seen running without a gradient, how many steps (the pipeline's count).
        self.cut_runs: dict[str, int] = {}
        # Followed layers seen running in some step: skipped by design on the others.
        self.ran: set[str] = set()
        # The graph nodes the latest pass with gradients hangs its output from, and
        # those of the step just taken: looked at (custom_functions) only where a
        # layer ran without a gradient, then let go.
        self._roots: list[Any] | None = None
        self.roots: list[Any] | None = None
        # The followed layers called in that pass: only they can be seen cut off
        # in its graph (a layer of an earlier pass is in another graph).
        self._pass_called: set[str] = set()
        self._roots_ran: frozenset[str] = frozenset()
        self.roots_ran: frozenset[str] = frozenset()
        # Layers looked at that way, and the custom autograd Functions found
        # between them and the output (the layers they explain).
        self.examined: set[str] = set()
        self.through_functions: dict[str, list[str]] = {}
        # Layers looked at that way whose parameters the graph does not hold at
        # all: cut off inside the model (a .detach() after them), which no output
        # left out of the loss explains. Looked at again once they had a gradient.
        self.cut_off: set[str] = set()
        # Layers never called because their holder reads their weights itself
        # (nn.MultiheadAttention's ``out_proj``), each with that holder's name:
        # whether they ran is whether it did. Not followed themselves.
        self.held_by: dict[str, str] = {}

    @property
    def followed(self) -> frozenset[str]:
        return frozenset(name for _, name in self._followed.values())

    def follow(self, modules: dict[str, nn.Module]) -> None:
        """Follow these layers (by name) from the next pass on."""
        for name, module in modules.items():
            self._followed[id(module)] = (weakref.ref(module), name)
        self.following = bool(self._followed)

    def without_gradient(
        self,
        names: frozenset[str],
        *,
        ran: frozenset[str],
        called: frozenset[str] | None,
        never_called: frozenset[str],
        outputs_unreached: bool = False,
    ) -> frozenset[str]:
        """A step's layers without a gradient: the ones to follow from now on.

        ``ran``: of them, those that had a gradient at the last step (they ran
        then); ``called``: the followed layers called in this step's passes
        (None: not knowable). A layer never called at all (an unused pooler)
        is the call tracker's finding and is not followed; one seen running
        without a gradient for ``_CALLED_CUT`` steps (a ``.detach()`` after
        it) is cut, which is established: following it stops. What stays
        followed is skipped on some steps by design, and each pass pays a hook
        on every module call while it does. ``outputs_unreached``: some output of
        the model was left out of the loss this step, which explains a layer
        that ran without a gradient (an early exit not trained this step): no
        count towards a cut then, unless the graph showed the layer cut off.
        """
        self.ran |= ran
        self._forget(ran)  # a new streak: the graph may hold them now
        if called is not None:
            counted = names & called & self.followed
            for name in counted & self.cut_off if outputs_unreached else counted:
                runs = self.cut_runs[name] = self.cut_runs.get(name, 0) + 1
                if runs >= _CALLED_CUT:
                    self.unfollow(name)
        for name in never_called & self.followed:
            self.unfollow(name)
        return names - never_called - self.followed - self.cut_runs.keys() - self.held_by.keys()

    def unfollow(self, name: str) -> None:
        self._followed = {key: item for key, item in self._followed.items() if item[1] != name}
        self.following = bool(self._followed)
        if not self._followed:
            self._unhook()
            self._roots = self.roots = None

    def explain(self, targets: dict[str, list[torch.Tensor]]) -> None:
        """Finds the custom autograd Functions between each layer of ``targets`` (that
        ran without a gradient; by name, with its parameters) and the output of the
        step just taken (``through_functions``), each layer looked at once; then the
        step's graph is let go."""
        roots, self.roots = self.roots, None
        fresh = {name: params for name, params in targets.items() if name not in self.examined}
        if roots and fresh:
            self.examined.update(fresh)
            found, outside = functions_through(roots, fresh)
            self.through_functions.update(found)
            self.cut_off |= outside & self.roots_ran

    def _forget(self, names: frozenset[str]) -> None:
        """Layers that had a gradient at the last step: what their graph showed
        before says nothing of the streak they begin now."""
        if names & self.examined:
            self.examined -= names
            self.cut_off -= names
            for name in names:
                self.through_functions.pop(name, None)

    def take(self) -> tuple[frozenset[str] | None, frozenset[str]]:
        """The followed layers called since the last step boundary (None: not knowable:
        no pass with gradients was seen, or one ran where module calls are not), and
        those of them called only with gradients off, inside a pass with gradients."""
        self._unhook()
        self.roots, self._roots = self._roots, None
        self.roots_ran, self._roots_ran = self._roots_ran, frozenset()
        with_grad, gradless = self._called, self._called_gradless
        called, blind = frozenset(with_grad | gradless), self._blind or not self._passes
        gradless = frozenset(gradless - with_grad)
        self._called, self._called_gradless = set(), set()
        self._blind, self._passes, self._in_pass = False, 0, False
        if blind:
            return None, frozenset()  # no pass seen (compiled in place) or a blind one
        self.ran |= called
        return called, gradless

    # -- the model's passes (ModelPasses) ----------------------------------
    def pass_starts(self, module: nn.Module) -> None:
        if not self._followed or not torch.is_grad_enabled():
            return  # a pass without gradients (an evaluation) makes no step's gradients
        if is_wrapper(module):
            self._blind = True  # inside a compiled graph no module call is seen
            return
        self._pass_called = set()
        self._in_pass = True
        self._mark(unwrap(module), self._called)  # its own hooks are already running
        self._inner_calls = 0
        self._passes += 1
        if self._handle is None:
            self._handle = register_module_forward_pre_hook(WeakHook(self, "called"))

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._handle is None:
            return
        self._in_pass = False
        if not self._inner_calls and torch.is_grad_enabled():
            # Not one module call seen inside the pass: compiled in place
            # (``model.compile()``), where hooks do not run. Nothing is known.
            self._blind = True
        if torch.is_grad_enabled():
            roots = [t.grad_fn for _, t in tensor_leaves(output) if t.grad_fn is not None]
            if roots:
                self._roots, self._roots_ran = roots, frozenset(self._pass_called)
        # The hook stays on until the step boundary: reentrant checkpointing
        # runs its blocks under no_grad in the pass and with gradients only in
        # backward, where they are seen running.

    def called(self, module: nn.Module, args: Any = None) -> None:
        if compiling() or (quiet.anywhere and quiet.replaying()):
            return  # trainwatch's own re-run of the model inside the pass
        if torch.is_grad_enabled():
            self._inner_calls += 1
            self._mark(module, self._called)
        elif self._in_pass:
            # Gradients off inside the training pass: the layer ran, so it is
            # not one skipped by design, yet nothing it computes reaches backward.
            self._inner_calls += 1
            self._mark(module, self._called_gradless)
        # (gradients off outside a pass with gradients: an evaluation, no step's call)

    def _mark(self, module: nn.Module, into: set[str]) -> None:
        found = self._followed.get(id(module))
        if found is not None and found[0]() is module:
            into.add(found[1])
            if self._in_pass:
                self._pass_called.add(found[1])

    def fail(self, exc: BaseException) -> None:
        """Knowing nothing, it claims nothing: every followed layer counts as called."""
        self.detach()

    def forget_explained(self) -> None:
        self.examined.clear()
        self.through_functions.clear()
        self.cut_off.clear()

    def detach(self) -> None:
        self._unhook()
        self._roots = self.roots = None
        self._followed.clear()
        self.held_by.clear()
        self.following = False
        self._called.clear()
        self._called_gradless.clear()
        self._in_pass = False

    def _unhook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
