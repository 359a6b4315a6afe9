"""Batches skipped before their backward say nothing of any layer.

Lightning's documented way to skip a batch in automatic optimisation is a
``training_step`` returning None: Lightning still calls ``optimizer.step(closure)``,
the closure runs no backward, and nothing changes. Three such batches in a row
(a sensor outage, a data-quality filter) were told as ``model_not_called`` ("the
model holding these parameters is no longer the one trained", "was the model
replaced after the optimizer was built?"), or, with the forward run before the
None, as every layer cut off by a ``.detach()``. A plain loop that leaves a NaN
loss without ``backward()`` and still steps was told the same way.

Now a step whose optimizer's parameters hold no gradient at all, with no backward
anywhere in the process since its last step, is a skipped step: no streak moves
and none starts. Told as before beside them: a model replaced after the optimizer
was built (its copy's backward runs, unwatched), a generator cut off whole from a
discriminator's backward, and a ``.detach()``ed layer in a run that also skips.
"""

from __future__ import annotations

import copy
import json
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

BATCH = 32
SKIP_FROM = 6  # the first batch skipped


def _data(skipped: int) -> TensorDataset:
    torch.manual_seed(0)
    x = torch.randn(20 * BATCH, 8)
    y = x[:, 0] * 2 + x[:, 1]
    valid = torch.ones(len(x), dtype=torch.bool)
    valid[SKIP_FROM * BATCH : (SKIP_FROM + skipped) * BATCH] = False  # an outage
    return TensorDataset(x, y, valid)


class Regressor(L.LightningModule):
    def __init__(self, forward_first: bool = False, detached: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.side = nn.Linear(8, 1)
        self.forward_first = forward_first
        self.detached = detached

    def training_step(self, batch, _):
        x, y, ok = batch
        if not self.forward_first and not ok.any():
            return None  # nothing usable in this batch: skip it
        side = self.side(x).squeeze(-1)
        pred = self.net(x).squeeze(-1) + (side.detach() if self.detached else side)
        if not ok.any():
            return None  # skipped on what the forward found
        return F.mse_loss(pred[ok], y[ok])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _fit(model: L.LightningModule, skipped: int, callbacks: list) -> None:
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(_data(skipped), batch_size=BATCH))


def _zero_gradient(alerts: list) -> list[tuple[int, str, str]]:
    return [(a.step, a.module, a.data["kind"]) for a in alerts if a.rule == "zero_gradient"]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("skipped", [3, 5])
@pytest.mark.parametrize("forward_first", [False, True], ids=["no_forward", "forward_first"])
def test_lightning_batches_skipped_by_returning_none_are_silent(skipped, forward_first, tmp_path):
    callback = TrainWatchCallback(log_dir=tmp_path, console=False)
    _fit(Regressor(forward_first), skipped, [callback])
    assert [a for a in callback.alerts if a.severity != "info"] == []


@pytest.mark.filterwarnings("ignore")
def test_a_detached_layer_is_told_in_a_lightning_run_that_skips_batches(tmp_path):
    callback = TrainWatchCallback(log_dir=tmp_path, console=False)
    _fit(Regressor(forward_first=True, detached=True), 4, [callback])
    assert _zero_gradient(callback.alerts) == [(0, "side", "none")]


LIGHTNING_SCRIPT = """
import sys
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
x = torch.randn(640, 8)
y = x[:, 0] * 2 + x[:, 1]
valid = torch.ones(640, dtype=torch.bool)
valid[192:352] = False  # batches 6 to 10 all invalid: an outage


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, _):
        x, y, ok = batch
        if sys.argv[1] == "before" and not ok.any():
            return None
        pred = self.net(x).squeeze(-1)
        if not ok.any():
            return None
        return F.mse_loss(pred[ok], y[ok])

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regressor(), DataLoader(TensorDataset(x, y, valid), batch_size=32))
"""


