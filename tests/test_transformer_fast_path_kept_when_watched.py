"""A transformer's eval-mode fast path is the same watched as unwatched.

``nn.TransformerEncoderLayer`` in eval mode, with gradients off or none of its
weights training, runs one fused kernel; it refused it whenever a module in it
had a forward hook, or a torch function mode was on the stack, and the slow
path's numbers differ in the last bits. trainwatch's hooks for one step (the
frozen output layer look, the call-order learning pass) and its modes (the
broadcast audit of the first steps, the class-target look of sampled steps)
so changed a frozen eval-mode teacher's outputs in a distillation, and with
them the loss: the run watched was not the run unwatched. Now the losses are
bit-identical under ``tw.watch``, ``trainwatch run`` and Lightning's callback,
and so is a trained transformer's validation under ``no_grad``; a transformer
classifier trained in eval mode by mistake is still told at step 0.
"""

from __future__ import annotations

import json
import subprocess
import sys

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


def _teacher() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


class AttentionBlock(nn.Module):
    """A block built on ``nn.MultiheadAttention`` itself (as torchvision's ViT is):
    its self-attention has a fast path of its own, refused under a function mode."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attention = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        x = x + self.attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(x)


class Distill(nn.Module):
    def __init__(self, attention_blocks: bool = False) -> None:
        super().__init__()
        self.student = nn.Linear(32, 2)
        self.teacher = (
            nn.Sequential(AttentionBlock(), AttentionBlock()) if attention_blocks else _teacher()
        )
        self.teacher.requires_grad_(False).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x[:, 0])


def _distil(
    watch: bool, teacher_under_no_grad: bool = True, attention_blocks: bool = False
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Distill(attention_blocks)
    opt = torch.optim.SGD(model.student.parameters(), lr=0.1)
    monitor = tw.watch(model, opt, console=False) if watch else None
    losses = []
    for _ in range(8):
        x = torch.randn(8, 10, 32)
        logits = model(x)
        if teacher_under_no_grad:
            with torch.no_grad():
                target = model.teacher(x)[:, 0, :2]
        else:  # frozen and in eval: the fast path too, with gradients on
            target = model.teacher(x)[:, 0, :2]
        loss = F.kl_div(F.log_softmax(logits, -1), F.softmax(target, -1), reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if monitor is not None:
        monitor.close()
    return losses


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def test_a_frozen_eval_teacher_under_no_grad_gives_the_same_losses_watched():
    assert _same(_distil(watch=True), _distil(watch=False))
    # Nothing of the guard stays (a stale global hook makes torch.compile warn).
    assert not torch.nn.modules.module._has_any_global_hook()


def test_a_frozen_eval_teacher_of_attention_blocks_gives_the_same_losses_watched():
    assert _same(
        _distil(watch=True, attention_blocks=True), _distil(watch=False, attention_blocks=True)
    )


def test_a_frozen_eval_teacher_called_with_gradients_on_gives_the_same_losses_watched():
    watched = _distil(watch=True, teacher_under_no_grad=False)
    assert _same(watched, _distil(watch=False, teacher_under_no_grad=False))


SCRIPT = """
import json
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class Distill(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
        layer = nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True)
        self.teacher = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.teacher.requires_grad_(False)
        self.teacher.eval()

    def forward(self, x):
        return self.student(x.mean(1))


model = Distill()
opt = torch.optim.Adam(model.student.parameters(), 1e-3)
losses = []
for step in range(8):
    x = torch.randn(16, 12, 32)
    y = torch.randint(0, 3, (16,))
    logits = model(x)
    with torch.no_grad():
        soft = model.teacher(x).mean(1)[:, :3].softmax(-1)
    distil = F.kl_div(logits.log_softmax(-1), soft, reduction="batchmean")
    loss = F.cross_entropy(logits, y) + distil
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append([loss.item(), soft.tolist()])
with open(sys.argv[1], "w") as f:
    json.dump(losses, f)
