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


def _two_models(
    step_disc: bool, disc_every: int = 1, steps: int = 60, zero_first: bool = False
) -> list:
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
            if zero_first:  # the tutorials' order: no gradient held as the pass starts
                opt_f.zero_grad()
                opt_d.zero_grad()
            loss = nn.functional.binary_cross_entropy_with_logits(disc(features(x)), domain)
            if not zero_first:
                opt_f.zero_grad()
                opt_d.zero_grad()
            loss.backward()
            opt_f.step()
            if step_disc and step % disc_every == 0:
                opt_d.step()
    return disc_monitor.alerts


@pytest.mark.parametrize("zero_first", [False, True], ids=["zero_after_forward", "zero_first"])
def test_a_discriminator_whose_optimizer_never_steps_is_reported_once(zero_first):
    alerts = [
        a for a in _two_models(step_disc=False, zero_first=zero_first) if a.rule == "not_optimized"
    ]
    assert len(alerts) == 1
    (alert,) = alerts
    assert alert.data["kind"] == "optimizer_never_steps"
    assert alert.severity == "warning" and alert.module == ""
    # The discriminator's gradients are reset at every iteration and written anew:
    # thrown away three times in a row, told within four steps, dated at the first it missed.
    assert alert.step == 0 and alert.data["lost_gradients"] == 3
    assert alert.data["steps_elsewhere"] <= 4
    assert alert.data["optimizer_name"] == "opt_d" and alert.data["model_name"] == "disc"


@pytest.mark.parametrize("zero_first", [False, True], ids=["zero_after_forward", "zero_first"])
def test_a_discriminator_that_steps_is_silent(zero_first):
    alerts = _two_models(step_disc=True, zero_first=zero_first)
    assert [a.rule for a in alerts if a.severity != "info"] == []


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


# -- one model, two optimizers: one of them never steps --------------------------------


class _Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(index))


def _recommender(sparse_every: int | None, steps: int = 60, frozen_emb: bool = False) -> list:
    """A sparse embedding under SparseAdam beside a dense head under Adam (one model)."""
    torch.manual_seed(0)
    model = _Recommender()
    if frozen_emb:
        model.emb.requires_grad_(False)  # its optimizer is for a later phase
    opt_sparse = torch.optim.SparseAdam(list(model.emb.parameters()), lr=1e-2)
    opt_dense = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    with tw.watch(model, [opt_sparse, opt_dense], console=False) as monitor:
        for step in range(steps):
            index = torch.randint(0, 500, (64,))
            opt_sparse.zero_grad()
            opt_dense.zero_grad()
            nn.functional.mse_loss(model(index), (index % 7).float()[:, None]).backward()
            opt_dense.step()
            if sparse_every is not None and step % sparse_every == 0:
                opt_sparse.step()
    return monitor.alerts


def test_one_of_a_models_optimizers_that_never_steps_is_reported_once():
    alerts = [a for a in _recommender(sparse_every=None) if a.rule == "not_optimized"]
    assert len(alerts) == 1
    (alert,) = alerts
    # opt_sparse.zero_grad() throws each step's gradient away: told at the fourth
    # iteration's backward, after the dense optimizer's third step.
    assert alert.module == "emb" and alert.step == 0 and alert.data["steps_elsewhere"] == 3
    assert alert.data["kind"] == "optimizer_never_steps" and alert.data["optimizer"] == 0
    assert alert.data["parameters"] == ["emb.weight"]
    # Named by class as well: the index depends on the order the optimizers were met.
    assert alert.data["optimizer_class"] == "SparseAdam"
    assert "opt_sparse (optimizer 0, SparseAdam)" in alert.message  # and by the name it has


@pytest.mark.parametrize("every", [1, 5], ids=["every_step", "every_fifth"])
def test_a_models_optimizers_that_all_step_are_silent(every):
    assert [a.rule for a in _recommender(sparse_every=every) if a.severity != "info"] == []


def test_an_optimizer_kept_for_frozen_parameters_is_silent_on_that_count():
    """Built ahead for a later phase: its parameters are frozen and hold no gradient."""
    alerts = _recommender(sparse_every=None, frozen_emb=True)
    assert not [a for a in alerts if a.data.get("kind") == "optimizer_never_steps"]


