"""broadcast in the loss of a layer that joins training after the audit's first steps.

A multi-task loop draws one task per step: a rare task's head gets its first
gradient at step 18, long after the audit of the run's first 3 steps, and its
loss pairs the ``(N, 1)`` head output with an ``(N,)`` target. A curriculum that
switches an auxiliary regression loss on at step 30 does the same. The first
gradient is only known at that step's boundary, after the loss ran; from the next
step the audit is armed until the layer gets a gradient again (the next step of
that task), and the bug is told there. The healthy twins stay silent, and the
audit runs on those few steps more, not on every step: a layer used once is
waited for 100 steps at most, and at most 8 waits come in a run.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from tests.test_run import alerts, write
from trainwatch.collect.joined_layers import WAIT, WAITS
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

TASKS = ["sentiment", "topic", "rating"]


class MultiTask(nn.Module):
    def __init__(self, tasks=TASKS, outputs=(2, 6, 1)) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(24, 64), nn.ReLU())
        self.heads = nn.ModuleDict({t: nn.Linear(64, k) for t, k in zip(tasks, outputs)})

    def forward(self, x, task=None):
        """One task's output; the shared features for ``task=None``."""
        feats = self.encoder(x)
        return feats if task is None else self.heads[task](feats)


def _audited(monitor) -> bool:
    """The training audit's mode is on the stack (called between a pass and its loss)."""
    from torch.overrides import _get_current_function_mode_stack

    audit = monitor._pipeline.behaviour._audit
    return any(
        getattr(m, "audit", lambda: None)() is audit for m in _get_current_function_mode_stack()
    )


def _broadcasts(monitor) -> list[tuple[int, str]]:
    return [(a.step, a.data["op"]) for a in monitor.alerts if a.rule == "broadcast"]


