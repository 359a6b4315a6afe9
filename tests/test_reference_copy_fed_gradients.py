"""A reference or teacher copy of the trained model, kept in eval, fed gradients.

DPO keeps ``ref = copy.deepcopy(policy).eval()`` beside the policy, and
self-distillation a teacher copied from the student; no optimizer holds the
copy. Computed without ``torch.no_grad()`` and never frozen, the copy gets
gradients at every backward. Its eval mode is the setup as meant (a noisy
reference is the other DPO bug): the gradients are the bug. They are told as a
target fed gradients at the copy's second step (``not_optimized`` under
``trainwatch run``, ``accumulated_gradient`` for a part of a LightningModule,
``data.kind: target_receives_gradients``), and never as a training step in
eval mode whose hint, ``model.train()``, would make the reference noisy.

The healthy twins (the copy under ``no_grad``, frozen or not) stay silent; a
reference left in training mode is still ``eval_in_train_mode``'s, and the
policy itself trained in eval after a validation still ``train_in_eval_mode``'s.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

TINY_LM = """
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.drop = nn.Dropout(0.1)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 50)

    def forward(self, ids):
        return self.head(self.body(self.drop(self.emb(ids))))
"""

DPO = (
    """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

how = sys.argv[1]
"""
    + TINY_LM
    + """

def logps(model, ids):
    lp = model(ids[:, :-1]).log_softmax(-1)
    return torch.gather(lp, 2, ids[:, 1:, None])[..., 0].sum(-1)


torch.manual_seed(0)
policy = TinyLM()
ref = copy.deepcopy(policy)
if how != "reference_in_training_mode":
    ref.eval()
if how == "frozen":
    ref.requires_grad_(False)
opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
for step in range(12):
    ids = torch.cat([torch.randint(0, 25, (8, 12)), torch.randint(25, 50, (8, 12))])
    if how == "bug":
        rc, rr = logps(ref, ids).chunk(2)  # no torch.no_grad()
    else:
        with torch.no_grad():
            rc, rr = logps(ref, ids).chunk(2)
    pc, pr = logps(policy, ids).chunk(2)
    loss = -F.logsigmoid(0.1 * ((pc - rc) - (pr - rr))).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if how == "train_forgotten" and step == 4:
        policy.eval()  # a validation that never calls policy.train() again
        with torch.no_grad():
            logps(policy, ids)
"""
)

SELF_DISTILLATION = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

how = sys.argv[1]
torch.manual_seed(0)
student = nn.Sequential(
    nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3)
)
for _ in range(5):  # a warm-up on its own, then the teacher is copied from it
    student(torch.randn(16, 10))
teacher = copy.deepcopy(student).eval()
opt = torch.optim.SGD(student.parameters(), lr=0.05)
for step in range(12):
    x, y = torch.randn(16, 10), torch.randint(0, 3, (16,))
    if how == "bug":
        soft = teacher(x).softmax(-1)  # no torch.no_grad()
    else:
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
    out = student(x)
    loss = F.cross_entropy(out, y) + F.kl_div(out.log_softmax(-1), soft, reduction="batchmean")
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

MOVING_TARGET = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

how, kind = sys.argv[1], sys.argv[2]


def block(i, o):
    return nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Dropout(0.2))


class Online(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = block(16, 32)
        self.projector = block(32, 8)
        self.predictor = nn.Linear(8, 8)

    def forward(self, x):
        return self.predictor(self.projector(self.backbone(x)))


torch.manual_seed(0)
online = Online()
if kind == "byol":  # the target copies the backbone and projector, not the predictor
    target = nn.Sequential(copy.deepcopy(online.backbone), copy.deepcopy(online.projector))
    followed = [*online.backbone.parameters(), *online.projector.parameters()]
else:  # a mean teacher: the whole model
    target = copy.deepcopy(online)
    followed = list(online.parameters())
target.eval()
opt = torch.optim.SGD(online.parameters(), lr=0.05)
for step in range(12):
    x = torch.randn(16, 16)
    noisy = x + 0.1 * torch.randn_like(x)
    if how == "bug":
        z = target(noisy)
    else:
        with torch.no_grad():
            z = target(noisy)
    out = online(x)
    if kind == "byol":
        loss = 2 - 2 * F.cosine_similarity(out, z, dim=-1).mean()
    else:
        loss = F.mse_loss(out, z)
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():  # moved by hand every step
        for t, o in zip(target.parameters(), followed):
            t.lerp_(o, 0.01)
"""


