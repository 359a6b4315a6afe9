"""A -inf mask applied to values that carry grad is no NaN/Inf alarm; what it turns into is.

Invalid-action masking in a policy's forward (``logits.masked_fill(~legal, -inf)``
fed to ``Categorical(logits=...)``, or returned through ``log_softmax``) and a
causal mask added to attention scores inside the model make -inf that requires
grad: the loss and every gradient stay finite, so the healthy runs are silent.
The bugs beside them are still told where they show: a state with no legal
action (a row of nothing but -inf) whose ``log_softmax``/``softmax`` is NaN in
the forward, the NaN it makes in the loss when the policy returns raw logits,
and a classifier whose target's own class was masked (an infinite loss).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.collect.tensors import finite_exact

CHECKS = ["auto", "step", "deferred"]
ACTIONS = 6
BAD_STEP = 2


def _errors(alerts) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts if a.severity != "info"]


# -- a policy that masks invalid actions -----------------------------------------------


class MaskedPolicy(nn.Module):
    """Scores every action, then masks the illegal ones with -inf (they carry grad)."""

    def __init__(self, output: str) -> None:
        super().__init__()
        self.output = output
        self.net = nn.Sequential(nn.Linear(2 * ACTIONS, 32), nn.ReLU(), nn.Linear(32, ACTIONS))

    def forward(self, values: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        logits = self.net(torch.cat([values, legal.float()], -1))
        logits = logits.masked_fill(~legal, float("-inf"))
        return logits.log_softmax(-1) if self.output == "log_softmax" else logits


def _rounds(gen: torch.Generator, step: int, planted: bool):
    """A batch of states, their legal actions, and the actions the behaviour policy took
    (uniform over the legal ones). Planted: one state with no legal action at all."""
    values = torch.rand(16, ACTIONS, generator=gen)
    legal = torch.rand(16, ACTIONS, generator=gen) < 0.5
    legal[:, 0] |= ~legal.any(-1)
    taken = torch.multinomial(legal.float(), 1, generator=gen).squeeze(1)
    if planted and step == BAD_STEP:
        legal[3] = False
    return values, legal, taken


def train_policy(output: str, check: str, planted: bool = False) -> tw.Monitor:
    torch.manual_seed(0)
    policy = MaskedPolicy(output)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(policy, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(5):
            values, legal, taken = _rounds(gen, step, planted)
            dist = torch.distributions.Categorical(
                logits=policy(values, legal), validate_args=False
            )
            reward = values.gather(1, taken[:, None]).squeeze(1)
            advantage = reward - reward.mean()
            loss = -(dist.log_prob(taken) * advantage).mean() - 0.01 * dist.entropy().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("output", ["logits", "log_softmax"])
@pytest.mark.parametrize("check", CHECKS)
def test_a_policy_masking_invalid_actions_with_negative_inf_is_silent(output, check):
    assert _errors(train_policy(output, check).alerts) == []


@pytest.mark.parametrize("check", CHECKS)
def test_a_state_with_no_legal_action_is_the_nan_of_the_policys_log_softmax(check):
    """log_softmax of a row of nothing but -inf is NaN, made in the model's own forward."""
    alerts = train_policy("log_softmax", check, planted=True).alerts
    first = next(a for a in alerts if a.rule.startswith("nonfinite"))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "")
    if check != "deferred":  # the no-sync path names the module only
        assert first.data["op"] == "aten::_log_softmax"


@pytest.mark.parametrize("check", CHECKS)
def test_a_state_with_no_legal_action_behind_raw_logits_is_a_nan_loss(check):
    """Returned as raw logits, the row of -inf turns NaN in the Categorical, outside
    the model: the loss is where it shows, not the forward."""
    alerts = train_policy("logits", check, planted=True).alerts
    first = next(a for a in alerts if a.rule.startswith("nonfinite"))
    assert (first.rule, first.step) == ("nonfinite_loss", BAD_STEP)
    assert not any(a.rule == "nonfinite_forward" for a in alerts)


# -- attention scores with a causal -inf mask, made in a module of their own ----------


class CausalScores(nn.Module):
    """Scaled dot products with the causal mask (and key padding) added: -inf with grad."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        length = q.shape[1]
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores + torch.zeros(length, length).masked_fill(future, float("-inf"))
        return scores.masked_fill(pad[:, None, :], float("-inf"))


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.scores = CausalScores()
        self.out = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        return self.out(torch.softmax(self.scores(q, k, pad), dim=-1) @ v)


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int = 20, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.attn = Attention(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(h + self.attn(h, pad))


def train_lm(check: str, planted: bool = False) -> tw.Monitor:
    torch.manual_seed(0)
    model = TinyCausalLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(5):
            ids = torch.randint(0, 20, (4, 8))
            pad = torch.zeros(4, 8, dtype=torch.bool)
            pad[:, 6:] = True  # right padding: the first key is always kept
            if planted and step == BAD_STEP:
                pad[1] = True  # a sequence of nothing but padding
            opt.zero_grad()
            logits = model(ids, pad)
            nn.functional.cross_entropy(logits.reshape(-1, 20), ids.reshape(-1)).backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("check", CHECKS)
def test_causal_mask_added_to_scores_that_carry_grad_is_silent(check):
    assert _errors(train_lm(check).alerts) == []


@pytest.mark.parametrize("check", CHECKS)
def test_a_fully_masked_row_is_the_nan_of_the_softmax_that_follows(check):
    alerts = train_lm(check, planted=True).alerts
    first = next(a for a in alerts if a.rule.startswith("nonfinite"))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "attn")
    if check != "deferred":
        assert first.data["op"] == "aten::_softmax"


# -- a classifier that masks disallowed classes ------------------------------------------


class AllowedClasses(nn.Module):
    """Logits of the classes a sample may take; the others are masked to -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.fc(x).masked_fill(~allowed, float("-inf"))


