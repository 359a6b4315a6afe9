"""Gradients taken through the model in eval mode, held until an update is seen to use them.

A backward through a pass made with the model in eval mode (``model.eval()``:
dropout off, batch norm on its running statistics) is a training step in eval
mode only when the optimizer applies what that backward computed. Much that
takes gradients in eval mode applies none: an EWC Fisher estimate at a task's
end (a backward per batch, the squared gradients summed, then ``zero_grad()``
and ``model.train()``), a saliency map or Grad-CAM, influence scores, a probe
through ``torch.autograd.grad`` (which writes no ``.grad`` at all).

So, on that path only, each such backward is looked at as it begins and ends
(which parameters' ``.grad`` it wrote: C loops over the parameters), and while
what it wrote is held, the model's passes in training mode are followed
(``pass_ends``, subscribed only then) to the next backward through one. There,
before any parameter accumulates: gradients the eval-mode backward left still
in place and not all zero are added onto, and go into the update with the new
ones; gradients set to None, replaced or zeroed since, or never written, go
into no update, and the step's report of them is taken back. Where no backward
in training mode comes before the step boundary, the step applied the
eval-mode gradients (``model.train()`` forgotten after a validation): the
report stands, told at that step.

Only passes whose root is in eval mode are held so, of a model with parameters
that train: a model training with its normalisation layers put in eval, or a
part of it left in eval, is training, and so is a frozen network in eval that
the loss goes through (a perceptual loss's): their passes' report stands as
it is found.
"""

from __future__ import annotations

import weakref
from itertools import compress, repeat
from operator import and_, attrgetter, is_not, ne, or_
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainwatch.collect.nonfinite_forward import graph_task_id
from trainwatch.collect.tensors import floating_tensors
from trainwatch.hooks import Failing, WeakHook, hook_pass_tensor
from trainwatch.record import ModeReport

_GRAD = attrgetter("grad")


def joined(found: ModeReport | None, report: ModeReport) -> ModeReport:
    """``found`` with the modules of ``report`` it lacks (``report`` where none).

    Passes of two parts called on their own (a CLIP model's two towers, both
    left in eval) each bring their modules: the step's report names them all.

    A module is in a frozen part for the step only where every pass that found it
    found it so. A model frozen and put in eval for another's backward (a world
    model's imagination pass training the policy, a GAN's discriminator for the
    generator's update), then trained with ``.train()`` forgotten, trains in eval
    mode at that step: the frozen pass before it does not make it an idiom.
    """
    if found is None:
        return report
    new = [(m, k) for m, k in zip(report.modules, report.kinds) if m not in found.modules]
    trained = [
        m for m in found.in_frozen_parts if m not in report.in_frozen_parts and m in report.modules
    ]
    if not new and not trained:
        return found
    return ModeReport(
        found.modules + [m for m, _ in new],
        found.kinds + [k for _, k in new],
        found.whole_model and report.whole_model,
        found.total + report.total if new else found.total,
        [m for m in found.in_frozen_parts if m not in trained]
        + [m for m in report.in_frozen_parts if m not in found.modules],
        parts_in_eval=found.parts_in_eval
        + [p for p in report.parts_in_eval if p not in found.parts_in_eval],
    )


def hook_backward(output: Any, hook: WeakHook) -> None:
    """``hook(grad)`` when backward reaches the pass's output, before any parameter
    of the model accumulates (its first floating tensor with a graph)."""
    for tensor in floating_tensors(output):
        # Not on a leaf (a returned parameter): the hook would stay on it.
        if tensor.requires_grad and tensor.grad_fn is not None:
            hook_pass_tensor(tensor, hook)
            return


def _versions(grads: list[torch.Tensor | None]) -> list[int]:
    return list(map(getattr, grads, repeat("_version"), repeat(-1)))


