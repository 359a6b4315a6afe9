"""Re-running a pass module by module, once a cheap trigger said something is off.

A replay must not change training: the global RNG (CPU and CUDA) is forked,
buffers are swapped for copies, what the forward changes in the model's
state is put back (``UndoneEffects``: the generators the model holds or the
pass was handed among it), the user's forward and backward hooks are held
off, and in a backward replay their gradient hooks on tensors too
(``rerun_hooks``), the real ``.grad`` is left alone, compiled
code runs eagerly so its modules are seen, and the module hooks that check
every module exist only for the replay's duration. It never issues a
collective: a DDP wrapper's ``.module`` is replayed, and models holding
SyncBatchNorm or FSDP-sharded modules are not replayed on one rank at all.

``replay_forward`` runs a pass whose output was off; ``replay_backward`` runs
the step's last pass forward and backward when its gradients were off, and
places the backward origin at the module whose part of the graph made it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import ExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from trainwatch.collect import quiet
from trainwatch.collect.nonfinite_entering import as_handed, entering_bad
from trainwatch.collect.nonfinite_hooks import register_keyword_hooks
from trainwatch.collect.nonfinite_locate import NonfiniteFinding, innermost_holding, op_of_node
from trainwatch.collect.op_trace import (
    _PASS_THROUGH,
    _TORCH_DIR,
    _TRAINWATCH_DIR,
    _null,
    swapped_buffers,
)
from trainwatch.collect.rerun_effects import UndoneEffects, call_arguments
from trainwatch.collect.rerun_hooks import HeldOffTensorHooks
from trainwatch.collect.tensors import (
    detached_copies,
    inexact_tensors,
    input_range,
    local_part,
    non_leaf,
)
from trainwatch.compiled import OutOfGraphDispatchMode, eager
from trainwatch.hooks import HookGroup
from trainwatch.rng import PassDraws, drawing_as_at, forked_rngs
from trainwatch.whole_layers import fully_sharded

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe


def replay_target(module: nn.Module) -> nn.Module | None:
    """What a one-rank replay may run: never anything that issues a collective.

    ``DistributedDataParallel`` syncs buffers and reduces gradients with the
    other ranks: its ``.module`` is replayed instead. ``SyncBatchNorm`` and
    FSDP-sharded modules talk to the other ranks inside their own forward:
    they are not replayed at all (None); ``unreplayed_origin`` says what can
    be told without a replay.
    """
    inner = getattr(module, "module", None)
    if isinstance(inner, nn.Module) and type(module).__name__ == "DistributedDataParallel":
        module = inner
    if fully_sharded(module) or any(isinstance(p, nn.SyncBatchNorm) for p in module.modules()):
        return None
    return module


NOT_REPLAYED = (
    "not replayed: FSDP-sharded (or SyncBatchNorm) modules talk to the other ranks "
    "inside their own pass, so a replay on one rank alone would wait for them"
)


def unreplayed_origin(module: nn.Module, args: Any, kwargs: Any) -> NonfiniteFinding:
    """A bad pass that may not be replayed here: what its inputs and this rank's
    weights say, without running anything.

    An input already non-finite is the origin (the data, as a replay would
    find). Otherwise the NaN/Inf was born inside the model, on this rank, from
    finite inputs: in which module is not known, so the model is named.
    """
    given = [t for t in inexact_tensors([args, kwargs]) if t.numel()]
    for tensor in given:
        bad = tensor.detach()
        if not bool(torch.isfinite(bad).all()):
            finding = NonfiniteFinding(
                module=0,
                direction="forward",
                cause="input",
                kind="nan" if bool(torch.isnan(bad).any()) else "inf",
                count=int((~torch.isfinite(bad)).sum()),
                shape=tuple(bad.shape),
                dtype=str(bad.dtype),
                device=str(bad.device),
            )
            finding.op_basis = NOT_REPLAYED
            return finding
    finding = NonfiniteFinding(module=0, direction="forward", cause="unreplayed")
    finding.op_basis = NOT_REPLAYED
    # Seen now, before this step's update: this rank's shards of the weights.
    finding.weights_nonfinite = not all(
        bool(torch.isfinite(local_part(p.detach())).all()) for p in module.parameters()
    )
    found = input_range(given)
    if found is not None:
        finding.input_min, finding.input_max = found
    return finding


class Replay:
    """Re-running a pass must not change training: RNG forked, buffers swapped, and
    whatever else the forward changes in the model's state put back.

    ``rng``: the CPU generator's state as the pass began, set inside the fork,
    with those of the model's own generators then (put back after), so the
    replay draws what the pass drew (its dropout masks, a token dropout drawn
    from ``self.gen``). ``arguments``:
    the values the replayed call is given (a generator among them is put back).
    """

    def __init__(
        self,
        probe: NonfiniteProbe,
        grad: bool,
        rng: PassDraws = None,
        arguments: list[Any] | None = None,
    ) -> None:
        self.probe = probe
        self.grad = grad
        self.rng = rng
        self.arguments = arguments or []
        self._stack: Any = None

    def __enter__(self) -> Replay:
        probe = self.probe
        self._stack = ExitStack()
        root = probe._modules[0]() if probe._modules else None
        # Whatever the forward changes in the model's state (a momentum encoder,
        # a queue, a memory) is put back, as if the replay never ran.
        effects = UndoneEffects(root.modules(), self.arguments) if root is not None else _null()
        self._stack.enter_context(effects)
        self._stack.enter_context(swapped_buffers(root) if root is not None else _null())
        # The CUDA generators too: a replay's dropout must not move training's RNG.
        self._stack.enter_context(forked_rngs(devices=probe.cuda_devices()))
        self._stack.enter_context(drawing_as_at(self.rng))
        self._stack.enter_context(torch.enable_grad() if self.grad else torch.no_grad())
        self._stack.enter_context(quiet.replay())
        self._stack.enter_context(eager())  # compiled modules run (and are seen) one by one
        if not probe._handles:
            # Module hooks only for the replay: healthy passes run without them.
            handles = HookGroup()
            handles.extend(probe.module_hooks())
            handles.extend(register_keyword_hooks(probe))
            self._stack.callback(handles.remove_all)
        probe._replaying = True
        probe._this_pass.known.clear()
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.probe._replaying = False
        self.probe._this_pass.known.clear()
        self.probe._this_pass.calls_in_progress.clear()
        self._stack.close()
        return True  # a replay that fails only means no finer location


class FirstNonfiniteBackward(OutOfGraphDispatchMode):
    """Watches a replay's backward: the autograd node whose op first made a NaN/Inf
    out of finite values (``SqrtBackward0`` at a zero: its op is a division, the
    node says what it differentiates). Only in a replay: a check per op.

    An op fed a value the forward saved may find it non-finite already: in
    ``torch.where(h > 0, torch.sqrt(h), 0)`` the forward's sqrt of a negative
    ``h`` is NaN, masked out, and its derivative reads it back, so no op of
    that backward has finite inputs. ``watch_graph`` hooks the graph's nodes
    for that: the first node whose gradient went non-finite while the gradient
    it was handed was finite made it. Whichever of the two sees it first wins.
    """

    def __init__(self) -> None:
        super().__init__()
        self.node: Any = None
        self.made: torch.Tensor | None = None  # the non-finite tensor it made
        self._handles: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.node is None:
            node = torch._C._current_autograd_node()
            if node is not None and not _finite(out) and _finite((args, kwargs)):
                self._seen(node, out)
        return out

    def _seen(self, node: Any, made: Any) -> None:
        self.node = node
        self.made = next(
            (t.detach() for t in _inexact(made) if not bool(torch.isfinite(t).all())), None
        )

    def watch_graph(self, outputs: list[torch.Tensor]) -> None:
        """Hook every node of the replay's graph (the hooks go with ``__exit__``)."""
        for node in graph_nodes([o.grad_fn for o in outputs]):
            if type(node).__name__ == "AccumulateGrad":
                continue  # a weight's own: it hands nothing on
            try:
                self._handles.append(node.register_hook(partial(self._node_done, node)))
            except (AttributeError, RuntimeError):
                continue

    def _node_done(self, node: Any, grad_inputs: Any, grad_outputs: Any) -> None:
        if self.node is None and not _finite(grad_inputs) and _finite(grad_outputs):
            self._seen(node, grad_inputs)

    def __exit__(self, *exc: Any) -> Any:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return super().__exit__(*exc)