@pytest.mark.parametrize("where", ["before", "after"])
def test_lightning_batches_skipped_under_trainwatch_run_are_silent(where, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SCRIPT)
    assert run_script(script, [where], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    assert [a for a in alerts if a["severity"] != "info"] == []
    assert json.loads((tmp_path / "log" / "alert_counts.json").read_text())["steps"] == 20


def _looks_armed() -> int:
    """Global forward hooks of trainwatch's look for a backward anywhere."""
    from torch.nn.modules import module

    hooks = module._global_forward_hooks.values()
    return sum(getattr(hook, "method", None) == "module_ran" for hook in hooks)


def _plain_loop(
    how: str, steps: int = 20, skipped: range = range(8, 12), armed: list[int] | None = None
) -> list[tw.Alert]:
    """A plain loop; ``how`` says what happens at the ``skipped`` steps, or which bug.
    ``armed`` gets whether the look for a backward anywhere was on at each step's end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    side = nn.Linear(8, 2)
    opt = torch.optim.SGD([*model.parameters(), *side.parameters()], lr=0.1)
    watched = nn.ModuleDict({"body": model, "side": side})
    monitor = tw.watch(watched, opt, console=False)
    criterion = nn.CrossEntropyLoss()
    best = copy.deepcopy(model)
    for step in range(steps):
        if how == "replaced" and step == 8:
            model = copy.deepcopy(best)  # the optimizer still steps the old one
            side = copy.deepcopy(side)
        x = torch.randn(32, 8)
        target = (x[:, 0] > 0).long()
        opt.zero_grad()
        if how == "skip_before_forward" and step in skipped:
            opt.step()  # the loop steps on every batch, usable or not
            if armed is not None:
                armed.append(_looks_armed())
            continue
        out = model(x) + (side(x).detach() if how == "detached" else side(x))
        loss = criterion(out, target)
        if how in ("skip_nan", "detached") and step in skipped:
            loss = loss * math.nan  # a corrupt batch
        if torch.isfinite(loss):
            loss.backward()
        opt.step()
        if armed is not None:
            armed.append(_looks_armed())
    monitor.close()
    return monitor.alerts


@pytest.mark.parametrize("how", ["skip_nan", "skip_before_forward"])
def test_a_plain_loop_stepping_over_skipped_batches_is_silent(how):
    armed: list[int] = []
    assert [a for a in _plain_loop(how, armed=armed) if a.rule == "zero_gradient"] == []
    # The look is on from the first skipped step to the first backward after the last.
    assert armed[:8] == [0] * 8 and armed[8:12] == [1] * 4 and armed[13:] == [0] * 7
    assert _looks_armed() == 0


def test_a_plain_loop_skipping_five_batches_from_the_first_is_silent():
    alerts = _plain_loop("skip_nan", skipped=range(0, 5))
    assert [a for a in alerts if a.rule == "zero_gradient"] == []


def test_a_detached_layer_is_told_in_a_plain_loop_that_skips_batches():
    assert _zero_gradient(_plain_loop("detached")) == [(0, "side", "none")]


def test_a_model_replaced_after_the_optimizer_is_still_told():
    # Its copy's backward runs, unwatched: no skipped batch.
    alerts = _plain_loop("replaced")
    assert _zero_gradient(alerts) == [(8, "", "model_not_called")]


def test_a_generator_cut_off_from_an_unwatched_discriminator_is_still_told():
    """The generator's loss reads its output ``.detach()``ed: the discriminator's
    backward runs at every step and never reaches it. Only the generator is watched."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    monitor = tw.watch(gen, opt_g, console=False)
    ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
    for _ in range(10):
        fake = gen(torch.randn(32, 4))
        opt_d.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(disc(torch.randn(32, 8)), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(disc(fake.detach()), zeros)
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(disc(fake.detach()), ones)  # the bug
        g_loss.backward()
        opt_g.step()
    monitor.close()
    told = _zero_gradient(monitor.alerts)
    assert {module for _, module, _ in told} == {"0", "2"}
    assert {kind for _, _, kind in told} == {"none"}


def test_an_lbfgs_closure_over_a_replaced_model_is_still_told():
    """A closure step whose closure's backward runs on a copy made after the
    optimizer was built: told a step later than a plain loop's, not taken for a skip."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=2)
    monitor = tw.watch(model, opt, console=False)
    best = copy.deepcopy(model)
    x = torch.randn(64, 8)
    y = x[:, :1] * 2
    for step in range(12):
        if step == 4:
            model = copy.deepcopy(best)

        def closure(trained: nn.Module = model) -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(trained(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    monitor.close()
    (told,) = _zero_gradient(monitor.alerts)
    assert told[1:] == ("", "model_not_called")
    assert told[0] in (4, 5)