def test_a_later_phase_optimizer_over_parameters_another_steps_is_silent():
    """Adam first, then L-BFGS over the same parameters (a physics-informed fit):
    L-BFGS does not step for the whole Adam phase, yet every parameter is updated."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    adam = torch.optim.Adam(model.parameters(), 1e-2)
    lbfgs = torch.optim.LBFGS(model.parameters(), max_iter=5)
    x = torch.linspace(0, 1, 64)[:, None]
    target = torch.sin(3 * x)
    with tw.watch(model, [adam, lbfgs], console=False) as monitor:
        for _ in range(60):
            adam.zero_grad()
            nn.functional.mse_loss(model(x), target).backward()
            adam.step()

        def closure():
            lbfgs.zero_grad()
            loss = nn.functional.mse_loss(model(x), target)
            loss.backward()
            return loss

        for _ in range(3):
            lbfgs.step(closure)
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []


# -- one of a model's optimizers stops stepping ------------------------------------------


def _two_phases(second_phase: str, steps: int = 150) -> list:
    """All of the model under one optimizer, then a second one for a second phase."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model.head = nn.Linear(16, 2)
    first = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    with tw.watch(model, first, console=False) as monitor:
        for _ in range(20):
            first.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            first.step()
        if second_phase == "head_only_body_frozen":
            model.body.requires_grad_(False)
        held = model.parameters() if second_phase == "everything" else model.head.parameters()
        second = torch.optim.Adam(held, 1e-4)
        monitor.add_optimizer(second)
        for _ in range(steps):
            second.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            second.step()
    return monitor.alerts


def test_a_second_phase_optimizer_over_the_head_while_the_body_trains_is_told_once():
    alerts = [a for a in _two_phases("head_only") if a.rule == "not_optimized"]
    assert len(alerts) == 1
    (alert,) = alerts
    assert alert.module == "body.0" and alert.data["kind"] == "optimizer_stopped"
    assert alert.data["optimizer"] == 0 and alert.data["last_step"] == 19
    assert alert.data["optimizer_class"] == "Adam"
    assert 119 <= alert.step <= 145  # looked at every 25 steps, from 100 steps stale


@pytest.mark.parametrize("second_phase", ["head_only_body_frozen", "everything"])
def test_a_second_phase_that_freezes_or_holds_the_rest_is_silent(second_phase):
    alerts = _two_phases(second_phase)
    assert [a.rule for a in alerts if a.severity != "info"] == []


def test_two_parts_trained_in_turns_of_a_hundred_and_fifty_steps_are_silent():
    """Each part trained in its turn, the other frozen meanwhile (block coordinate
    descent): the resting optimizer's parameters get no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    parts = [model[0], model[2]]
    opts = [torch.optim.SGD(part.parameters(), 1e-2) for part in parts]
    with tw.watch(model, opts, console=False) as monitor:
        for step in range(600):
            turn = (step // 150) % 2
            parts[turn].requires_grad_(True)
            parts[1 - turn].requires_grad_(False)
            for opt in opts:
                opt.zero_grad()
            x = torch.randn(32, 8)
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opts[turn].step()
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []


class _ToggledGAN:
    """Lightning's manual GAN recipe: toggle_optimizer freezes the other optimizer's
    parameters around each one's step. (With the discriminator's gradients reset
    right after its forgotten step, none is left for the generator's step to see:
    that order is not caught.)"""

    @staticmethod
    def build(step_disc: bool, stop_disc_at: int | None = None):
        import lightning.pytorch as pl
        from torch.nn import functional as F

        class GAN(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False
                self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
                self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))

            def training_step(self, batch, batch_idx):
                (real,) = batch
                opt_g, opt_d = self.optimizers()
                z = torch.randn(len(real), 8)
                ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
                self.toggle_optimizer(opt_g)
                fake_score = self.discriminator(self.generator(z))
                self.manual_backward(F.binary_cross_entropy_with_logits(fake_score, ones))
                opt_g.step()
                opt_g.zero_grad()
                self.untoggle_optimizer(opt_g)
                self.toggle_optimizer(opt_d)
                opt_d.zero_grad()
                fake = self.generator(z).detach()
                d_loss = F.binary_cross_entropy_with_logits(
                    self.discriminator(real), ones
                ) + F.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
                self.manual_backward(d_loss)
                if step_disc and (stop_disc_at is None or batch_idx < stop_disc_at):
                    opt_d.step()
                self.untoggle_optimizer(opt_d)

            def configure_optimizers(self):
                return [
                    torch.optim.Adam(self.generator.parameters(), 2e-4),
                    torch.optim.Adam(self.discriminator.parameters(), 2e-4),
                ]

        return GAN()


@pytest.mark.parametrize("step_disc", [False, True], ids=["step_forgotten", "steps"])
def test_lightning_toggle_optimizer_does_not_hide_a_discriminator_never_stepped(
    tmp_path, step_disc
):
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    data = DataLoader(TensorDataset(torch.randn(32 * 40, 2)), batch_size=32)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(_ToggledGAN.build(step_disc), data)
    found = [a.data.get("optimizer") for a in callback.alerts if a.rule == "not_optimized"]
    assert found == ([] if step_disc else [1])


@pytest.mark.parametrize("stop_disc_at", [40, None], ids=["stops_at_40", "keeps_stepping"])
def test_lightning_toggle_optimizer_does_not_hide_a_discriminator_that_stopped_stepping(
    tmp_path, stop_disc_at
):
    """The discriminator's step dropped from batch 40 on while its backward still runs:
    toggle_optimizer(opt_g) has it frozen whenever the generator's step looks."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    data = DataLoader(TensorDataset(torch.randn(32 * 200, 2)), batch_size=32)
    gan = _ToggledGAN.build(True, stop_disc_at)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(gan, data)
    found = [a for a in callback.alerts if a.rule == "not_optimized"]
    if stop_disc_at is None:
        assert found == []
        return
    (alert,) = found
    assert alert.data["kind"] == "optimizer_stopped" and alert.data["optimizer"] == 1
    assert alert.data["last_step"] >= 40
    assert {name.split(".")[0] for name in alert.data["parameters"]} == {"discriminator"}