# Nodes a replay's graph is walked for, at most (the walk runs once something is off).
_GRAPH_LIMIT = 1_000_000


def graph_nodes(roots: list[Any], limit: int = _GRAPH_LIMIT) -> Iterator[Any]:
    """Every autograd node reachable from ``roots``, each once."""
    seen: set[int] = set()
    stack = [r for r in roots if r is not None]
    while stack and len(seen) < limit:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(fn for fn, _ in getattr(node, "next_functions", ()) if fn is not None)


# A frame of the stack anomaly mode keeps with a node: '  File "x.py", line 3, in f'.
_FRAME = re.compile(r'File "(.+)", line (\d+), in (\S+)')
# PyTorch's frame that calls a module: an op below it ran in that module's forward.
_MODULE_CALL = os.path.join("nn", "modules", "module.py")


def node_source(node: Any) -> str | None:
    """The user's line in a module's own ``forward`` that made ``node``, from the
    stack autograd kept for it (the replay's forward runs in anomaly mode).

    None when no stack was kept, or the op ran in one of PyTorch's own modules
    (``nn.Linear``): the user's line further out would be the module's call.
    """
    metadata = getattr(node, "metadata", None)
    stack = metadata.get("traceback_") if isinstance(metadata, dict) else None
    if not stack:
        return None
    for entry in reversed(stack):
        found = _FRAME.search(entry)
        if found is None:
            continue
        name, line, function = found.groups()
        if name.startswith(_TORCH_DIR) or "<frozen" in name:
            if name.endswith(_MODULE_CALL):
                return None  # inside a module PyTorch wrote
            continue
        if name.startswith(_TRAINWATCH_DIR):
            if function in _PASS_THROUGH:
                continue
            return None
        return f"{name}:{line}"
    return None


