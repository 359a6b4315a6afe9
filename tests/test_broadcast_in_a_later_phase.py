"""broadcast in a later phase of training: the audit runs again when one begins.

A curriculum trains a classifier, then replaces the head with a one-output
regression head, builds a new optimizer and switches to a Huber loss: a
``(N, 1)`` head output against an ``(N,)`` target there averages every
prediction against every target, and the audit of the run's first steps has
long ended. A new optimizer, a part of the model replaced or parameters
unfrozen re-arm it for ``audit_steps`` steps (and the evaluation audit for as
many passes); a loss changed with no such sign is found by its kind (the
autograd ops from it back to the model's output) at the next step the class
target look samples, and audited the step after; with that off, at the next
sampled recheck (100, 200, 400, 800, ...). The same phase changes with matching
shapes stay silent, and a long healthy run is audited on its sampled steps only.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import TinyNet, rules_of
from tests.lightning_models import quiet_trainer
from tests.test_run import alerts, write
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

PHASE_A = 40  # steps of the first phase, far past the first-steps audit


def _classes(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(32, 8, generator=gen)
        yield x, x[:, :4].argmax(1)


def _scores(n: int, seed: int, flat: bool):
    """Regression targets: ``(N,)`` when ``flat`` (the bug against an (N, 1) head)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(32, 8, generator=gen)
        y = x[:, :4].amax(1, keepdim=True)
        yield x, y.squeeze(1) if flat else y


def _fit(model, opt, data, loss_fn) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own size warning
        for x, y in data:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()


def _broadcasts(monitor) -> list[tuple[int, str, str]]:
    return [
        (a.step, a.data["op"], a.data["phase"]) for a in monitor.alerts if a.rule == "broadcast"
    ]


def _audited(monitor) -> int:
    """1 while the training audit's mode is on the stack (another look's mode, the
    class targets' on their sampled steps, is not counted)."""
    from torch.overrides import _get_current_function_mode_stack

    audit = monitor._pipeline.behaviour._audit
    modes = _get_current_function_mode_stack()
    return int(any(getattr(m, "audit", lambda: None)() is audit for m in modes))