def _multitask(quiet_watch, buggy: bool, steps: int = 300):
    """Tasks drawn per step in proportion to dataset size; ``rating`` is rare."""
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    draws, data = torch.Generator().manual_seed(123), torch.Generator().manual_seed(0)
    probs = torch.tensor([6000.0, 4000.0, 800.0])
    w = torch.randn(24, 6, generator=data)
    rating, audited = [], []
    for step in range(steps):
        task = TASKS[torch.multinomial(probs, 1, generator=draws).item()]
        x = torch.randn(32, 24, generator=data)
        out = model(x, task)
        if _audited(monitor):
            audited.append(step)
        if task == "rating":
            rating.append(step)
            y = (x @ w)[:, 0].tanh() * 2 + 3
            loss = ((out - (y if buggy else y[:, None])) ** 2).mean()
        elif task == "topic":
            loss = F.cross_entropy(out, (x @ w).argmax(1))
        else:
            loss = F.cross_entropy(out, ((x @ w)[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor, rating, audited


def test_a_rare_tasks_flat_target_is_caught_at_its_next_step(quiet_watch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        monitor, rating, _ = _multitask(quiet_watch, buggy=True)
    assert rating[0] > 3  # joined after the first steps' audit
    assert _broadcasts(monitor) == [(rating[1], "sub")]
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["shapes"] == [[32, 1], [32]] and alert.data["result"] == [32, 32]


def test_a_healthy_multitask_loop_is_silent_and_audited_only_until_the_task_came_again(
    quiet_watch,
):
    """The first steps, the steps from the rare task's first to its second, and the
    sampled rechecks: nothing more in 300 steps (its other 20 steps go unaudited)."""
    monitor, rating, audited = _multitask(quiet_watch, buggy=False)
    assert _broadcasts(monitor) == []
    assert audited == [0, 1, 2, *range(rating[0] + 1, rating[1] + 1), 100, 200]
    assert len(rating) > 20
    assert torch._C._len_torch_function_stack() == 0


def _auxiliary(quiet_watch, flat: bool, switch: int = 30, steps: int = 60):
    """A classifier with a regression head beside it whose loss is switched on at
    ``switch``: both heads run at every step, only the classifier's loss before."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    model = nn.ModuleDict({"body": body, "cls": nn.Linear(16, 4), "aux": nn.Linear(16, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(32, 8, generator=gen)
        h = model["body"](x)
        loss = F.cross_entropy(model["cls"](h), x[:, :4].argmax(1))
        if step >= switch:
            target = x[:, :4].amax(1, keepdim=True)
            loss = loss + 0.5 * F.mse_loss(model["aux"](h), target.squeeze(1) if flat else target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor


def test_an_auxiliary_loss_switched_on_later_with_a_flat_target_is_caught(quiet_watch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        monitor = _auxiliary(quiet_watch, flat=True)
    assert _broadcasts(monitor) == [(31, "mse_loss")]


def test_an_auxiliary_loss_switched_on_later_with_matching_shapes_is_silent(quiet_watch):
    monitor = _auxiliary(quiet_watch, flat=False)
    assert _broadcasts(monitor) == []


def _heads_joining(quiet_watch, schedule):
    """Heads, each trained on the steps ``schedule(head, step)`` says; returns the
    audited steps."""
    torch.manual_seed(0)
    names = [f"t{i}" for i in range(12)]
    model = MultiTask(names, [1] * len(names))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    audited = []
    for step in range(260):
        x = torch.randn(16, 24, generator=gen)
        feats = model(x)
        if _audited(monitor):
            audited.append(step)
        loss = feats.square().mean()
        for i, name in enumerate(names):
            if schedule(i, step):
                loss = loss + F.mse_loss(model.heads[name](feats), x[:, i : i + 1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert _broadcasts(monitor) == []
    return audited


def test_a_head_used_once_is_waited_for_a_bounded_number_of_steps(quiet_watch):
    audited = _heads_joining(quiet_watch, lambda i, step: i == 0 and step == 20)
    assert audited == [0, 1, 2, *range(21, 21 + WAIT), 200]


def test_heads_joining_one_by_one_are_waited_for_a_bounded_number_of_times(quiet_watch):
    """A curriculum adding a task every 10 steps: each new head is audited at its
    second step, for the first ``WAITS`` of them; later ones by the sampled rechecks."""
    audited = _heads_joining(quiet_watch, lambda i, step: step >= 10 * (i + 1))
    assert WAITS < 12
    assert audited == [0, 1, 2, *(10 * (i + 1) + 1 for i in range(WAITS)), 100, 200]


MULTITASK = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

BUGGY = sys.argv[1] == "flat"
torch.manual_seed(0)
names = ["sentiment", "topic", "rating"]
probs = torch.tensor([6000.0, 4000.0, 800.0])
model = nn.ModuleDict({"encoder": nn.Sequential(nn.Linear(24, 64), nn.ReLU()),
                       "heads": nn.ModuleDict({"sentiment": nn.Linear(64, 2),
                                               "topic": nn.Linear(64, 6),
                                               "rating": nn.Linear(64, 1)})})
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(123)
W = torch.randn(24, 6)
rating = []
for step in range(120):
    task = names[torch.multinomial(probs, 1, generator=gen).item()]
    x = torch.randn(32, 24)
    out = model["heads"][task](model["encoder"](x))
    if task == "rating":
        rating.append(step)
        y = (x @ W)[:, 0].tanh() * 2 + 3
        loss = ((out - (y if BUGGY else y[:, None])) ** 2).mean()
    elif task == "topic":
        loss = F.cross_entropy(out, (x @ W).argmax(1))
    else:
        loss = F.cross_entropy(out, ((x @ W)[:, 0] > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
print("rating", rating)
"""


@pytest.mark.parametrize("flat", [True, False], ids=["flat_target", "matching_target"])
def test_trainwatch_run_audits_a_rare_tasks_loss(tmp_path, capsys, flat):
    script = write(tmp_path, "multitask.py", MULTITASK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        code = run_script(
            script, ["flat" if flat else "col"], log_dir=tmp_path / "log", console=False
        )
    assert code == 0
    line = [row for row in capsys.readouterr().out.splitlines() if row.startswith("rating")]
    rating = [int(s) for s in line[-1].split("[")[1].rstrip("]").split(",")]
    assert rating[0] > 3
    found = [
        (a["step"], a["data"]["op"]) for a in alerts(tmp_path / "log") if a["rule"] == "broadcast"
    ]
    assert found == ([(rating[1], "sub")] if flat else [])


class _AuxiliaryModule(pl.LightningModule):
    """A classifier whose auxiliary regression loss is switched on at step 30."""

    def __init__(self, flat: bool) -> None:
        super().__init__()
        self.flat = flat
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.cls = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 1)

    def forward(self, x):
        h = self.body(x)
        return self.cls(h), self.aux(h)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        logits, value = self(x)
        loss = F.cross_entropy(logits, x[:, :4].argmax(1))
        if self.global_step >= 30:
            target = x[:, :4].amax(1, keepdim=True)
            loss = loss + F.huber_loss(value, target.squeeze(1) if self.flat else target)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(50 * 16, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=16)


@pytest.mark.parametrize("flat", [True, False], ids=["flat_target", "matching_target"])
def test_a_lightning_auxiliary_loss_switched_on_later_is_audited(tmp_path, flat):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(_AuxiliaryModule(flat))
    found = [(a.step, a.data["op"]) for a in callback.alerts if a.rule == "broadcast"]
    assert found == ([(31, "huber_loss")] if flat else [])