"""


def test_trainwatch_run_leaves_an_unmodified_distillation_bit_identical(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain, watched = tmp_path / "plain.json", tmp_path / "watched.json"
    subprocess.run([sys.executable, str(script), str(plain)], check=True)
    run_script(script, [str(watched)], log_dir=tmp_path / "log", console=False)
    assert json.loads(watched.read_text()) == json.loads(plain.read_text())


class LitDistill(L.LightningModule):
    """The teacher called in ``training_step``, never in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = _teacher().requires_grad_(False).eval()
        self.student = nn.Linear(32, 2)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x[:, 0])

    def training_step(self, batch, index):
        (x,) = batch
        logits = self(x)
        with torch.no_grad():
            target = self.teacher(x)[:, 0, :2]
        loss = F.kl_div(logits.log_softmax(-1), target.softmax(-1), reduction="batchmean")
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.student.parameters(), lr=0.1)


def _lightning_losses(tmp_path, callbacks: list) -> list[float]:
    torch.manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(64, 10, 32)), batch_size=8)
    module = LitDistill()
    quiet_trainer(tmp_path, callbacks, max_steps=8).fit(module, loader)
    return module.losses


def test_lightning_teacher_in_training_step_gives_the_same_losses_watched(tmp_path):
    plain = _lightning_losses(tmp_path / "plain", [])
    watched = _lightning_losses(tmp_path / "watched", [TrainWatchCallback(console=False)])
    assert len(plain) == 8
    assert watched == plain


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, 0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.features = self.encoder(x)
        return self.head(self.features.mean(1))


def _validate(model: nn.Module, outputs: list) -> None:
    model.eval()
    with torch.no_grad():
        outputs += [model(torch.randn(32, 16, 32)), model.features]


def _train_and_validate(
    watch: bool, train_mode: bool = True, mid_step: bool = False
) -> tuple[list, list, list]:
    """``mid_step``: the batch's eval-mode accuracy is taken between the loss and
    backward (the broadcast audit of the first steps is on then); else a
    validation comes first, as Lightning's sanity check, and every other step."""
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = tw.watch(model, opt, console=False) if watch else None
    losses: list = []
    outputs: list = []
    if not mid_step:
        _validate(model, outputs)
    for step in range(8):
        model.train(train_mode)
        x, y = torch.randn(32, 16, 32), torch.randint(0, 3, (32,))
        loss = F.cross_entropy(model(x), y)
        if mid_step:
            _validate(model, outputs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if not mid_step and step % 2 == 1:
            _validate(model, outputs)
    alerts = monitor.alerts if monitor is not None else []
    if monitor is not None:
        monitor.close()
    return losses, outputs, alerts


@pytest.mark.parametrize("mid_step", [False, True], ids=["between_steps", "mid_step"])
def test_a_trained_transformer_validated_under_no_grad_in_eval_is_bit_identical_watched(mid_step):
    losses, outputs, alerts = _train_and_validate(watch=True, mid_step=mid_step)
    plain_losses, plain_outputs, _ = _train_and_validate(watch=False, mid_step=mid_step)
    assert _same(losses, plain_losses)
    assert _same(outputs, plain_outputs)
    assert [a for a in alerts if a.rule == "train_in_eval_mode"] == []


def test_a_transformer_classifier_trained_in_eval_mode_is_still_told_at_step_0():
    _, _, alerts = _train_and_validate(watch=True, train_mode=False)
    told = [(a.step, a.module) for a in alerts if a.rule == "train_in_eval_mode"]
    assert told[:1] == [(0, "encoder.layers.0.self_attn")]


def _with_a_users_hook(watch: bool) -> tuple[list[torch.Tensor], int]:
    """A hook of the user's inside the teacher keeps it off the fast path, watched or not."""
    calls = []
    torch.manual_seed(0)
    model = Distill()
    model.teacher.layers[0].linear1.register_forward_hook(lambda *_: calls.append(1))
    opt = torch.optim.SGD(model.student.parameters(), lr=0.1)
    monitor = tw.watch(model, opt, console=False) if watch else None
    losses = []
    for _ in range(6):
        x = torch.randn(8, 10, 32)
        logits = model(x)
        with torch.no_grad():
            target = model.teacher(x)[:, 0, :2]
        loss = F.kl_div(F.log_softmax(logits, -1), F.softmax(target, -1), reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if monitor is not None:
        monitor.close()
    return losses, len(calls)


def test_a_users_own_hook_inside_the_teacher_stays_and_runs_as_unwatched():
    watched, watched_calls = _with_a_users_hook(watch=True)
    plain, plain_calls = _with_a_users_hook(watch=False)
    assert watched_calls == plain_calls == 6
    assert _same(watched, plain)
