"""What kind of model gradients exploded in, looked at only as the alert is built.

The same explosion has different causes by the model. In a regression a
corrupt target far outside the data's range makes a squared error, and its
gradient, as large as it likes: a robust loss is one fix. A recurrent network
multiplies its signal by the same weights at every time step, so an update
that grows them a little grows the gradients through the sequence by their
power; and a classification loss's gradient on its logits is bounded (softmax
minus a one-hot) whatever the target. There no outlier explains it: the
updates blew the weights up, and clipping the gradients with a small
``max_norm`` and a lower learning rate are the fixes. A recurrent network
trained with a regression loss has both causes open: which one a jump is, the
course of its norms says (see trainwatch.rules.gradient_scale).

The modules are read from the model when asked; the loss functions are those
the loss audit (``collect/broadcast.py``) saw take the model's outputs in its
first steps, by their torch names, none where it did not run.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

# Losses whose gradient on the model's outputs is bounded whatever the target.
CLASSIFICATION_LOSSES = frozenset(
    {
        "cross_entropy",
        "nll_loss",
        "binary_cross_entropy",
        "binary_cross_entropy_with_logits",
        "multi_margin_loss",
        "multilabel_margin_loss",
        "multilabel_soft_margin_loss",
        "soft_margin_loss",
        "ctc_loss",
        "kl_div",
    }
)
# Losses an outlier target can make as large as it likes.
REGRESSION_LOSSES = frozenset(
    {
        "mse_loss",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "gaussian_nll_loss",
        "poisson_nll_loss",
    }
)
LOSSES = CLASSIFICATION_LOSSES | REGRESSION_LOSSES

RECURRENT = "recurrent"
CLASSIFICATION = "classification"


RECURRENT_MODULES = (nn.RNNBase, nn.RNNCellBase)


def recurrent_modules(model: nn.Module) -> list[str]:
    """``model``'s recurrent modules (``nn.RNN``/``LSTM``/``GRU`` or a cell), by
    their qualified names, in the model's order."""
    return [name for name, module in model.named_modules() if isinstance(module, RECURRENT_MODULES)]


def recurrent_module(model: nn.Module | None) -> str | None:
    """The first recurrent module of ``model``, by its qualified name; None when it
    has none."""
    if model is None:
        return None
    return next(iter(recurrent_modules(model)), None)


def regression_loss(losses: Collection[str]) -> str | None:
    """The first regression loss among ``losses`` (by name), None where none was seen:
    an outlier target or input can make its gradient as large as it likes."""
    return min((loss for loss in losses if loss in REGRESSION_LOSSES), default=None)


def explosion_kind(model: nn.Module | None, losses: Collection[str]) -> tuple[str, str] | None:
    """Where an explosion comes from the weights, not from an outlier in the data:
    ``(RECURRENT, module)`` for a model with a recurrent module, ``(CLASSIFICATION,
    loss)`` for one trained with classification losses only; None otherwise (a
    regression, or a loss not seen)."""
    found = recurrent_module(model)
    if found is not None:
        return RECURRENT, found
    if losses and not any(loss in REGRESSION_LOSSES for loss in losses):
        classes = sorted(loss for loss in losses if loss in CLASSIFICATION_LOSSES)
        if classes:
            return CLASSIFICATION, classes[0]
    return None