def test_a_second_phase_with_the_body_frozen_after_its_last_gradient_is_silent():
    """The body's gradients of the first phase's last backward stay (frozen, never
    reset again): no training of the body, nothing to tell."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model.head = nn.Linear(16, 2)
    first = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    with tw.watch(model, first, console=False) as monitor:
        for _ in range(20):
            first.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            first.step()
        model.body.requires_grad_(False)
        second = torch.optim.Adam(model.head.parameters(), 1e-4)
        monitor.add_optimizer(second)
        for _ in range(200):
            second.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            second.step()
        assert all(p.grad is not None for p in model.body.parameters())
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []


# -- a retired head's gradient left behind is no training ---------------------------------


def _pretrain_then_finetune(second_phase: str) -> list:
    """A body pretrained with one head, then fine-tuned with a new head by a new
    optimizer (the body in both). The first head's gradient of its last backward
    stays (the new optimizer's zero_grad() never reaches it): only when the loss
    still runs through it does backward write to it."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model.old_head = nn.Linear(16, 3)
    model.new_head = nn.Linear(16, 2)
    first = torch.optim.Adam([*model.body.parameters(), *model.old_head.parameters()], 1e-3)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    with tw.watch(model, first, console=False) as monitor:
        for _ in range(20):
            first.zero_grad()
            nn.functional.cross_entropy(model.old_head(model.body(x)), y).backward()
            first.step()
        second = torch.optim.Adam([*model.body.parameters(), *model.new_head.parameters()], 1e-4)
        monitor.add_optimizer(second)
        for _ in range(150):
            if second_phase == "old_head_in_loss_reset_to_none":
                model.zero_grad()  # the old head's gradient is a new tensor at every backward
            else:
                second.zero_grad()  # the old head's gradient accumulates in place
            h = model.body(x)
            loss = nn.functional.cross_entropy(model.new_head(h), y)
            if second_phase != "old_head_retired":
                loss = loss + nn.functional.cross_entropy(model.old_head(h), y)
            loss.backward()
            second.step()
        assert model.old_head.weight.grad is not None
    return [a for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize(
    "second_phase",
    ["old_head_retired", "old_head_in_loss", "old_head_in_loss_reset_to_none"],
)
def test_a_stale_gradient_on_a_retired_head_is_not_taken_for_training(second_phase):
    alerts = _pretrain_then_finetune(second_phase)
    if second_phase == "old_head_retired":
        assert alerts == []
        return
    (alert,) = alerts
    assert alert.rule == "not_optimized" and alert.data["kind"] == "optimizer_stopped"
    assert alert.module == "old_head" and alert.data["last_step"] == 19
    assert alert.data["parameters"] == ["old_head.weight", "old_head.bias"]
    assert 119 <= alert.step <= 145  # looked at every 25 steps, from 100 steps stale


PRETRAIN_FINETUNE = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
x = torch.randn(256, 10)
y3, y5 = (x[:, :3]).argmax(1), (x[:, 3:8]).argmax(1)
body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
pre = nn.Sequential(body, nn.Linear(32, 3))
opt = torch.optim.Adam(pre.parameters(), 1e-2)
for _ in range(60):
    opt.zero_grad()
    F.cross_entropy(pre(x), y3).backward()
    opt.step()
ft = nn.Sequential(body, nn.Linear(32, 5))  # the same body, a new head
opt2 = torch.optim.Adam(ft.parameters(), 1e-3)
for _ in range(150):
    opt2.zero_grad()
    loss = F.cross_entropy(ft(x), y5)
    if sys.argv[1] == "old_head_in_loss":
        loss = loss + F.cross_entropy(pre(x), y3)
    loss.backward()
    opt2.step()
"""


@pytest.mark.parametrize("second_phase", ["old_head_retired", "old_head_in_loss"])
def test_trainwatch_run_takes_no_stale_gradient_of_a_pretraining_head_for_training(
    tmp_path, second_phase
):
    script = tmp_path / "pretrain_finetune.py"
    script.write_text(PRETRAIN_FINETUNE)
    run_script(script, [second_phase], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [
        (a["module"], a["data"].get("kind"))
        for a in map(json.loads, lines)
        if a["rule"] == "not_optimized"
    ]
    assert found == ([("1", "optimizer_stopped")] if second_phase == "old_head_in_loss" else [])


# -- an optimizer that never stepped, beside a gradient merely left behind ----------------


def _probe_then_finetune(diagnostic: bool, forget_body_step: bool) -> list:
    """Linear probing, then fine-tuning (LP-FT): the body frozen while only the head's
    optimizer steps, then both. One diagnostic backward over the whole model first
    (every parameter gets a gradient?) leaves the body's gradients behind: the
    head's optimizer never resets them. The planted bug: the body trainable from
    the start and ``opt_body.step()`` forgotten."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
    model.head = nn.Linear(16, 2)
    opt_body = torch.optim.Adam(model.body.parameters(), 1e-4)
    opt_head = torch.optim.Adam(model.head.parameters(), 1e-3)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    with tw.watch(model, [opt_body, opt_head], console=False) as monitor:
        if diagnostic:
            nn.functional.cross_entropy(model(x), y).backward()
            assert all(p.grad is not None for p in model.parameters())
        model.body.requires_grad_(forget_body_step)
        for _ in range(60):  # the linear probe: only the head's optimizer
            opt_head.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt_head.step()
        model.body.requires_grad_(True)
        for _ in range(40):  # fine-tuning
            opt_body.zero_grad()
            opt_head.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if not forget_body_step:
                opt_body.step()
            opt_head.step()
    return [a for a in monitor.alerts if a.severity != "info"]


def test_a_body_frozen_for_a_linear_probe_with_gradients_left_behind_is_silent():
    assert _probe_then_finetune(diagnostic=True, forget_body_step=False) == []


@pytest.mark.parametrize("diagnostic", [False, True], ids=["plain", "after_a_diagnostic"])
def test_a_body_optimizer_whose_step_is_forgotten_is_told_beside_stale_gradients(diagnostic):
    (alert,) = _probe_then_finetune(diagnostic=diagnostic, forget_body_step=True)
    assert alert.rule == "not_optimized" and alert.data["kind"] == "optimizer_never_steps"
    assert alert.data["optimizer"] == 0 and alert.step == PATIENCE
    assert {name.split(".")[0] for name in alert.data["parameters"]} == {"body"}


def _distilled_beside_a_saliency_map(teacher_in_loss: bool, reset_after: bool) -> list:
    """A teacher whose optimizer is built for a later phase, one saliency backward
    through it (``loss.backward()`` for the input's gradient), then a student
    distilled from it under ``no_grad``: nothing trains the teacher, nothing is
    lost. The planted bug: the teacher's own loss in the student's, its step
    forgotten."""
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt_t = torch.optim.Adam(teacher.parameters(), 1e-4)
    opt_s = torch.optim.Adam(student.parameters(), 1e-3)
    with (
        tw.watch(teacher, opt_t, console=False) as watched_teacher,
        tw.watch(student, opt_s, console=False),
    ):
        x = torch.randn(16, 8, requires_grad=True)
        nn.functional.cross_entropy(teacher(x), torch.randint(0, 3, (16,))).backward()
        assert x.grad is not None  # the saliency map
        if reset_after:
            teacher.zero_grad()
        for _ in range(60):
            x = torch.randn(32, 8)
            with torch.set_grad_enabled(teacher_in_loss):
                t = teacher(x)
            s = student(x)
            loss = nn.functional.kl_div(s.log_softmax(1), t.softmax(1), reduction="batchmean")
            if teacher_in_loss:
                loss = loss + nn.functional.cross_entropy(t, t.argmax(1))
            opt_s.zero_grad()
            if reset_after:
                opt_t.zero_grad()
            loss.backward()
            opt_s.step()
    return [a for a in watched_teacher.alerts if a.severity != "info"]


@pytest.mark.parametrize("reset_after", [False, True], ids=["gradients_kept", "reset"])
def test_a_teacher_reached_by_one_saliency_backward_is_silent(reset_after):
    assert _distilled_beside_a_saliency_map(teacher_in_loss=False, reset_after=reset_after) == []


@pytest.mark.parametrize("reset_after", [False, True], ids=["accumulated", "reset_first"])
def test_a_teacher_trained_by_the_loss_whose_step_is_forgotten_is_told(reset_after):
    (alert,) = _distilled_beside_a_saliency_map(teacher_in_loss=True, reset_after=reset_after)
    assert alert.rule == "not_optimized" and alert.data["kind"] == "optimizer_never_steps"
    if reset_after:  # each step's gradient thrown away: told within four steps
        assert alert.step == 0 and alert.data["lost_gradients"] == 3
    else:  # piled up, never reset: the longer wait
        assert PATIENCE <= alert.step <= PATIENCE + 2


LINEAR_PROBE = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
forget = sys.argv[1] == "forget"
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))
body, head = model[:4], model[4]
opt_body = torch.optim.Adam(body.parameters(), 1e-4)
opt_head = torch.optim.Adam(head.parameters(), 1e-3)
x = torch.randn(256, 8)
y = (x[:, 0] > 0).long()
F.cross_entropy(model(x), y).backward()  # does every parameter get a gradient?
assert all(p.grad is not None for p in model.parameters())
body.requires_grad_(forget)
for _ in range(60):  # the linear probe: only the head's optimizer
    opt_head.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt_head.step()
