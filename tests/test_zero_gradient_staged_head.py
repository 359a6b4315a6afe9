"""A staged auxiliary head: its warning is withdrawn once its loss term joins.

A two-head model whose second head's loss is switched on after a warm-up (an
auxiliary task, a curriculum) gives that head no gradient at all for its first
steps: ``zero_gradient`` tells it, since nobody can tell it then from a head
cut off by a ``.detach()``. When every parameter of it keeps getting gradients
for a run of steps, the rule takes its warning back in a note (``data.kind:
joined``, ``data.withdraws``), as ``frozen_in_optimizer`` does for a freeze
undone: ``--fail-on warning`` passes, and the summaries mark the warning
undone. A head cut off for good (its logit detached) and a head used only now
and then after the warm-up (unused_parameter's story) keep the warning
standing. Under ``tw.watch``, ``trainwatch run`` (the script's own monitor
too) and Lightning alike.
"""

from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.alert import standing_worst
from trainwatch.lightning import TrainWatchCallback
from trainwatch.report import build_report
from trainwatch.runner import EXIT_ALERTS, run_script

WARMUP, STEPS = 16, 40


class CustomerNet(nn.Module):
    """A churn logit and a lifetime value from one trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.churn_head = nn.Linear(16, 1)
        self.ltv_head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.churn_head(h).squeeze(-1), self.ltv_head(h).squeeze(-1)


def churn_term(variant: str, step: int, logit: torch.Tensor, target: torch.Tensor):
    """The churn loss of ``step``, or None where it is left out: ``staged`` joins
    after the warm-up for good, ``detached`` joins with its logit cut off by a
    ``.detach()`` (the bug), ``rare`` joins on one step in five only."""
    if step < WARMUP or (variant == "rare" and step % 5):
        return None
    if variant == "detached":
        logit = logit.detach()
    return F.binary_cross_entropy_with_logits(logit, target)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 12, generator=gen)
    return x, x[:, :3].sum(1), (x[:, 3] > 0.5).float()


def _watched_run(quiet_watch, variant: str) -> tw.Monitor:
    torch.manual_seed(0)
    model = CustomerNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with quiet_watch(model, opt) as monitor:
        for step in range(STEPS):
            x, ltv, churn = _batch(step)
            churn_logit, ltv_pred = model(x)
            loss = F.mse_loss(ltv_pred, ltv)
            extra = churn_term(variant, step, churn_logit, churn)
            if extra is not None:
                loss = loss + extra
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor


def _told(alerts, head: str = "churn_head") -> list[tuple[str, int, str | None, bool]]:
    return [
        (a.severity, a.step, a.data.get("kind"), bool(a.data.get("withdraws")))
        for a in alerts
        if a.rule == "zero_gradient" and a.module == head
    ]


def _standing(monitor: tw.Monitor) -> str | None:
    return standing_worst((a, a.step) for a in monitor.alerts)


def test_a_staged_head_under_watch_is_withdrawn_when_it_joins_the_loss(quiet_watch):
    monitor = _watched_run(quiet_watch, "staged")
    assert _told(monitor.alerts) == [
        ("warning", 0, "none", False),
        ("info", WARMUP, "joined", True),
    ]
    note = next(a for a in monitor.alerts if a.data.get("kind") == "joined")
    assert note.data["parameters"] == ["churn_head.weight", "churn_head.bias"]
    assert note.data["since_step"] == WARMUP and note.data["steps"] == 10
    assert "joined the loss at step 16" in note.message
    assert _standing(monitor) == "info"


def test_control_a_head_detached_for_good_stays_a_warning(quiet_watch):
    monitor = _watched_run(quiet_watch, "detached")
    assert _told(monitor.alerts) == [("warning", 0, "none", False)]
    assert _standing(monitor) == "warning"


def test_control_a_head_used_on_rare_steps_after_the_warm_up_stays_a_warning(quiet_watch):
    monitor = _watched_run(quiet_watch, "rare")
    assert _told(monitor.alerts) == [("warning", 0, "none", False)]
    assert "unused_parameter" in {a.rule for a in monitor.alerts}
    assert _standing(monitor) == "warning"


def test_a_head_joining_for_fewer_steps_than_needed_stays_a_warning(quiet_watch):
    """Gradients for nine steps in a row, then none again: not staged in."""
    torch.manual_seed(0)
    model = CustomerNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with quiet_watch(model, opt) as monitor:
        for step in range(STEPS):
            x, ltv, churn = _batch(step)
            churn_logit, ltv_pred = model(x)
            loss = F.mse_loss(ltv_pred, ltv)
            if WARMUP <= step < WARMUP + 9:
                loss = loss + F.binary_cross_entropy_with_logits(churn_logit, churn)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert _told(monitor.alerts) == [("warning", 0, "none", False)]


# ``python multitask.py VARIANT OWN``: OWN "own" watches the loop with the
# script's own ``tw.watch``; "run" leaves it to ``trainwatch run``.
SCRIPT = """
import contextlib
import sys
import torch
from torch.nn import functional as F
import trainwatch as tw
from tests.test_zero_gradient_staged_head import STEPS, CustomerNet, _batch, churn_term

