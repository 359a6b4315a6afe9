"""Whether the optimizer trains only tensors outside the model's layers, which feed none of them.

A "freeze the backbone" loop that froze every parameter (``for p in
model.parameters()`` where ``model.backbone`` was meant), with the optimizer
built the common way from the trainable parameters alone, leaves it one
learnable tensor outside the model's layers: a temperature, a loss weight
(``log_t = nn.Parameter(...)``, beside the model or on the LightningModule
itself). The optimizer steps, the loss moves a little, and nothing of the
model trains; no gradient is missing anywhere.

The same setup is deliberate where the model is a fixed feature extractor or
the tensor feeds the model. Told, then, only where all of this holds:

- every parameter of the model's layers (its modules but the root) is frozen;
- every trainable tensor the watched optimizers hold is the root's own
  parameter or held by no module at all (a head in a module of its own, a
  linear probe's, or another model's parameters, an EMA target's online
  network, is a model that trains), and they are learned scalars, a few
  elements in all (a head's weights, prototypes or a soft prompt held as bare
  tensors are trained on purpose beside a fixed model);
- on the first step after the setup, some frozen layer ran in training mode
  with gradients on (a feature extractor run in eval mode or under
  ``no_grad`` is fixed on purpose), and no layer's output required grad (a
  soft prompt or a visual prompt feeding the frozen model is prompt tuning).

The frozen layers are hooked from the audit that finds such a setup to the
end of its first step only: a healthy step pays nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch.collect.tensors import tensor_leaves
from trainwatch.compiled import unwrap, user_name
from trainwatch.fast_paths import hook_module, layer_members
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.layers import names_outside
from trainwatch.preflight import LEARNED_SCALARS_MAX_ELEMENTS
from trainwatch.record import LooseTraining


def loose_training(root: nn.Module, optimizers: Sequence[Optimizer]) -> LooseTraining | None:
    """The trainable tensors the optimizers hold, where no layer of the model trains
    and each is the root's own parameter or held by no module; None otherwise.

    Made at an audit only, and scans the heap (which modules hold the tensors)
    only where the model's layers are all frozen and the optimizers hold
    trainable tensors outside them.
    """
    own = {id(p): name for name, p in root.named_parameters(recurse=False)}
    frozen: set[int] = set()
    for module in root.modules():
        if module is root:
            continue
        for param in module.parameters(recurse=False):
            if id(param) in own:
                continue  # the root's own, shared with a layer: the layer's
            if param.requires_grad:
                return None
            frozen.add(id(param))
    if not frozen:
        return None  # no frozen layer: the model is its own parameters
    trained: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in frozen:
                    # Frozen layers in the optimizer: frozen_in_optimizer's finding
                    # (or a GAN's part frozen for the other's phase).
                    return None
                if param.requires_grad:
                    trained[id(param)] = param
    if not trained:
        return None  # nothing trainable at all: the audit's own finding
    elements = sum(p.numel() for p in trained.values())
    if elements > LEARNED_SCALARS_MAX_ELEMENTS:
        # More than a temperature or a few loss weights: a head or prototypes of
        # the model's own, a soft prompt, trained on purpose beside a fixed model.
        return None
    outside = [p for key, p in trained.items() if key not in own]
    if outside and names_outside(outside):
        return None  # a module of its own trains (a separate head, another model)
    names = [user_name(own[key]) for key in trained if key in own]
    return LooseTraining(
        names=names,
        outside=len(outside),
        elements=elements,
        shapes=[tuple(p.shape) for p in outside],
    )


def frozen_layer_modules(root: nn.Module) -> list[nn.Module]:
    """The modules holding parameters of their own, the root and TorchScript aside."""
    return [
        module
        for module in root.modules()
        if module is not root
        and not isinstance(module, torch.jit.ScriptModule)
        and next(module.parameters(recurse=False), None) is not None
    ]


class LayersFedLook:
    """Hooks the frozen layers until the first step after the audit is over: whether
    one ran in training mode with gradients on, and whether any output required grad."""

    def __init__(self, root: nn.Module, found: LooseTraining) -> None:
        self.found = found
        self.ran = False  # a layer ran at all
        self.trained_pass = False  # a layer ran in training mode with gradients on
        self.fed = False  # a layer's output required grad: something feeds the model
        self._hooks = HookGroup()
        members = layer_members(root)
        for module in frozen_layer_modules(root):
            hook = WeakHook(self, "_ran")
            self._hooks.add(hook_module(module, hook, in_layer=id(module) in members))
        # Dropped without a verdict (its optimizer or monitor gone): the hooks go too.
        weakref.finalize(self, self._hooks.remove_all)

    def _ran(self, module: nn.Module, args: Any, output: Any) -> None:
        self.ran = True
        if not torch.is_grad_enabled() or not module.training:
            return
        self.trained_pass = True
        if any(tensor.requires_grad for _, tensor in tensor_leaves(output)):
            self.fed = True
            self.detach()  # prompt tuning, or a trainable part: nothing more to see

    def verdict(self) -> LooseTraining | None:
        """At the step's end: what to tell, if the setup changes nothing of the model."""
        self.detach()
        return self.found if self.trained_pass and not self.fed else None

    def fail(self, exc: BaseException) -> None:
        self.detach()

    def detach(self) -> None:
        self._hooks.remove_all()


class FrozenModelLooks:
    """``trainwatch run``: the frozen models an optimizer of tensors outside every module
    may have been meant to train.

    Such an optimizer holds no model's parameter and joins no monitor, and the
    model frozen whole, whose backward never runs, takes no step of its own: the
    run would say only that the optimizer's tensors are watched by no model. At
    the optimizer's second step, each model watched that has taken no step and has
    no optimizer, whose layers are all frozen, has its layers hooked for one step
    (see :class:`LayersFedLook`); at the third, those that ran in training mode
    with gradients on, fed by nothing that trains, are the finding.
    """

    def __init__(self) -> None:
        self._looks: weakref.WeakKeyDictionary[Optimizer, list[tuple[Any, LayersFedLook]]] = (
            weakref.WeakKeyDictionary()
        )

    def arm(self, optimizer: Optimizer, monitors: Sequence[Any]) -> None:
        """Hook the layers of the frozen models ``optimizer`` may be meant to train."""
        looks = []
        for monitor in monitors:
            if monitor.closed or monitor.step_count or monitor.optimizers:
                continue
            root = unwrap(monitor.model)
            found = loose_training(root, [optimizer])
            if found is not None:
                looks.append((weakref.ref(monitor), LayersFedLook(root, found)))
        if looks:
            self._looks[optimizer] = looks

    def verdicts(self, optimizer: Optimizer) -> list[tuple[Any, LooseTraining]]:
        """The monitors whose model nothing trains, with what the optimizer trains."""
        told = []
        for ref, look in self._looks.pop(optimizer, []):
            found = look.verdict()
            monitor = ref()
            if found is not None and monitor is not None and not monitor.closed:
                told.append((monitor, found))
        return told
