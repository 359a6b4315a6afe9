"""A Lightning fit whose training batches never stepped an optimizer ends with the
closing note ``tw.watch`` gives the same loop.

A monitor that saw the model run but no step says so as it closes ("no training
step watched: the model ran 8 forward passes, but its optimizer never stepped"):
a run that printed nothing would leave the user guessing whether trainwatch ran
at all. Under the callback the monitor's summary reaches the console through a
reporter (the DDP relay), which kept the steps and norms but dropped the note,
so a manual-optimisation ``training_step`` that forgets ``opt.step()``, or an
automatic one returning None under a GradScaler ("16-mixed": Lightning then
skips the step), ended in silence. Under ``trainwatch run`` the run then added
its own line instead, false beside the script's backward passes ("no backward
pass reached a model").

The controls end without the note: healthy automatic and manual fits (and the
same under the GradScaler), ``trainer.validate()`` (no step is due), a fit told
to run no training batch, a module with no optimizer that updates its weights by
hand (Lightning's stand-in optimizer never steps; it is no optimizer of the
user's), and a fit that fails at its first batch (the traceback is the story).
"""

from __future__ import annotations

import io

import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

import trainwatch as tw
from tests.lightning_models import BoringNet, ManualNet, quiet_trainer
from tests.run_script import stderr_under_run
from trainwatch.lightning import TrainWatchCallback

NOTE = "trainwatch: no training step watched"
NEVER_STEPPED = "the model ran 8 forward passes, but its optimizer never stepped"


class ForgetsTheStep(ManualNet):
    """Manual optimisation: zero_grad and backward, but ``opt.step()`` forgotten."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        return loss


class ReturnsNothing(BoringNet):
    """Automatic optimisation: the loss logged but not returned, every batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", nn.functional.mse_loss(self(x), y))


class UpdatesByHand(ManualNet):
    """No optimizer (``configure_optimizers`` returns None): plain SGD by hand."""

    def configure_optimizers(self):
        return None

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        with torch.no_grad():
            for param in self.parameters():
                param -= 0.05 * param.grad


class FailsAtOnce(BoringNet):
    def training_step(self, batch, batch_idx):
        raise ValueError("a bad batch")


def _scaled() -> dict:
    """The "16-mixed" precision plugin with its GradScaler, on CPU."""
    return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}


def _console(tmp_path, model, *, run=lambda trainer, model: trainer.fit(model), **kwargs) -> str:
    """What the callback printed over one epoch of 8 batches, without validation (each
    forward pass is a training batch's)."""
    out = io.StringIO()
    options = dict(max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0)
    options.update(kwargs)
    trainer = quiet_trainer(tmp_path, [TrainWatchCallback(console=out)], **options)
    run(trainer, model)
    return out.getvalue()


def test_the_same_loop_under_tw_watch_says_this(tmp_path):
    """The reference: ForgetsTheStep's loop written plainly, under tw.watch."""
    model = ForgetsTheStep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = io.StringIO()
    with tw.watch(model, opt, console=out):
        for x, y in model.train_dataloader():
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
    # (Its setup table first: tw.watch was handed the optimizer at attach.)
    assert out.getvalue().strip().splitlines()[-1] == f"{NOTE}: {NEVER_STEPPED}"


def test_manual_optimisation_that_forgets_the_step_ends_with_the_note(tmp_path):
    assert _console(tmp_path, ForgetsTheStep()).strip() == f"{NOTE}: {NEVER_STEPPED}"


def test_control_manual_optimisation_that_steps_ends_with_its_summary(tmp_path):
    printed = _console(tmp_path, ManualNet())
    assert "8 steps watched" in printed and NOTE not in printed


def test_a_loss_never_returned_under_the_grad_scaler_ends_with_the_note(tmp_path):
    # Lightning's AMP plugin skips the optimizer's step when training_step returns None.
    printed = _console(tmp_path, ReturnsNothing(), **_scaled())
    assert f"{NOTE}: {NEVER_STEPPED}" in printed


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_control_a_healthy_automatic_fit_ends_with_its_summary(tmp_path, precision):
    printed = _console(tmp_path, BoringNet(), **(_scaled() if precision == "16-mixed" else {}))
    # (The GradScaler skips one step: its initial scale overflows fp16 once.)
    steps = 7 if precision == "16-mixed" else 8
    assert f"trainwatch: {steps} steps watched" in printed and NOTE not in printed


def test_control_validate_alone_claims_no_broken_training(tmp_path):
    printed = _console(
        tmp_path,
        BoringNet(),
        run=lambda trainer, model: trainer.validate(model),
        limit_val_batches=2,
    )
    assert printed == ""


def test_control_a_fit_told_to_run_no_training_batch_has_no_note(tmp_path):
    printed = _console(tmp_path, BoringNet(), limit_train_batches=0, limit_val_batches=2)
    assert printed == ""


def test_control_weights_updated_by_hand_without_an_optimizer_have_no_note(tmp_path):
    assert NOTE not in _console(tmp_path, UpdatesByHand())


def test_control_a_fit_failing_at_its_first_batch_has_no_note(tmp_path):
    out = io.StringIO()
    trainer = quiet_trainer(tmp_path, [TrainWatchCallback(console=out)], max_epochs=1)
    with pytest.raises(ValueError, match="a bad batch"):
        trainer.fit(FailsAtOnce())
    assert NOTE not in out.getvalue()


SCRIPT = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from trainwatch.lightning import TrainWatchCallback

torch.set_num_threads(1)


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.fc1, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        if "step" in sys.argv:
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


x = torch.randn(64, 8)
trainer = pl.Trainer(
    accelerator="cpu", max_epochs=1, enable_progress_bar=False, logger=False,
    enable_checkpointing=False, enable_model_summary=False, callbacks=[TrainWatchCallback()],
)
trainer.fit(Net(), DataLoader(TensorDataset(x, x[:, :1]), batch_size=8))
"""


@pytest.mark.slow
def test_under_trainwatch_run_the_callbacks_note_is_the_closing_line(tmp_path):
    err = stderr_under_run(tmp_path, SCRIPT)
    assert err.count(NOTE) == 1, err
    assert NEVER_STEPPED in err and "no backward pass reached a model" not in err


@pytest.mark.slow
def test_control_under_trainwatch_run_a_stepping_callback_run_has_no_note(tmp_path):
    err = stderr_under_run(tmp_path, SCRIPT, "step")
    assert NOTE not in err and "8 steps watched" in err
