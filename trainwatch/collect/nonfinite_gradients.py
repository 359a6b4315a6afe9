"""Each checked module call's gradients, summed as backward passes through it.

Tensor hooks on a call's inputs and outputs (never full backward hooks: about
150 us a module, and broken by in-place ops), placed only where each module
is checked (deferred mode, replays, recomputations). A call whose input
gradient went non-finite while its output gradient was finite is where the
backward NaN/Inf was born; on the spot it is named as backward reaches it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainwatch.collect.nonfinite_locate import ForwardCall, NonfiniteFinding, backward_op
from trainwatch.collect.nonfinite_replay import node_source
from trainwatch.collect.nonfinite_sums import grad_finite, grad_index, reads_now
from trainwatch.collect.tensors import non_leaf
from trainwatch.hooks import WeakHook

if TYPE_CHECKING:
    from trainwatch.collect.nonfinite import NonfiniteProbe


def hook_gradients(
    probe: NonfiniteProbe, call: ForwardCall, ins: list[torch.Tensor], outs: list[torch.Tensor]
) -> None:
    """Have the probe's ``on_grad`` told of the gradients of ``call``'s tensors."""
    # Leaves (a parameter handed to a module, or returned by one) are left
    # alone: a hook on one would stay on it after the step, one more each
    # step, and its gradient sums every use, so it names no single call;
    # the step's gradient norms check parameters anyway.
    for tensor in outs:
        if non_leaf(tensor):
            tensor.register_hook(WeakHook(probe, "on_grad", call, "out"))
            stop = {id(t.grad_fn) for t in ins if t.grad_fn is not None}
            probe._this_pass.grad_fns[id(call)] = (tensor.grad_fn, stop)
            break
    for tensor in ins:
        if non_leaf(tensor):
            tensor.register_hook(WeakHook(probe, "on_grad", call, "in"))


def on_grad(probe: NonfiniteProbe, call: ForwardCall, side: str, grad: torch.Tensor) -> None:
    """A gradient of ``call``'s output (``side`` "out") or input ("in") arrived."""
    if not probe.enabled:
        return
    if not (grad.is_floating_point() or grad.is_complex()) or grad.layout != torch.strided:
        return  # a complex tensor's gradient is complex: checked as its output was
    index = grad_index(probe, grad)
    if index is None:
        return
    probe._this_step.grad_events.append((call, side, index))
    if side == "out":
        probe._this_step.out_seen.add(id(call))
    on_the_spot = reads_now(probe, grad)
    if not on_the_spot or probe._this_step.backward_origin is not None:
        probe._this_step.immediate_grads = probe._this_step.immediate_grads and on_the_spot
        return
    if grad_finite(probe, index, grad):
        return
    probe._this_step.any_bad_grad = True
    if side == "out":
        probe._this_step.out_bad.add(id(call))
        return
    if id(call) in probe._this_step.out_bad or id(call) not in probe._this_step.out_seen:
        return  # its output gradient was already bad (propagated), or never came
    finding = NonfiniteFinding(
        module=call.module,
        direction="backward",
        cause="module",
        kind="nan" if bool(torch.isnan(grad).any()) else "inf",
        count=int((~torch.isfinite(grad)).sum()),
        shape=tuple(grad.shape),
        dtype=str(grad.dtype),
        device=str(grad.device),
    )
    watch = probe._backward_watch
    grad_fn, stop = probe._this_pass.grad_fns.get(id(call), (None, set()))
    seen = watch.node if watch is not None else None
    op = backward_op(grad_fn, stop, seen_bad=seen)
    if op is not None:
        finding.op, finding.op_basis = op
        if finding.op_basis == "re-run":
            finding.source = node_source(seen)
    probe._this_step.backward_origin = finding