class EvalModeGradients:
    """The eval-mode backward passes of one step whose gradients no update has been
    seen to use yet (``held``), and what they left in ``.grad``.

    ``owner`` is told through its ``training_backward_starts`` when a backward
    reaches a pass in training mode while gradients are held.
    """

    def __init__(self, owner: Failing) -> None:
        # The model's passes (ModelPasses, set once attached), subscribed to while
        # gradients are held.
        self.passes: Any = None
        self._training_starts = WeakHook(owner, "training_backward_starts")
        self.step = -1  # the step the held backward passes ran in (-1: none held)
        # The step's report before them: what stands if their gradients go unused.
        self.prior: ModeReport | None = None
        # What they left, by parameter id: the parameter and its gradient, weakly.
        self._left: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}
        # The backward in progress: the parameters, their gradients and those
        # gradients' versions as it began, and its passes' report.
        self.in_backward = False
        self._task: int | None = None  # its graph task, where torch says
        self._params: list[torch.Tensor] = []
        self._before: list[torch.Tensor | None] = []
        self._before_versions: list[int] = []
        self._report: ModeReport | None = None
        self._subscribed = False

    @property
    def held(self) -> bool:
        return self.step >= 0

    def backward_starts(
        self, report: ModeReport, step: int, told: ModeReport | None, model: nn.Module
    ) -> bool | None:
        """Backward reached an eval-mode pass's output. True for the first such pass of
        this backward: the caller queues ``backward_ends`` for its end. None for a
        model none of whose parameters trains (a frozen loss network watched on its
        own): what it writes tells nothing, the gradient goes through it to what
        trains, and the report stands as found."""
        if self.in_this_backward():
            self._report = joined(self._report, report)
            return False
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return None
        if self.step != step:
            # The first of this step's (a held step before it went to its boundary).
            self._left.clear()
            self.step, self.prior = step, told
            if not self._subscribed and self.passes is not None:
                self.passes.subscribe("eval-mode gradients", self, starts=False)
                self._subscribed = True
        self.in_backward = True
        self._task = graph_task_id() if graph_task_id is not None else None
        self._report = report
        self._params = params
        self._before = grads = list(map(_GRAD, params))
        self._before_versions = _versions(grads)
        return True

    def in_this_backward(self) -> bool:
        """In the eval-mode backward begun last, not ended yet. One that raised never
        ends: a later backward (another graph task) is no part of it."""
        if not self.in_backward:
            return False
        if graph_task_id is None or graph_task_id() == self._task:
            return True
        self.in_backward, self._params, self._report = False, [], None
        self._before, self._before_versions = [], []
        return False

    def backward_ends(self) -> ModeReport | None:
        """The backward ended: its report where it wrote a ``.grad`` (an update may
        use it), None where it wrote none (``torch.autograd.grad``, ``inputs=``)."""
        params, report = self._params, self._report
        self.in_backward, self._params, self._report = False, [], None
        grads = list(map(_GRAD, params))
        changed = map(
            or_, map(is_not, grads, self._before), map(ne, _versions(grads), self._before_versions)
        )
        wrote = list(map(and_, map(is_not, grads, repeat(None)), changed))
        self._before, self._before_versions = [], []
        if not any(wrote):
            return None
        written = list(compress(params, wrote))
        refs = map(weakref.ref, compress(grads, wrote))
        self._left.update(zip(map(id, written), zip(written, refs)))
        return report

    def applied(self) -> bool:
        """Some gradient a held backward left is still its parameter's, not all zero:
        the backward about to begin adds onto it. One read of the device, here only."""
        kept = [
            grad
            for param, ref in self._left.values()
            if (grad := param.grad) is not None and ref() is grad
        ]
        plain = [g for g in kept if type(g) is torch.Tensor and g.layout == torch.strided]
        if len(plain) < len(kept):
            return True  # a sparse or wrapped gradient: the tensor itself stands as evidence
        sizes = [g.detach().abs().amax().float() for g in plain if g.numel()]
        if not sizes:
            return False
        device = sizes[0].device
        return bool(torch.stack([s.to(device) for s in sizes]).amax() > 0)

    def release(self) -> None:
        """Nothing held any more: the training passes are no longer followed."""
        self.step, self.prior = -1, None
        self._left.clear()
        self.unsubscribe()

    def unsubscribe(self) -> None:
        if self._subscribed:
            self._subscribed = False
            self.passes.unsubscribe(self)

    # -- the model's passes, while gradients are held (ModelPasses) ------------
    def pass_starts(self, module: nn.Module) -> None:
        return None

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A pass in training mode with gradients: its backward is a training one."""
        ran = module.module if isinstance(module, DistributedDataParallel) else module
        if ran.training and torch.is_grad_enabled():
            hook_backward(output, self._training_starts)
