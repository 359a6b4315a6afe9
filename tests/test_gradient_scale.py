"""exploding_gradient / vanishing_gradient: spikes against a layer's own past, layers starved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches, rules_of
from trainwatch.config import ExplodingGradientConfig
from trainwatch.record import StepRecord
from trainwatch.rules.gradient_scale import ExplodingGradientRule


def _loop(model, opt, steps, scale_at=None, scale=1e4, batch=32, clip=None):
    data = batches(
        steps, batch=batch, inputs=model[0].in_features if isinstance(model, nn.Sequential) else 8
    )
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if step == scale_at:
            loss = loss * scale  # a loss term that blows up for one batch
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def test_loss_spike_after_warmup_is_exploding_at_that_step(model, quiet_watch):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # bounded updates: one spike only
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 90, scale_at=70)
    (alert,) = [a for a in monitor.alerts if a.rule == "exploding_gradient"]
    assert alert.step == 70
    assert alert.module in {"fc1", "fc2", "head"}
    assert alert.data["ratio"] > 1000
    assert set(alert.data["layers"]) == {"fc1", "fc2", "head"}


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_loop_that_clips_already_is_not_told_to_clip(model, quiet_watch, clip):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 90, scale_at=70, clip=clip)
    (alert,) = [a for a in monitor.alerts if a.rule == "exploding_gradient"]
    assert alert.step == 70 and alert.data["ratio"] > 1000  # measured before the clip
    if clip is None:
        assert "Clip gradients (torch.nn.utils.clip_grad_norm_)" in alert.hint
    else:
        assert "Clip gradients" not in alert.hint and "bounds the update" in alert.hint


def test_healthy_training_and_spikes_during_warmup_stay_quiet(model, quiet_watch):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 150, scale_at=10)  # the first steps are exempt
    assert [r for r in rules_of(monitor) if r.endswith("_gradient")] == []


def test_absolute_bound_is_optional(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt, exploding_gradient={"max_norm": 1e-6, "warmup": 0})
    _loop(model, opt, 3)
    alerts = [a for a in monitor.alerts if a.rule == "exploding_gradient"]
    assert alerts and alerts[0].step == 0 and "bound" in alerts[0].message


def test_layer_recovering_from_tiny_gradients_is_not_exploding():
    """A deep stack waking up after init: big jump for the layer, still below the others."""
    rule = ExplodingGradientRule(ExplodingGradientConfig(warmup=5))
    alerts = []
    for step in range(30):
        early = step < 20
        norms = {"0": 1e-4 if early else 0.05, "2": 0.3, "4": 0.4}
        alerts += rule.evaluate(StepRecord(step=step, layer_norms=norms))
    assert alerts == []
    alerts = rule.evaluate(StepRecord(step=30, layer_norms={"0": 50.0, "2": 0.3, "4": 0.4}))
    assert [a.module for a in alerts] == ["0"]


def _deep(act: type[nn.Module], depth: int, width: int = 16) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(8, width), act()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), act()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def test_deep_sigmoid_stack_vanishes_from_the_first_step(quiet_watch):
    torch.manual_seed(0)
    model = _deep(nn.Sigmoid, 20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 75)
    (alert,) = [a for a in monitor.alerts if a.rule == "vanishing_gradient"]
    assert alert.module == "0"  # the layer furthest from the loss starves most
    assert alert.step == 0
    assert alert.data["ratio"] < 1e-4
    assert "0" in alert.data["layers"]


def test_deep_relu_stack_and_rare_token_embeddings_do_not_vanish(quiet_watch):
    torch.manual_seed(0)
    model = _deep(nn.ReLU, 8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 80)
    assert [r for r in rules_of(monitor) if r.endswith("_gradient")] == []

    class LM(nn.Module):
        def __init__(self, vocab: int = 2000) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, 16)
            self.fc = nn.Linear(16, 32)
            self.head = nn.Linear(32, vocab)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.fc(self.embed(tokens))))

    torch.manual_seed(0)
    lm = LM()
    opt = torch.optim.Adam(lm.parameters(), lr=1e-3)
    monitor = quiet_watch(lm, opt)
    zipf = 1.0 / torch.arange(1, 2001).float()
    for _ in range(80):
        tokens = torch.multinomial(zipf, 64, replacement=True)
        opt.zero_grad()
        nn.functional.cross_entropy(lm(tokens), tokens.roll(1)).backward()
        opt.step()
    assert [r for r in rules_of(monitor) if r.endswith("_gradient")] == []


def test_tiny_net_stays_quiet(quiet_watch):
    torch.manual_seed(1)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    _loop(model, opt, 120)
    assert [r for r in rules_of(monitor) if r.endswith("_gradient")] == []


class _Layout:
    """Stands for the step pipeline's kept layout: any object that can be weakly keyed."""


