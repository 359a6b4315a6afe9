"""train_in_eval_mode: gradients taken in eval mode that no update applies are no training step.

EWC estimates its Fisher information at a task's end with the model in eval
mode: a backward per batch (or ``torch.autograd.grad``), the squared gradients
summed, the gradients wiped, then ``model.train()`` and the next task trains
on. A saliency map computed mid-training does the same for one batch. Those
backward passes feed no optimizer step, and used to be told as a training step
in eval mode with the hint "training resumed without model.train()" (it did
not). Each twin beside them forgets ``model.train()`` and is still told, at
the step and module where the update uses eval-mode gradients.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainwatch.runner import run_script

TASK_STEPS = 6  # the Fisher is estimated at the boundary of the two tasks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3)
    )


def _batch(seed: int, task: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 8, generator=gen)
    logits = x[:, :3] if task == 0 else -x[:, :3]
    return x, logits.argmax(1)


def _fisher(model: nn.Module, how: str) -> list[torch.Tensor]:
    """The diagonal Fisher: squared gradients of the log-likelihood of sampled labels."""
    params = list(model.parameters())
    fisher = [torch.zeros_like(p) for p in params]
    for seed in range(4):
        x, _ = _batch(100 + seed, 0)
        logp = F.log_softmax(model(x), 1)
        nll = F.nll_loss(logp, torch.multinomial(logp.exp().detach(), 1).squeeze(1))
        if how == "autograd":
            grads = torch.autograd.grad(nll, params)  # writes no .grad
        else:
            model.zero_grad(set_to_none=how != "zeroed")
            nll.backward()
            grads = [p.grad for p in params]
        for f, g in zip(fisher, grads):
            f += g.detach() ** 2 / 4
    if how != "left":
        # The usual end ("zeroed": in place); "left" counts on the loop's zero_grad().
        model.zero_grad(set_to_none=how != "zeroed")
    return fisher


def _ewc(quiet_watch, how: str, forget_train: bool = False):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    fisher = anchor = None
    for step in range(2 * TASK_STEPS):
        if step == TASK_STEPS:
            model.eval()
            fisher = _fisher(model, how)
            if not forget_train:
                model.train()
            anchor = [p.detach().clone() for p in model.parameters()]
        x, y = _batch(step, step // TASK_STEPS)
        loss = F.cross_entropy(model(x), y)
        if fisher is not None:
            loss = loss + sum(
                (f * (p - a) ** 2).sum() for f, p, a in zip(fisher, model.parameters(), anchor)
            )
        opt.zero_grad(set_to_none=how != "zeroed")
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


def _told(monitor) -> list[tuple[str, int, str]]:
    return [
        (a.severity, a.step, a.module) for a in monitor.alerts if a.rule == "train_in_eval_mode"
    ]


@pytest.mark.parametrize("how", ["backward", "zeroed", "left", "autograd"])
def test_an_ewc_fisher_estimated_in_eval_mode_is_no_training_step(quiet_watch, how):
    """Wiped by model.zero_grad() after it (set to None, or zeroed in place), wiped by
    the loop's opt.zero_grad() before the next backward, or never written
    (torch.autograd.grad): silent."""
    assert _told(_ewc(quiet_watch, how)) == []


@pytest.mark.parametrize("how", ["backward", "zeroed", "autograd"])
def test_ewc_that_forgets_model_train_after_the_fisher_is_told_at_that_step(quiet_watch, how):
    monitor = _ewc(quiet_watch, how, forget_train=True)
    (alert, *_) = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert (alert.severity, alert.step, alert.module) == ("warning", TASK_STEPS, "1")
    assert alert.data["modules"] == ["1", "3"] and alert.data["whole_model"] is True
    assert "model.train()" in alert.hint


def _saliency_mid_training(quiet_watch, how: str):
    """A saliency map of one batch every 4 steps, with the model in eval mode: the
    input's gradient only, the parameters' wiped (or never written) after it."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(12):
        x, y = _batch(step, 0)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step % 4 == 3:
            model.eval()
            image = x[:4].clone().requires_grad_(True)
            score = model(image).max(1).values.sum()
            if how == "autograd":
                (saliency,) = torch.autograd.grad(score, image)
            elif how == "inputs":
                score.backward(inputs=[image])
                saliency = image.grad
            else:
                score.backward()  # writes the parameters' .grad too
                saliency = image.grad
                model.zero_grad()
            assert saliency.abs().sum() > 0
            model.train()
    monitor.close()
    return monitor


@pytest.mark.parametrize("how", ["backward", "inputs", "autograd"])
def test_a_saliency_map_computed_in_eval_mode_mid_training_is_silent(quiet_watch, how):
    assert _told(_saliency_mid_training(quiet_watch, how)) == []


