"""constant_output: outputs that stopped varying across the batch; the traps stay silent."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches, rules_of

EVERY_STEP = {"every": 1}


def _regress(model, opt, steps: int, broadcast_bug: bool = False, seed: int = 0) -> None:
    for x, y in batches(steps, seed=seed):
        opt.zero_grad()
        out = model(x)
        target = y.squeeze(-1) if broadcast_bug else y
        ((out - target) ** 2).mean().backward()
        opt.step()


def test_regression_collapsed_to_the_target_mean_names_the_model_output(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, constant_output=EVERY_STEP)
    _regress(model, opt, 40, broadcast_bug=True)  # (N, 1) - (N,): predicts the mean
    (alert,) = [a for a in monitor.alerts if a.rule == "constant_output"]
    assert alert.module == ""
    assert 5 <= alert.step <= 30
    assert alert.data["spread"] < 0.05 * alert.data["target_spread"]
    assert abs(alert.data["value"]) < 0.5  # the targets' mean is ~0
    assert "collapsed to" in alert.message and "loss target" in alert.message
    assert "broadcast" in rules_of(monitor)  # the cause, named too


def test_healthy_regression_to_convergence_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, constant_output={"every": 5})
    _regress(model, opt, 300)
    assert rules_of(monitor) == []


def test_healthy_regression_on_tiny_targets_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, constant_output={"every": 5})
    for x, y in batches(200):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), 0.01 * y).backward()
        opt.step()
    assert rules_of(monitor) == []


def test_healthy_classifier_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet(outputs=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, constant_output={"every": 5})
    for x, _ in batches(200):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
        opt.step()
    assert rules_of(monitor) == []


def test_hidden_layer_that_stops_varying_is_named_not_the_layers_after_it(quiet_watch):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(8, 16))
    model.add_module("act", nn.Tanh())
    model.add_module("fc2", nn.Linear(16, 16))
    model.add_module("head", nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, constant_output=EVERY_STEP, zero_gradient=False)

    def plant(step: int) -> None:
        if step == 6:
            with torch.no_grad():
                model.fc2.weight.zero_()  # fc2 now outputs its bias, whatever the input
            model.fc2.weight.requires_grad_(False)

    for step, (x, y) in enumerate(batches(12)):
        plant(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    found = {a.module: a for a in monitor.alerts if a.rule == "constant_output"}
    assert found["fc2"].step == 6
    assert "head" not in found  # its input is constant: fc2 explains it
    assert found[""].step == 6  # and the model's output no longer depends on x


def test_positional_embedding_of_a_constant_input_is_silent(quiet_watch):
    class WithPositions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(50, 16)
            self.positions = nn.Embedding(12, 16)  # input: arange, the same for every sample
            self.table = nn.Parameter(torch.randn(12, 16) * 0.02)
            self.head = nn.Linear(16, 1)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            n, t = tokens.shape
            pos = torch.arange(t).expand(n, t)
            h = self.tokens(tokens) + self.positions(pos) + self.table[:t]
            return self.head(h).mean(1)

    torch.manual_seed(0)
    model = WithPositions()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, constant_output=EVERY_STEP)
    for _ in range(20):
        tokens = torch.randint(0, 50, (16, 12))
        opt.zero_grad()
        nn.functional.mse_loss(model(tokens), tokens.float().mean(1, keepdim=True) / 50).backward()
        opt.step()
    assert rules_of(monitor) == []


def test_recurrent_model_is_silent(quiet_watch):
    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 16, num_layers=2)  # (T, N, F): dim 0 is time
            self.cell = nn.GRUCell(4, 16)  # called once per time step, state starts at zero
            self.head = nn.Linear(32, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(x)
            h = torch.zeros(x.shape[1], 16)
            for step in x:
                h = self.cell(step, h)
            return self.head(torch.cat([out[-1], h], dim=1))

    torch.manual_seed(0)
    model = Recurrent()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, constant_output=EVERY_STEP)
    for _ in range(30):
        x = torch.randn(6, 16, 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.sum(0)[:, :1]).backward()
        opt.step()
    assert rules_of(monitor) == []


def test_batch_size_one_and_integer_outputs_are_not_judged(quiet_watch):
    class Argmax(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.argmax(1)  # integer output: no spread to speak of

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), Argmax())
    monitor = quiet_watch(model, constant_output=EVERY_STEP)
    for _ in range(5):
        model(torch.zeros(8, 8) + torch.randn(1, 8))
        monitor.step()
    assert "constant_output" not in rules_of(monitor)
    frozen = TinyNet()
    nn.init.zeros_(frozen.head.weight)
    frozen.head.requires_grad_(False)
    opt = torch.optim.SGD([p for p in frozen.parameters() if p.requires_grad], lr=0.01)
    monitor = quiet_watch(frozen, opt, constant_output=EVERY_STEP, zero_gradient=False)
    for x, y in batches(5, batch=1):
        opt.zero_grad()
        nn.functional.mse_loss(frozen(x), y).backward()  # constant, but one sample says nothing
        opt.step()
    assert [a for a in monitor.alerts if a.rule == "constant_output"] == []


def test_zero_initialised_branch_is_silent(quiet_watch):
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.branch = nn.Linear(8, 8)
            nn.init.zeros_(self.branch.weight)  # adaLN-zero / LoRA-B style start
            nn.init.zeros_(self.branch.bias)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.fc(x))
            return self.head(h + self.branch(h))

    torch.manual_seed(0)
    model = Residual()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, constant_output=EVERY_STEP)
    _regress(model, opt, 20)
    assert rules_of(monitor) == []


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.fc(x)))


def _deep(depth: int) -> nn.Sequential:
    """A residual stack: its output varies at any depth (a plain deep tanh stack
    collapses, truly: its output stops varying across the batch)."""
    return nn.Sequential(nn.Linear(8, 16), *(_Block() for _ in range(depth)), nn.Linear(16, 1))


def _deep_run(quiet_watch, collapse: bool, steps: int = 16, count=None):
    """80 measured modules; with ``collapse``, block 15's fc outputs its bias from step 6 on."""
    torch.manual_seed(0)
    model = _deep(20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, constant_output=EVERY_STEP, zero_gradient=False)
    for step, (x, y) in enumerate(batches(steps)):
        if count is not None:
            count.append(0)
        if collapse and step == 6:
            fc = model[16].fc
            with torch.no_grad():
                fc.weight.zero_()
            fc.weight.requires_grad_(False)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return monitor


