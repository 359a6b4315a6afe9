"""The one device-to-host transfer per step.

Everything a step measured on the device is concatenated and copied back
together, so the cost is one sync (or none, on CPU) however many layers the
model has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def read_back(pieces: Sequence[torch.Tensor]) -> list[list[float]]:
    """Copy 1-D device tensors to the host in one transfer per device, split again."""
    if not pieces:
        return []
    sizes = [int(p.numel()) for p in pieces]
    devices = {p.device for p in pieces}
    if len(devices) == 1:
        flat = torch.cat([p.reshape(-1).float() for p in pieces]).cpu()
    else:
        flat = torch.cat([p.reshape(-1).float().cpu() for p in pieces])
    values = flat.tolist()
    out: list[list[float]] = []
    start = 0
    for size in sizes:
        out.append(values[start : start + size])
        start += size
    return out
