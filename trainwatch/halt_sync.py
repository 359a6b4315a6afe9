"""Under ``torch.distributed``, a halt on one rank stops every rank at the same step.

A rank that raised alone would leave the others waiting in their next
collective (DDP's gradient all-reduce) until the process group's timeout, maybe
half an hour later. So every rank holds its own halt and, every
``distributed.halt_check_every`` steps, all of them reduce one flag: one small
all-reduce, paid only when ``halt_on`` names a rule. When any rank flagged, the
halting alert is gathered (an object gather, on that step only), the hooks
registered in :attr:`HaltSync.before_halt` run on every rank together (the
Lightning callback's relay delivers the other ranks' alerts to rank zero
there), and every rank raises :class:`TrainingHealthError` with the alert of
the first rank that halted, stamped with that rank (``data["rank"]``).

Under FSDP2 the same step-end all-reduce carries the whole-layer gradient
norms' vector (``trainwatch.whole_layers``) at their cadence: one collective
when both fall on a step, and this object exists without ``halt_on`` too
(``halting`` False), for the norms alone.

When a check returns or raises, the backend holds none of its tensors. A gloo
collective runs on one of the process group's worker threads, and ``wait()``
returns as the data lands: the worker lets go of the tensors a moment later,
and letting go of a tensor Python also knows needs the GIL. A halt is raised
right after the check's last collective and a script often ends right after
it; when the interpreter is already finalizing by the time the worker asks
for the GIL, Python stops that thread inside a C++ destructor and the process
aborts ("terminate called without an active exception", SIGABRT). So the
check follows its tensors by weak reference and waits, the GIL released,
until the worker has dropped them (almost always it already has; at most
``LET_GO_S``).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
import weakref
from collections.abc import Callable

import torch

from trainwatch.alert import Alert
from trainwatch.errors import TrainingHealthError
from trainwatch.whole_layers import WholeLayerNorms

# The longest a check waits for the backend's worker threads to drop its tensors.
LET_GO_S = 1.0


def running_distributed() -> bool:
    """A process group of more than one rank is up."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class HaltSync:
    def __init__(
        self, every: int, halting: bool = True, layers: WholeLayerNorms | None = None
    ) -> None:
        self.every = every
        # False: no halt_on; only the whole-layer norms and the `after_step` hooks.
        self.halting = halting
        self.layers = layers
        # Run on every rank at each step's end, before the check (a relay's
        # delivery point); each must be non-collective or run on every rank.
        self.after_step: list[Callable[[int], None]] = []
        self.held: TrainingHealthError | None = None
        # Run on every rank, together, before the halt is raised.
        self.before_halt: list[Callable[[], None]] = []
        # Hands another rank's halting alert to this rank's sinks (rank zero
        # writes it), when no relay delivers it already.
        self.report_remote: Callable[[Alert], None] | None = None

    def hold(self, halt: TrainingHealthError) -> None:
        if self.held is None:
            self.held = halt

    def at_step(self, step: int) -> None:
        """Called by every rank at the end of each step (0-based ``step``)."""
        for hook in self.after_step:
            hook(step)
        halt_due = self.halting and (step + 1) % self.every == 0
        layers = self.layers
        norms_due = layers is not None and layers.due(step)
        if not halt_due and not norms_due:
            return
        dist = torch.distributed
        handed: list[weakref.ref] = []
        flag = 1.0 if halt_due and self.held is not None else 0.0
        if layers is not None and norms_due:
            flag_first = [torch.tensor([flag], dtype=torch.float64), layers.payload()]
            reduced = _summed(torch.cat(flag_first), handed)
            del flag_first
            layers.land(reduced[1:], dist.get_world_size())
            flagged = reduced[0] > 0.0
        else:
            flagged = _summed(torch.tensor([flag], dtype=torch.float64), handed)[0] > 0.0
        if not halt_due or not flagged:
            _let_go(handed)
            return
        mine = self.held.alert.to_dict() if self.held is not None else None
        gathered = _gathered(mine, handed)
        _let_go(handed)
        rank = dist.get_rank()
        origin = next(r for r, found in enumerate(gathered) if found is not None)
        alert = Alert.from_dict(gathered[origin])
        alert = dataclasses.replace(alert, data={**alert.data, "rank": origin})
        for hook in self.before_halt:
            hook()
        if rank == 0 and self.report_remote is not None:
            for other, found in enumerate(gathered):
                if other != 0 and found is not None:
                    remote = Alert.from_dict(found)
                    self.report_remote(
                        dataclasses.replace(remote, data={**remote.data, "rank": other})
                    )
        self.held = None
        raise TrainingHealthError(alert)


def _summed(tensor: torch.Tensor, handed: list[weakref.ref]) -> list[float]:
    """``tensor`` summed across ranks (one all-reduce), as a list; the caller keeps
    no reference to it, so that ``_let_go`` can tell when the backend dropped it."""
    dist = torch.distributed
    tensor = tensor.to(_device())
    handed.append(weakref.ref(tensor))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def _gathered(obj: object, handed: list[weakref.ref]) -> list:
    """Every rank's ``obj``, by rank: ``all_gather_object`` with tensors of our own,
    so that the check can follow them to the end (see ``_let_go``)."""
    dist = torch.distributed
    world, device = dist.get_world_size(), _device()
    data = pickle.dumps(obj)
    sizes = [int(size) for size in _summed_sizes(len(data), world, handed)]
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    handed.extend(weakref.ref(t) for t in (mine, *parts))
    dist.all_gather(parts, mine)
    return [
        pickle.loads(part[:size].cpu().numpy().tobytes())
        for part, size in zip(parts, sizes, strict=True)
    ]


def _summed_sizes(size: int, world: int, handed: list[weakref.ref]) -> list[float]:
    """Each rank's ``size``, by rank (one all-reduce of a one-hot row)."""
    row = torch.zeros(world, dtype=torch.float64)
    row[torch.distributed.get_rank()] = float(size)
    return _summed(row, handed)


def _let_go(handed: list[weakref.ref]) -> None:
    """Waits, the GIL released, until the backend's worker threads have dropped
    the tensors of this check's collectives (gloo only: its workers drop them
    right after each collective; at most ``LET_GO_S``)."""
    if torch.distributed.get_backend() != "gloo":
        return
    deadline = time.monotonic() + LET_GO_S
    while any(ref() is not None for ref in handed) and time.monotonic() < deadline:
        time.sleep(0.0002)


def _device() -> torch.device:
    """NCCL reduces CUDA tensors only; gloo and the others, CPU ones."""
    dist = torch.distributed
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