def test_past_the_first_steps_a_sampled_pass_measures_a_bounded_number_of_modules(
    quiet_watch, monkeypatch
):
    from trainwatch.collect.activations import ActivationSampler

    measured: list[int] = []
    real = ActivationSampler.after_forward

    def counting(self, index, *args):
        measured[-1] += 1
        return real(self, index, *args)

    monkeypatch.setattr(ActivationSampler, "after_forward", counting)
    monitor = _deep_run(quiet_watch, collapse=False, steps=10, count=measured)
    assert min(measured[:5]) > 60  # the first steps: every module
    assert max(measured[5:]) <= 33  # then the model's output and 32 others in turn
    assert rules_of(monitor) == []


def test_a_collapse_deep_in_a_deep_model_is_still_found_in_turn(quiet_watch):
    monitor = _deep_run(quiet_watch, collapse=True)
    found = {a.module: a for a in monitor.alerts if a.rule == "constant_output"}
    assert set(found) == {"16.fc"}  # the layers after it see a constant input: it explains them
    assert found["16.fc"].step >= 6


class _ActNorm(nn.Module):
    """A flow layer: its log-determinant is one number, expanded over the batch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.randn(width) * 0.1)
        self.logs = nn.Parameter(torch.randn(width) * 0.1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x + self.loc) * self.logs.exp(), self.logs.sum().expand(x.shape[0])


class _Flow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _ActNorm(2)
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, logdet = self.norm(x)
        return y + self.net(y), logdet


def test_an_output_the_same_for_every_row_by_design_is_no_collapse(quiet_watch):
    """Its spread is float rounding (about 1e-8 of its size) one step and 0 the next:
    that largest spread is no variation a later 0 could have lost."""
    torch.manual_seed(1)
    model = _Flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    for _ in range(150):
        z, logdet = model(torch.randn(64, 2) * 2 + 1)
        loss = (0.5 * (z**2).sum(1) - logdet).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rules_of(monitor) == []


class _DropPath(nn.Module):
    """torchvision.ops.StochasticDepth(p, mode="batch"): the whole batch's branch
    dropped at once, its output exactly 0 on those steps."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        return x * torch.empty([1] * x.ndim).bernoulli_(1 - self.p).div_(1 - self.p)


