"""A NaN in the first batch of a fine-tuning phase whose new optimizer was never passed.

``monitor = tw.watch(model)`` with no optimizer: trainwatch finds the
optimizers stepping the model at their steps and watches each from its second
one. A fine-tune trains the head alone, then unfreezes the body and builds a
new optimizer over the whole model (a restart with a fresh AdamW alike). When
the first batch of that phase held a NaN label, the new optimizer's first
step (counted, not watched) applied the NaN gradient, and the next step's
forward met NaN weights no watched update had made: told as
``nonfinite_parameter``, "written in place by the training code". It is a
non-finite loss born from the target, at that step, as the same NaN is told
in the first phase, and as it is where the loop passes both optimizers
(``monitor.add_optimizer``), the twin these tests run beside. A NaN feature
there is the input's. With every module's sums read a step later
(``check: deferred``), a NaN in the second batch of the phase, the step the
optimizer is watched from, is the loss's too (the two steps' sums were read
as one: a gradient born in the model's own code).

Beside each, the clean run says nothing; the NaN in the first phase is told
as before; Lightning (an unfreeze adding a param group) and ``trainwatch run``
on the unmodified script, which join an optimizer at its first step, tell the
same; training goes on bit for bit as without trainwatch.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

PHASE, STEPS = 6, 10  # head alone for PHASE steps, then the whole model
CHECKS = ("auto", "step", "deferred")


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def fine_tune(
    bug: str = "none",
    at: int = PHASE,
    check: str | None = "auto",
    passed: bool = False,
) -> tuple[list[tuple[str, int, str | None]], list[tw.Alert], Regressor]:
    """The head trained alone, then the body unfrozen under a new AdamW. ``bug``: a NaN
    ``label`` or ``feature`` in the batch of step ``at``. ``passed``: the loop hands
    each optimizer over (``tw.watch(model, opt)``, then ``monitor.add_optimizer``).
    ``check``: None for a run without trainwatch."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=g)
    model = Regressor()
    for p in model.body.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
    monitor = None
    if check is not None:
        config = {"nonfinite_forward": {"check": check}}
        given = opt if passed else None
        monitor = tw.watch(model, given, console=False, config=config)
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=g)
        y = torch.sin(x @ w)
        if step == PHASE:
            for p in model.body.parameters():
                p.requires_grad_(True)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if passed and monitor is not None:
                monitor.add_optimizer(opt)
        if step == at and bug == "label":
            y[3] = float("nan")  # a missing label
        if step == at and bug == "feature":
            x[5, 2] = float("nan")  # a missing feature
        opt.zero_grad()
        loss = F.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        opt.step()
    if monitor is None:
        return [], [], model
    monitor.close()
    alerts = [a for a in monitor.alerts if a.severity != "info"]
    return [(a.rule, a.step, a.module) for a in alerts], alerts, model


@pytest.mark.parametrize("check", CHECKS)
def test_the_clean_fine_tune_says_nothing(check):
    assert fine_tune(check=check)[0] == []


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_label_in_the_new_phases_first_batch_is_a_nonfinite_loss_at_that_step(check):
    told, alerts, _ = fine_tune("label", check=check)
    assert told == [("nonfinite_loss", PHASE, None)]
    assert alerts[0].data["cause"] == "loss"
    assert "written in place" not in alerts[0].message
    assert told == fine_tune("label", check=check, passed=True)[0]


