"""When the trainable-parameter audit is due, the audit, and the check of the step after it.

The audit (which parameters train, where, and which optimizer holds them) is
made at attach and again whenever a step's parameter counts differ from the
last audited ones: a ``requires_grad`` flip, a param group or a parameter
added. Those counts are what the step boundary has already made, so a
healthy step pays no call here. The first step after an audit then checks
that backward gave some trainable parameter a gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch.layers import ParamInfo
from trainwatch.record import SetupCheck, StepRecord
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

    def audit(
        self, step: int, root: nn.Module, optimizers: Sequence[Optimizer]
    ) -> tuple[SetupAudit, StepRecord]:
        """A new audit, and the record its rule judges (optimizer coverage)."""
        self.due = False
        revision = self.latest.revision + 1 if self.latest is not None else 0
        with _untoggled(root):
            audit = build_audit(root, optimizers, revision=revision, step=max(step, 0))
        self.latest = audit
        # Where the trainable ones sit (adapters at the module holding the pair).
        inner = [row.module for row in audit.locations if row.section == "trainable"]
        owners = inner or [row.module for row in audit.locations if row.trainable]
        record = StepRecord(step=max(step, 0), source="setup")
        record.setup = SetupCheck(
            revision, len(optimizers), audit.trainable, audit.unheld, list(owners)
        )
        self.reach_due = set(range(len(optimizers))) if optimizers else {None}
        return audit, record

    def check_reach(self, record: StepRecord, backward_ran: bool, optimizers: int) -> None:
        """First step after an audit: a backward ran, yet no trainable parameter got a
        gradient (``record.setup`` then says so, for the rule)."""
        if record.present or not record.missing or not backward_ran:
            return
        assert self.latest is not None
        record.setup = SetupCheck(
            self.latest.revision,
            optimizers,
            self.latest.trainable,
            self.latest.unheld,
            unreached=list(record.missing),
            never_called=record.never_called,
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
