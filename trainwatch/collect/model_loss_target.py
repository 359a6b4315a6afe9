"""The target a model's own loss received, read from the loss's autograd graph.

A model called with ``labels=`` computes its loss inside its forward pass,
out of the class target look's sight (its span opens when the pass ends).
A causal language model does not hand those labels to the loss as they
are: it shifts them (position ``t`` predicts the token at ``t + 1``), so
the loss sees one position a row fewer (``labels[:, 1:]``), or, as
transformers' ``ForCausalLMLoss`` does, the shifted labels with
``ignore_index`` appended to each row. What the loss counted is in the
graph: the ``nll_loss`` node ``cross_entropy`` leaves keeps the very target
tensor it received and its ``ignore_index``, a node or two from the loss.
Reading them dispatches no op.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

# The autograd nodes of nll_loss (cross_entropy's last op): flat, and (N, C, d...).
_CLASS_LOSS_NODES = frozenset({"NllLossBackward0", "NllLoss2DBackward0"})
# Nodes looked at from the loss: enough for a loss divided by a token count
# (transformers' num_items_in_batch) or summed with an auxiliary loss.
_NODES = 16


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss a model returned: its ``loss`` field or key, or the scalar a tuple
    output starts with (transformers' ``return_dict=False``)."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, tuple) and output:
        loss = output[0]
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.grad_fn is not None:
        return loss
    return None


def _signed(index: int) -> int:
    """An ``ignore_index`` as the graph keeps it (a 64-bit unsigned integer) made signed."""
    return index - (1 << 64) if index >= 1 << 63 else index


def loss_target(output: Any, sizes: Collection[int]) -> tuple[torch.Tensor, int] | None:
    """The target and ``ignore_index`` of the class loss behind the model's returned
    loss whose target has one of ``sizes`` elements, or None (no such loss, a
    compiled or fused one whose graph keeps no target)."""
    loss = _loss_of(output)
    if loss is None:
        return None
    queue = [loss.grad_fn]
    for _ in range(_NODES):
        if not queue:
            return None
        node = queue.pop(0)
        if type(node).__name__ in _CLASS_LOSS_NODES:
            try:
                target = node._saved_target
                ignored = node._saved_ignore_index
            except RuntimeError:  # the graph's saved tensors were freed
                return None
            if isinstance(target, torch.Tensor) and target.numel() in sizes:
                return target, _signed(int(ignored))
            continue  # another loss: its logits are not looked into
        queue.extend(child for child, _ in node.next_functions if child is not None)
    return None