def test_the_nan_label_is_told_with_the_loss_the_training_code_holds():
    alerts = fine_tune("label")[1]
    assert alerts[0].data["kind"] == "nan"
    assert alerts[0].message.startswith("the loss is non-finite (nan)")
    assert "NaN or Inf in the targets" in alerts[0].hint


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_feature_in_the_new_phases_first_batch_is_the_input(check):
    told, alerts, _ = fine_tune("feature", check=check)
    assert told == [("nonfinite_forward", PHASE, "body.0")]
    assert alerts[0].data["cause"] == "input"
    assert told == fine_tune("feature", check=check, passed=True)[0]


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_label_at_the_step_the_new_optimizer_is_watched_from_is_the_loss(check):
    told = fine_tune("label", at=PHASE + 1, check=check)[0]
    assert told == [("nonfinite_loss", PHASE + 1, None)]
    assert told == fine_tune("label", at=PHASE + 1, check=check, passed=True)[0]


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_label_in_the_first_phase_is_told_as_before(check):
    assert fine_tune("label", at=3, check=check)[0] == [("nonfinite_loss", 3, None)]


@pytest.mark.parametrize("bug", ["none", "label"])
def test_training_is_bit_identical_with_and_without_trainwatch(bug):
    plain = fine_tune(bug, check=None)[2].state_dict()
    watched = fine_tune(bug)[2].state_dict()
    for name, value in plain.items():
        torch.testing.assert_close(watched[name], value, rtol=0, atol=0, equal_nan=True)


# -- Lightning: the body unfrozen into the optimizer (BaseFinetuning) ----------------


def test_lightning_a_nan_label_in_the_first_batch_after_the_unfreeze_is_the_loss(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import BaseFinetuning

    from trainwatch.lightning import TrainWatchCallback

    epochs, batches = 2, 3

    class Module(L.LightningModule):
        def __init__(self, bug: str) -> None:
            super().__init__()
            self.net, self.bug = Regressor(), bug

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, index):
            x, y = batch
            if self.bug == "label" and self.current_epoch == 1 and index == 0:
                y = y.clone()
                y[3] = float("nan")
            return F.mse_loss(self(x).squeeze(-1), y)

        def configure_optimizers(self):
            trainable = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.Adam(trainable, lr=1e-2)

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.net.body)

        def finetune_function(self, pl_module, epoch, optimizer):
            if epoch == 1:
                self.unfreeze_and_add_param_group(pl_module.net.body, optimizer, lr=1e-3)

    def run(bug: str) -> list[tuple[str, int, str | None]]:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16 * batches, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(1)))
        callback = TrainWatchCallback(log_dir=str(tmp_path / bug), console=False)
        trainer = L.Trainer(
            max_epochs=epochs,
            callbacks=[Unfreeze(), callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, generator=g)
        trainer.fit(Module(bug), loader)
        return [(a.rule, a.step, a.module) for a in callback.monitor.alerts if a.severity != "info"]

    assert run("none") == []
    assert run("label") == [("nonfinite_loss", batches, None)]


# -- trainwatch run: the unmodified script ---------------------------------------------

SCRIPT = """
import sys

import torch
import torch.nn.functional as F
from torch import nn

BUG = sys.argv[1]
PHASE, STEPS = 6, 10


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.body(x))


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
w = torch.randn(8, generator=g)
model = Regressor()
for p in model.body.parameters():
    p.requires_grad_(False)
opt = torch.optim.Adam(model.head.parameters(), lr=1e-2)
for step in range(STEPS):
    x = torch.randn(16, 8, generator=g)
    y = torch.sin(x @ w)
    if step == PHASE:
        for p in model.body.parameters():
            p.requires_grad_(True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if BUG == "label":
            y[3] = float("nan")
    opt.zero_grad()
    loss = F.mse_loss(model(x).squeeze(-1), y)
    loss.backward()
    opt.step()
print("loss", loss.item())
"""


@pytest.fixture
def _forget_script_module():
    yield
    sys.modules.pop("phases", None)


@pytest.mark.usefixtures("_forget_script_module")
@pytest.mark.parametrize("bug", ["none", "label"])
def test_trainwatch_run_tells_the_same_of_the_unmodified_script(tmp_path: Path, bug):
    script = tmp_path / "phases.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log_dir = tmp_path / "log"
    assert run_script(script, [bug], log_dir=log_dir, console=False) == 0
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    told = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    assert told == ([] if bug == "none" else [("nonfinite_loss", PHASE, None)])
