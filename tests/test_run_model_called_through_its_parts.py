"""``trainwatch run`` on a model whose own ``forward`` the loop never calls.

CleanRL's PPO ``Agent`` is called through ``get_value(x)`` (``self.critic(x)``)
and ``get_action_and_value(x)`` (``self.actor(x)`` and ``self.critic(x)``), with
one Adam over ``agent.parameters()``; a Siamese net trains through
``net.forward_once(x)``. Each part called used to be watched as a model of its
own (``Sequential``, ``Sequential#2``): names lost their prefix (``0`` for
``critic.0``), each part's setup table counted the shared optimizer's every
parameter, and the gradient norms showed ``Sequential#2:<outside the model>``.
A module called on its own whose optimizer holds it and more now brings the
smallest module holding that optimizer's parameters: that is the model, the
part one of its passes. Each beside controls whose models stay as they were.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

PPO = """
import sys
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Normal

bug, action_space = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
rng = np.random.default_rng(0)
OBS, ACTIONS, STEPS, MINIBATCH = 6, 3, 64, 16


def layer_init(layer, std=np.sqrt(2)):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(OBS, 32)), nn.Tanh(), layer_init(nn.Linear(32, 1), std=1.0)
        )
        out = ACTIONS if action_space == "discrete" else 2
        self.actor = nn.Sequential(
            layer_init(nn.Linear(OBS, 32)), nn.Tanh(), layer_init(nn.Linear(32, out), std=0.01)
        )
        if action_space == "continuous":
            self.actor_logstd = nn.Parameter(torch.zeros(1, 2))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        if action_space == "discrete":
            probs = Categorical(logits=self.actor(x))
        else:
            mean = self.actor(x)
            probs = Normal(mean, self.actor_logstd.expand_as(mean).exp())
        if action is None:
            action = probs.sample()
        logprob, entropy = probs.log_prob(action), probs.entropy()
        if action_space == "continuous":
            logprob, entropy = logprob.sum(1), entropy.sum(1)
        return action, logprob, entropy, self.critic(x)


agent = Agent()
optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
for update in range(3):
    obs = torch.tensor(rng.normal(size=(STEPS, OBS)), dtype=torch.float32)
    with torch.no_grad():
        actions, logprobs, _, values = agent.get_action_and_value(obs)
        values = values.flatten()
        rewards = torch.tensor(rng.normal(size=STEPS), dtype=torch.float32)
        next_value = agent.get_value(obs[-1:]).reshape(1)
        returns = rewards + 0.99 * torch.cat([values[1:], next_value])
        advantages = returns - values
    for start in range(0, STEPS, MINIBATCH):
        mb = slice(start, start + MINIBATCH)
        _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs[mb], actions[mb])
        ratio = (newlogprob - logprobs[mb]).exp()
        mb_adv = advantages[mb]
        mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
        pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 0.8, 1.2)).mean()
        if bug != "value_shape":
            newvalue = newvalue.view(-1)  # planted bug: left out, (N, 1) against (N,)
        v_loss = 0.5 * ((newvalue - returns[mb]) ** 2).mean()
        loss = pg_loss - 0.01 * entropy.mean() + 0.5 * v_loss
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
        optimizer.step()
"""

SIAMESE = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class SiameseNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.fc = nn.Sequential(nn.Linear(8 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward_once(self, x):
        return self.fc(self.cnn(x).flatten(1))

    def forward(self, a, b):
        return self.forward_once(a), self.forward_once(b)


net = SiameseNetwork()
optimizer = torch.optim.Adam(net.parameters(), lr=5e-4)
for step in range(10):
    x1, x2 = torch.randn(16, 1, 8, 8), torch.randn(16, 1, 8, 8)
    label = (torch.rand(16, 1) < 0.5).float()
    d = F.pairwise_distance(net.forward_once(x1), net.forward_once(x2), keepdim=True)
    loss = torch.mean((1 - label) * d.pow(2) + label * torch.clamp(2.0 - d, min=0.0).pow(2))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
net.eval()
with torch.no_grad():
    net(x1, x2)
"""

