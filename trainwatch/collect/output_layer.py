"""Whether the model's output comes straight out of a layer whose weights are all frozen.

A classification head frozen by mistake (``model.classifier.requires_grad_(False)``,
or a freeze by name pattern that caught the head too) while the encoder trains
fails nowhere: the optimizer holds what trains, every trainable parameter gets
a gradient, and the encoder learns to feed a fixed random projection. The
setup table shows the head's row at 0 trainable, and nothing else does.

Which layer the output comes from is read from a pass's autograd graph, so a
layer registered last but never feeding the output (a momentum encoder, an EMA
copy, a teacher run without gradients) is never taken for it: from the
output's nodes back, every path must meet the output of a frozen layer before
any trainable tensor (an ``AccumulateGrad`` node), and at least one must meet
one. An output that comes from a frozen layer sharing a weight with another
module (a language model's head tied to its input embedding) is not claimed:
its weight is the embedding's, trained or frozen with it, never a freshly
initialised head. Nor is one no trainable parameter lies behind: nothing
trains through the layer (the trainable ones miss the loss: another finding).
A frozen layer a watched optimizer holds is not looked for: it trains at other
times (a GAN's discriminator, frozen for the generator's phase). With the
layers found go the frozen ones behind them, up to the first ops that use a
trainable parameter: a head on a model that trains is small beside what
trains, a frozen network fed by a trainable part (a prompt-tuned language
model, adapters, a loss network) is not, and the rule weighs the two.

The frozen layers are hooked only for one step, from its first pass with
gradients, after the setup changed (the model attached, a ``requires_grad``
flipped): a healthy step pays nothing. What is found is a note, not a finding: a frozen
output layer is also deliberate (prompt or prefix tuning of a frozen language
model, a fixed classifier).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.optim import Optimizer

from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.tensors import tensor_leaves
from trainwatch.compiled import is_wrapper, user_name
from trainwatch.fast_paths import hook_module, layer_members
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.record import FrozenOutput

# Graph nodes walked back from the output at most: past them, nothing is claimed.
_MOST_NODES = 100_000


def frozen_layers(
    root: nn.Module, optimizers: Sequence[Optimizer] = ()
) -> tuple[list[tuple[str, nn.Module, bool]], dict[int, int]] | None:
    """The layers (modules holding parameters of their own, the root aside) whose
    every parameter is frozen and held by none of ``optimizers``, each with
    whether it shares one with another module (tied); and the model's
    trainable parameters, by id, with their element counts.

    A frozen layer an optimizer holds trains at other times: a GAN's
    discriminator, frozen for the generator's phase (``toggle_optimizer``).
    None while a lazy module's parameters are not sized yet (its first call does).
    """
    held = {id(p) for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]}
    holders: dict[int, int] = {}
    trainable: dict[int, int] = {}
    for module in root.modules():
        for param in module.parameters(recurse=False):
            if is_lazy(param):
                return None
            holders[id(param)] = holders.get(id(param), 0) + 1
            if param.requires_grad:
                trainable[id(param)] = param.numel()
    found = []
    for raw, module in root.named_modules():
        if module is root or isinstance(module, torch.jit.ScriptModule):
            continue  # the root's output is the pass's; TorchScript takes no hooks
        own = list(module.parameters(recurse=False))
        if own and not any(p.requires_grad or id(p) in held for p in own):
            found.append((user_name(raw), module, any(holders[id(p)] > 1 for p in own)))
    return found, trainable


def frozen_sources(
    roots: list[Any], outputs: dict[int, tuple[Any, str, bool]], trainable: dict[int, int]
) -> FrozenOutput | None:
    """The frozen layers ``roots`` (the output's graph nodes) come from, and what lies
    behind them (``FrozenOutput``, its ``frozen`` and ``tail`` left for the caller).

    Claimed only when every path back from ``roots`` meets one of ``outputs``
    (the frozen layers' output nodes, by id, with their names and whether they
    are tied) before any tensor that requires grad, none of them tied, and
    some trainable parameter lies behind them; None otherwise, or for a graph
    too large to walk.
    """
    found: list[str] = []
    behind: list[Any] = []
    walked: list[Any] = []  # holds every node met, so that no id is reused meanwhile
    seen: set[int] = set()
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        if id(node) in seen:
            continue
        seen.add(id(node))
        walked.append(node)
        if len(walked) > _MOST_NODES:
            return None
        met = outputs.get(id(node))
        if met is not None and met[0] is node:
            if met[2]:
                return None  # a tied layer: its weight is another module's (an embedding)
            if met[1] not in found:
                found.append(met[1])
            behind.append(node)
            continue
        if getattr(node, "variable", None) is not None:
            return None  # a trainable tensor reaches the output on a path of its own
        queue.extend(child for child, _ in node.next_functions if child is not None)
    if not found:
        return None
    tail, upstream = _behind(behind, outputs, trainable)
    if not upstream:
        return None  # nothing that trains feeds them (the trainable ones miss the loss)
    return FrozenOutput(found, 0, upstream, [name for name in tail if name not in found])


def _behind(
    nodes: list[Any], outputs: dict[int, tuple[Any, str, bool]], trainable: dict[int, int]
) -> tuple[list[str], int]:
    """Behind ``nodes``: the frozen layers met before any op that uses a trainable
    parameter (the frozen part of the model the output comes out of), and the
    elements of the ``trainable`` parameters reached at all.

    First the frozen part, up to those ops, then the rest of the graph from
    their inputs: every node of the first walk is reached without one. A frozen
    part too large to walk claims nothing; past that, the count is what the
    walk reached (a lower bound).
    """
    tail: list[str] = []
    reached: dict[int, int] = {}
    walked: list[Any] = []
    seen: set[int] = set()
    frozen_part = deque(
        child for node in nodes for child, _ in node.next_functions if child is not None
    )
    rest: deque[Any] = deque()
    for queue, in_tail in ((frozen_part, True), (rest, False)):
        while queue and len(walked) < _MOST_NODES:
            node = queue.popleft()
            if id(node) in seen:
                continue
            seen.add(id(node))
            walked.append(node)
            children = [child for child, _ in node.next_functions if child is not None]
            uses = False
            for child in children:
                variable = getattr(child, "variable", None)
                if variable is not None and id(variable) in trainable:
                    reached[id(variable)] = trainable[id(variable)]
                    uses = True
            if in_tail:
                met = outputs.get(id(node))
                if met is not None and met[0] is node and met[1] not in tail:
                    tail.append(met[1])
            (rest if in_tail and uses else queue).extend(children)
        if in_tail and queue:
            return [], 0  # the frozen part is too large to walk: nothing is claimed
    return tail, sum(reached.values())


def _elements(layers: dict[str, nn.Module], names: list[str]) -> int:
    return sum(p.numel() for name in names for p in layers[name].parameters(recurse=False))


class OutputLayerLook:
    """Looks, on the passes with gradients of one step, for a frozen layer the output comes from.

    ``on_found`` is given what was found, each layer once for the run.
    """

    def __init__(
        self,
        passes: ModelPasses,
        root: nn.Module,
        optimizers: Sequence[Optimizer],
        step_count: Callable[[], int],
        on_found: Callable[[FrozenOutput], None],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self._passes = passes
        self._root = weakref.ref(root)
        self._optimizers = optimizers  # the monitor's own list: it adds to it
        self._step_count = step_count
        self._on_found = on_found
        self._on_error = on_error
        self._hooks = HookGroup()
        self._step: int | None = None  # the step whose passes are looked at
        self._layers: list[tuple[str, nn.Module, bool]] | None = None
        self._trainable: dict[int, int] = {}  # the model's trainable parameters
        # The frozen layers' outputs in the step looked at: their graph nodes (held,
        # so that each keeps its Python object) by id, with the layer's name and
        # whether it is tied.
        self._outputs: dict[int, tuple[Any, str, bool]] = {}
        self.told: set[str] = set()

    def arm(self) -> None:
        """Look at the passes with gradients of the next step that has any."""
        self._step = None
        self._layers = None
        if not self._passes.listens(self):
            self._passes.subscribe("frozen output layer", self)

    def pass_starts(self, module: nn.Module) -> None:
        step = self._step_count()
        if self._step is not None and step != self._step:
            self.detach()  # the step looked at is over
            return
        if not torch.is_grad_enabled():
            return  # an evaluation: its output has no graph to read
        if is_wrapper(module):
            # Around a compiled graph no layer is seen, and hooks that come and go
            # would make dynamo recompile.
            self.detach()
            return
        if self._layers is None:
            root = self._root()
            found = frozen_layers(root, self._optimizers) if root is not None else ([], {})
            if found is None:
                return  # lazy modules sized by this pass: the next one is looked at
            self._layers, self._trainable = found
        self._step = step
        if not self._layers or not self._trainable:
            self.detach()  # nothing frozen, or nothing trains: no such layer to find
            return
        if not self._hooks:
            # On until the step is over: a loop calling the model's parts runs
            # some of them between its passes (blocks under a checkpoint).
            root = self._root()
            members = layer_members(root) if root is not None else set()
            for name, layer, tied in self._layers:
                hook = WeakHook(self, "_layer_ran", name, tied)
                self._hooks.add(hook_module(layer, hook, in_layer=id(layer) in members))

    def _layer_ran(self, name: str, tied: bool, module: nn.Module, args: Any, output: Any) -> None:
        for _, tensor in tensor_leaves(output):
            node = tensor.grad_fn
            if node is not None:
                # An outer layer returning its inner one's tensor names the node last.
                self._outputs[id(node)] = (node, name, tied)

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._hooks or not torch.is_grad_enabled():
            return  # not a pass looked at
        for name, layer, tied in self._layers or []:
            if layer is module:
                # A part called on its own is the pass (its head called by the loop):
                # the pass ends before the layer's own hook would run.
                self._layer_ran(name, tied, module, args, output)
        roots = [t.grad_fn for _, t in tensor_leaves(output) if t.grad_fn is not None]
        if not roots or not self._outputs:
            return
        found = frozen_sources(roots, self._outputs, self._trainable)
        if found is None or all(name in self.told for name in found.layers):
            return
        self.told.update(found.layers)
        layers = {name: layer for name, layer, _ in self._layers or []}
        found.frozen = _elements(layers, found.layers)
        found.tail = found.frozen + _elements(layers, found.behind)
        self._on_found(found)

    def fail(self, exc: BaseException) -> None:
        self.detach()
        self._on_error("frozen output layer", exc)

    def detach(self) -> None:
        self._hooks.remove_all()
        self._outputs = {}
        self._layers = None
        if self._passes.listens(self):
            self._passes.unsubscribe(self)
