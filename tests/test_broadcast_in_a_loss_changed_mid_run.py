"""broadcast in a loss whose computation changes mid-run, with no other sign of a new phase.

A curriculum in the loop adds an auxiliary term from an epoch on
(``loss = loss + F.mse_loss(pred, y_aux)``, ``pred`` of shape ``(N, 1)`` and
``y_aux`` of shape ``(N,)``: every prediction averaged against every target), a
LightningModule's ``training_step`` adds it from ``current_epoch >= k``: no
optimizer, part or freeze changes, so no new phase re-arms the audit, and the
sampled rechecks (100, 200, 400, 800...) would find it hundreds of steps late.
The loss's kind (the types of the autograd ops from it back to the model's
output) is read on the class target look's sampled steps, at most
``loss_kind_every`` (10) steps apart; a new kind has the audit follow the next
step. So the bug is told within ``loss_kind_every`` steps of the change,
naming its source line. The same loops with a matching auxiliary target stay
silent (audited one step more), and loops whose loss legitimately varies from
step to step (mixup on half the batches, tasks in turn, gradient accumulation,
AMP, a label-smoothing warm-up) stay silent and are audited a few steps more,
not at every step.
"""

from __future__ import annotations

import inspect
import json
import sys
import textwrap
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

BOUND = 10  # steps from the change to its audit, at most: broadcast.loss_kind_every
BATCHES = 51  # an epoch: the term switched on at epoch 5 comes at step 255
SWITCH_EPOCH = 5
SWITCH = SWITCH_EPOCH * BATCHES
RECHECKS = [0, 1, 2, 100, 200]  # the audit's steps in any loop of 300: the first three, rechecks


def _audited(monitor: tw.Monitor) -> bool:
    """The training audit's mode is on the stack (asked between a pass and its loss)."""
    audit = monitor._pipeline.behaviour._audit
    return any(
        getattr(m, "audit", lambda: None)() is audit for m in _get_current_function_mode_stack()
    )


def _broadcasts(alerts) -> list[tuple[int, str | None, str, str]]:
    return [
        (a.step, a.module, a.data["op"], a.data["source"].rsplit(":", 1)[1])
        for a in alerts
        if a.rule == "broadcast"
    ]


def _line_of(function, text: str) -> str:
    """The line number of the line of ``function`` that holds ``text``."""
    lines, first = inspect.getsourcelines(function)
    return str(first + next(i for i, line in enumerate(lines) if text in line))


# --- a plain loop: a regressor, an auxiliary term from epoch 5 --------------------


def _curriculum(quiet_watch, flat: bool, epochs: int = 6):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=gen)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    audited = []
    step = 0
    for epoch in range(epochs):
        for _ in range(BATCHES):
            x = torch.randn(32, 8, generator=gen)
            y = x @ w
            y_aux = x[:, 0] * 2 if flat else x[:, :1] * 2
            pred = model(x)
            if _audited(monitor):
                audited.append(step)
            loss = F.mse_loss(pred, y)
            if epoch >= SWITCH_EPOCH:
                loss = loss + F.mse_loss(pred, y_aux)  # the auxiliary term
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    return monitor, audited


