"""An evaluation that calls the model's parts, not the model, is judged like one of the model.

A seq2seq model or an autoencoder trained through ``model(x)`` is often
evaluated through its methods: ``model.decode(model.encode(x))``, embeddings
from ``model.encode(x)`` for a retrieval metric, a greedy decoding loop over
``model.decoder`` and ``model.generator``. The pass hooks sit on the model's
root alone, so such an evaluation run without ``model.eval()`` (dropout on,
batch norm moving its statistics) was seen by no check. A no-grad block is
now looked into, and a part with dropout or batch norm in training mode
called there on its own is followed as a pass of the model's. Parts called
under ``no_grad`` as part of every training step (a target, pseudo-labels),
frozen parts (a teacher inside the model) and healthy evaluations stay silent.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.autograd import grad_mode
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import quiet_trainer
from trainwatch import late_models
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


class Seq2Seq(nn.Module):
    """Trained through ``forward``; evaluated through ``encode``, ``decode`` and its parts."""

    def __init__(self, mode_dependent: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = nn.BatchNorm1d(32) if mode_dependent else nn.Identity()
        drop = nn.Dropout(0.2) if mode_dependent else nn.Identity()
        self.encoder = nn.Sequential(nn.Linear(16, 32), norm, nn.ReLU(), drop, nn.Linear(32, 8))
        self.decoder = nn.Sequential(
            nn.Linear(8, 32),
            nn.ReLU(),
            nn.Dropout(0.2) if mode_dependent else nn.Identity(),
            nn.Linear(32, 8),
        )
        self.generator = nn.Linear(8, 16)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(self.decoder(z))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def _whole(model: Seq2Seq) -> None:
    for _ in range(3):
        model(torch.randn(32, 16))


def _encode_decode(model: Seq2Seq) -> None:
    for _ in range(3):
        z = model.encode(torch.randn(32, 16))
        model.decode(z)


def _encode_only(model: Seq2Seq) -> None:
    """Embeddings of the whole gallery at once, for a retrieval metric."""
    model.encode(torch.randn(64, 16))


def _greedy_decoding(model: Seq2Seq) -> None:
    h = model.encoder(torch.randn(32, 16))
    for _ in range(4):
        h = model.decoder(h)
        model.generator(h).argmax(-1)


def _train(model: Seq2Seq, opt, steps: int, every_step=None, evaluate=None, forgot_eval=True):
    for step in range(steps):
        x = torch.randn(32, 16)
        extra = every_step(model, x) if every_step is not None else 0.0
        opt.zero_grad()
        (F.mse_loss(model(x), x) + extra).backward()
        opt.step()
        if evaluate is not None and step % 10 == 9:
            if not forgot_eval:
                model.eval()
            with torch.no_grad():
                evaluate(model)
            model.train()


def _warnings(monitor) -> list[tuple[str, str, int]]:
    return [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize(
    "evaluate", [_whole, _encode_decode, _encode_only, _greedy_decoding], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("forgot_eval", [True, False], ids=["forgot_eval", "healthy"])
def test_an_evaluation_through_the_models_parts_in_training_mode_is_told(
    quiet_watch, evaluate, forgot_eval
):
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 30, evaluate=evaluate, forgot_eval=forgot_eval)
    monitor.close()
    if not forgot_eval:
        assert _warnings(monitor) == []
        # A healthy evaluation leaves no hook on the parts: training costs what it did.
        assert not model.encoder._forward_hooks and not model.decoder._forward_hooks
        return
    # Once, at the first evaluation (after 10 steps), named at the first module
    # in training mode: the encoder's batch norm.
    assert _warnings(monitor)[0] == ("eval_in_train_mode", "encoder.1", 10)
    assert {module for _, module, _ in _warnings(monitor)} == {"encoder.1"}


def test_the_parts_of_one_evaluation_are_listed_in_one_alert(quiet_watch):
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 12, evaluate=_encode_decode)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.data["modules"] == ["encoder.1", "encoder.3", "decoder.2"]
    assert alert.data["mode_dependent"] == 3


@pytest.mark.parametrize("block", ["no_grad", "inference_mode", "decorated"])
def test_embeddings_computed_in_any_no_grad_block_are_judged(quiet_watch, block):
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)

    @torch.no_grad()
    def embed(x):
        return model.encode(x)

    for step in range(15):
        x = torch.randn(32, 16)
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        opt.step()
        if step == 9:
            if block == "decorated":
                embed(torch.randn(64, 16))
            else:
                with torch.inference_mode() if block == "inference_mode" else torch.no_grad():
                    model.encode(torch.randn(64, 16))
    assert _warnings(monitor) == [("eval_in_train_mode", "encoder.1", 10)]


def _target_before(model: Seq2Seq, x: torch.Tensor) -> torch.Tensor:
    """A target made by the model's encoder under no_grad at every step (BYOL-like)."""
    with torch.no_grad():
        target = model.encode(x + 0.1 * torch.randn_like(x))
    return F.mse_loss(model.encode(x), target)


