"""A fixed point solved under ``no_grad`` at every training step is training, not an evaluation.

A deep-equilibrium model solves ``z = cell(z, u)`` without gradients, twenty
calls of its cell in training mode, then applies the cell once with gradients
(a Jacobian-free gradient); the solver often sits in the training loop and
calls ``model.cell``, or the watched model is the cell itself. A consistency
model's target is K steps of its own denoiser, run the same way. Counted one
call at a time these looked like a validation loop's batches and were told as
an evaluation in training mode at the first step, the hint asking for a
``model.eval()`` that would break the solver. Calls that feed on the one
before them are now one computation: a solve at every step is training and
stays silent. A validation loop that forgot ``model.eval()`` (a solve per
batch through the part, or the whole model over its batches) is still told,
at the step it ran in and at the part's module; ``whole_model`` says whether
the model around the part was left in training mode too.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback


class Cell(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.W, self.bn, self.drop = nn.Linear(d, d, bias=False), nn.BatchNorm1d(d), nn.Dropout(0.1)

    def forward(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bn(self.W(self.drop(z))) + u)


class DEQNet(nn.Module):
    """Injection, cell and head; ``forward`` solves with its own loop (one outer pass)."""

    def __init__(self, din: int = 20, d: int = 32, k: int = 4) -> None:
        super().__init__()
        self.inj, self.cell, self.head = nn.Linear(din, d), Cell(d), nn.Linear(d, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(fixed_point(self.cell, self.inj(x)))


def fixed_point(cell, u: torch.Tensor, iters: int = 20) -> torch.Tensor:
    z = torch.zeros_like(u)
    for _ in range(iters):
        z = cell(z, u)
    return z


def anderson(cell, u: torch.Tensor, iters: int = 20, m: int = 3) -> torch.Tensor:
    """Each new estimate mixed from the last ``m`` outputs: no call takes the last output."""
    z, outputs = torch.zeros_like(u), []
    for _ in range(iters):
        outputs = [*outputs, cell(z, u)][-m:]
        z = sum(outputs) / len(outputs)
    return z


SOLVERS = {"fixed_point": fixed_point, "anderson": anderson}


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    x = torch.randn(640, 20)
    return x, (x @ torch.randn(20, 4)).argmax(1)


def _warnings(monitor) -> list[tuple[str, str, int]]:
    return [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]


def _train_deq_through_its_cell(quiet_watch, solver, validate=None, put_in_eval=None):
    """Two epochs of 16 steps, each solving through ``model.cell`` under no_grad;
    after each epoch ``validate`` runs under no_grad, after ``put_in_eval``."""
    solve = SOLVERS[solver]
    x, y = _data()
    model = DEQNet()
    opt = torch.optim.Adam(model.parameters(), 2e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(2):
        model.train()
        for i in range(0, 512, 32):
            u = model.inj(x[i : i + 32])
            with torch.no_grad():
                z = solve(model.cell, u)
            loss = F.cross_entropy(model.head(model.cell(z, u)), y[i : i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if put_in_eval is not None:
            put_in_eval(model)
        with torch.no_grad():
            for j in range(512, 640, 32):
                if validate == "whole":
                    model(x[j : j + 32])
                elif validate == "cell":
                    model.head(solve(model.cell, model.inj(x[j : j + 32])))
    monitor.close()
    return monitor


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_a_deq_solved_through_its_cell_at_every_step_is_silent(quiet_watch, solver):
    monitor = _train_deq_through_its_cell(quiet_watch, solver, "cell", put_in_eval=nn.Module.eval)
    assert _warnings(monitor) == []
    assert [a for a in monitor.alerts if a.rule == "eval_in_train_mode"] == []


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@pytest.mark.parametrize("validate", ["cell", "whole"])
def test_a_deq_validated_without_eval_is_told(quiet_watch, solver, validate):
    monitor = _train_deq_through_its_cell(quiet_watch, solver, validate)
    found = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    # Once, at the first validation (after the first epoch's 16 steps), named at
    # a module of the cell; the whole model was left in training mode.
    assert [(a.step, a.module.startswith("cell.")) for a in found] == [(16, True)]
    assert found[0].severity == "warning"
    assert found[0].data["whole_model"] is True


def test_a_part_put_back_in_training_mode_is_not_the_whole_model(quiet_watch):
    """``model.eval()`` then ``model.cell.train()``: only the part ran, in training mode."""

    def cell_alone_in_training(model: nn.Module) -> None:
        model.eval()
        model.cell.train()

    monitor = _train_deq_through_its_cell(
        quiet_watch, "fixed_point", "cell", put_in_eval=cell_alone_in_training
    )
    found = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert [(a.step, a.module.startswith("cell.")) for a in found] == [(16, True)]
    assert found[0].data["whole_model"] is False


def _train_the_cell_as_the_model(quiet_watch, forgot_eval: bool):
    """The watched model is the cell: the solver's calls are passes of the whole model."""
    x, y = _data()
    torch.manual_seed(0)
    inj, cell, head = nn.Linear(20, 32), Cell(), nn.Linear(32, 4)
    opt = torch.optim.Adam([*inj.parameters(), *cell.parameters(), *head.parameters()], 2e-3)
    monitor = quiet_watch(cell, opt)
    for _ in range(2):
        cell.train()
        for i in range(0, 512, 32):
            u = inj(x[i : i + 32])
            with torch.no_grad():
                z = fixed_point(cell, u)
            loss = F.cross_entropy(head(cell(z, u)), y[i : i + 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if not forgot_eval:
            cell.eval()
        with torch.no_grad():
            for j in range(512, 640, 32):
                head(fixed_point(cell, inj(x[j : j + 32])))
    monitor.close()
    return monitor


@pytest.mark.parametrize("forgot_eval", [True, False], ids=["forgot_eval", "healthy"])
def test_a_watched_cell_solved_at_every_step_is_judged(quiet_watch, forgot_eval):
    monitor = _train_the_cell_as_the_model(quiet_watch, forgot_eval)
    found = [(rule, step) for rule, _, step in _warnings(monitor)]
    assert found == ([("eval_in_train_mode", 16)] if forgot_eval else [])


class Denoiser(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, d)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - 0.1 * self.net(x)


class Consistency(nn.Module):
    """Learns to jump K denoising steps at once; its target is K steps of its denoiser."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.denoiser = Denoiser(d)
        self.jump = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.jump(x)


def _denoise(model: Consistency, x: torch.Tensor, steps: int = 12) -> torch.Tensor:
    for _ in range(steps):
        x = model.denoiser(x)
    return x


@pytest.mark.parametrize("forgot_eval", [True, False], ids=["forgot_eval", "healthy"])
def test_a_target_iterated_through_a_part_at_every_step_is_training(quiet_watch, forgot_eval):
    model = Consistency()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(30):
        x = torch.randn(32, 16)
        denoised = model.denoiser(x + 0.1 * torch.randn_like(x))
        with torch.no_grad():
            target = _denoise(model, x)
        loss = F.mse_loss(model(x), target) + F.mse_loss(denoised, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            if not forgot_eval:
                model.eval()
            with torch.no_grad():
                for _ in range(3):
                    _denoise(model, torch.randn(32, 16))  # samples for a metric
            model.train()
    monitor.close()
    expected = [("eval_in_train_mode", "denoiser.net.1", 10)] if forgot_eval else []
    assert _warnings(monitor) == expected


class _LitDEQ(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inj, self.cell, self.head = nn.Linear(20, 32), Cell(), nn.Linear(32, 4)

    def training_step(self, batch, index):
        x, y = batch
        u = self.inj(x)
        with torch.no_grad():
            z = fixed_point(self.cell, u)
        return F.cross_entropy(self.head(self.cell(z, u)), y)

    def validation_step(self, batch, index):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.head(fixed_point(self.cell, self.inj(x))), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 2e-3)


@pytest.mark.slow
def test_a_lightning_deq_solving_in_its_training_step_is_silent(tmp_path):
    x, y = _data()
    train = DataLoader(TensorDataset(x[:512], y[:512]), batch_size=32)
    val = DataLoader(TensorDataset(x[512:], y[512:]), batch_size=32)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(_LitDEQ(), train, val)
    assert [a for a in callback.alerts if a.rule == "eval_in_train_mode"] == []
