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

When a check returns or raises, the backend holds none of its tensors
(``trainwatch.followed_collectives`` says why that matters at exit).

A monitor has its own built by :func:`halt_sync_for_run` at its first step
boundary, where it also learns which rank it writes for.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainwatch.alert import Alert
from trainwatch.errors import TrainingHealthError
from trainwatch.followed_collectives import Followed
from trainwatch.sinks.base import StepNumbers
from trainwatch.whole_layers import Deliver, WholeLayerNorms, fully_sharded

if TYPE_CHECKING:
    from trainwatch.config import Config
    from trainwatch.dispatch import Dispatcher
    from trainwatch.step_pipeline import StepPipeline


def process_group_up() -> bool:
    """A process group is initialised (of any size: one rank of a launch counts)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


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
        followed = Followed()
        flag = 1.0 if halt_due and self.held is not None else 0.0
        if layers is not None and norms_due:
            flag_first = [torch.tensor([flag], dtype=torch.float64), layers.payload()]
            reduced = followed.sum(torch.cat(flag_first))
            del flag_first
            layers.land(reduced[1:], dist.get_world_size())
            flagged = reduced[0] > 0.0
        else:
            flagged = followed.sum(torch.tensor([flag], dtype=torch.float64))[0] > 0.0
        if not halt_due or not flagged:
            followed.let_go()
            return
        mine = self.held.alert.to_dict() if self.held is not None else None
        gathered = followed.all_gather_object(mine)
        followed.let_go()
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


def halt_sync_for_run(
    config: Config,
    root: nn.Module,
    pipeline: StepPipeline,
    dispatcher: Dispatcher,
    *,
    relayed: bool,
    after_step: list[Callable[[int], None]],
    before_halt: list[Callable[[], None]],
    on_error: Callable[[str, BaseException], None],
) -> HaltSync | None:
    """A monitor's step-end collective across ranks (the halt check; under FSDP2 the
    whole-layer norms too), or None where none is needed.

    Built at the first step boundary, not at watch time: the process group is
    often set up after the model is watched. Then too each rank's alerts are
    stamped with its rank (unless a relay, ``relayed``, stamps them), and under
    FSDP2 the pipeline is given its whole-layer norms. ``after_step`` and
    ``before_halt`` are the monitor's own lists (adapters add to them later).
    """
    if not running_distributed():
        return None
    if not relayed:
        # Each rank writes its own sinks: say which rank each alert is from.
        dispatcher.rank = torch.distributed.get_rank()
    if fully_sharded(root):
        pipeline.whole = WholeLayerNorms(
            config.distributed.gather_every,
            pipeline.layers.layers,
            _report_whole_norms(pipeline, dispatcher),
            on_error,
        )
    if not (config.halt_on or pipeline.whole is not None or after_step):
        return None
    sync = HaltSync(
        config.distributed.halt_check_every,
        halting=bool(config.halt_on),
        layers=pipeline.whole,
    )
    sync.after_step = after_step
    sync.before_halt = before_halt
    sync.report_remote = None if relayed else _report_remote(dispatcher)
    return sync


def _report_whole_norms(pipeline: StepPipeline, dispatcher: Dispatcher) -> Deliver:
    """Under FSDP2, a step's whole-layer norms summed across ranks become what is
    reported (``grad_norms()``, the sinks' numbers). The pipeline, which holds the
    norms' collector, is reached weakly: no cycle keeps a dropped monitor's alive."""
    ref = weakref.ref(pipeline)

    def deliver(step: int, optimizer: int | None, norms: dict[str, float], total: float) -> None:
        target = ref()
        if target is None:
            return
        target.latest_by_source[optimizer] = norms
        target.total_norm = total
        dispatcher.numbers(StepNumbers(step, norms, total))

    return deliver


def _report_remote(dispatcher: Dispatcher) -> Callable[[Alert], None]:
    """Another rank's halting alert, written by this rank's sinks (rank zero)."""

    def report(alert: Alert) -> None:
        dispatcher.publish([alert], may_halt=False)

    return report
