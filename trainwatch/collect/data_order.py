"""Whether a training DataLoader reads its dataset in order.

``DataLoader(shuffle=False)`` without a sampler of the user's own builds a
``SequentialSampler`` (inside a ``BatchSampler``): index 0, 1, 2, ... every
epoch. A ``DistributedSampler(shuffle=False)`` reads each rank's share in
order too. A sampler or batch sampler of the user's own (weighted, grouped by
length, curriculum) is a choice, and an ``IterableDataset`` has no sampler to
judge: both are left alone.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import BatchSampler, DataLoader, SequentialSampler
from torch.utils.data.distributed import DistributedSampler


def sequential_order(loader: Any) -> str | None:
    """How ``loader`` reads its data in order (for the alert), or None when it does not."""
    if not isinstance(loader, DataLoader):
        return None
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(loader, "sampler", None)
    if batch_sampler is not None:
        if type(batch_sampler) is not BatchSampler:
            return None  # the user's own batching
        sampler = batch_sampler.sampler
    if type(sampler) is SequentialSampler:
        return "a SequentialSampler (DataLoader(shuffle=False))"
    if isinstance(sampler, DistributedSampler) and not getattr(sampler, "shuffle", True):
        return "a DistributedSampler(shuffle=False)"
    return None
