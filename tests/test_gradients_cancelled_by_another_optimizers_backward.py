"""accumulated_gradient, ``other_optimizers_backward``: a later backward cancelling
the gradients an earlier one left while another optimizer stepped.

A GAN whose discriminator loss uses the generator's output without ``.detach()``
(``retain_graph=True`` silencing torch's complaint) writes the discriminator's
gradient into the generator; the generator's own backward adds onto it before
its step, and the two nearly cancel: the generator barely learns while both
losses move. Told from the figure (the norm the earlier backward left against
the norm at the generator's step), at most half of it left at 5 of the last 6
steps looked at.

Each planted bug has its healthy twin beside it, silent; and the loops whose
later backward adds to what another left by design (a multi-task loop with one
optimizer per head and one for the shared encoder, an actor-critic with a
shared trunk, domain adaptation through a gradient-reversal layer) stay silent
with the look run over them.
"""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

KIND = "other_optimizers_backward"


def _cancelled(alerts) -> list:
    return [a for a in alerts if a.data.get("kind") == KIND]


class _Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))


def _watched(quiet_watch, how: str, whole: nn.Module, parts) -> list:
    """One monitor over ``whole`` with every optimizer (``"one"``), or one per part
    with its own optimizer (``"each"``, as trainwatch run watches separate models)."""
    if how == "one":
        return [quiet_watch(whole, [opt for _, opt in parts])]
    return [quiet_watch(module, opt) for module, opt in parts]


def _gan(quiet_watch, how: str, loss: str, order: str, bug: bool, iterations: int = 20):
    """A GAN loop; ``order``:

    - ``d_first``: both optimizers reset at the top of the iteration, one generator
      pass, the discriminator's step first; the bug: its loss on the generator's
      output not detached (``retain_graph=True``), the twin detaches it.
    - ``g_first``: the generator's step first, each optimizer reset right after its
      own step; the bug: the discriminator's loss on a fresh generator output not
      detached, whose gradient in the generator waits for the next iteration's
      generator backward. The twin resets each optimizer right before its backward.
    """
    torch.manual_seed(0)
    gan = _Gan()
    G, D = gan.generator, gan.discriminator
    opt_g = torch.optim.Adam(G.parameters(), 2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.5, 0.999))
    monitors = _watched(quiet_watch, how, gan, [(D, opt_d), (G, opt_g)])
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)

    bce = F.binary_cross_entropy_with_logits

    def d_loss(real, fake):
        if loss == "bce":
            return bce(D(real), ones) + bce(D(fake), zeros)
        return D(fake).mean() - D(real).mean()  # a Wasserstein critic

    def g_loss(fake):
        return bce(D(fake), ones) if loss == "bce" else -D(fake).mean()

    for _ in range(iterations):
        real = torch.randn(64, 2) * 0.5 + torch.tensor([2.0, -1.0])
        if order == "d_first":
            opt_d.zero_grad()
            opt_g.zero_grad()
            fake = G(torch.randn(64, 8))
            d_loss(real, fake if bug else fake.detach()).backward(retain_graph=bug)
            opt_d.step()
            g_loss(fake).backward()
            opt_g.step()
        else:
            if not bug:
                opt_g.zero_grad()
            g_loss(G(torch.randn(64, 8))).backward()
            opt_g.step()
            if bug:
                opt_g.zero_grad()
            else:
                opt_d.zero_grad()
            d_loss(real, G(torch.randn(64, 8))).backward()
            opt_d.step()
            if bug:
                opt_d.zero_grad()
    return monitors


@pytest.mark.parametrize("bug", [True, False], ids=["not_detached", "healthy"])
@pytest.mark.parametrize("order", ["d_first", "g_first"])
@pytest.mark.parametrize("loss", ["bce", "wgan"])
@pytest.mark.parametrize("how", ["one", "each"])
def test_a_generator_fed_the_discriminators_gradient_is_told(quiet_watch, how, loss, order, bug):
    monitors = _gan(quiet_watch, how, loss, order, bug)
    alerts = [a for m in monitors for a in m.alerts]
    if not bug:
        assert [rules_of(m) for m in monitors] == [[] for _ in monitors]
        return
    assert [a.rule for a in alerts if a.severity != "info"] == ["accumulated_gradient"]
    (alert,) = _cancelled(alerts)
    assert alert.severity == "warning"
    assert alert.step <= (4 if how == "one" else 2)  # the first steps looked at
    if how == "one":  # the generator part, its optimizer the second of the monitor's
        assert alert.module == "generator"
        assert alert.data["modules"] == ["generator.0", "generator.2"]
        assert alert.data["optimizer"] == 1
        assert alert.data["other_optimizers"] == ["optimizer 0 (Adam)"]
    else:  # the generator's own monitor
        assert alert.module == ""
        assert alert.data["modules"] == ["0", "2"]
        assert alert.data["other_optimizers"] == ["Adam"]
    assert alert.data["parameters"] == 4
    assert alert.data["kept"] <= 0.5
    assert alert.data["norm_at_step"] < alert.data["norm_before"]
    assert alert.data["cancelled_steps"] >= 5
    assert ".detach()" in alert.message and "fake.detach()" in alert.hint
    assert "retain_graph=True" in alert.hint
    generator_monitor = monitors[-1]
    tracker = generator_monitor._pipeline.tracker
    assert tracker.cancels is None and not tracker.follow_cancels  # told: stopped for good