def _norm_sequence(steps: int = 120):
    """Layer norms as a run gives them: drifting, a spike, a zero, a NaN, a restart, a new layer."""
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        layers = ["a", "b", "c", "d"] + (["late"] if step >= 60 else [])
        noise = torch.rand(len(layers), generator=gen).tolist()
        norms = {
            layer: 0.5 * (1 + i) * (1 + 0.3 * n) for i, (layer, n) in enumerate(zip(layers, noise))
        }
        if step == 40:
            norms["b"] *= 5e3  # a spike
        if step == 45:
            norms["c"] = 0.0
        if step == 50:
            norms["d"] = float("nan")
        if step in (70, 71, 72, 73, 74, 75):
            norms["a"] *= 1e-4  # starved for a while
        restarted = frozenset({"c"}) if step == 80 else frozenset()
        yield step, norms, restarted


def test_vanishing_on_the_usual_step_returns_early_and_still_judges_as_the_full_look():
    """Records with a kept layout (the usual step) and without one give the same alerts
    and the same streaks over a run with a spike, a zero, a NaN and a starved layer."""
    from trainwatch.config import VanishingGradientConfig
    from trainwatch.rules.gradient_scale import VanishingGradientRule

    layouts: dict = {}
    config = VanishingGradientConfig(patience=3, warmup=5)
    kept, bare = VanishingGradientRule(config), VanishingGradientRule(config)
    found_kept, found_bare = [], []
    for step, norms, restarted in _norm_sequence():
        layout = layouts.setdefault(tuple(norms), _Layout())
        for rule, found, with_layout in ((kept, found_kept, layout), (bare, found_bare, None)):
            record = StepRecord(step=step, layer_norms=dict(norms), restarted_layers=restarted)
            record.layout = with_layout
            found += [(a.step, a.module) for a in rule.evaluate(record)]
    assert found_kept == found_bare and {module for _, module in found_bare} == {"a"}
    assert kept.state_dict() == bare.state_dict()


class _EveryLayerInPython(ExplodingGradientRule):
    """The rule without its C-loop path: every step takes the per-layer look."""

    def _moved_in_c(self, warm, record):
        return False


def _norm_sequences(seed: int) -> list[StepRecord]:
    """Two optimizers' layer sets taking turns, with spikes, zeros, NaNs, a restart,
    a layer added mid-run and a bound crossed."""
    rng = torch.Generator().manual_seed(seed)
    records = []
    for step in range(400):
        scale = float(torch.empty(1).log_normal_(0, 0.3, generator=rng))
        a = {f"a{i}": scale * (i + 1) * 0.01 for i in range(6)}
        if step > 150:
            a["a6"] = scale * 0.02  # a head added mid-run
        b = {f"b{i}": scale * (i + 1) for i in range(3)}
        if step in (80, 81, 300):
            a["a2"] *= 1e4  # a spike
        if step == 120:
            a["a4"] = 0.0
        if step == 200:
            b["b1"] = float("nan")
        if step == 250:
            b["b0"] = 5e3  # over the bound
        restarted = frozenset({"a1"}) if step == 220 else frozenset()
        records.append(StepRecord(step=step, layer_norms=a, restarted_layers=restarted))
        records.append(StepRecord(step=step, layer_norms=b, source="manual"))
    return records


