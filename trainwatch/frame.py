"""A step's device numbers, read back to the host in one transfer.

Collectors add the tensors they measured during a step (gradient norms, the
output's sum codes, sampled activation statistics, the loss) and keep the
handle they get back; after :meth:`StepFrame.read` each handle gives its own
values. Everything is concatenated and copied back together, so the cost is
one transfer however many layers the model has.

On CUDA the copy can be *lagged*: started without blocking at the end of
step k and read at the end of step k+1, by when the GPU has long finished it,
so the host never waits for the device. Alerts still carry step k.
"""

from __future__ import annotations

import torch

_HOST = {torch.device("cpu")}


class Slot:
    """A handle on one piece of a frame: its values once the frame is read."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: StepFrame, index: int) -> None:
        self.frame = frame
        self.index = index

    def values(self) -> list[float]:
        lists = self.frame._lists  # read already (always, on the host): no call
        return lists[self.index] if lists is not None else self.frame.values_of(self.index)

    def value(self) -> float | None:
        """The first value (a scalar piece), or None for an empty piece."""
        values = self.values()
        return values[0] if values else None


class StepFrame:
    def __init__(self) -> None:
        self._pieces: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._devices: set[torch.device] = set()
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._lists: list[list[float]] | None = None
        self._known: dict[int, list[float]] = {}  # pieces read on the host already
        self.transfers = 0  # device-to-host copies made (0 or 1)

    def __len__(self) -> int:
        return len(self._pieces)

    def add(self, tensor: torch.Tensor, read: list[float] | None = None) -> Slot:
        """Read ``tensor`` (any shape, flattened) back with the step.

        ``read``: its values, read on the host already (a CPU trigger's look):
        kept for the frame's read instead of reading that piece a second time.
        """
        if self._lists is not None or self._host is not None:
            raise RuntimeError("this step's frame was already read back")
        if read is not None:
            self._known[len(self._pieces)] = read
        if tensor.requires_grad:
            tensor = tensor.detach()
        flat = tensor if tensor.dim() == 1 else tensor.reshape(-1)
        self._pieces.append(flat)
        self._sizes.append(flat.numel())
        self._devices.add(flat.device)
        return Slot(self, len(self._pieces) - 1)

    def piece(self, slot: Slot) -> torch.Tensor | None:
        """The tensor ``slot`` reads back, while this frame is not read yet (None after)."""
        if slot.frame is not self or self._lists is not None or self._host is not None:
            return None
        return self._pieces[slot.index]

    def wants_lag(self, mode: str) -> bool:
        """``auto`` lags on CUDA, where a sync stalls the queue, and reads at once elsewhere."""
        if mode == "sync" or not self._pieces:
            return False
        if mode == "lagged":
            return True
        for device in self._devices:
            if device.type == "cuda":
                return True
        return False

    def read(self, non_blocking: bool = False) -> None:
        """Start the one transfer; ``non_blocking`` on CUDA lets the values land later."""
        pieces = self._pieces
        if not pieces:
            self._lists = []
            return
        devices = self._devices
        if devices == _HOST:
            # Already on the host: no transfer, no concatenation.
            known = self._known
            if not known:
                self._lists = [p.tolist() for p in pieces]
            elif len(known) == len(pieces):  # keyed 0, 1, ... in the order added
                self._lists = list(known.values())
            else:
                self._lists = [known.get(i) or p.tolist() for i, p in enumerate(pieces)]
            return
        self.transfers = 1
        if len(devices) > 1:
            self._host = torch.cat([p.float().cpu() for p in pieces])
            return
        flat = torch.cat([p.float() for p in pieces])
        (device,) = devices
        if device.type == "cuda" and non_blocking:
            self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))
        else:
            self._host = flat.cpu()

    def landed(self) -> bool:
        """Its values can be read without waiting on the device: read on the host
        already, or its copy finished (asked by a look judging a step later)."""
        if self._lists is not None:
            return True
        if self._host is None:
            return False
        return self._event is None or bool(self._event.query())

    @property
    def lagged(self) -> bool:
        return self._event is not None

    def values_of(self, index: int) -> list[float]:
        if self._lists is None:
            self._lists = self._split()
        return self._lists[index]

    def _split(self) -> list[list[float]]:
        if self._host is None:
            return [[] for _ in self._sizes]
        if self._event is not None:
            self._event.synchronize()  # long done by now: the next step ran meanwhile
        flat = self._host.tolist()
        out, start = [], 0
        for size in self._sizes:
            out.append(flat[start : start + size])
            start += size
        self._pieces = []  # the device tensors are no longer needed
        return out
