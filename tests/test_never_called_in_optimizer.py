"""zero_gradient on a layer nobody calls whose parameters an optimizer trains.

An auxiliary head still in the optimizer after its loss was commented out is a
warning after ``patience`` steps (at the first step under DDP, which fails at
its next iteration); the same head called, frozen, or left out of the
optimizer stays silent, and without any optimizer it is one note at most.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.test_run import alerts as run_alerts
from tests.test_run import write
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


def warnings_of(alerts) -> list[tuple[str, str | None]]:
    return [(a.rule, a.module) for a in alerts if a.severity != "info"]


# -- a plain loop: a two-headed MLP whose auxiliary loss was commented out ------------


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.main_head = nn.Linear(16, 1)
        self.aux_head = nn.Linear(16, 4)
        self.use_aux = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        out = self.main_head(h)
        if self.use_aux:
            out = out + 0.1 * self.aux_head(h).mean(1, keepdim=True)
        return out


def _plain_loop(model: nn.Module, params=None, steps: int = 6, **watch_options) -> tw.Monitor:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters() if params is None else params, lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO(), **watch_options) as monitor:
        for _ in range(steps):
            x = torch.randn(16, 8)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
            opt.step()
    return monitor


def test_never_called_head_in_the_optimizer_warns_after_patience_steps():
    torch.manual_seed(0)
    monitor = _plain_loop(TwoHeads())
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.severity, alert.step) == (
        "zero_gradient",
        "aux_head",
        "warning",
        0,
    )
    assert alert.data["kind"] == "never_called"
    assert alert.data["in_optimizer"] is True and alert.data["distributed"] is False
    assert alert.data["steps"] == 3  # patience
    assert "never called" in alert.message and "optimizer holds" in alert.message
    for words in ("optimizer state", "find_unused_parameters=True", "second iteration"):
        assert words in alert.hint
    for fix in ("Freeze", "out of the optimizer", "call it"):
        assert fix in alert.hint


def test_never_called_head_waits_for_patience():
    torch.manual_seed(0)
    assert _plain_loop(TwoHeads(), steps=2).alerts == []
    torch.manual_seed(0)
    assert len(_plain_loop(TwoHeads(), steps=5, zero_gradient={"patience": 5}).alerts) == 1


def test_called_head_is_clean():
    torch.manual_seed(0)
    model = TwoHeads()
    model.use_aux = True
    assert _plain_loop(model).alerts == []


def test_frozen_never_called_head_left_out_of_the_optimizer_is_clean():
    torch.manual_seed(0)
    model = TwoHeads()
    model.aux_head.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert _plain_loop(model, trainable).alerts == []


def test_never_called_head_no_optimizer_holds_is_at_most_a_note():
    torch.manual_seed(0)
    model = TwoHeads()
    held = [p for name, p in model.named_parameters() if not name.startswith("aux_head")]
    monitor = _plain_loop(model, held)
    assert warnings_of(monitor.alerts) == []


def test_never_called_head_without_any_optimizer_is_a_note():
    """Hand-written updates: no optimizer holds the head, so it is one info line."""
    torch.manual_seed(0)
    model = TwoHeads()
    with tw.watch(model, console=False) as monitor:
        for _ in range(5):
            x = torch.randn(16, 8)
            model.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.05 * p.grad
            monitor.step()
    (note,) = monitor.alerts
    assert (note.rule, note.module, note.severity) == ("zero_gradient", "aux_head", "info")
    assert note.data["kind"] == "never_called"


# -- DDP: a one-process gloo group; the next iteration would fail, so at once ----------


@contextmanager
def one_process_group() -> Iterator[None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{port}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_under_ddp_never_called_head_warns_at_the_first_step():
    torch.manual_seed(0)
    model = TwoHeads()
    with one_process_group():
        monitor = _plain_loop(model, steps=1)
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.severity, alert.step) == (
        "zero_gradient",
        "aux_head",
        "warning",
        0,
    )
    assert alert.data["distributed"] is True and alert.data["steps"] == 1
    # The launcher's wrapper is not seen: it may lack find_unused_parameters.
    assert "next iteration fails" in alert.message


def test_under_ddp_with_find_unused_parameters_the_usual_patience_applies():
    """DDP copes there (an expert or head not called yet is allowed): no warning at once."""
    torch.manual_seed(0)
    with one_process_group():
        trained = nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
        assert _plain_loop(trained, steps=2).alerts == []
        trained = nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
        monitor = _plain_loop(trained, steps=3)
    (alert,) = monitor.alerts
    assert (alert.module, alert.severity, alert.step) == ("module.aux_head", "warning", 0)
    assert alert.data["steps"] == 3
    assert "only because find_unused_parameters=True" in alert.message


def test_under_ddp_without_find_unused_parameters_the_warning_comes_before_the_failure():
    """DDP's reducer fails at the second forward; the first step already said why."""
    torch.manual_seed(0)
    model = TwoHeads()
    with one_process_group():
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with tw.watch(ddp, opt, console=io.StringIO()) as monitor:
            with pytest.raises(RuntimeError, match="find_unused_parameters"):
                for _ in range(2):
                    x = torch.randn(16, 8)
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
                    opt.step()
            assert monitor.step_count == 1
            (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.step) == ("zero_gradient", "module.aux_head", 0)
    assert "next iteration fails" in alert.message


