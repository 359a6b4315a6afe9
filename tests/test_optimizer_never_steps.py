"""An optimizer that holds a model but never steps, while another model trains.

A domain-adversarial (or GAN) loop with two models and two optimizers that
forgets ``opt_d.step()`` trains the feature extractor and never the
discriminator: its gradients pile up at every backward and its weights never
move. That model's monitor counted steps from that optimizer's hooks, which
never ran, so nothing was ever said of it.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.collect.idle_optimizer import PATIENCE
from trainwatch.runner import run_script


def _two_models(step_disc: bool, disc_every: int = 1, steps: int = 60) -> list:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
    disc = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_f = torch.optim.Adam(features.parameters(), 1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
    with (
        tw.watch(features, opt_f, console=False),
        tw.watch(disc, opt_d, console=False) as disc_monitor,
    ):
        for step in range(steps):
            x, domain = torch.randn(32, 8), torch.randint(0, 2, (32, 1)).float()
            loss = nn.functional.binary_cross_entropy_with_logits(disc(features(x)), domain)
            opt_f.zero_grad()
            opt_d.zero_grad()
            loss.backward()
            opt_f.step()
            if step_disc and step % disc_every == 0:
                opt_d.step()
    return disc_monitor.alerts


def test_a_discriminator_whose_optimizer_never_steps_is_reported_once():
    alerts = [a for a in _two_models(step_disc=False) if a.rule == "not_optimized"]
    assert len(alerts) == 1
    (alert,) = alerts
    assert alert.data["kind"] == "optimizer_never_steps"
    assert alert.severity == "warning" and alert.module == ""
    assert PATIENCE <= alert.step <= PATIENCE + 2  # dated by the training's step
    assert alert.data["steps_elsewhere"] >= PATIENCE


def test_a_discriminator_that_steps_is_silent():
    assert [a.rule for a in _two_models(step_disc=True) if a.severity != "info"] == []


def test_a_discriminator_stepped_every_fifth_iteration_is_silent():
    # A critic or discriminator updated less often than the other model by design.
    assert [a.rule for a in _two_models(step_disc=True, disc_every=5) if a.severity != "info"] == []


def test_a_model_with_no_gradient_and_an_idle_optimizer_is_silent():
    """A frozen copy beside an optimizer object: nothing piles up, nothing to say."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    frozen = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    idle = torch.optim.SGD(frozen.parameters(), 0.1)
    with tw.watch(model, opt, console=False), tw.watch(frozen, idle, console=False) as other:
        for _ in range(40):
            x = torch.randn(16, 8)
            with torch.no_grad():
                target = frozen(x)
            loss = (model(x) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert other.alerts == []


SCRIPT = """
import sys
import torch
from torch import nn

step_disc = sys.argv[1] == "step"
torch.manual_seed(0)
features = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
disc = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
opt_f = torch.optim.Adam(features.parameters(), 1e-3)
opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
for step in range(50):
    x, domain = torch.randn(32, 8), torch.randint(0, 2, (32, 1)).float()
    loss = nn.functional.binary_cross_entropy_with_logits(disc(features(x)), domain)
    opt_f.zero_grad()
    opt_d.zero_grad()
    loss.backward()
    opt_f.step()
    if step_disc:
        opt_d.step()
"""


@pytest.mark.parametrize("how", ["step", "forget"])
def test_trainwatch_run_tells_the_optimizer_that_never_steps(tmp_path, how):
    script = tmp_path / "dann.py"
    script.write_text(SCRIPT)
    run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a["data"].get("kind") for a in map(json.loads, lines) if a["rule"] == "not_optimized"]
    assert found == (["optimizer_never_steps"] if how == "forget" else [])


UNCERTAINTY = """
import sys
import torch
from torch import nn

forgot = sys.argv[1] == "forgot"
torch.manual_seed(0)


class TwoTasks(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.reg, self.cls = nn.Linear(32, 1), nn.Linear(32, 3)

    def forward(self, x):
        h = self.trunk(x)
        return self.reg(h).squeeze(-1), self.cls(h)


class UncertaintyWeighting(nn.Module):
    # Kendall et al.: a learned log-variance per task, in the loss.

    def __init__(self, tasks):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(tasks))

    def forward(self, losses):
        weights = torch.exp(-self.log_vars)
        return sum(weights[i] * l + self.log_vars[i] for i, l in enumerate(losses))


model, criterion = TwoTasks(), UncertaintyWeighting(2)
params = list(model.parameters()) + ([] if forgot else list(criterion.parameters()))
opt = torch.optim.Adam(params, 2e-3)
for step in range(80):
    y = torch.randint(0, 3, (32,))
    x = torch.randn(32, 12) + y[:, None]
    reg, cls = model(x)
    loss = criterion([nn.functional.mse_loss(reg, x.sum(1)), nn.functional.cross_entropy(cls, y)])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

HAND_TRAINED_BESIDE = """
import torch
from torch import nn

torch.manual_seed(0)
model, probe = nn.Linear(8, 1), nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), 0.05)
for step in range(80):
    x = torch.randn(16, 8)
    target = x.sum(1, keepdim=True)
    loss = (model(x) - target).pow(2).mean() + (probe(x) - target).pow(2).mean()
    opt.zero_grad()
    probe.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():  # the probe: updated by hand, every step
        for p in probe.parameters():
            p -= 0.05 * p.grad
"""


def _run_alerts(tmp_path, body: str, *args: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(body)
    run_script(script, list(args), log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] != "info"]


def test_learned_loss_weights_left_out_of_the_optimizer_are_reported(tmp_path):
    found = _run_alerts(tmp_path, UNCERTAINTY, "forgot")
    assert [(a["rule"], a["data"]["kind"]) for a in found] == [("not_optimized", "never_updated")]
    assert "log_vars" in found[0]["message"] and found[0]["step"] == 50


def test_learned_loss_weights_in_the_optimizer_are_silent(tmp_path):
    assert _run_alerts(tmp_path, UNCERTAINTY, "kept") == []


def test_a_model_updated_by_hand_beside_an_optimizer_is_silent(tmp_path):
    assert _run_alerts(tmp_path, HAND_TRAINED_BESIDE) == []