def _pseudo_labels(model: Seq2Seq, x: torch.Tensor) -> torch.Tensor:
    """Pseudo-labels through two parts one after the other, at every step."""
    with torch.no_grad():
        labels = model.decode(model.encode(x + 0.1 * torch.randn_like(x)))
    return F.mse_loss(model(x), labels)


@pytest.mark.parametrize("every_step", [_target_before, _pseudo_labels], ids=lambda f: f.__name__)
def test_parts_run_under_no_grad_at_every_training_step_are_training(quiet_watch, every_step):
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 40, every_step=every_step)
    assert model.encoder._forward_hooks  # followed all along, judged as training
    monitor.close()
    assert _warnings(monitor) == []


def test_a_target_made_after_each_step_is_training(quiet_watch):
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(40):
        x = torch.randn(32, 16)
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        opt.step()
        with torch.no_grad():
            model.encode(x)
    monitor.close()
    assert _warnings(monitor) == []


class _WithTeacher(Seq2Seq):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.Linear(32, 8))
        self.teacher.requires_grad_(False)


@pytest.mark.parametrize("ema", [False, True], ids=["fixed_teacher", "ema_target"])
def test_a_frozen_part_run_on_two_views_a_step_is_no_evaluation(quiet_watch, ema):
    model = _WithTeacher()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(30):
        x = torch.randn(32, 16)
        with torch.no_grad():
            targets = model.teacher(x) + model.teacher(x.flip(0))
            if ema:
                for t, s in zip(model.teacher.parameters(), model.encoder.parameters()):
                    if t.shape == s.shape:
                        t.lerp_(s, 0.05)
        opt.zero_grad()
        (F.mse_loss(model(x), x) + F.mse_loss(model.encode(x), targets)).backward()
        opt.step()
    assert _warnings(monitor) == []


def test_a_model_without_dropout_or_batch_norm_is_not_looked_into(quiet_watch):
    model = Seq2Seq(mode_dependent=False)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 30, evaluate=_encode_decode)
    assert _warnings(monitor) == []
    assert grad_mode.no_grad.__enter__.__module__ != late_models.__name__


class _Agent(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Dropout(dropout), nn.Linear(32, 2))
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Linear(32, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs)


@pytest.mark.parametrize("through", ["whole", "actor"])
@pytest.mark.parametrize("dropout", [0.1, 0.0], ids=["dropout", "no_dropout"])
def test_rollouts_through_a_part_are_judged_as_rollouts_through_the_policy(
    quiet_watch, through, dropout
):
    """Batch-of-one actions under no_grad at each environment step, then an update."""
    agent = _Agent(dropout)
    opt = torch.optim.Adam(agent.parameters(), 1e-3)
    monitor = quiet_watch(agent, opt)
    for _ in range(6):
        observations = [torch.randn(1, 4) for _ in range(16)]
        for obs in observations:
            with torch.no_grad():
                agent(obs) if through == "whole" else agent.actor(obs)
        logits, values = agent(torch.cat(observations))
        opt.zero_grad()
        (logits.logsumexp(-1).mean() + values.pow(2).mean()).backward()
        opt.step()
    found = {(rule, module) for rule, module, _ in _warnings(monitor)}
    assert found == ({("eval_in_train_mode", "actor.1")} if dropout else set())