SCRIPT = """
import sys, torch, torch.nn as nn
torch.manual_seed(0)
DETACH = "--detach" in sys.argv
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
optG = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.5, 0.999))
optD = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.999))
crit = nn.BCEWithLogitsLoss()
for it in range(30):
    real = torch.randn(64, 2) * 0.5 + torch.tensor([2.0, -1.0])
    z = torch.randn(64, 8)
    optD.zero_grad(); optG.zero_grad()
    fake = G(z)
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    lossD = crit(D(real), ones) + crit(D(fake.detach() if DETACH else fake), zeros)
    lossD.backward(retain_graph=True)
    optD.step()
    lossG = crit(D(fake), ones)
    lossG.backward()
    optG.step()
"""


@pytest.mark.parametrize("detach", [False, True], ids=["not_detached", "detached"])
def test_trainwatch_run_tells_the_generator_of_an_unmodified_gan_script(tmp_path, detach):
    script = tmp_path / "gan.py"
    script.write_text(SCRIPT)
    args = ["--detach"] if detach else []
    assert run_script(script, args, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["severity"] != "info"]
    if detach:
        assert found == []
        return
    (alert,) = found
    assert alert["rule"] == "accumulated_gradient" and alert["data"]["kind"] == KIND
    assert alert["data"]["model"] == "Sequential"  # the generator: called first
    assert alert["module"] == "" and alert["step"] == 1
    assert alert["data"]["kept"] < 0.2


class _LightningGan(pl.LightningModule):
    """Manual optimization, the discriminator's step first, both reset at the end of
    the step; ``how``: ``plain`` (its loss on the generator's output not detached),
    ``detached``, or ``toggled`` (not detached, each step inside
    ``toggle_optimizer``, which freezes the other model's parameters)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.automatic_optimization = False
        self.how = how

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch, index):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        n = real.shape[0]
        fake = self(torch.randn(n, 8))
        toggled = self.how == "toggled"
        if toggled:
            self.toggle_optimizer(opt_d)
        seen = fake.detach() if self.how == "detached" else fake
        loss_d = F.binary_cross_entropy_with_logits(
            self.discriminator(real), torch.ones(n, 1)
        ) + F.binary_cross_entropy_with_logits(self.discriminator(seen), torch.zeros(n, 1))
        self.manual_backward(loss_d, retain_graph=True)
        opt_d.step()
        if toggled:
            self.untoggle_optimizer(opt_d)
            self.toggle_optimizer(opt_g)
        loss_g = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(n, 1))
        self.manual_backward(loss_g)
        opt_g.step()
        if toggled:
            self.untoggle_optimizer(opt_g)
        opt_d.zero_grad()
        opt_g.zero_grad()

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), 2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), 2e-4, betas=(0.5, 0.999)),
        )


@pytest.mark.parametrize("how", ["plain", "detached", "toggled"])
def test_a_lightning_gan_without_toggle_optimizer_is_told(tmp_path, how):
    real = torch.randn(640, 2) * 0.5 + torch.tensor([2.0, -1.0])
    data = DataLoader(TensorDataset(real), batch_size=32, shuffle=True)
    callback = TrainWatchCallback(console=False)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(_LightningGan(how), data)
    monitor = callback.monitor
    if how != "plain":
        assert rules_of(monitor) == []
        return
    assert rules_of(monitor) == ["accumulated_gradient"]
    (alert,) = _cancelled(monitor.alerts)
    assert alert.module == "generator"
    assert alert.data["optimizer"] == 0 and alert.data["kept"] <= 0.5


# -- loops whose later backward adds to what another left, by design ----------------


def _multitask(quiet_watch, how: str, iterations: int = 30):
    """One optimizer per head, each stepping after its own loss's backward; the
    shared encoder's, holding both losses' gradients, steps last."""
    torch.manual_seed(0)
    net = nn.ModuleDict(
        {
            "encoder": nn.Sequential(nn.Linear(16, 64), nn.ReLU()),
            "head1": nn.Linear(64, 1),
            "head2": nn.Linear(64, 3),
        }
    )
    opts = [torch.optim.Adam(net[k].parameters(), 1e-3) for k in ("encoder", "head1", "head2")]
    monitors = _watched(quiet_watch, how, net, list(zip(net.values(), opts)))
    opt_enc, opt_1, opt_2 = opts
    w = torch.randn(16, 1)
    for _ in range(iterations):
        x = torch.randn(32, 16)
        for opt in opts:
            opt.zero_grad()
        features = net["encoder"](x)
        F.mse_loss(net["head1"](features), x @ w).backward(retain_graph=True)
        opt_1.step()
        F.cross_entropy(net["head2"](features), (x[:, :3] > 0).long().argmax(1)).backward()
        opt_2.step()
        opt_enc.step()
    return monitors


def _actor_critic(quiet_watch, how: str, iterations: int = 30):
    """A2C with a shared trunk: the actor's optimizer steps its head after the
    policy loss's backward; the critic's, holding the trunk, after the value loss's."""
    torch.manual_seed(0)
    net = nn.ModuleDict(
        {
            "trunk": nn.Sequential(nn.Linear(8, 64), nn.Tanh()),
            "actor": nn.Linear(64, 4),
            "critic": nn.Linear(64, 1),
        }
    )
    opt_a = torch.optim.Adam(net["actor"].parameters(), 7e-4)
    opt_c = torch.optim.Adam([*net["trunk"].parameters(), *net["critic"].parameters()], 7e-4)
    monitors = [quiet_watch(net, [opt_a, opt_c])]
    for _ in range(iterations):
        state = torch.randn(64, 8)
        reward = state[:, :1] * 0.5 + torch.randn(64, 1) * 0.1
        opt_a.zero_grad()
        opt_c.zero_grad()
        hidden = net["trunk"](state)
        value = net["critic"](hidden)
        policy = torch.distributions.Categorical(logits=net["actor"](hidden))
        action = policy.sample()
        advantage = (reward - value).detach().squeeze(1)
        policy_loss = -(policy.log_prob(action) * advantage).mean() - 0.01 * policy.entropy().mean()
        policy_loss.backward(retain_graph=True)
        opt_a.step()
        (0.5 * (reward - value).pow(2).mean()).backward()
        opt_c.step()
    return monitors