def _inexact(value: Any) -> list[torch.Tensor]:
    """The floating and complex tensors in ``value``: a complex gradient (a complex
    sqrt's derivative at 0) holds the NaN before the op that makes it real."""
    return [
        t
        for t in tree_leaves(value)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel()
    ]


def _finite(value: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _inexact(value))


def backward_leaving_grads(
    outputs: list[torch.Tensor], params: list[torch.Tensor], grads: list[torch.Tensor]
) -> None:
    """Backward from ``outputs`` with the parameters' real ``.grad`` left as they are.

    ``torch.autograd.grad`` never touches ``.grad``; a reentrant checkpoint
    refuses it, so there the gradients are set aside around a plain backward
    and put back (the replay only happens once a step's gradients were bad).
    """
    try:
        # The graph is kept for the second try: the refusal comes mid-way.
        torch.autograd.grad(outputs, params, grads, allow_unused=True, retain_graph=True)
        return
    except RuntimeError as exc:
        if "checkpoint" not in str(exc):
            raise
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        torch.autograd.backward(outputs, grads)
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


# -- what is replayed, and when ------------------------------------------------

REPLAY_STREAK = 3  # bad steps in a row after which replays stop


def replay_forward(
    probe: NonfiniteProbe, module: nn.Module, args: Any, kwargs: Any, rng: PassDraws
) -> None:
    """Run the pass again module by module to find where its NaN/Inf was born."""
    # Grad mode as in the pass itself: the replay takes the paths the pass took
    # (a forward may branch on ``torch.is_grad_enabled()``).
    target = replay_target(module)
    if target is None:
        # Collective-free: the inputs and this rank's weights, read as they are.
        probe._this_step.forward_origin = unreplayed_origin(module, args, kwargs)
        return
    module = target
    with Replay(
        probe, grad=torch.is_grad_enabled(), rng=rng, arguments=call_arguments(args, kwargs)
    ):
        args, kwargs = detached_copies((args, kwargs))
        module(*args, **kwargs)


