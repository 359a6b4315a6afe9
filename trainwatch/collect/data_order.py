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

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler

# Samplers that pick samples one at a time, in order or at random: the batches
# they make hold whatever classes the data gives. Any other composes batches
# by a design of the user's own.
_PLAIN_SAMPLERS = (
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
)


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


def own_batching(loader: Any) -> str | None:
    """The sampler of the user's own that composes ``loader``'s batches, or None.

    A P x K identity sampler (re-identification, metric learning) or an
    episode sampler (N-way K-shot) puts few classes in each batch on purpose,
    a bucketing sampler groups by length: batches holding few classes are then
    the design, not data stored sorted by class.
    """
    if not isinstance(loader, DataLoader):
        return None
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is not None and type(batch_sampler) is not BatchSampler:
        return type(batch_sampler).__name__
    sampler = batch_sampler.sampler if batch_sampler is not None else loader.sampler
    if not isinstance(sampler, _PLAIN_SAMPLERS):
        return type(sampler).__name__
    return None