variant, own = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = CustomerNet()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
watch = tw.watch(model, opt, console=False) if own == "own" else contextlib.nullcontext()
with watch:
    for step in range(STEPS):
        x, ltv, churn = _batch(step)
        churn_logit, ltv_pred = model(x)
        loss = F.mse_loss(ltv_pred, ltv)
        extra = churn_term(variant, step, churn_logit, churn)
        if extra is not None:
            loss = loss + extra
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

LIGHTNING_SCRIPT = """
import sys
import lightning.pytorch as pl
from tests.test_zero_gradient_staged_head import LitCustomer

pl.Trainer(
    max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
).fit(LitCustomer(sys.argv[1]))
"""


class LitCustomer(pl.LightningModule):
    """The same model, its churn loss switched on by the trainer's global step."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = CustomerNet()
        self.variant = variant

    def forward(self, x: torch.Tensor):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, ltv, churn = batch
        churn_logit, ltv_pred = self(x)
        loss = F.mse_loss(ltv_pred, ltv)
        extra = churn_term(self.variant, self.global_step, churn_logit, churn)
        return loss if extra is None else loss + extra

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        batches = [_batch(step) for step in range(STEPS)]
        data = TensorDataset(*(torch.cat(parts) for parts in zip(*batches)))
        return DataLoader(
            data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
        )


def _run(tmp_path: Path, variant: str, how: str) -> tuple[int, list[tuple]]:
    script = tmp_path / "multitask.py"
    script.write_text(textwrap.dedent(LIGHTNING_SCRIPT if how == "lightning" else SCRIPT))
    args = [variant] if how == "lightning" else [variant, how]
    code = run_script(script, args, log_dir=tmp_path / "log", fail_on="warning", console=True)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    told = [
        (a["severity"], a["step"], a["data"].get("kind"), bool(a["data"].get("withdraws")))
        for a in map(json.loads, lines)
        if a["rule"] == "zero_gradient" and a["module"].endswith("churn_head")
    ]
    return code, told


@pytest.mark.parametrize("how", ["run", "own", "lightning"])
def test_run_fail_on_warning_passes_a_staged_head(tmp_path, capsys, how):
    code, told = _run(tmp_path, "staged", how)
    assert told == [("warning", 0, "none", False), ("info", WARMUP, "joined", True)]
    assert code == 0
    err = capsys.readouterr().err
    assert "failing" not in err
    if how != "own":  # the script's own monitor keeps its summary to itself
        assert "warning (undone 16)" in err
    rows = build_report(tmp_path / "log").rows
    assert [(r.severity, r.undone_step) for r in rows if r.rule == "zero_gradient"] == [
        ("warning", WARMUP)
    ]
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())["counts"]
    assert [c["first_step"] for c in counts if c["rule"] == "zero_gradient"] == [0, WARMUP]


@pytest.mark.parametrize("how", ["run", "own", "lightning"])
@pytest.mark.parametrize("variant", ["detached", "rare"])
def test_control_run_fail_on_warning_fails_a_head_never_staged_in(tmp_path, capsys, how, variant):
    code, told = _run(tmp_path, variant, how)
    assert told == [("warning", 0, "none", False)]
    assert code == EXIT_ALERTS
    err = capsys.readouterr().err
    assert "failing (exit 3): an alert of severity warning" in err
    assert "(undone" not in err


def _lightning_fit(tmp_path: Path, variant: str) -> tuple[TrainWatchCallback, str]:
    console = io.StringIO()
    callback = TrainWatchCallback(console=console, log_dir=str(tmp_path / "tw"))
    trainer = quiet_trainer(tmp_path, [callback], max_steps=STEPS)
    trainer.fit(LitCustomer(variant))
    return callback, console.getvalue()


def test_a_staged_head_under_lightning_is_withdrawn_when_it_joins_the_loss(tmp_path):
    callback, console = _lightning_fit(tmp_path, "staged")
    alerts = callback.monitor.alerts
    assert _told(alerts, "net.churn_head") == [
        ("warning", 0, "none", False),
        ("info", WARMUP, "joined", True),
    ]
    assert "warning (undone 16)" in console
    assert standing_worst((a, a.step) for a in alerts) == "info"


def test_control_a_detached_head_under_lightning_stays_a_warning(tmp_path):
    callback, console = _lightning_fit(tmp_path, "detached")
    alerts = callback.monitor.alerts
    assert _told(alerts, "net.churn_head") == [("warning", 0, "none", False)]
    assert "(undone" not in console
    assert standing_worst((a, a.step) for a in alerts) == "warning"
