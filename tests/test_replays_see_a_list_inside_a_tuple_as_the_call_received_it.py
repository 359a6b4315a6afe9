"""A NaN replay runs a pass on the list inside its tuple argument as the call received it.

A recurrent block is often called with its state in a list inside a tuple:
``cell((x, [h]))``, its forward writing the new state back into that list
(``state[0] = h``) so the caller goes on from it, or the loop moving the
list on once the call returns (``state[0] = next_h``). The arguments' check
took a tuple for a plain value and never looked into it: the replay (at the
pass's end on CPU, at the step boundary on a GPU, and the backward replay
at the step boundary) ran the model on the state the call left behind. A
NaN made by ``gate``'s log was then blamed on the data (the state written
back was that NaN already), and a NaN gradient made by ``norm``'s sqrt was
not found again (the state moved on) and blamed on ``lin``'s weights.

Each planted bug sits beside its healthy twin, which stays silent and trains
bit for bit as without trainwatch, the lists rewritten as they would be; a
NaN in the state the call received is still told as the data's.
"""

from __future__ import annotations

import textwrap

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.test_run import alerts as logged_alerts
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

BAD_STEP = 3
STEPS = 6


def _told(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.severity != "info"]


class LogGate(nn.Module):
    """Scales by the log of the step's first feature: NaN where it is negative."""

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return h * torch.log(x[:, :1])


class StatefulCell(nn.Module):
    """Called as ``cell((x, state))``: writes its new state back into ``state``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4 + 8, 8)
        self.gate = LogGate()
        self.head = nn.Linear(8, 2)

    def forward(self, inputs):
        x, state = inputs
        previous = state["h"] if isinstance(state, dict) else state[0]
        h = self.gate(torch.tanh(self.lin(torch.cat([x, previous], -1))), x)
        if isinstance(state, dict):
            state["h"] = h
        else:
            state[0] = h  # the caller goes on from the new state
        return self.head(h)


class SqrtNorm(nn.Module):
    """Adds each row's norm: finite forward, an Inf derivative at an all-zero row."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.sqrt((h**2).sum(-1, keepdim=True))


