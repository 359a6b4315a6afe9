"""Whether a model's weights moved between two of its passes, told without a sync.

A momentum target (BYOL, MoCo, DINO, a mean teacher) is updated outside
backward, in one of three ways, and each leaves a different trace on the
first parameter:

- an in-place update under ``no_grad`` (``t.lerp_(o, 0.01)``) bumps its
  version counter;
- ``param.data = ...`` (MoCo's own code) gives it new storage;
- an update written into ``param.data`` in place (``t.data.mul_(m).add_(...)``,
  as DINO does) changes neither: ``.data`` has a version counter of its own.
  Only the values show it, so a few of them are kept too.

The values are copied to the host without waiting: on a GPU the copy is
queued and only read at the next comparison, by when it has long landed.
"""

from __future__ import annotations

import torch
from torch import nn

# Values of the first parameter compared, evenly spread over it.
_SAMPLED = 8


class WeightsFingerprint:
    """The first parameter's version counter, storage, and a few of its values."""

    __slots__ = ("version", "storage", "_values", "_event")

    def __init__(self, first: torch.Tensor) -> None:
        self.version = first._version
        self.storage = first.data_ptr()
        flat = first.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // _SAMPLED)][:_SAMPLED]
        self._event: torch.cuda.Event | None = None
        if picked.is_cuda:
            values = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            values.copy_(picked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(picked.device))
            self._values: torch.Tensor | list = values
        elif picked.device.type == "cpu":
            self._values = picked.tolist()
        else:  # another accelerator: a copy would wait for it; the counters must do
            self._values = []

    def values(self) -> list:
        if self._event is not None:
            self._event.synchronize()  # queued at the last pass: done by now
            self._event = None
            self._values = self._values.tolist()  # type: ignore[union-attr]
        return self._values  # type: ignore[return-value]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WeightsFingerprint):
            return NotImplemented
        if self.version != other.version or self.storage != other.storage:
            return False
        mine, theirs = self.values(), other.values()
        # A NaN is never equal to itself: the same NaN in place is no move.
        return len(mine) == len(theirs) and all(
            a == b or (a != a and b != b) for a, b in zip(mine, theirs)
        )

    __hash__ = None  # type: ignore[assignment]


def weights_fingerprint(model: nn.Module | None) -> WeightsFingerprint | None:
    """What the model's weights are now, to compare with a later pass (None: no weights)."""
    first = next(model.parameters(), None) if model is not None else None
    return None if first is None else WeightsFingerprint(first)