body.requires_grad_(True)
for _ in range(40):
    opt_body.zero_grad()
    opt_head.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if not forget:
        opt_body.step()
    opt_head.step()
"""

SALIENCY_THEN_DISTILL = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
forget = sys.argv[1] == "forget"
teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt_t = torch.optim.Adam(teacher.parameters(), 1e-4)  # for a later phase
opt_s = torch.optim.Adam(student.parameters(), 1e-3)
x = torch.randn(16, 8, requires_grad=True)
F.cross_entropy(teacher(x), torch.randint(0, 3, (16,))).backward()
saliency = x.grad.abs().amax(1)
for _ in range(60):
    x = torch.randn(32, 8)
    with torch.set_grad_enabled(forget):
        t = teacher(x)
    s = student(x)
    loss = F.kl_div(s.log_softmax(1), t.softmax(1), reduction="batchmean")
    if forget:
        loss = loss + F.cross_entropy(t, t.argmax(1))
    opt_s.zero_grad()
    opt_t.zero_grad()
    loss.backward()
    opt_s.step()
"""


@pytest.mark.parametrize("script", ["linear_probe", "saliency_then_distill"])
@pytest.mark.parametrize("how", ["healthy", "forget"])
def test_trainwatch_run_takes_no_gradient_left_behind_for_an_optimizer_never_stepping(
    tmp_path, script, how
):
    body = LINEAR_PROBE if script == "linear_probe" else SALIENCY_THEN_DISTILL
    found = [(a["rule"], a["data"].get("kind")) for a in _run_alerts(tmp_path, body, how)]
    assert found == ([("not_optimized", "optimizer_never_steps")] if how == "forget" else [])


def test_lightning_toggle_optimizer_does_not_show_the_generator_frozen_in_the_setup_table(
    tmp_path,
):
    """The audit is made at a step of the toggled GAN: the table still shows every
    parameter trainable, as the model is."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=False)
    data = DataLoader(TensorDataset(torch.randn(32 * 4, 2)), batch_size=32)
    gan = _ToggledGAN.build(True)
    quiet_trainer(tmp_path, [callback], max_epochs=1).fit(gan, data)
    audit = callback.monitor.setup_audit
    total = sum(p.numel() for p in gan.parameters())
    assert audit.trainable == total
    assert all(p.requires_grad for p in gan.parameters())  # put back as they were