def _allowed(y: torch.Tensor, gen: torch.Generator, masks_target: bool) -> torch.Tensor:
    allowed = torch.rand(y.shape[0], 5, generator=gen) < 0.6
    allowed[torch.arange(y.shape[0]), y] = True
    if masks_target:
        allowed[2, y[2]] = False  # the target's own class masked: -log(0) is inf
    return allowed


def test_a_masked_target_class_is_an_infinite_loss_not_a_forward_alarm():
    """cross_entropy of a -inf logit at the target is inf, its gradient finite: the
    loss handed over tells it, at its step; the same loop without the bug is silent."""
    for planted in (False, True):
        torch.manual_seed(0)
        model = AllowedClasses()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(0)
        with tw.watch(model, opt, console=False) as monitor:
            for step in range(5):
                x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen)
                allowed = _allowed(y, gen, planted and step == BAD_STEP)
                loss = nn.functional.cross_entropy(model(x, allowed), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                monitor.step(loss=loss)
        if planted:
            assert _errors(monitor.alerts) == [("nonfinite_loss", BAD_STEP, None)]
        else:
            assert _errors(monitor.alerts) == []


@pytest.mark.slow
def test_lightning_masked_target_class_is_an_infinite_loss(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from trainwatch.lightning import TrainWatchCallback

    class Masked(pl.LightningModule):
        def __init__(self, planted: bool) -> None:
            super().__init__()
            self.planted = planted
            self.classes = AllowedClasses()
            self.gen = torch.Generator().manual_seed(1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            allowed = _allowed(y, self.gen, self.planted and batch_idx == BAD_STEP)
            return nn.functional.cross_entropy(self.classes(x, allowed), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            gen = torch.Generator().manual_seed(0)
            x, y = torch.randn(80, 8, generator=gen), torch.randint(0, 5, (80,), generator=gen)
            return DataLoader(TensorDataset(x, y), batch_size=16)

    for planted in (False, True):
        callback = TrainWatchCallback(console=False, log_dir=tmp_path / str(planted))
        quiet_trainer(tmp_path / str(planted), [callback], max_epochs=1).fit(Masked(planted))
        expected = [("nonfinite_loss", BAD_STEP, None)] if planted else []
        assert _errors(callback.alerts) == expected


def test_negative_inf_in_a_weight_is_never_a_mask():
    """Masks are made by ops; a -inf an optimizer wrote into a weight is not one."""
    weight = nn.Parameter(torch.randn(4, 4))
    with torch.no_grad():
        weight[0, 0] = float("-inf")
    assert finite_exact(weight) is False
    legal = torch.rand(4, 4) < 0.5
    legal[:, 0] = True
    logits = torch.randn(4, 4) @ nn.Parameter(torch.eye(4))  # carries grad
    assert finite_exact(logits.masked_fill(~legal, float("-inf"))) is True


# -- the same scripts, unmodified, under `trainwatch run` -------------------------------

_SCRIPT = """
import sys
import torch
from torch import nn

PLANTED = sys.argv[1] == "planted"
torch.manual_seed(0)
K = 6


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * K, 32), nn.ReLU(), nn.Linear(32, K))

    def forward(self, values, legal):
        logits = self.net(torch.cat([values, legal.float()], -1))
        return logits.masked_fill(~legal, float("-inf")).log_softmax(-1)


policy = Policy()
opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
for step in range(5):
    values = torch.rand(16, K)
    legal = torch.rand(16, K) < 0.5
    legal[:, 0] |= ~legal.any(-1)
    taken = torch.multinomial(legal.float(), 1).squeeze(1)
    if PLANTED and step == 2:
        legal[3] = False  # a state with no legal action
    logp = policy(values, legal).gather(1, taken[:, None]).squeeze(1)
    reward = values.gather(1, taken[:, None]).squeeze(1)
    loss = -(logp * (reward - reward.mean())).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.slow
def test_trainwatch_run_on_a_masked_policy_script(tmp_path: Path):
    script = tmp_path / "masked_policy.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    outcomes = {}
    for mode in ("healthy", "planted"):
        logs = tmp_path / mode
        done = subprocess.run(
            [sys.executable, "-m", "trainwatch", "run", "--fail-on", "error"]
            + ["--log-dir", str(logs), str(script), mode],
            capture_output=True,
            text=True,
            timeout=300,
        )
        path = logs / "alerts.jsonl"
        alerts = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
        outcomes[mode] = (
            done.returncode,
            [(a["rule"], a["step"], a["module"]) for a in alerts if a["severity"] != "info"],
        )
    assert outcomes["healthy"] == (0, []), outcomes
    code, alerts = outcomes["planted"]
    assert code != 0 and alerts[0] == ("nonfinite_forward", BAD_STEP, ""), outcomes


def test_a_masked_output_is_judged_by_its_sum_alone():
    """A policy's masked logits at every pass: one sum, no elementwise recheck."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    policy = MaskedPolicy("logits")
    legal = torch.rand(64, ACTIONS) < 0.5
    legal[:, 0] = True
    logits = policy(torch.rand(64, ACTIONS), legal)
    with Ops() as ops:
        assert finite_exact(logits) is True
    # One sum, read back: no isfinite, isnan or isposinf over the logits.
    assert [op for op in ops.seen if "_local_scalar_dense" not in op] == ["aten.sum.default"]
