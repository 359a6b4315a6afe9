"""Probabilities fed to a loss function that expects logits or log-probabilities.

``F.softmax`` before ``nn.CrossEntropyLoss`` (which applies ``log_softmax``
itself) squeezes every logit into (0, 1): the gradient all but vanishes and a
classifier trains to a fraction of its accuracy without a NaN, a zero gradient
or a broadcast to show for it. The values cannot tell it (a confident model's
logits may lie in (0, 1) too); the autograd graph can: the loss's input was
made by a ``softmax`` or a ``sigmoid`` (``binary_cross_entropy_with_logits``
after a sigmoid, ``kl_div``'s log-probabilities taken as a softmax), perhaps
through a cast, a view or a slice. Judged by the
broadcast audit (``collect/broadcast.py``) on the steps it follows the loss.
"""

from __future__ import annotations

from typing import Any

import torch

# Each loss function that takes logits (or log-probabilities), the autograd nodes
# whose output it must not take, and what each finding is told as.
LOSS_INPUTS: dict[str, dict[str, str]] = {
    "cross_entropy": {
        "SoftmaxBackward0": "softmax_into_cross_entropy",
        "SigmoidBackward0": "sigmoid_into_cross_entropy",
    },
    "nll_loss": {"SoftmaxBackward0": "softmax_into_nll"},
    "binary_cross_entropy_with_logits": {
        "SigmoidBackward0": "sigmoid_into_bce_with_logits",
        "SoftmaxBackward0": "softmax_into_bce_with_logits",
    },
    # Its input is log-probabilities (the target is probabilities, or
    # log-probabilities with log_target=True): a distillation's student side.
    "kl_div": {"SoftmaxBackward0": "softmax_into_kl_div"},
}
# Nodes that only cast, reshape or select: probabilities through them stay probabilities
# (``probs[:, :-1].reshape(-1, V)`` for next-token targets, ``probs.float()``).
_KEEPS_VALUES = frozenset(
    {
        "ToCopyBackward0",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "CloneBackward0",
        "AliasBackward0",
        "TransposeBackward0",
        "TransposeBackward1",
        "PermuteBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "UnsqueezeBackward0",
        "SliceBackward0",
        "SelectBackward0",
        "ExpandBackward0",
    }
)
_MAX_HOPS = 6
SQUASHING = frozenset(node for nodes in LOSS_INPUTS.values() for node in nodes)


def _input(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    value = args[0] if args else kwargs.get("input")
    return value if isinstance(value, torch.Tensor) else None


def squashing_node(tensor: torch.Tensor) -> Any:
    """The softmax or sigmoid node that made ``tensor``, past casts and reshapes; or None."""
    node = tensor.grad_fn
    for _ in range(_MAX_HOPS):
        if node is None:
            return None
        name = type(node).__name__
        if name in SQUASHING:
            return node
        if name not in _KEEPS_VALUES or not node.next_functions:
            return None
        node = node.next_functions[0][0]
    return None


def made_by_log_softmax(tensor: torch.Tensor) -> bool:
    """``tensor`` is a log_softmax's output, past casts and reshapes, or scaled by a
    positive number (``log_softmax(x) / T``: a loss scaled by 1/T, no raw logits):
    nothing for ``nll_loss``'s raw-logit check to measure."""
    node = tensor.grad_fn
    for _ in range(_MAX_HOPS):
        if node is None:
            return False
        name = type(node).__name__
        if name == "LogSoftmaxBackward0":
            return True
        if name not in _KEEPS_VALUES and not _positive_scale(node, name):
            return False
        if not node.next_functions:
            return False
        node = node.next_functions[0][0]
    return False


def _positive_scale(node: Any, name: str) -> bool:
    """A multiplication or division of its first operand by a positive Python number."""
    if name not in ("MulBackward0", "DivBackward0"):
        return False
    other = getattr(node, "_saved_other", None)
    return (
        isinstance(other, torch.Tensor)
        and other.dim() == 0
        and other.device.type == "cpu"
        and float(other) > 0
    )


def probabilities_fed(name: str, args: Any, kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    """For loss function ``name`` given a softmax's (sigmoid's) output as its input:
    the finding's kind and the node that squashed it. Without a graph (a loss under
    ``no_grad``) nothing is told: the values alone cannot tell probabilities."""
    tensor = _input(args, kwargs)
    if tensor is None or tensor.grad_fn is None:
        return None
    node = squashing_node(tensor)
    if node is None:
        return None
    kind = LOSS_INPUTS[name].get(type(node).__name__)
    return (kind, node) if kind is not None else None
