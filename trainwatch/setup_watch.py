"""When the trainable-parameter audit is due, the audit, and the check of the step after it.

The audit (which parameters train, where, and which optimizer holds them) is
made at attach and again whenever a step's parameter counts differ from the
last audited ones: a ``requires_grad`` flip, a param group or a parameter
added. Those counts are what the step boundary has already made, so a
healthy step pays no call here. The first step after an audit then checks
that backward gave some trainable parameter a gradient. Under DDP, each
audit also compares the parameters DDP all-reduces with those trainable now:
more trainable (a layer unfrozen after wrapping, never synced) or fewer (one
frozen after wrapping, whose gradient DDP's reducer waits for in vain).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch.collect.loose_training import LayersFedLook, loose_training
from trainwatch.ddp_sync import SyncGap, parameter_names, sync_gaps
from trainwatch.halt_sync import process_group_up
from trainwatch.layers import ParamInfo
from trainwatch.record import FrozenOutput, SetupCheck, StepRecord
from trainwatch.setup_audit import SetupAudit, build_audit


class SetupWatch:
    def __init__(self) -> None:
        self.latest: SetupAudit | None = None
        # The counts last audited, per optimizer (None: steps without one).
        self.signatures: dict[int | None, tuple[int, ...]] = {}
        self.due = False
        # The frozen parameters each optimizer held at its last audit, by name.
        self.frozen_names: dict[int | None, dict[str, ParamInfo]] = {}
        # The optimizers whose next step checks what backward reached.
        self.reach_due: set[int | None] = set()
        # The step the check was due at, while it waits a boundary (see check_reach).
        self._reach_since: int | None = None
        # The note on updates made outside .grad was given.
        self._outside_told = False
        # Under a process group: the parameters frozen at the last audit, and
        # those already told as not synced by DDP, or as frozen after it.
        self._frozen_before: set[str] | None = None
        self._told_unsynced: set[str] = set()
        self._told_frozen: set[str] = set()
        # Frozen layers a pass's output came from before the audit they belong to
        # was made (the model's first pass, ahead of its first step boundary).
        self.frozen_output: FrozenOutput | None = None
        # Where no layer of the model trains and the optimizers train only tensors
        # outside them: the frozen layers' calls until the step after the audit ends.
        self._loose_look: LayersFedLook | None = None

    def audit(
        self, step: int, root: nn.Module, optimizers: Sequence[Optimizer]
    ) -> tuple[SetupAudit, StepRecord]:
        """A new audit, and the record its rule judges (optimizer coverage)."""
        self.due = False
        revision = self.latest.revision + 1 if self.latest is not None else 0
        with _untoggled(root):
            audit = build_audit(root, optimizers, revision=revision, step=max(step, 0))
            unsynced, frozen_after = self._ddp_gaps(root)
        self.latest = audit
        # Where the trainable ones sit (adapters at the module holding the pair).
        inner = [row.module for row in audit.locations if row.section == "trainable"]
        owners = inner or [row.module for row in audit.locations if row.trainable]
        record = StepRecord(step=max(step, 0), source="setup")
        record.setup = SetupCheck(
            revision, len(optimizers), audit.trainable, audit.unheld, list(owners)
        )
        if not audit.trainable:
            # A frozen EMA target in the optimizer beside the online network it follows.
            record.setup.trained_outside = sum(row.trainable for row in audit.optimizers)
        if self._loose_look is not None:
            self._loose_look.detach()
            self._loose_look = None
        if optimizers:
            # Whether all the optimizers train lies outside the model's frozen layers
            # (a walk that stops at the first trainable layer).
            loose = loose_training(root, optimizers)
            if loose is not None:
                self._loose_look = LayersFedLook(root, loose)
        if unsynced is not None:
            names, gap, every = unsynced
            record.setup.unsynced = names
            record.setup.synced, record.setup.sync_trainable = gap.synced, gap.trainable
            record.setup.find_unused = gap.find_unused
            record.setup.unsynced_all = every
        if frozen_after is not None:
            names, gap = frozen_after
            record.setup.frozen_after = names
            record.setup.synced, record.setup.sync_trainable = gap.synced, gap.trainable
        record.setup.frozen_output, self.frozen_output = self.frozen_output, None
        self.reach_due = set(range(len(optimizers))) if optimizers else {None}
        self._reach_since = None
        return audit, record

    def frozen_output_found(self, found: FrozenOutput) -> StepRecord | None:
        """Frozen layers a pass's output came from: kept for the audit still to be
        made, or the record that tells them now (the setup changed after the audit)."""
        if self.latest is None or self.due:
            self.frozen_output = found
            return None
        # Dated at the audit that saw the change, as its own findings are.
        record = StepRecord(step=self.latest.step, source="passes")
        record.setup = SetupCheck(
            self.latest.revision,
            len(self.latest.optimizers),
            self.latest.trainable,
            self.latest.unheld,
            frozen_output=found,
        )
        return record

    def _ddp_gaps(
        self, root: nn.Module
    ) -> tuple[tuple[list[str], SyncGap, bool] | None, tuple[list[str], SyncGap] | None]:
        """Where DDP's reducer and the trainable parameters disagree, not told before."""
        if not process_group_up():
            return None, None
        trainable, frozen = parameter_names(root)
        before, self._frozen_before = self._frozen_before, set(frozen)
        short, waits = sync_gaps(root)
        return (
            self._unsynced(trainable, before, short) if short is not None else None,
            self._frozen_after(frozen, before, waits) if waits is not None else None,
        )

    def _unsynced(
        self, trainable: list[str], before: set[str] | None, gap: SyncGap
    ) -> tuple[list[str], SyncGap, bool] | None:
        """Trainable parameters DDP does not all-reduce.

        Named: those frozen at the previous audit and trainable now (the layer
        just unfrozen), or every trainable one when no audit saw them frozen.
        DDP tells how many parameters it holds, not which: once it falls short,
        a layer unfrozen later is named whether DDP holds it or not.
        """
        newly = [name for name in trainable if before and name in before]
        if not newly and not self._told_unsynced:
            newly = trainable
        names = [name for name in newly if name not in self._told_unsynced]
        if not names:
            return None
        self._told_unsynced.update(names)
        return names, gap, names == trainable

    def _frozen_after(
        self, frozen: list[str], before: set[str] | None, gap: SyncGap
    ) -> tuple[list[str], SyncGap] | None:
        """Frozen parameters DDP's reducer still waits for.

        Named: those trainable at the previous audit and frozen now, or every
        frozen one when no audit saw them train (the monitor attached after
        the freeze; the count of those DDP waits for goes with them).
        """
        newly = [name for name in frozen if before is not None and name not in before]
        if not newly and not self._told_frozen:
            newly = frozen
        names = [name for name in newly if name not in self._told_frozen]
        if not names:
            return None
        self._told_frozen.update(names)
        return names, gap

    def check_reach(
        self,
        record: StepRecord,
        index: int | None,
        step: int,
        backward_ran: bool,
        optimizers: int,
    ) -> None:
        """First step after an audit: a backward ran, yet no trainable parameter got a
        gradient (``record.setup`` then says so, for the rule).

        Without an optimizer and with no gradient anywhere, whether the loop's own
        update moved the weights (gradients computed outside ``.grad``) is seen
        only by comparing two boundaries: the first waits for the next, and the
        check keeps its step.
        """
        look = self._loose_look
        if look is not None and self.latest is not None:
            if not look.ran:
                # Made at this boundary (Lightning's first audit): the layers are
                # looked at over the next step, and this check waits for it.
                return
            self._loose_look = None
            loose = look.verdict()
            if loose is not None:
                record.setup = SetupCheck(
                    self.latest.revision,
                    optimizers,
                    self.latest.trainable,
                    self.latest.unheld,
                    loose=loose,
                    since=self.latest.step,
                )
                self.reach_due.discard(index)
                return
        if record.weights_unseen and self._reach_since is None:
            self._reach_since = step
            return
        self.reach_due.discard(index)
        since, self._reach_since = self._reach_since, None
        assert self.latest is not None
        if record.moved_without_grad:
            if not self._outside_told:
                self._outside_told = True
                record.setup = SetupCheck(
                    self.latest.revision,
                    optimizers,
                    self.latest.trainable,
                    self.latest.unheld,
                    outside_grad=len(record.moved_without_grad),
                    since=since,
                )
            return
        if record.present or not record.missing or not backward_ran:
            return
        record.setup = SetupCheck(
            self.latest.revision,
            optimizers,
            self.latest.trainable,
            self.latest.unheld,
            unreached=list(record.missing),
            never_called=record.never_called,
            since=since,
        )


@contextmanager
def _untoggled(root: nn.Module) -> Iterator[None]:
    """The parameters' own ``requires_grad`` while the audit is made.

    Lightning's ``toggle_optimizer`` (a manual-optimisation GAN's recipe) freezes
    every parameter the stepping optimizer does not hold, for the while, and
    keeps their flags in ``_param_requires_grad_state``: an audit made then
    would show the generator frozen at the discriminator's step. Outside any
    autograd op (the step boundary), flipping them back and forth is harmless.
    """
    saved = getattr(root, "_param_requires_grad_state", None)
    if not isinstance(saved, dict) or not saved:
        yield
        return
    toggled = [(p, p.requires_grad) for p in saved if isinstance(p, torch.Tensor) and p.is_leaf]
    try:
        for param, _ in toggled:
            param.requires_grad_(bool(saved[param]))
        yield
    finally:
        for param, flag in toggled:
            param.requires_grad_(flag)
