"""The one device-to-host transfer per step, now or one step later.

Everything a step measured on the device is concatenated and copied back
together, so the cost is one transfer however many layers the model has. On
CUDA the copy can be *lagged*: started without blocking at the end of step k
and read at the end of step k+1, by when the GPU has long finished it, so the
host never waits for the device. Alerts still carry step k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Staged:
    """A step's numbers on their way to the host."""

    def __init__(self, pieces: Sequence[torch.Tensor], non_blocking: bool) -> None:
        self._sizes = [int(p.numel()) for p in pieces]
        self._event = None
        self._host: torch.Tensor | None = None
        self._lists: list[list[float]] | None = None
        if not pieces:
            return
        devices = {p.device for p in pieces}
        if devices == {torch.device("cpu")}:
            # Already on the host: no transfer, no concatenation.
            self._lists = [p.reshape(-1).tolist() for p in pieces]
            return
        if len(devices) > 1:
            self._host = torch.cat([p.reshape(-1).float().cpu() for p in pieces])
            return
        flat = torch.cat([p.reshape(-1).float() for p in pieces])
        (device,) = devices
        if device.type == "cuda" and non_blocking:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))
        else:
            self._host = flat.cpu()

    @property
    def lagged(self) -> bool:
        return self._event is not None

    def values(self) -> list[list[float]]:
        if self._lists is not None:
            return self._lists
        if self._host is None:
            return [[] for _ in self._sizes]
        if self._event is not None:
            self._event.synchronize()  # long done by now: the next step ran meanwhile
        flat = self._host.tolist()
        out, start = [], 0
        for size in self._sizes:
            out.append(flat[start : start + size])
            start += size
        return out


def wants_lag(mode: str, pieces: Sequence[torch.Tensor]) -> bool:
    """``auto`` lags on CUDA, where a sync stalls the queue, and reads at once elsewhere."""
    if mode == "sync" or not pieces:
        return False
    if mode == "lagged":
        return True
    return any(p.device.type == "cuda" for p in pieces)


def read_back(pieces: Sequence[torch.Tensor]) -> list[list[float]]:
    """Copy 1-D device tensors to the host in one transfer, split again."""
    return Staged(pieces, non_blocking=False).values()
