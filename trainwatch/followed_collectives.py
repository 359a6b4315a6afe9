"""Collectives whose tensors are followed until the process group lets go of them.

A gloo collective runs on one of the process group's worker threads, and
``wait()`` returns as the data lands: the worker drops its references to the
tensors a moment later, and dropping a tensor Python also knows needs the
GIL. trainwatch's collectives often come right before a script ends (a halt
raised after the check, a last gather at close); when the interpreter is
already finalizing by the time the worker asks for the GIL, Python stops that
thread inside a C++ destructor and the process aborts ("terminate called
without an active exception", SIGABRT). So each collective here keeps a weak
reference to every tensor it hands over, and :meth:`Followed.let_go` waits,
the GIL released, until the worker has dropped them (almost always it already
has; at most ``LET_GO_S``).
"""

from __future__ import annotations

import pickle
import time
import weakref
from typing import Any

import torch

# The longest a caller waits for the backend's worker threads to drop its tensors.
LET_GO_S = 1.0


def collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo and the others, CPU ones."""
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Followed:
    """The tensors one caller hands to collectives, followed by weak reference."""

    def __init__(self) -> None:
        self._handed: list[weakref.ref[torch.Tensor]] = []

    def sum(self, tensor: torch.Tensor) -> list[float]:
        """``tensor`` summed across ranks (one all-reduce), as a list; no reference to
        it is kept, so that :meth:`let_go` can tell when the backend dropped it."""
        dist = torch.distributed
        tensor = tensor.to(collective_device())
        self._handed.append(weakref.ref(tensor))
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.tolist()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank: ``all_gather_object`` with tensors of our own."""
        dist = torch.distributed
        world, device = dist.get_world_size(), collective_device()
        data = pickle.dumps(obj)
        row = torch.zeros(world, dtype=torch.float64)
        row[dist.get_rank()] = float(len(data))
        sizes = [int(size) for size in self.sum(row)]  # each rank's size, one all-reduce
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        parts = [torch.empty_like(mine) for _ in range(world)]
        self._handed.extend(weakref.ref(t) for t in (mine, *parts))
        dist.all_gather(parts, mine)
        return [
            pickle.loads(part[:size].cpu().numpy().tobytes())
            for part, size in zip(parts, sizes, strict=True)
        ]

    def let_go(self) -> None:
        """Waits, the GIL released, until the backend's worker threads have dropped
        every tensor handed over (gloo only; at most ``LET_GO_S``)."""
        handed, self._handed = self._handed, []
        if torch.distributed.get_backend() != "gloo":
            return
        deadline = time.monotonic() + LET_GO_S
        while any(ref() is not None for ref in handed) and time.monotonic() < deadline:
            time.sleep(0.0002)