def _outcome(rule: ExplodingGradientRule, records: list[StepRecord]):
    alerts = [(a.step, a.module, a.message, a.data) for r in records for a in rule.evaluate(r)]
    return alerts, rule.state_dict()


def test_the_c_loop_steps_move_the_averages_exactly_as_the_per_layer_look_does():
    config = ExplodingGradientConfig(warmup=20, max_norm=1e3)
    for seed in range(3):
        records = _norm_sequences(seed)
        fast = ExplodingGradientRule(config)
        fast_alerts, fast_state = _outcome(fast, records)
        slow_alerts, slow_state = _outcome(_EveryLayerInPython(config), records)
        assert fast_alerts == slow_alerts
        assert fast_state == slow_state
        assert {step for step, *_ in fast_alerts} >= {80, 250, 300}


def test_a_resumed_rule_carries_on_from_the_averages_the_c_loop_moved():
    config = ExplodingGradientConfig(warmup=5)
    records = _norm_sequences(0)
    first = ExplodingGradientRule(config)
    for record in records[:200]:
        first.evaluate(record)
    resumed = ExplodingGradientRule(config)
    resumed.load_state_dict(first.state_dict())
    rest_resumed = _outcome(resumed, records[200:])
    rest_first = _outcome(first, records[200:])
    assert rest_resumed == rest_first