def test_an_auxiliary_term_added_at_an_epoch_is_told_within_the_bound(quiet_watch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own size warning
        monitor, _ = _curriculum(quiet_watch, flat=True)
    ((step, module, op, line),) = _broadcasts(monitor.alerts)
    assert SWITCH < step <= SWITCH + BOUND == SWITCH + tw.Config().broadcast.loss_kind_every
    assert (module, op, line) == (None, "mse_loss", _line_of(_curriculum, "auxiliary term"))
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["shapes"] == [[32, 1], [32]] and alert.data["result"] == [32, 32]
    assert [a.rule for a in monitor.alerts] == ["broadcast"]


def test_the_same_term_with_a_matching_target_is_silent_and_audited_one_step_more(
    quiet_watch,
):
    monitor, audited = _curriculum(quiet_watch, flat=False)
    assert monitor.alerts == []
    (extra,) = [step for step in audited if step not in RECHECKS]
    assert SWITCH < extra <= SWITCH + BOUND
    assert torch._C._len_torch_function_stack() == 0


def test_without_the_loss_kind_the_term_waits_for_the_sampled_recheck(quiet_watch):
    """The old bound: the first recheck after the change (400), past this run's end."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        monitor, _ = _curriculum(
            lambda m, o: quiet_watch(m, o, broadcast={"loss_kind_every": 0}), flat=True
        )
    assert _broadcasts(monitor.alerts) == []


# --- loops whose loss varies on purpose: silent, audited a few steps more ---------


def _varying(quiet_watch, kind: str, steps: int = 300):
    """A classifier whose loss takes more than one form from step 40 on (so that the
    new forms come after the audit of the first steps)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    scaler = torch.amp.GradScaler("cpu")
    audited = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = x[:, :4].argmax(1)
        late = step >= 40
        if kind == "accumulation":  # four micro-batches, each loss scaled
            for micro in range(4 if late else 1):
                rows = slice(micro * 8, micro * 8 + 8) if late else slice(None)
                out = model(x[rows])
                if micro == 0 and _audited(monitor):
                    audited.append(step)
                (F.cross_entropy(out, y[rows]) / (4 if late else 1)).backward()
            opt.step()
            opt.zero_grad()
            continue
        if kind == "amp" and late:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                if _audited(monitor):
                    audited.append(step)
                loss = F.cross_entropy(out, y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            continue
        mixed = kind == "mixup" and late and torch.rand(1, generator=gen).item() < 0.5
        if mixed:
            lam, perm = 0.7, torch.randperm(32, generator=gen)
            x = lam * x + (1 - lam) * x[perm]
        out = model(x)
        if _audited(monitor):
            audited.append(step)
        if mixed:
            loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
        elif kind == "tasks" and late and step % 3 == 1:
            loss = F.mse_loss(out, x[:, :4])
        elif kind == "tasks" and late and step % 3 == 2:
            loss = F.smooth_l1_loss(out.sum(1), x[:, 0])
        elif kind == "smoothing":
            loss = F.cross_entropy(out, y, label_smoothing=min(0.1, max(0, step - 40) / 1000))
        else:
            loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor, audited


@pytest.mark.parametrize("kind", ["mixup", "tasks", "accumulation", "amp", "smoothing"])
def test_a_loss_varying_on_purpose_is_silent_and_audited_a_few_steps_more(quiet_watch, kind):
    monitor, audited = _varying(quiet_watch, kind)
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []
    extra = [step for step in audited if step not in RECHECKS]
    assert len(extra) <= 6, extra  # each new form waits a step or two for its audit


def test_a_mixup_branch_with_a_flat_target_is_told_when_it_comes_again(quiet_watch):
    """The new form is found on a sampled step; the audit waits on the next steps
    until the branch is taken again, where the flat target is judged."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    mixed_steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for step in range(120):
            x = torch.randn(32, 8, generator=gen)
            y = x[:, :1].sin()
            mixed = step >= 43 and torch.rand(1, generator=gen).item() < 0.5
            if mixed:
                lam, perm = 0.7, torch.randperm(32, generator=gen)
                x = lam * x + (1 - lam) * x[perm]
                y_mixed = (lam * y + (1 - lam) * y[perm]).squeeze(1)  # flattened by mistake
                mixed_steps.append(step)
                loss = F.l1_loss(model(x), y_mixed)
            else:
                loss = F.l1_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    sampled = next(s for s in mixed_steps if s % BOUND == 0)
    again = next(s for s in mixed_steps if s > sampled)
    assert [(s, op) for s, _, op, _ in _broadcasts(monitor.alerts)] == [(again, "l1_loss")]


# --- Lightning: training_step adds the term from an epoch on ------------------------


class _AuxiliaryFromAnEpoch(pl.LightningModule):
    """A regressor whose ``training_step`` adds an auxiliary term from epoch 2 (step 46)."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.flat = flat
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y, y_aux = batch
        pred = self(x)
        loss = F.mse_loss(pred, y)
        if self.current_epoch >= 2:
            loss = loss + 0.5 * F.mse_loss(pred, y_aux.squeeze(1) if self.flat else y_aux)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        x = torch.randn(23 * 8, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :1].sin(), x[:, 1:2].cos()), batch_size=8)


@pytest.mark.parametrize("flat", [True, False], ids=["flat_target", "matching_target"])
def test_a_lightning_term_added_from_an_epoch_is_told_within_the_bound(tmp_path, flat):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=3, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(_AuxiliaryFromAnEpoch(flat))
    found = _broadcasts(callback.alerts)
    assert [a.rule for a in callback.alerts if a.severity != "info" and a.rule != "broadcast"] == []
    if not flat:
        assert found == []
        return
    ((step, module, op, line),) = found
    switch = 2 * 23
    assert switch < step <= switch + BOUND
    line_of_term = _line_of(_AuxiliaryFromAnEpoch.training_step, "y_aux.squeeze(1)")
    assert (module, op, line) == (None, "mse_loss", line_of_term)


# --- trainwatch run: an unmodified script -----------------------------------------

SCRIPT = """
import sys

import torch
import torch.nn.functional as F
from torch import nn

FLAT = sys.argv[1] == "flat"
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
w = torch.randn(8, 1, generator=gen)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for epoch in range(6):
    for i in range(51):
        x = torch.randn(32, 8, generator=gen)
        y = x @ w
        y_aux = x[:, 0] * 2 if FLAT else x[:, :1] * 2
        pred = model(x)
        loss = F.mse_loss(pred, y)
        if epoch >= 5:
            loss = loss + F.mse_loss(pred, y_aux)  # the auxiliary term
        opt.zero_grad()
        loss.backward()
        opt.step()
print("loss", loss.item())
"""


@pytest.fixture
def _forget_script_module():
    yield
    sys.modules.pop("aux_curriculum", None)


@pytest.mark.usefixtures("_forget_script_module")
@pytest.mark.parametrize("flat", [True, False], ids=["flat_target", "matching_target"])
def test_trainwatch_run_tells_the_term_within_the_bound(tmp_path, flat):
    script = tmp_path / "aux_curriculum.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log_dir = tmp_path / "log"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        code = run_script(script, ["flat" if flat else "col"], log_dir=log_dir, console=False)
    assert code == 0
    alerts = [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]
    if not flat:
        assert alerts == []
        return
    (alert,) = alerts
    assert alert["rule"] == "broadcast" and alert["data"]["op"] == "mse_loss"
    assert SWITCH < alert["step"] <= SWITCH + BOUND
    line = next(i + 1 for i, text in enumerate(SCRIPT.splitlines()) if "auxiliary term" in text)
    assert alert["data"]["source"] == f"{script}:{line}"