def replay_backward(probe: NonfiniteProbe) -> bool:
    """This step's gradients are bad: run the last pass again, forward and backward.

    The gradient that entered the model is fed back in, and every module's
    gradients are checked on the way; the real ``.grad`` is left alone
    (``torch.autograd.grad``). Returns whether a replay ran.
    """
    if probe._this_pass.last_call is None or probe._this_step.backward_origin is not None:
        return False
    entering_bad(probe)
    probe._step_bad = True
    if probe._bad_streak >= REPLAY_STREAK:
        return False  # still broken: what follows is the cascade, already reported
    if probe._this_step.forward_origin is not None or probe._this_step.entering_origin is not None:
        return False
    module, args, kwargs, rng = probe._this_pass.last_call
    module = replay_target(module)
    if module is None:
        probe._this_step.backward_unreplayable = True
        return False
    params = [p for p in module.parameters() if p.requires_grad]
    # The user's gradient hooks (a logger, a reversal layer's counter) are held off
    # for it: on the weights, and those its forward registers.
    with (
        Replay(probe, grad=True, rng=rng, arguments=call_arguments(args, kwargs)),
        HeldOffTensorHooks(params),
    ):
        args, kwargs = detached_copies((args, kwargs))
        # Anomaly mode keeps, with every node, the stack that made it: the
        # line of the op whose derivative turns out to make the NaN/Inf.
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            output = module(*args, **kwargs)
        outs = [o for o in inexact_tensors(output) if non_leaf(o)]
        entering = probe._this_pass.grad_entering
        pairs = [(o, as_handed(g, o)) for o, g in zip(outs, entering) if g is not None]
        if pairs and params:
            watch = probe._backward_watch = FirstNonfiniteBackward()
            try:
                with watch:
                    watch.watch_graph([o for o, _ in pairs])
                    backward_leaving_grads([o for o, _ in pairs], params, [g for _, g in pairs])
            finally:
                probe._backward_watch = None  # the graph it saw goes with the replay
            if watch.node is not None:
                _place_backward_birth(probe, watch.node, watch.made)
            probe._this_step.backward_replayed = True
    return True


def _place_backward_birth(
    probe: NonfiniteProbe, node: Any, made: torch.Tensor | None = None
) -> None:
    """The replay saw the autograd node that made the first NaN/Inf from finite
    values: the innermost module call whose part of the graph holds it made it.

    The gradient hooks alone can name the wrong module when the NaN is born
    in a module's own code (``torch.sqrt`` in its ``forward``): a child
    reading the same tensor sees that tensor's whole gradient, every
    reader's share summed, and looks like the origin; with no child
    around the op, the NaN would look as if it came from the loss.
    """
    found = innermost_holding(probe._this_step.calls, probe._this_pass.grad_fns, node)
    if found is None:
        return  # outside every module: the gradient entering the model says so
    origin = probe._this_step.backward_origin
    if origin is not None and origin.module == found.module:
        return
    finding = NonfiniteFinding(
        module=found.module,
        direction="backward",
        cause="module",
        kind=origin.kind if origin is not None else None,
        dtype=found.dtype,  # its output's: the gradient through it has that dtype
        device=found.device,
    )
    finding.op, finding.op_basis = op_of_node(node), "re-run"
    finding.source = node_source(node)
    if made is not None:  # told as the node made it
        finding.kind = "nan" if bool(torch.isnan(made).any()) else "inf"
        finding.count = int((~torch.isfinite(made)).sum())
        finding.shape = tuple(made.shape)
    probe._this_step.backward_origin = finding