def test_blocks_torch_enters_itself_are_not_looked_into(quiet_watch, monkeypatch):
    """``clip_grad_norm_`` enters no_grad blocks of its own at every step: no look,
    not even the lookout's question (only the script's own blocks are asked about)."""
    asked = []
    entered = late_models.NoGradLookout.entered
    monkeypatch.setattr(
        late_models.NoGradLookout,
        "entered",
        lambda self, block, script: asked.append(script) or entered(self, block, script),
    )
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    quiet_watch(model, opt)
    for _ in range(5):
        x = torch.randn(32, 16)
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert asked == []
    with torch.no_grad():
        model.encode(x)
    assert len(asked) == 1


def test_closing_the_monitor_gives_the_blocks_back(quiet_watch):
    model = Seq2Seq()
    monitor = quiet_watch(model, torch.optim.Adam(model.parameters(), 1e-3))
    assert grad_mode.no_grad.__enter__.__module__ == late_models.__name__
    monitor.close()
    assert grad_mode.no_grad.__enter__.__module__ != late_models.__name__
    assert grad_mode.inference_mode.__exit__.__module__ != late_models.__name__


_SCRIPT = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

forgot_eval = sys.argv[1] == "forgot_eval"
torch.manual_seed(0)


class AutoEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 8)
        )
        self.decoder = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16)
        )

    def encode(self, x):
        return self.encoder(x)

    def decode(self, z):
        return self.decoder(z)

    def forward(self, x):
        return self.decode(self.encode(x))


model = AutoEncoder()
opt = torch.optim.Adam(model.parameters(), 1e-3)
for step in range(40):
    x = torch.randn(32, 16)
    loss = F.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 20 == 19:
        if not forgot_eval:
            model.eval()
        with torch.no_grad():
            for _ in range(3):
                model.decode(model.encode(torch.randn(32, 16)))
        model.train()
"""


@pytest.mark.slow
@pytest.mark.parametrize("forgot_eval", [True, False], ids=["forgot_eval", "healthy"])
def test_trainwatch_run_tells_an_evaluation_through_parts(tmp_path, forgot_eval):
    import json

    script = tmp_path / "autoencoder.py"
    script.write_text(_SCRIPT)
    how = "forgot_eval" if forgot_eval else "healthy"
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["module"], a["step"]) for a in map(json.loads, lines)]
    found = [f for f in found if f[0] == "eval_in_train_mode"]
    assert found == ([("eval_in_train_mode", "encoder.1", 20)] if forgot_eval else [])


class _Retrieval(L.LightningModule):
    """Trains through ``self(x)``; a callback measures retrieval on ``encode`` embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Seq2Seq()

    def forward(self, x):
        return self.net(x)

    def encode(self, x):
        return self.net.encode(x)

    def training_step(self, batch, index):
        (x,) = batch
        return F.mse_loss(self(x), x)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), 1e-3)


class _RetrievalMetric(L.Callback):
    def __init__(self, forgot_eval: bool) -> None:
        self.forgot_eval = forgot_eval

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, index):
        if trainer.global_step % 10:
            return
        if not self.forgot_eval:
            pl_module.eval()
        with torch.no_grad():
            gallery = pl_module.encode(torch.randn(64, 16))
            (gallery @ gallery.t()).argmax(-1)
        pl_module.train()


@pytest.mark.slow
@pytest.mark.parametrize("forgot_eval", [True, False], ids=["forgot_eval", "healthy"])
def test_a_lightning_callback_embedding_through_a_part_is_judged(tmp_path, forgot_eval):
    loader = DataLoader(TensorDataset(torch.randn(256, 16)), batch_size=32, shuffle=True)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback, _RetrievalMetric(forgot_eval)], max_steps=25)
    trainer.fit(_Retrieval(), loader)
    found = [(a.rule, a.module, a.step) for a in callback.alerts if a.severity != "info"]
    assert found == ([("eval_in_train_mode", "net.encoder.1", 10)] if forgot_eval else [])