def _run(tmp_path, source: str, *args: str) -> list[dict]:
    script = tmp_path / "loop.py"
    script.write_text(source)
    assert run_script(script, list(args), log_dir=tmp_path / "log", console=False) == 0
    return [
        json.loads(line) for line in (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    ]


def _told(alerts: list[dict]) -> list[tuple[str, int, str | None]]:
    return [(a["rule"], a["step"], a["data"].get("kind")) for a in alerts]


@pytest.mark.parametrize("source", [DPO, SELF_DISTILLATION], ids=["dpo", "self_distillation"])
def test_run_tells_a_copy_fed_gradients_at_its_second_step_and_no_training_in_eval(
    tmp_path, source
):
    alerts = _run(tmp_path, source, "bug")
    assert _told(alerts) == [("not_optimized", 1, "target_receives_gradients")]
    (alert,) = alerts
    assert alert["severity"] == "warning"
    assert "torch.no_grad()" in alert["hint"] and "requires_grad_(False)" in alert["hint"]
    assert "model.train()" not in alert["hint"]
    assert "took 1 step:" in alert["message"]


@pytest.mark.parametrize("source", [DPO, SELF_DISTILLATION], ids=["dpo", "self_distillation"])
@pytest.mark.parametrize("how", ["frozen", "no_grad"])
def test_run_of_a_copy_under_no_grad_is_silent(tmp_path, source, how):
    assert _run(tmp_path, source, how) == []


@pytest.mark.parametrize("kind", ["mean_teacher", "byol"])
def test_run_of_a_moving_target_in_eval_under_no_grad_is_silent(tmp_path, kind):
    assert _run(tmp_path, MOVING_TARGET, "no_grad", kind) == []


@pytest.mark.parametrize("kind", ["mean_teacher", "byol"])
def test_run_tells_a_moving_target_fed_gradients_as_a_target_only(tmp_path, kind):
    # Moved by hand every step: accumulated_gradient's finding, at the step the
    # loop first moved it; its eval mode is no training step in eval.
    alerts = _run(tmp_path, MOVING_TARGET, "bug", kind)
    assert _told(alerts) == [("accumulated_gradient", 1, "target_receives_gradients")]


def test_run_still_tells_a_reference_left_in_training_mode(tmp_path):
    alerts = _run(tmp_path, DPO, "reference_in_training_mode")
    assert [(a["rule"], a["data"].get("finding")) for a in alerts] == [
        ("eval_in_train_mode", "frozen model used in training mode")
    ]


def test_run_still_tells_the_policy_trained_in_eval_after_a_validation(tmp_path):
    alerts = _run(tmp_path, DPO, "train_forgotten")
    assert [(a["rule"], a["step"], a["severity"]) for a in alerts] == [
        ("train_in_eval_mode", 5, "warning")
    ]
    assert "model.train()" in alerts[0]["hint"]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.drop = nn.Dropout(0.1)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.drop(self.emb(ids))))


class LitDPO(L.LightningModule):
    """The policy and its reference side by side, the optimizer over the policy."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.policy = TinyLM()
        self.ref = TinyLM()
        self.ref.load_state_dict(self.policy.state_dict())
        if how not in ("reference_in_training_mode", "bug_in_training_mode"):
            self.ref.eval()
        if how == "frozen":
            self.ref.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.how not in ("reference_in_training_mode", "bug_in_training_mode"):
            self.ref.eval()  # Lightning put the whole module in training mode
        if self.how == "train_forgotten" and self.current_epoch == 1:
            self.policy.eval()  # a metrics helper that never puts it back

    def _logps(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        lp = model(ids[:, :-1]).log_softmax(-1)
        return torch.gather(lp, 2, ids[:, 1:, None])[..., 0].sum(-1)

    def training_step(self, ids, index):
        pc, pr = self._logps(self.policy, ids).chunk(2)
        if self.how.startswith("bug"):
            rc, rr = self._logps(self.ref, ids).chunk(2)
        else:
            with torch.no_grad():
                rc, rr = self._logps(self.ref, ids).chunk(2)
        return -F.logsigmoid(0.1 * ((pc - rc) - (pr - rr))).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=1e-3)


def _fit(tmp_path, how: str) -> list:
    gen = torch.Generator().manual_seed(0)
    data = [
        torch.cat([torch.randint(0, 25, (8, 12), generator=gen), torch.randint(25, 50, (8, 12))])
        for _ in range(4)
    ]
    callback = TrainWatchCallback(console=False)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    quiet_trainer(tmp_path, [callback], max_epochs=2).fit(LitDPO(how), loader)
    return callback.alerts


def test_lightning_reference_fed_gradients_is_a_target_and_stays_a_frozen_part(tmp_path):
    alerts = _fit(tmp_path, "bug")
    told = [(a.severity, a.rule, a.step, a.module, a.data.get("kind")) for a in alerts]
    assert told[0] == ("error", "accumulated_gradient", 0, "ref", "target_receives_gradients")
    modes = [a for a in alerts if a.rule == "train_in_eval_mode"]
    # At most the note that a frozen part is kept in eval, named for what it is.
    assert [(a.severity, a.data["finding"]) for a in modes] == [
        ("info", "frozen part kept in eval")
    ]
    assert len(told) == 2


@pytest.mark.parametrize("how", ["frozen", "no_grad"])
def test_lightning_reference_under_no_grad_is_silent(tmp_path, how):
    assert _fit(tmp_path, how) == []


def test_lightning_still_tells_a_reference_left_in_training_mode(tmp_path):
    alerts = _fit(tmp_path, "reference_in_training_mode")
    assert [(a.rule, a.module, a.data.get("finding")) for a in alerts] == [
        ("eval_in_train_mode", "ref.drop", "frozen part in training mode")
    ]


def test_lightning_reference_fed_gradients_in_training_mode_is_told_both_ways(tmp_path):
    # The gradients are the target's finding; its dropout on, a frozen part's in
    # training mode: the gradients reaching it train nothing.
    alerts = _fit(tmp_path, "bug_in_training_mode")
    assert [(a.rule, a.module, a.data.get("kind") or a.data.get("finding")) for a in alerts] == [
        ("accumulated_gradient", "ref", "target_receives_gradients"),
        ("eval_in_train_mode", "ref.drop", "frozen part in training mode"),
    ]
    assert "get no gradient" not in alerts[1].message


def test_lightning_still_tells_the_policy_trained_in_eval(tmp_path):
    alerts = _fit(tmp_path, "train_forgotten")
    assert [(a.rule, a.step, a.module, a.severity) for a in alerts] == [
        ("train_in_eval_mode", 4, "policy.drop", "warning")
    ]