class _ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


def _domain_adaptation(quiet_watch, how: str, domain_first: bool, iterations: int = 30):
    """DANN: the features trained by the label loss and, through a gradient-reversal
    layer, against the domain classifier; one optimizer per part, the features' last."""
    torch.manual_seed(0)
    net = nn.ModuleDict(
        {
            "features": nn.Sequential(nn.Linear(10, 64), nn.ReLU()),
            "classifier": nn.Linear(64, 3),
            "domain": nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1)),
        }
    )
    opts = [
        torch.optim.SGD(net[k].parameters(), 1e-2, momentum=0.9)
        for k in ("features", "classifier", "domain")
    ]
    monitors = _watched(quiet_watch, how, net, list(zip(net.values(), opts)))
    opt_f, opt_c, opt_d = opts
    domains = torch.cat([torch.zeros(64, 1), torch.ones(64, 1)])
    for _ in range(iterations):
        source = torch.randn(64, 10)
        labels = (source[:, 0] > 0).long() + (source[:, 1] > 0).long()
        target = torch.randn(64, 10) + 0.7
        for opt in opts:
            opt.zero_grad()
        f_source, f_target = net["features"](source), net["features"](target)
        reversed_features = _ReverseGradient.apply(torch.cat([f_source, f_target]))
        domain_loss = F.binary_cross_entropy_with_logits(net["domain"](reversed_features), domains)
        label_loss = F.cross_entropy(net["classifier"](f_source), labels)
        first, second = (domain_loss, label_loss) if domain_first else (label_loss, domain_loss)
        first.backward(retain_graph=True)
        (opt_d if domain_first else opt_c).step()
        second.backward()
        (opt_c if domain_first else opt_d).step()
        opt_f.step()
    return monitors


@pytest.mark.parametrize(
    "loop",
    [
        _multitask,
        _actor_critic,
        lambda watch, how: _domain_adaptation(watch, how, domain_first=False),
        lambda watch, how: _domain_adaptation(watch, how, domain_first=True),
    ],
    ids=["multi_task", "actor_critic", "gradient_reversal", "gradient_reversal_domain_first"],
)
@pytest.mark.parametrize("how", ["one", "each"])
def test_a_later_backward_adding_to_what_another_left_by_design_is_silent(quiet_watch, loop, how):
    monitors = loop(quiet_watch, how)
    assert [rules_of(m) for m in monitors] == [[] for _ in monitors]
    # The look ran over the loop, saw nothing cancelled, and stopped for good.
    assert any(m.step_count >= 20 for m in monitors)
    trackers = [m._pipeline.tracker for m in monitors]
    assert all(t.cancels is None for t in trackers)
    assert any(not t.follow_cancels for t in trackers)


def test_a_loop_with_one_backward_per_step_never_starts_the_look(quiet_watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    monitor = quiet_watch(model, opt)
    for _ in range(30):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(16, 8)), torch.randn(16, 1)).backward()
        opt.step()
    tracker = monitor._pipeline.tracker
    assert tracker.follow_cancels and tracker.cancels is None
    assert rules_of(monitor) == []
