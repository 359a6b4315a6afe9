"""A large frozen part of a model that trains, left in training mode: one info line.

A frozen teacher inside a distillation wrapper, or a frozen backbone under a
trained head, is usually kept in eval mode; ``model.train()`` puts it back in
training mode, where the teacher's dropout makes its targets noisy and the
backbone's batch norm keeps overwriting its running statistics. Nothing was
said of it: the no-grad pass check sees whole passes, and the train-in-eval
check the opposite mode. Frozen layers beside trained adapters (LoRA) and
frozen embeddings are no such part: their dropout is meant to be on.
"""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


class Distiller(nn.Module):
    """``frozen``: the teacher's parameters have requires_grad=False; else they keep
    it, and only the optimizer (built over the student) and ``no_grad`` leave the
    teacher untrained."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.teacher = nn.Sequential(
            nn.Linear(16, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 4)
        )
        if frozen:
            self.teacher.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            target = self.teacher(x).softmax(-1)
        return self.student(x), target


def _distil(model: Distiller, keep_teacher_in_eval: bool, steps: int = 12) -> list:
    opt = torch.optim.Adam(model.student.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(steps):
            model.train()
            if keep_teacher_in_eval:
                model.teacher.eval()
            logits, target = model(torch.randn(32, 16))
            loss = nn.functional.kl_div(logits.log_softmax(-1), target, reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def _frozen_findings(alerts: list) -> list[tuple[int, str | None, str]]:
    return [
        (a.step, a.module, a.severity)
        for a in alerts
        if a.data.get("finding") == "frozen part in training mode"
    ]


def test_a_frozen_teacher_left_in_training_mode_is_one_info_line():
    torch.manual_seed(0)
    alerts = _distil(Distiller(), keep_teacher_in_eval=False)
    assert _frozen_findings(alerts) == [(0, "teacher.2", "info")]
    (alert,) = [a for a in alerts if a.data.get("finding")]
    assert alert.rule == "eval_in_train_mode" and "dropout is on" in alert.message


def test_a_frozen_teacher_kept_in_eval_mode_says_nothing_of_it():
    torch.manual_seed(0)
    alerts = _distil(Distiller(), keep_teacher_in_eval=True)
    assert _frozen_findings(alerts) == []
    assert all(a.severity == "info" for a in alerts)


def _linear_probe(
    backbone_in_eval: bool,
    freeze_at: int | None = 0,
    unfreeze_at: int | None = None,
) -> list:
    """``unfreeze_at``: the second phase, the backbone trainable again, handed to the
    optimizer and put back in training mode on that step. ``freeze_at`` None: the
    optimizer is built over the head, the backbone never frozen (it gets gradients
    that nothing applies)."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 128), nn.BatchNorm1d(128), nn.ReLU())
    model = nn.Sequential(backbone, nn.Linear(128, 4))
    if freeze_at is None:
        opt = torch.optim.SGD(model[1].parameters(), lr=0.05)
    elif freeze_at == 0:  # the usual linear probe: frozen, and the optimizer over the head
        backbone.requires_grad_(False)
        opt = torch.optim.SGD(model[1].parameters(), lr=0.05)
    else:  # trained end to end, then frozen
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(20):
            if step == freeze_at:
                backbone.requires_grad_(False)
            if step == unfreeze_at:
                backbone.requires_grad_(True)
                opt.add_param_group({"params": list(backbone.parameters()), "lr": 0.005})
            model.train()
            if backbone_in_eval and (unfreeze_at is None or step < unfreeze_at):
                backbone.eval()
            y = torch.randint(0, 4, (32,))
            loss = nn.functional.cross_entropy(model(torch.randn(32, 16)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor.alerts


def test_a_teacher_never_frozen_that_no_optimizer_holds_left_in_training_mode_is_told_as_frozen():
    """Run under ``no_grad`` inside the model's own pass, held by no optimizer: it
    trains no more than a frozen teacher, and its dropout makes the targets noisy."""
    torch.manual_seed(0)
    alerts = _distil(Distiller(frozen=False), keep_teacher_in_eval=False)
    assert _frozen_findings(alerts) == [(0, "teacher.2", "info")]
    assert [a.rule for a in alerts] == ["eval_in_train_mode"]
    assert alerts[0].data["held_by_no_optimizer"] is True
    assert "no optimizer holds its parameters" in alerts[0].message


def test_a_teacher_never_frozen_kept_in_eval_mode_is_the_usual_fine_tuning_line_only():
    torch.manual_seed(0)
    alerts = _distil(Distiller(frozen=False), keep_teacher_in_eval=True)
    assert [(a.rule, a.severity) for a in alerts] == [("train_in_eval_mode", "info")]


def test_a_students_dropout_in_training_mode_beside_a_teacher_never_frozen_is_no_frozen_part():
    torch.manual_seed(0)
    model = Distiller(frozen=False)
    model.student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    alerts = _distil(model, keep_teacher_in_eval=True)
    assert [(a.rule, a.severity, a.module) for a in alerts] == [
        ("train_in_eval_mode", "info", "teacher.2")
    ]


def test_a_backbone_left_out_of_the_optimizer_that_gets_gradients_is_no_frozen_part():
    """Never frozen, its gradients never applied: not_optimized's finding alone."""
    alerts = _linear_probe(backbone_in_eval=False, freeze_at=None)
    assert _frozen_findings(alerts) == []
    assert "not_optimized" in {a.rule for a in alerts}


def test_a_frozen_backbone_whose_batch_norm_trains_is_one_info_line():
    found = _frozen_findings(_linear_probe(backbone_in_eval=False))
    assert found == [(0, "0.1", "info")]


def test_a_frozen_backbone_kept_in_eval_mode_is_the_usual_fine_tuning_line_only():
    alerts = _linear_probe(backbone_in_eval=True)
    assert _frozen_findings(alerts) == []
    assert [(a.rule, a.severity) for a in alerts] == [("train_in_eval_mode", "info")]


def test_a_backbone_frozen_after_some_steps_is_told_from_then_on():
    found = _frozen_findings(_linear_probe(backbone_in_eval=False, freeze_at=8))
    assert len(found) == 1 and 8 <= found[0][0] <= 9


def test_a_backbone_unfrozen_and_put_back_in_training_mode_is_no_frozen_part():
    """The linear probe's second phase: trainable again, in the optimizer and in
    training mode from the same step on. Nothing is frozen on that step's pass."""
    alerts = _linear_probe(backbone_in_eval=True, unfreeze_at=10)
    assert _frozen_findings(alerts) == []


class LoRALinear(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(4, d) * 0.01)
        self.b = nn.Parameter(torch.zeros(d, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = LoRALinear(d)
        self.ff = nn.Sequential(nn.Linear(d, d), nn.Dropout(0.1))
        self.ff.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.attn(x))


def test_frozen_base_layers_beside_trained_adapters_keep_their_dropout_silently():
    torch.manual_seed(0)
    embed = nn.Embedding(100, 32)
    embed.requires_grad_(False)  # frozen embeddings: a small share of the model
    model = nn.Sequential(embed, nn.Dropout(0.1), *[Block(32) for _ in range(4)], nn.Linear(32, 2))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(12):
            out = model(torch.randint(0, 100, (8, 6))).mean(1)
            loss = nn.functional.cross_entropy(out, torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert _frozen_findings(monitor.alerts) == []


SCRIPT = """
import sys
import torch
from torch import nn

keep_eval = sys.argv[1] == "eval"
torch.manual_seed(0)
student = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
teacher = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 4))


class Distiller(nn.Module):
    def __init__(self):
        super().__init__()
        self.student, self.teacher = student, teacher
        self.teacher.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(x).softmax(-1)
        return self.student(x), target


model = Distiller()
opt = torch.optim.Adam(model.student.parameters(), 1e-3)
for step in range(10):
    model.train()
    if keep_eval:
        model.teacher.eval()
    logits, target = model(torch.randn(32, 16))
    loss = nn.functional.kl_div(logits.log_softmax(-1), target, reduction="batchmean")
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _frozen_parts_told_under_run(tmp_path, source: str, how: str) -> list[tuple[int, str]]:
    """(step, module) of each frozen part ``trainwatch run`` told in training mode."""
    script = tmp_path / "train.py"
    script.write_text(source)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [
        (a["step"], a["module"])
        for a in map(json.loads, lines)
        if a["data"].get("finding") == "frozen part in training mode"
    ]


@pytest.mark.parametrize("how", ["train", "eval"])
def test_trainwatch_run_tells_the_frozen_teacher_in_training_mode(tmp_path, how):
    found = _frozen_parts_told_under_run(tmp_path, SCRIPT, how)
    assert found == ([(0, "teacher.2")] if how == "train" else [])


@pytest.mark.parametrize("how", ["train", "eval"])
def test_trainwatch_run_tells_a_teacher_never_frozen_in_training_mode(tmp_path, how):
    """Held by no optimizer, run under no_grad: told as a frozen one; kept in eval,
    the usual fine-tuning line and no warning."""
    source = SCRIPT.replace("self.teacher.requires_grad_(False)", "pass")
    found = _frozen_parts_told_under_run(tmp_path, source, how)
    assert found == ([(0, "teacher.2")] if how == "train" else [])
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    assert [a["severity"] for a in map(json.loads, lines)] == ["info"]


LOSS_NETWORK = """
import sys
import torch
from torch import nn


class LossNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        return self.features(x)


torch.manual_seed(0)
generator = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1))
loss_net = LossNet()
if sys.argv[1] == "eval":
    loss_net.eval()
loss_net.requires_grad_(False)
opt = torch.optim.Adam(generator.parameters(), 1e-3)
for step in range(6):
    x = torch.rand(4, 3, 16, 16)
    with torch.no_grad():
        target = loss_net(x)
    loss = nn.functional.mse_loss(loss_net(generator(x)), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("eval", ("train_in_eval_mode", "info")), ("train", ("eval_in_train_mode", "info"))],
)
def test_a_frozen_perceptual_loss_network_watched_on_its_own_is_a_frozen_part(
    tmp_path, mode, expected
):
    """Under trainwatch run the loss network is a model of its own, none of whose
    parameters trains; backward runs through it to the generator's image. In eval
    mode, as it should be, it is the usual note, not a forgotten model.train(); in
    training mode (its batch norm drifting), the frozen-part note."""
    script = tmp_path / "style.py"
    script.write_text(LOSS_NETWORK)
    run_script(script, [mode], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    found = [(a["rule"], a["severity"]) for a in alerts if a["data"]["model"] == "LossNet"]
    assert found == [expected]


class _Embeddings(nn.Module):
    """BERT's layout: tables, a layer norm and the dropout after them."""

    def __init__(self) -> None:
        super().__init__()
        self.words = nn.Embedding(500, 32)
        self.positions = nn.Embedding(16, 32)
        self.norm = nn.LayerNorm(32)
        self.dropout = nn.Dropout(0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.words(tokens) + self.positions(torch.arange(tokens.shape[1]))
        return self.dropout(self.norm(h))


class _SmallTextModel(nn.Module):
    """Embeddings that hold most of the parameters of a small model, as in a tiny
    BERT or DistilBERT (about a third of the latter's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = _Embeddings()
        self.encoder = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embeddings(tokens)).mean(1))


@pytest.mark.parametrize(("frozen", "told"), [("embeddings", False), ("encoder", True)])
def test_frozen_embeddings_holding_most_parameters_are_no_frozen_part(frozen, told):
    torch.manual_seed(0)
    model = _SmallTextModel()
    getattr(model, frozen).requires_grad_(False)
    if frozen == "encoder":
        model.encoder[0] = nn.Linear(32, 32 * 24)  # large enough to be a part
        model.encoder[0].requires_grad_(False)
        model.head = nn.Linear(32 * 24, 2)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(4):
            tokens = torch.randint(0, 500, (8, 16))
            loss = nn.functional.cross_entropy(model(tokens), torch.randint(0, 2, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    notes = [a for a in monitor.alerts if a.data.get("finding") == "frozen part in training mode"]
    assert bool(notes) is told


class _WithEmaCopy(nn.Module):
    """A network and its EMA copy, registered and frozen, updated by hand. ``mean_teacher``:
    the copy makes the targets, called in training mode under no_grad; else it is only
    ever copied from, and its forward never runs."""

    def __init__(self, mean_teacher: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))
        self.ema_net = copy.deepcopy(self.net).requires_grad_(False)
        self.mean_teacher = mean_teacher

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.mean_teacher:
            return self.net(x), None
        with torch.no_grad():
            target = self.ema_net(x).softmax(-1)
        return self.net(x), target


def _train_with_ema(model: _WithEmaCopy, steps: int = 12) -> list:
    opt = torch.optim.AdamW(model.net.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(steps):
            logits, target = model(torch.randn(32, 16))
            if target is None:
                target = torch.randint(0, 3, (32,))
            loss = nn.functional.cross_entropy(logits, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for ema, param in zip(model.ema_net.parameters(), model.net.parameters()):
                    ema.lerp_(param, 0.01)
    return monitor.alerts


@pytest.mark.parametrize("mean_teacher", [False, True], ids=["only_copied_from", "mean_teacher"])
def test_an_ema_copy_whose_forward_never_runs_is_no_frozen_part_in_training_mode(mean_teacher):
    torch.manual_seed(0)
    found = _frozen_findings(_train_with_ema(_WithEmaCopy(mean_teacher)))
    assert found == ([(0, "ema_net.2", "info")] if mean_teacher else [])


class _LitWithEmaCopy(L.LightningModule):
    """No forward of its own: training_step calls the parts. ``teacher``: the frozen
    copy makes the targets in training mode; else it is only updated and copied from."""

    def __init__(self, teacher: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))
        self.ema_net = copy.deepcopy(self.net).requires_grad_(False)
        self.teacher = teacher

    def training_step(self, batch, index):
        x, y = batch
        if self.teacher:
            with torch.no_grad():
                y = self.ema_net(x).softmax(-1)
        return nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, index):
        with torch.no_grad():
            for ema, param in zip(self.ema_net.parameters(), self.net.parameters()):
                ema.lerp_(param, 0.01)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=1e-3)


@pytest.mark.parametrize("teacher", [False, True], ids=["only_copied_from", "teacher"])
def test_lightning_ema_part_never_called_is_no_frozen_part_in_training_mode(tmp_path, teacher):
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (256,))), batch_size=32)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_steps=12).fit(_LitWithEmaCopy(teacher), loader)
    found = _frozen_findings(callback.alerts)
    assert found == ([(0, "ema_net.2", "info")] if teacher else [])


EMA_SCRIPT = """
import copy
import sys
import torch
from torch import nn

mean_teacher = sys.argv[1] == "mean_teacher"
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))
        self.ema_net = copy.deepcopy(self.net).requires_grad_(False)

    def forward(self, x):
        if mean_teacher:
            with torch.no_grad():
                return self.net(x), self.ema_net(x).softmax(-1)
        return self.net(x), torch.randint(0, 3, (x.shape[0],))


model = Net()
opt = torch.optim.AdamW(model.net.parameters(), lr=1e-3)
for step in range(10):
    logits, target = model(torch.randn(32, 16))
    loss = nn.functional.cross_entropy(logits, target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        for ema, param in zip(model.ema_net.parameters(), model.net.parameters()):
            ema.lerp_(param, 0.01)
"""


@pytest.mark.parametrize("how", ["only_copied_from", "mean_teacher"])
def test_trainwatch_run_is_silent_on_an_ema_copy_that_never_runs(tmp_path, how):
    found = _frozen_parts_told_under_run(tmp_path, EMA_SCRIPT, how)
    assert found == ([(0, "ema_net.2")] if how == "mean_teacher" else [])


TOGGLED_GAN = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.G = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z):
        return self.G(z)


model = GAN()
opt_g = torch.optim.Adam(model.G.parameters(), 1e-3)
opt_d = torch.optim.Adam(model.D.parameters(), 1e-3)


def toggle(opt):  # LightningModule.toggle_optimizer: freeze what opt does not hold
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    for p in model.parameters():
        p.requires_grad_(id(p) in held)


for step in range(12):
    real, z = torch.randn(64, 2), torch.randn(64, 8)
    toggle(opt_d)
    fake = model(z).detach()
    d_loss = F.softplus(-model.D(real)).mean() + F.softplus(model.D(fake)).mean()
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    if sys.argv[1] == "frozen":  # the generator's step dropped: it stays frozen
        continue
    toggle(opt_g)
    g_loss = F.softplus(-model.D(model(z))).mean()
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
    opt_g.zero_grad()
    model.requires_grad_(True)  # untoggle
"""


@pytest.mark.parametrize("how", ["toggled", "frozen"])
def test_trainwatch_run_on_a_generator_frozen_only_for_the_critics_step_is_no_frozen_part(
    tmp_path, how
):
    """``trainwatch run`` finds the model inside the discriminator's step, the
    generator frozen by the toggle; its own step trains it. Left frozen, it is one."""
    found = _frozen_parts_told_under_run(tmp_path, TOGGLED_GAN, how)
    assert found == ([] if how == "toggled" else [(0, "G.1")])


def test_a_frozen_teacher_in_training_mode_over_a_single_step_is_told_at_close():
    torch.manual_seed(0)
    assert _frozen_findings(_distil(Distiller(), keep_teacher_in_eval=False, steps=1)) == [
        (0, "teacher.2", "info")
    ]