def _curriculum(quiet_watch, flat: bool, **config):
    """Phase A: 4-way classification. Phase B: a new 1-output head, a new optimizer
    handed to the monitor, a Huber loss on a regression target."""
    torch.manual_seed(0)
    model = TinyNet(outputs=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt, **config)
    _fit(model, opt, _classes(PHASE_A, 0), F.cross_entropy)
    model.head = nn.Linear(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.add_optimizer(opt)
    _fit(model, opt, _scores(10, 1, flat), F.huber_loss)
    return monitor


def test_a_new_head_and_optimizer_with_a_flat_target_is_caught_at_the_new_phase(quiet_watch):
    monitor = _curriculum(quiet_watch, flat=True)
    assert _broadcasts(monitor) == [(PHASE_A, "huber_loss", "training")]
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["shapes"] == [[32, 1], [32]] and alert.data["result"] == [32, 32]


def test_a_new_head_and_optimizer_with_matching_shapes_stay_silent(quiet_watch):
    monitor = _curriculum(quiet_watch, flat=False)
    assert rules_of(monitor) == []


def test_an_optimizer_handed_over_for_a_new_phase_audits_its_first_steps(quiet_watch):
    """``audit_steps`` steps of the new phase, from its first, then no mode again."""
    torch.manual_seed(0)
    model = TinyNet(outputs=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt, broadcast={"audit_steps": 2})
    _fit(model, opt, _classes(10, 0), F.cross_entropy)
    model.head = nn.Linear(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.add_optimizer(opt)
    audited = []
    for x, y in _scores(5, 1, flat=False):
        out = model(x)
        audited.append(_audited(monitor))
        opt.zero_grad()
        F.huber_loss(out, y).backward()
        opt.step()
    assert audited == [1, 1, 0, 0, 0]
    assert torch._C._len_torch_function_stack() == 0


def _unfreeze(quiet_watch, flat: bool):
    """A frozen encoder trained as a linear probe, then unfrozen for fine-tuning with a
    regression loss: no new optimizer, no new module, only requires_grad flipped."""
    torch.manual_seed(0)
    model = TinyNet(outputs=1)
    for p in [*model.fc1.parameters(), *model.fc2.parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, frozen_in_optimizer=False)
    _fit(model, opt, _scores(PHASE_A, 0, flat=False), F.mse_loss)
    for p in model.parameters():
        p.requires_grad_(True)
    _fit(model, opt, _scores(10, 1, flat=flat), F.l1_loss)
    return monitor


def test_unfreezing_with_a_flat_target_is_caught_in_the_new_phase(quiet_watch):
    monitor = _unfreeze(quiet_watch, flat=True)
    # Seen at the boundary of the first step after unfreezing: the next is audited.
    assert _broadcasts(monitor) == [(PHASE_A + 1, "l1_loss", "training")]


def test_unfreezing_with_matching_shapes_stays_silent(quiet_watch):
    monitor = _unfreeze(quiet_watch, flat=False)
    assert "broadcast" not in rules_of(monitor)


def test_a_loop_toggling_a_freeze_every_step_is_not_audited_throughout(quiet_watch):
    """Two setups taken in turns (a part frozen on every other step): each is a new
    phase once, not at every step."""
    torch.manual_seed(0)
    model = TinyNet(outputs=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, frozen_in_optimizer=False, broadcast={"recheck_from": 0})
    audited = []
    for step, (x, y) in enumerate(_scores(60, 0, flat=False)):
        model.fc1.weight.requires_grad_(step % 2 == 0)
        out = model(x)
        audited.append(_audited(monitor))
        opt.zero_grad()
        F.mse_loss(out, y).backward()
        opt.step()
    assert sum(audited[10:]) == 0


def _loss_changed_at(quiet_watch, switch: int, flat: bool, steps: int = 130, **config):
    """Same model, optimizer and head throughout; at ``switch`` the loop starts
    regressing on the first logit with a Huber loss: no sign but the loss code."""
    torch.manual_seed(0)
    model = TinyNet(outputs=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt, **config)
    _fit(model, opt, _classes(switch, 0), F.cross_entropy)
    _fit(model, opt, _scores(steps - switch, 1, flat), lambda out, y: F.huber_loss(out[:, :1], y))
    return monitor


def test_a_loss_changed_without_other_sign_is_caught_the_step_after_its_kind_changed(
    quiet_watch,
):
    """Step 60 is one the class target look samples: the new kind is read there."""
    monitor = _loss_changed_at(quiet_watch, 60, flat=True)
    assert _broadcasts(monitor) == [(61, "huber_loss", "training")]


def test_without_the_loss_kind_a_changed_loss_waits_for_the_next_sampled_recheck(quiet_watch):
    monitor = _loss_changed_at(quiet_watch, 60, flat=True, broadcast={"loss_kind_every": 0})
    assert _broadcasts(monitor) == [(100, "huber_loss", "training")]


def test_a_loss_changed_with_matching_shapes_stays_silent(quiet_watch):
    monitor = _loss_changed_at(quiet_watch, 60, flat=False)
    assert rules_of(monitor) == []


def test_the_sampled_recheck_is_off_when_configured_so(quiet_watch):
    off = {"recheck_from": 0, "loss_kind_every": 0}
    monitor = _loss_changed_at(quiet_watch, 60, flat=True, broadcast=off)
    assert _broadcasts(monitor) == []


def test_a_long_healthy_run_is_audited_at_the_sampled_steps_only(quiet_watch):
    """Steps 0-2, then one step at 100, 200, 400 and 800 (doubling up to
    ``recheck_every``); the other steps enter no mode, and nothing is told."""
    torch.manual_seed(0)
    model = TinyNet(outputs=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"recheck_every": 300})
    audited = []
    for step, (x, y) in enumerate(_scores(1001, 0, flat=False)):
        out = model(x)
        if _audited(monitor):
            audited.append(step)
        opt.zero_grad()
        F.mse_loss(out, y).backward()
        opt.step()
    assert audited == [0, 1, 2, 100, 200, 400, 700, 1000]
    assert rules_of(monitor) == []
    assert torch._C._len_torch_function_stack() == 0


def _evaluate(model, flat: bool) -> None:
    x, y = next(_scores(1, 9, flat))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        float(((model(x) - y) ** 2).mean())


def _validated_curriculum(quiet_watch, flat: bool):
    """Phase A validated every 5 steps (its evaluation audit long used up), then
    phase B's validation pairs the new head's (N, 1) with an (N,) target."""
    torch.manual_seed(0)
    model = TinyNet(outputs=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for step, batch in enumerate(_classes(PHASE_A, 0)):
        _fit(model, opt, [batch], F.cross_entropy)
        if step % 5 == 4:
            with torch.no_grad():
                model(batch[0]).argmax(1).eq(batch[1]).float().mean()
    model.head = nn.Linear(16, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.add_optimizer(opt)
    for step, batch in enumerate(_scores(10, 1, flat=False)):
        _fit(model, opt, [batch], F.huber_loss)
        if step % 5 == 4:
            _evaluate(model, flat)
    model(torch.randn(4, 8))  # the next pass ends the last evaluation's span
    return monitor


def test_a_new_phases_validation_loss_is_audited_too(quiet_watch):
    monitor = _validated_curriculum(quiet_watch, flat=True)
    assert _broadcasts(monitor) == [(PHASE_A + 5, "sub", "evaluation")]


def test_a_new_phases_matching_validation_loss_stays_silent(quiet_watch):
    monitor = _validated_curriculum(quiet_watch, flat=False)
    assert rules_of(monitor) == []


CURRICULUM = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

FLAT = sys.argv[1] == "flat"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(0)
for step in range(40):
    x = torch.randn(32, 8, generator=gen)
    opt.zero_grad()
    F.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
    opt.step()
model[2] = nn.Linear(16, 1)  # phase B: a regression head and a new optimizer
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(10):
    x = torch.randn(32, 8, generator=gen)
    y = x[:, :4].amax(1, keepdim=True)
    opt.zero_grad()
    F.huber_loss(model(x), y.squeeze(1) if FLAT else y).backward()
    opt.step()
"""


@pytest.mark.parametrize("flat", [True, False], ids=["flat_target", "matching_target"])
def test_trainwatch_run_audits_the_new_phase_of_a_curriculum(tmp_path, flat):
    script = write(tmp_path, "curriculum.py", CURRICULUM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        code = run_script(
            script, ["flat" if flat else "col"], log_dir=tmp_path / "log", console=False
        )
    assert code == 0
    found = [(a["rule"], a["data"].get("op")) for a in alerts(tmp_path / "log")]
    assert found == ([("broadcast", "huber_loss")] if flat else [])


class _Curriculum(pl.LightningModule):
    """Regression throughout; a callback swaps the loss at an epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.loss_fn = F.mse_loss

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(40 * 8, 8, generator=gen)
        return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8, shuffle=True)


class _SwapLoss(pl.Callback):
    """From epoch 2 (step 80) on, a robust loss; ``flat`` flattens the target there."""

    def __init__(self, flat: bool) -> None:
        self.flat = flat

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 2:
            flat = self.flat
            pl_module.loss_fn = lambda out, y: F.smooth_l1_loss(out, y.squeeze(1) if flat else y)


@pytest.mark.parametrize("flat", [True, False], ids=["flat_target", "matching_target"])
def test_a_lightning_callback_swapping_the_loss_is_caught_the_step_after(tmp_path, flat):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback, _SwapLoss(flat)], max_epochs=3, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.fit(_Curriculum())
    found = [(a.rule, a.step, a.data["op"]) for a in callback.alerts if a.rule == "broadcast"]
    assert found == ([("broadcast", 81, "smooth_l1_loss")] if flat else [])
    assert [a.rule for a in callback.alerts if a.rule != "broadcast"] == []