def _learning_rate_raised_at(step_raised: int | None, quiet_watch) -> list:
    """Regression with SGD; from ``step_raised`` on, a learning rate 500 times too high."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(90):
        if step == step_raised:
            for group in opt.param_groups:
                group["lr"] = 5.0
        x = torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        opt.step()
    return monitor.alerts


def test_the_nan_that_exploding_gradients_lead_to_says_so_and_blames_the_learning_rate(
    quiet_watch,
):
    alerts = _learning_rate_raised_at(60, quiet_watch)
    assert alerts[0].rule == "exploding_gradient" and alerts[0].step >= 60
    (nan,) = [a for a in alerts if a.rule.startswith("nonfinite")][:1]
    assert nan.step > alerts[0].step and nan.data["after_exploding"] is True
    assert "exploding_gradient" in nan.message and "learning rate" in nan.hint
    assert "epsilon" not in nan.hint


def test_a_steady_learning_rate_raises_neither(quiet_watch):
    assert [a for a in _learning_rate_raised_at(None, quiet_watch) if a.severity != "info"] == []


def _too_high_from_the_start(lr: float, quiet_watch, optimizer: str = "sgd") -> list:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    opt = (
        torch.optim.SGD(model.parameters(), lr=lr)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), lr=lr)
    )
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        x = torch.randn(32, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin() * 3).backward()
        opt.step()
    return monitor.alerts


def test_a_learning_rate_far_too_high_from_the_first_step_is_diverging_within_the_warm_up(
    quiet_watch,
):
    """The per-layer averages have no past yet; the total norm grows tenfold a step."""
    (alert,) = [a for a in _too_high_from_the_start(2.0, quiet_watch) if a.severity != "info"][:1]
    assert (alert.rule, alert.module, alert.data["kind"]) == (
        "exploding_gradient",
        None,
        "diverging",
    )
    assert alert.step <= 5 and alert.data["growth"] >= 1e3
    assert "learning rate" in alert.hint


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_usual_learning_rate_grows_no_runaway_in_the_warm_up(quiet_watch, optimizer):
    lr = 0.05 if optimizer == "sgd" else 1e-3
    assert [
        a for a in _too_high_from_the_start(lr, quiet_watch, optimizer) if a.severity != "info"
    ] == []


def _linear_regression(lr: float, quiet_watch, zero_head: bool = False, steps: int = 40) -> list:
    """Plain SGD on least squares. One linear layer past its stable learning rate
    grows about 3x a step; ``zero_head``: two layers, the second initialised to zero
    (its norms start from almost nothing and grow as the head learns)."""
    torch.manual_seed(0)
    if zero_head:
        model = nn.Sequential(nn.Linear(20, 16), nn.Linear(16, 1))
        nn.init.zeros_(model[1].weight)
    else:
        model = nn.Sequential(nn.Linear(20, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(20, 1, generator=gen)
    for _ in range(steps):
        x = torch.randn(256, 20, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x @ w).backward()
        opt.step()
    return monitor.alerts


def test_a_learning_rate_that_diverges_a_few_times_a_step_is_diverging_within_the_warm_up(
    quiet_watch,
):
    """Three times a step, never tenfold: doubling six steps running is a runaway too."""
    found = [a for a in _linear_regression(2.0, quiet_watch) if a.severity != "info"]
    assert found, "no alert"
    alert = found[0]
    assert (alert.rule, alert.data["kind"]) == ("exploding_gradient", "diverging")
    assert alert.step <= 12 and alert.data["steps_growing"] >= 6
    assert "at least 2x a step" in alert.message


@pytest.mark.parametrize(("lr", "zero_head"), [(0.05, False), (0.02, True), (0.1, True)])
def test_the_same_regression_at_a_stable_learning_rate_grows_no_runaway(quiet_watch, lr, zero_head):
    found = _linear_regression(lr, quiet_watch, zero_head=zero_head)
    assert [a for a in found if a.severity != "info"] == []


def _saturating_classifier(seed: int, lr_factor_at: tuple[int, float] | None = None) -> list:
    """Well-separated clusters, SGD with Nesterov momentum: the loss reaches 1e-3
    to 1e-6 within 100 steps, and from then on the gradients are near zero but
    for the odd hard example, which lifts them 50-150x for one step."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(16, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 4),
    )
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9, nesterov=True)
    centres = torch.randn(4, 16) * 2
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(300):
            if lr_factor_at is not None and step == lr_factor_at[0]:
                for group in opt.param_groups:
                    group["lr"] *= lr_factor_at[1]
            y = torch.randint(0, 4, (32,))
            loss = nn.functional.cross_entropy(model(centres[y] + torch.randn(32, 16)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [a for a in monitor.alerts if a.rule == "exploding_gradient"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_classifier_trained_to_a_near_zero_loss_spikes_without_an_alarm(seed):
    # Its layers' norms move about 1.5 (log) a step; one hard example is 4-5 of
    # those moves, and below the highest typical norm each layer has had.
    assert _saturating_classifier(seed) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_learning_rate_raised_100x_on_that_classifier_still_fires(seed):
    alerts = _saturating_classifier(seed, lr_factor_at=(200, 100.0))
    assert alerts and 200 <= alerts[0].step <= 225
    assert alerts[0].data["ratio"] > 100


def _reinforce_on_a_bandit(seed: int, steps: int = 800) -> list:
    """Batch-of-one REINFORCE on a contextual bandit with a running baseline: its
    single-sample gradient norms are heavy-tailed by nature."""
    torch.manual_seed(seed)
    arms, width = 5, 4
    payoff = torch.randn(width, arms)
    policy = nn.Sequential(nn.Linear(width, 32), nn.Tanh(), nn.Linear(32, arms))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    baseline = 0.0
    with tw.watch(policy, opt, console=False) as monitor:
        for _ in range(steps):
            context = torch.randn(1, width)
            dist = torch.distributions.Categorical(logits=policy(context))
            action = dist.sample()
            reward = float((context @ payoff)[0, action] + 0.5 * torch.randn(()))
            loss = -((reward - baseline) * dist.log_prob(action)).sum()
            baseline = 0.95 * baseline + 0.05 * reward
            opt.zero_grad()
            loss.backward()
            opt.step()
    return [a for a in monitor.alerts if a.rule == "exploding_gradient"]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_batch_of_one_policy_gradient_s_heavy_tail_is_no_explosion(seed):
    assert _reinforce_on_a_bandit(seed) == []