class _DroppedBlock(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.sd = _DropPath(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.sd(self.f(x))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_branch_dropped_for_the_whole_batch_on_sampled_steps_is_no_collapse(seed):
    torch.manual_seed(seed)
    blocks = [_DroppedBlock(p) for p in (0.1, 0.2, 0.3, 0.4, 0.5)]
    model = nn.Sequential(nn.Linear(16, 32), *blocks, nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    weights = torch.randn(16, 4)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(200):
            x = torch.randn(32, 16)
            loss = nn.functional.cross_entropy(model(x), (x @ weights).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert "constant_output" not in [a.rule for a in monitor.alerts]


def test_control_a_branch_collapsed_to_its_bias_is_still_told():
    torch.manual_seed(0)
    blocks = [_DroppedBlock(0.0) for _ in range(3)]
    model = nn.Sequential(nn.Linear(16, 32), *blocks, nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    weights = torch.randn(16, 4)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(120):
            if step == 40:
                with torch.no_grad():
                    blocks[1].f[2].weight.zero_()  # its output: the bias, for every row
                blocks[1].f[2].weight.requires_grad_(False)
            x = torch.randn(32, 16)
            loss = nn.functional.cross_entropy(model(x), (x @ weights).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    found = [(a.rule, a.module) for a in monitor.alerts if a.rule == "constant_output"]
    assert ("constant_output", "2.f.2") in found


# A PPO loop as written by hand: the policy's actions are drawn from its own
# Normal(mu, std) during the rollout, and the loss's log_prob subtracts mu from
# them. Their spread is exploration noise, not a target mu should match.
PPO_SCRIPT = """
import torch
import torch.nn as nn

torch.manual_seed(0)
T, MB, GAMMA, LAM, CLIP = 512, 64, 0.99, 0.95, 0.2


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.mu = nn.Linear(64, 1)
        self.v = nn.Linear(64, 1)
        self.log_std = nn.Parameter(torch.zeros(1))

    def forward(self, obs):
        h = self.trunk(obs)
        return self.mu(h), self.log_std.expand(obs.size(0), 1), self.v(h).squeeze(-1)


net = ActorCritic()
opt = torch.optim.Adam(net.parameters(), lr=3e-4)
for update in range(4):
    obs_buf, act_buf, logp_buf, rew_buf, val_buf = [], [], [], [], []
    pos, target = torch.zeros(1), torch.rand(1) * 2 - 1
    with torch.no_grad():
        for t in range(T):
            obs = torch.cat([pos, target]).unsqueeze(0)
            mu, log_std, value = net(obs)
            dist = torch.distributions.Normal(mu, log_std.exp())
            action = dist.sample()
            obs_buf.append(obs)
            act_buf.append(action)
            logp_buf.append(dist.log_prob(action).sum(-1))
            val_buf.append(value)
            pos = (pos + 0.1 * action.squeeze(0).clamp(-1, 1)).clamp(-2, 2)
            rew_buf.append(-(pos - target).abs())
            if (t + 1) % 64 == 0:
                pos, target = torch.zeros(1), torch.rand(1) * 2 - 1
    obs_b, act_b, logp_b = map(torch.cat, (obs_buf, act_buf, logp_buf))
    rew, val = torch.cat(rew_buf), torch.cat(val_buf)
    adv, last = torch.zeros(T), 0.0
    for t in reversed(range(T)):  # GAE
        nv = val[t + 1] if t + 1 < T and (t + 1) % 64 else 0.0
        delta = rew[t] + GAMMA * nv - val[t]
        last = delta + GAMMA * LAM * (last if (t + 1) % 64 else 0.0)
        adv[t] = last
    ret = adv + val
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    for epoch in range(4):
        for idx in torch.randperm(T).split(MB):
            o, a, lp_old, A, R = obs_b[idx], act_b[idx], logp_b[idx], adv[idx], ret[idx]
            mu, log_std, v = net(o)
            dist = torch.distributions.Normal(mu, log_std.exp())
            ratio = (dist.log_prob(a).sum(-1) - lp_old).exp()
            pg = -torch.min(ratio * A, ratio.clamp(1 - CLIP, 1 + CLIP) * A).mean()
            loss = pg - 0.01 * dist.entropy().mean() + 0.5 * (v - R).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
"""


def test_a_policy_mean_is_not_held_to_the_spread_of_its_own_sampled_actions(tmp_path):
    import json

    from trainwatch.runner import run_script

    script = tmp_path / "ppo.py"
    script.write_text(PPO_SCRIPT)
    log = tmp_path / "log"
    assert run_script(script, [], log_dir=log, console=False) == 0
    told = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    assert [a["rule"] for a in told if a["severity"] != "info"] == []