def test_under_ddp_every_head_called_is_clean():
    torch.manual_seed(0)
    model = TwoHeads()
    model.use_aux = True
    with one_process_group():
        ddp = nn.parallel.DistributedDataParallel(model)
        monitor = _plain_loop(ddp, steps=3)
    assert monitor.alerts == []


# -- Lightning: a small transformer classifier whose pooler nobody calls --------------


class TinyEncoder(pl.LightningModule):
    def __init__(self, *, use_pooler: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.pooler = nn.Linear(16, 16)  # kept from a pre-training recipe
        self.classifier = nn.Linear(16, 3)
        self.use_pooler = use_pooler

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(ids)).mean(1)
        if self.use_pooler:
            h = torch.tanh(self.pooler(h))
        return self.classifier(h)

    def training_step(self, batch, batch_idx):
        ids, labels = batch
        return nn.functional.cross_entropy(self(ids), labels)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 20, (32, 6), generator=gen)
        return DataLoader(TensorDataset(ids, ids[:, 0] % 3), batch_size=8)


def _fit(model: pl.LightningModule, tmp_path) -> TrainWatchCallback:
    callback = TrainWatchCallback(console=io.StringIO())
    quiet_trainer(tmp_path, [callback], max_steps=4).fit(model)
    return callback


def test_lightning_pooler_never_called_is_a_warning(tmp_path):
    torch.manual_seed(0)
    callback = _fit(TinyEncoder(use_pooler=False), tmp_path)
    assert warnings_of(callback.alerts) == [("zero_gradient", "pooler")]
    (alert,) = callback.alerts
    assert alert.data["kind"] == "never_called" and alert.step == 0


def test_lightning_pooler_called_is_clean(tmp_path):
    torch.manual_seed(0)
    callback = _fit(TinyEncoder(use_pooler=True), tmp_path)
    assert callback.alerts == []


# -- trainwatch run: an unmodified CNN script ---------------------------------------

CNN = """
import sys
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 3)
        self.rotation_head = nn.Linear(4 * 8 * 8, 4)  # its loss is commented out below

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        out = self.fc(h)
        if "aux" in sys.argv:
            out = out + 0.1 * self.rotation_head(h)[:, :3]
        return out


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(6):
    x = torch.randn(8, 1, 8, 8)
    y = torch.randint(0, 3, (8,))
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    # loss = loss + 0.1 * rotation_loss(model.rotation_head(...))
    loss.backward()
    opt.step()
"""


@pytest.fixture
def _forget_netdef():
    yield
    import sys

    sys.modules.pop("netdef", None)


def test_trainwatch_run_cnn_with_a_rotation_head_never_called_warns(tmp_path, _forget_netdef):
    script = write(tmp_path, "cnn.py", CNN)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    found = run_alerts(tmp_path / "log")
    assert [(a["rule"], a["module"], a["severity"]) for a in found] == [
        ("zero_gradient", "rotation_head", "warning")
    ]
    assert found[0]["data"]["kind"] == "never_called"


def test_trainwatch_run_cnn_with_the_head_called_is_clean(tmp_path, _forget_netdef):
    script = write(tmp_path, "cnn.py", CNN)
    assert run_script(script, ["aux"], log_dir=tmp_path / "log", console=False) == 0
    assert run_alerts(tmp_path / "log") == []
