"""The loss scale of a GradScaler, read without a sync of its own.

``GradScaler`` keeps its scale in a one-element device tensor (``_scale``,
made at the first ``scale()`` call and updated in place by ``update()``).
A step reads a copy of it with the step's other numbers, in the same single
transfer; a host read (``loss_scale``) happens only on the slow path, once
many backward passes went by without a step.
"""

from __future__ import annotations

from typing import Any

import torch


def scale_tensor(scaler: Any) -> torch.Tensor | None:
    """A copy of the scale the step's backward used; None while none exists yet
    (before the first ``scale()``, or a scaler built with ``enabled=False``)."""
    if scaler is None or not getattr(scaler, "_enabled", True):
        return None
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        return None
    # A copy: update() changes the scale in place before a lagged readback lands.
    return scale.detach().reshape(-1)[:1].clone()


def loss_scale(scaler: Any) -> float | None:
    """The scale as a host float (one sync on a device): for the slow path only."""
    scale = scale_tensor(scaler)
    return float(scale) if scale is not None else None