def _validated(quiet_watch, forget_train: bool):
    """A validation loop under no_grad every 4 steps, model.train() after it or not."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for step in range(10):
        x, y = _batch(step, 0)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step == 3:
            model.eval()
            with torch.no_grad():
                for seed in range(3):
                    model(_batch(50 + seed, 0)[0])
            if not forget_train:
                model.train()
    monitor.close()
    return monitor


def test_training_on_after_a_validation_without_model_train_is_told_at_the_next_step(
    quiet_watch,
):
    monitor = _validated(quiet_watch, forget_train=True)
    (alert, *_) = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert (alert.severity, alert.step, alert.module) == ("warning", 4, "1")
    assert "model.train()" in alert.hint


def test_training_on_after_a_validation_with_model_train_is_silent(quiet_watch):
    assert _told(_validated(quiet_watch, forget_train=False)) == []


def _eval_mode_loss_applied(quiet_watch, wiped: bool):
    """Each step adds a loss through a pass in eval mode (a clean-view consistency
    term, backward'd first), then trains in training mode: its gradients are added
    onto and applied, unless the loop wipes them before the training backward."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for step in range(6):
        x, y = _batch(step, 0)
        opt.zero_grad()
        model.eval()
        F.cross_entropy(model(x), y).backward()
        model.train()
        if wiped:
            opt.zero_grad()
        F.cross_entropy(model(x + 0.1 * torch.randn_like(x)), y).backward()
        opt.step()
    monitor.close()
    return monitor


def test_an_eval_mode_backward_whose_gradients_the_update_applies_is_told(quiet_watch):
    told = _told(_eval_mode_loss_applied(quiet_watch, wiped=False))
    assert told and told[0] == ("warning", 0, "1")


def test_an_eval_mode_backward_wiped_before_the_training_backward_is_silent(quiet_watch):
    assert _told(_eval_mode_loss_applied(quiet_watch, wiped=True)) == []


# The sweep's script under ``trainwatch run``: a Fisher of ten batches at step 50.
SCRIPT = """
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

how, forget_train = sys.argv[1], sys.argv[2] == "forget"
torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4)
)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
W = torch.randn(20, 4)
fisher, anchor = None, None
for step in range(60):
    if step == 50:
        model.eval()
        params = list(model.parameters())
        fisher = [torch.zeros_like(p) for p in params]
        for _ in range(10):
            model.zero_grad()
            logp = F.log_softmax(model(torch.randn(32, 20)), 1)
            nll = F.nll_loss(logp, torch.multinomial(logp.exp(), 1).squeeze(1))
            if how == "autograd":
                grads = torch.autograd.grad(nll, params)
            else:
                nll.backward()
                grads = [p.grad for p in params]
            for f, g in zip(fisher, grads):
                f += g.detach() ** 2 / 10
        model.zero_grad()
        if not forget_train:
            model.train()
        anchor = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(32, 20)
    y = (x @ W).argmax(1) if step < 50 else (x @ W).argmin(1)
    loss = F.cross_entropy(model(x), y)
    if fisher is not None:
        loss = loss + 50 * sum(
            (f * (p - a) ** 2).sum() for f, p, a in zip(fisher, model.parameters(), anchor)
        )
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("how", ["backward", "autograd"])
@pytest.mark.parametrize("forget_train", [False, True])
def test_the_ewc_script_under_trainwatch_run(tmp_path, how, forget_train):
    script = tmp_path / "ewc.py"
    script.write_text(SCRIPT)
    arg = "forget" if forget_train else "train"
    assert run_script(script, [how, arg], log_dir=tmp_path / "log", console=False) == 0
    alerts = [json.loads(line) for line in (tmp_path / "log" / "alerts.jsonl").open()]
    told = {(a["rule"], a["step"], a["module"]) for a in alerts if a["severity"] != "info"}
    assert told == ({("train_in_eval_mode", 50, "1")} if forget_train else set())


# A LightningModule estimating its Fisher at the end of the first task's epoch.
LIGHTNING = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

forget_train = sys.argv[1] == "forget"


class EWC(pl.LightningModule):
    # EWC over two tasks, one an epoch: the Fisher estimated at the end of the first.

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3)
        )
        self.fisher = None

    def forward(self, x):
        return self.net(x)

    def on_train_epoch_end(self):
        if self.current_epoch != 0:
            return
        self.eval()
        params = list(self.parameters())
        self.fisher = [torch.zeros_like(p) for p in params]
        for _ in range(4):
            self.zero_grad()
            logp = F.log_softmax(self(torch.randn(32, 16)), 1)
            F.nll_loss(logp, torch.multinomial(logp.exp(), 1).squeeze(1)).backward()
            for f, p in zip(self.fisher, params):
                f += p.grad.detach() ** 2 / 4
        self.zero_grad()
        if not forget_train:
            self.train()
        self.anchor = [p.detach().clone() for p in params]

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.current_epoch == 1:
            y = (y + 1) % 3  # the second task
        loss = F.cross_entropy(self(x), y)
        if self.fisher is not None:
            loss = loss + sum(
                (f * (p - a) ** 2).sum()
                for f, p, a in zip(self.fisher, self.parameters(), self.anchor)
            )
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(256, 16)
data = DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=32, shuffle=True)
trainer = pl.Trainer(
    max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(EWC(), data)
"""


@pytest.mark.slow
@pytest.mark.parametrize("forget_train", [False, True])
def test_a_lightning_ewc_module_estimating_its_fisher_at_the_epoch_end(tmp_path, forget_train):
    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING)
    arg = "forget" if forget_train else "train"
    run_script(script, [arg], log_dir=tmp_path / "log", console=False)
    alerts = [json.loads(line) for line in (tmp_path / "log" / "alerts.jsonl").open()]
    told = {(a["rule"], a["step"], a["module"]) for a in alerts if a["severity"] != "info"}
    assert told == ({("train_in_eval_mode", 8, "net.1")} if forget_train else set())