class Cell(nn.Module):
    """Called as ``cell((x, state))``: reads its state, leaves it to the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4 + 8, 8, bias=False)
        self.norm = SqrtNorm()
        self.head = nn.Linear(8, 2)

    def forward(self, inputs):
        x, state = inputs
        return self.head(self.norm(self.lin(torch.cat([x, state[0]], -1))))


def _train_rewritten(plant: str | None, container: str = "list", check: str | None = None):
    """The forward writes its state back into the list (or dict) inside its tuple.
    The losses, the weights after, the state each call left, the alerts (None unwatched)."""
    torch.manual_seed(0)
    model = StatefulCell()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if check is not None:
        monitor = tw.watch(model, opt, console=False, nonfinite_forward={"check": check})
    losses, left = [], []
    try:
        for step in range(STEPS):
            x = torch.rand(16, 4) + 0.5
            h = torch.zeros(16, 8)
            if step == BAD_STEP and plant == "negative feature":
                x[3, 0] = -1.0
            if step == BAD_STEP and plant == "nan state":
                h[5, 2] = float("nan")
            state = {"h": h} if container == "dict" else [h]
            loss = F.cross_entropy(model((x, state)), torch.randint(0, 2, (16,)))
            left.append(state["h"] if container == "dict" else state[0])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if monitor is not None:
            monitor.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return losses, weights, left, None if monitor is None else monitor.alerts


def _train_moved_on(plant: bool, check: str | None = None):
    """The loop moves the list inside the tuple on once the call returns."""
    torch.manual_seed(0)
    model = Cell()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if check is not None:
        monitor = tw.watch(model, opt, console=False, nonfinite_forward={"check": check})
    state = [torch.rand(16, 8)]
    losses = []
    try:
        for step in range(STEPS):
            x = torch.rand(16, 4) + 0.5
            if plant and step == BAD_STEP:
                x[3] = 0.0
                state[0][3] = 0.0  # an all-zero row reaches norm
            out = model((x, state))
            state[0] = torch.rand(16, 8)  # the next chunk's state, set by the loop
            loss = F.cross_entropy(out, torch.randint(0, 2, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if monitor is not None:
            monitor.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return losses, weights, None if monitor is None else monitor.alerts


# -- the forward replay ----------------------------------------------------------------
@pytest.mark.parametrize("check", ["auto", "step"])
@pytest.mark.parametrize("container", ["list", "dict"])
def test_a_nan_made_in_a_module_is_placed_there_though_the_forward_rewrote_the_state_in_its_tuple(
    container, check
):
    *_, alerts = _train_rewritten("negative feature", container, check)
    first = _told(alerts)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "gate")
    assert first.data["cause"] == "module"
    assert first.data["op"] == "aten::log"


def test_a_nan_in_the_state_the_call_received_is_still_the_datas():
    *_, alerts = _train_rewritten("nan state", check="auto")
    first = _told(alerts)[0]
    assert (first.rule, first.step) == ("nonfinite_forward", BAD_STEP)
    assert first.data["cause"] == "input"


@pytest.mark.parametrize("container", ["list", "dict"])
def test_control_the_cell_rewriting_its_state_stays_silent_and_trains_as_without_trainwatch(
    container,
):
    plain_losses, plain_weights, plain_left, _ = _train_rewritten(None, container)
    losses, weights, left, alerts = _train_rewritten(None, container, check="auto")
    assert _told(alerts) == []
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    # Its forward's writes land in the caller's containers as they would unwatched.
    assert all(torch.equal(a, b) for a, b in zip(left, plain_left))


# -- the backward replay -----------------------------------------------------------------
@pytest.mark.parametrize("check", ["auto", "step"])
def test_a_nan_gradient_is_placed_in_its_module_though_the_loop_moved_the_state_in_the_tuple_on(
    check,
):
    *_, alerts = _train_moved_on(True, check)
    first = _told(alerts)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", BAD_STEP, "norm")
    assert first.data["cause"] == "module" and first.data["op"] == "aten::sqrt"


def test_control_the_cell_whose_state_the_loop_moves_on_stays_silent_and_trains_as_without():
    plain_losses, plain_weights, _ = _train_moved_on(False)
    losses, weights, alerts = _train_moved_on(False, check="auto")
    assert _told(alerts) == []
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))


# -- Lightning --------------------------------------------------------------------------
class StatefulLit(pl.LightningModule):
    """The stateful cell trained by a Trainer: a negative feature at one batch."""

    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.cell = StatefulCell()
        self.bad = bad

    def forward(self, inputs):
        return self.cell(inputs)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.bad and batch_idx == BAD_STEP:
            x = x.clone()
            x[3, 0] = -1.0
        state = [torch.zeros(len(x), 8)]
        return F.cross_entropy(self((x, state)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("bad", [True, False])
def test_lightning_places_the_nan_of_a_cell_rewriting_the_state_in_its_tuple(tmp_path, bad):
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.rand(96, 4, generator=gen) + 0.5, torch.randint(0, 2, (96,), generator=gen)
    )
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=STEPS)
    torch.manual_seed(0)
    trainer.fit(StatefulLit(bad), torch.utils.data.DataLoader(data, batch_size=16))
    told = _told(callback.monitor.alerts)
    if not bad:
        assert told == []
        return
    first = told[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "cell.gate")
    assert first.data["cause"] == "module" and first.data["op"] == "aten::log"


# -- trainwatch run -------------------------------------------------------------------------
SCRIPT = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)

class LogGate(nn.Module):
    def forward(self, h, x):
        return h * torch.log(x[:, :1])

class Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 8)
        self.gate = LogGate()
        self.head = nn.Linear(8, 2)
    def forward(self, inputs):
        x, state = inputs
        h = self.gate(torch.tanh(self.lin(torch.cat([x, state[0]], -1))), x)
        state[0] = h.detach()
        return self.head(h)

model = Cell()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state = [torch.zeros(16, 8)]
for step in range(8):
    x = torch.rand(16, 4) + 0.5
    if step == 5 and BAD:
        x[3, 0] = -1.0
    loss = F.cross_entropy(model((x, state)), torch.randint(0, 2, (16,)))
    opt.zero_grad(); loss.backward(); opt.step()
    if not torch.isfinite(state[0]).all():
        state = [torch.zeros(16, 8)]
"""


@pytest.mark.parametrize("bad", [True, False])
def test_trainwatch_run_places_the_nan_of_a_cell_carrying_its_state_in_a_tuple(tmp_path, bad):
    script = tmp_path / "cell.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("BAD", str(bad)))
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    told = [a for a in logged_alerts(tmp_path / "log") if a["severity"] != "info"]
    if not bad:
        assert told == []
        return
    first = told[0]
    assert (first["rule"], first["step"], first["module"]) == ("nonfinite_forward", 5, "gate")
    assert first["data"]["cause"] == "module" and first["data"]["op"] == "aten::log"