GAN = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


G, D = Generator(), Discriminator()
opt_g = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
ones, zeros = torch.ones(32, 1), torch.zeros(32, 1)
for step in range(10):
    real = torch.randn(32, 2) * 0.5 + 1.0
    fake = G(torch.randn(32, 4))
    d_loss = F.binary_cross_entropy_with_logits(D(real), ones) + (
        F.binary_cross_entropy_with_logits(D(fake.detach()), zeros)
    )
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = F.binary_cross_entropy_with_logits(D(fake), ones)
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
"""

# One optimizer over two models that no module holds together: nothing to
# watch them as one model, so each stays a model of its own.
SEPARATE = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
decoder = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
opt = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-3)
for step in range(10):
    x = torch.randn(32, 8)
    loss = F.mse_loss(decoder(encoder(x)), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# A model with its own forward, called whole; its optimizer also holds a loss
# module's learned weight (no module holds both: each stays a model of its own).
OWN_FORWARD = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))


class WeightedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(1))

    def forward(self, pred, y):
        return (F.mse_loss(pred, y) * torch.exp(-self.log_var) + self.log_var).squeeze()


model, criterion = Net(), WeightedLoss()
opt = torch.optim.SGD([*model.parameters(), *criterion.parameters()], lr=0.01)
for step in range(10):
    x = torch.randn(32, 8)
    loss = criterion(model(x), x[:, :1])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path, source, args=(), console=False):
    """The alerts, the models with a setup table, and the run's summary."""
    script = tmp_path / "train.py"
    script.write_text(source)
    log = tmp_path / "log"
    assert run_script(script, list(args), log_dir=log, console=console) == 0
    alerts = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    audits = json.loads((log / "setup.json").read_text())["audits"]
    return alerts, [a["model"] for a in audits]


@pytest.mark.parametrize("action_space", ["discrete", "continuous"])
def test_a_ppo_agent_called_through_its_parts_is_one_silent_model(tmp_path, capsys, action_space):
    alerts, models = _run(tmp_path, PPO, ["none", action_space], console=True)
    assert models == ["Agent"]
    assert alerts == []
    err = capsys.readouterr().err
    assert "<outside the model>" not in err and "Sequential" not in err, err
    assert "critic.0" in err and "actor.0" in err, err  # names keep their prefix


def test_a_ppo_value_of_shape_n_1_against_returns_is_told_at_the_critic(tmp_path):
    alerts, models = _run(tmp_path, PPO, ["value_shape", "discrete"])
    assert models == ["Agent"]
    (alert,) = alerts
    assert alert["rule"] == "broadcast" and alert["module"] == "critic"
    assert alert["data"]["model"] == "Agent"
    assert alert["data"]["shapes"] == [[16, 1], [16]] and alert["step"] == 0


def test_a_siamese_net_trained_through_forward_once_is_one_silent_model(tmp_path, capsys):
    alerts, models = _run(tmp_path, SIAMESE, console=True)
    assert models == ["SiameseNetwork"]
    assert alerts == []
    err = capsys.readouterr().err
    assert "<outside the model>" not in err and "cnn.0" in err, err


def test_a_gan_with_an_optimizer_each_stays_two_models(tmp_path):
    alerts, models = _run(tmp_path, GAN)
    assert sorted(models) == ["Discriminator", "Generator"]
    assert alerts == []


def test_one_optimizer_over_two_separate_models_keeps_both(tmp_path):
    alerts, models = _run(tmp_path, SEPARATE)
    assert models == ["Sequential", "Sequential#2"]
    assert alerts == []


def test_a_model_called_whole_stays_the_model_beside_a_learned_loss_weight(tmp_path):
    alerts, models = _run(tmp_path, OWN_FORWARD)
    assert models == ["Net", "WeightedLoss"]
    assert [a for a in alerts if a["severity"] != "info"] == []
