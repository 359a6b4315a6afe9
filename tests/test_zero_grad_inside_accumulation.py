"""zero_gradient, kind reset_between_backwards: zero_grad() inside a gradient-accumulation
loop.

Each micro-batch's zero_grad() wipes what the earlier micro-batches left, so each
optimizer step applies only the last micro-batch's gradients: the effective batch
is as many times smaller as there are micro-batches, and the loss still goes down.
That is one warning per optimizer, after three steps in a row, dated at the first.
Each planted bug runs beside the healthy shapes that also run several backward
passes between two steps with gradients reset between them (GANs, SAM, LBFGS,
gradient penalties, adversarial training, per-task gradients), which stay silent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from tests.conftest import batches, rules_of
from tests.lightning_models import BoringNet, quiet_trainer
from tests.optimizer_wrappers import SAM
from trainwatch.cli import main as cli_main
from trainwatch.collect.between_backwards import SETTLED_STEPS
from trainwatch.lightning import TrainWatchCallback

F = nn.functional
KIND = "reset_between_backwards"

RESETS = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer_in_place": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model": lambda model, opt: model.zero_grad(),
}


def _mlp(outputs: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, outputs))


def _told(alerts) -> list[tuple[str, str | None, int, str | None]]:
    return [(a.rule, a.module, a.step, a.data.get("kind")) for a in alerts if a.severity != "info"]


def _accumulate(model, opt, accum: int, where: str, reset=RESETS["optimizer"], steps: int = 5):
    """``where``: "inside" (the bug: before every micro-batch) or "after" the step."""
    for i, (x, y) in enumerate(batches(accum * steps, batch=8)):
        if where == "inside":
            reset(model, opt)
        (F.mse_loss(model(x), y) / accum).backward()
        if (i + 1) % accum == 0:
            opt.step()
            if where == "after":
                reset(model, opt)


# -- the planted bug and its control ---------------------------------------------
@pytest.mark.parametrize("accum", [4, 2])
@pytest.mark.parametrize("how", list(RESETS))
def test_zero_grad_inside_the_accumulation_loop_is_one_warning_at_step_0(quiet_watch, how, accum):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _accumulate(model, opt, accum, "inside", RESETS[how])
    assert _told(monitor.alerts) == [("zero_gradient", "", 0, KIND)]
    (alert,) = monitor.alerts
    assert alert.severity == "warning"
    assert alert.data["backward_passes"] == accum and alert.data["wiped"] == accum - 1
    assert alert.data["optimizer"] == 0 and alert.data["steps"] == 3
    assert f"once every {accum} backward passes" in alert.message
    assert f"the other {accum - 1} {'is' if accum == 2 else 'are'} wiped" in alert.message
    assert "right after optimizer.step()" in alert.hint


@pytest.mark.parametrize("accum", [4, 2])
@pytest.mark.parametrize("how", list(RESETS))
def test_zero_grad_after_the_step_is_silent(quiet_watch, how, accum):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _accumulate(model, opt, accum, "after", RESETS[how])
    assert monitor.step_count == 5
    assert rules_of(monitor) == []


def test_accumulating_as_intended_settles_and_the_look_comes_off(quiet_watch):
    """A loop that accumulates as intended pays for the look over its first steps only."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    tracker = monitor._pipeline.tracker
    _accumulate(model, opt, 4, "after", steps=3)
    assert tracker.wipes is not None  # looking
    _accumulate(model, opt, 4, "after", steps=SETTLED_STEPS)
    assert tracker.wipes is None and tracker.follow_wipes is None
    assert rules_of(monitor) == []


def test_one_backward_per_step_is_silent(quiet_watch):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _accumulate(model, opt, 1, "inside", steps=10)
    assert rules_of(monitor) == []


def _clipped_amp_steps(model, opt, where: str, steps: int = 4, accum: int = 4):
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches(accum * steps, batch=8)):
        if where == "inside":
            opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y) / accum).backward()
        if (i + 1) % accum == 0:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            if where == "after":
                opt.zero_grad()


@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_grad_scaler_and_a_clip_before_the_step_neither_hide_it_nor_fake_it(quiet_watch, where):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _clipped_amp_steps(model, opt, where)
    if where == "inside":
        assert _told(monitor.alerts) == [("zero_gradient", "", 0, KIND)]
    else:
        assert rules_of(monitor) == []


CLIPS = {
    "norm": lambda model: nn.utils.clip_grad_norm_(model.parameters(), 0.05),
    "value": lambda model: nn.utils.clip_grad_value_(model.parameters(), 0.01),
}


@pytest.mark.parametrize("clip", list(CLIPS))
def test_a_clip_after_each_micro_batch_rescales_and_is_no_wipe(quiet_watch, clip):
    """Gradients written in place between two backward passes, not zeroed."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(20, batch=8)):
        (F.mse_loss(model(x), y) / 4).backward()
        CLIPS[clip](model)
        if (i + 1) % 4 == 0:
            opt.step()
            opt.zero_grad(set_to_none=False)
    assert rules_of(monitor) == []


class BodyHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("inside", [("head",), ("body", "head"), ()], ids=["head", "both", "none"])
def test_two_optimizers_each_told_at_the_module_it_steps(quiet_watch, inside):
    """A backbone's and a head's optimizer stepping after the same micro-batches."""
    torch.manual_seed(0)
    model = BodyHead()
    opts = {
        "body": torch.optim.SGD(model.body.parameters(), lr=0.05),
        "head": torch.optim.SGD(model.head.parameters(), lr=0.05),
    }
    monitor = quiet_watch(model, [opts["body"], opts["head"]])
    for i, (x, y) in enumerate(batches(20, batch=8)):
        for name in inside:
            opts[name].zero_grad()
        (F.mse_loss(model(x), y) / 4).backward()
        if (i + 1) % 4 == 0:
            opts["body"].step()
            opts["head"].step()
            for name in set(opts) - set(inside):
                opts[name].zero_grad()
    told = {(a.module, a.data["optimizer"]) for a in monitor.alerts if a.data.get("kind") == KIND}
    expected = {"body": ("body.0", 0), "head": ("head", 1)}
    assert told == {expected[name] for name in inside}
    assert rules_of(monitor) == ["zero_gradient"] * len(inside)


# -- healthy shapes with several backward passes between steps -------------------
def test_a_one_off_gradient_probe_on_a_held_out_batch_is_silent(quiet_watch):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    held_x, held_y = next(batches(1, batch=8, seed=5))
    for i, (x, y) in enumerate(batches(24, batch=8)):
        if i % 8 == 3:  # a gradient-norm probe now and then, then back to training
            opt.zero_grad()
            F.mse_loss(model(held_x), held_y).backward()
            sum(p.grad.norm() ** 2 for p in model.parameters())
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    assert rules_of(monitor) == []


@pytest.mark.parametrize("probe", ["autograd_grad", "gradient_penalty"])
def test_autograd_grad_before_the_backward_is_silent(quiet_watch, probe):
    """torch.autograd.grad reaches the model and writes no .grad."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for x, y in batches(8, batch=8):
        if probe == "gradient_penalty":
            x = x.clone().requires_grad_(True)
        out = model(x)
        loss = F.mse_loss(out, y)
        if probe == "autograd_grad":
            torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        else:
            (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = loss + grad.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert rules_of(monitor) == []


def test_fast_adversarial_training_with_an_fgsm_backward_is_silent(quiet_watch):
    """The perturbation's backward reaches the weights too; zero_grad() then clears it
    before the training backward: its pass took an input that requires grad."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for x, y in batches(8, batch=8):
        delta = torch.zeros_like(x, requires_grad=True)
        F.mse_loss(model(x + delta), y).backward()
        delta = (0.1 * delta.grad.sign()).detach()
        opt.zero_grad()
        F.mse_loss(model(x + delta), y).backward()
        opt.step()
    assert rules_of(monitor) == []


@pytest.mark.parametrize("shape", ["pcgrad", "dp_sgd"])
def test_per_loss_or_per_sample_gradients_combined_by_hand_are_silent(quiet_watch, shape):
    """Each backward's gradients read and combined before the next zero_grad():
    several losses of one graph (PCGrad), or per-sample clipping written out (DP-SGD)."""
    model = _mlp(outputs=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    params = list(model.parameters())
    for x, y in batches(8, batch=8):
        total = [torch.zeros_like(p) for p in params]
        if shape == "pcgrad":
            out = model(x)
            losses = [F.mse_loss(out[:, :1], y), F.mse_loss(out[:, 1:], -y)]
            for k, loss in enumerate(losses):
                opt.zero_grad()
                loss.backward(retain_graph=k == 0)
                total = [t + p.grad for t, p in zip(total, params)]
        else:
            for xi, yi in zip(x[:4], y[:4]):
                opt.zero_grad()
                F.mse_loss(model(xi[None])[:, :1], yi[None]).backward()
                norm = float(torch.sqrt(sum(p.grad.pow(2).sum() for p in params)))
                total = [t + p.grad * min(1.0, 1.0 / norm) for t, p in zip(total, params)]
        for p, t in zip(params, total):
            p.grad = t / 4
        opt.step()
    assert rules_of(monitor) == []


@pytest.mark.parametrize("how", ["first_and_second_step", "closure"])
def test_sam_two_backward_passes_around_a_weight_perturbation_are_silent(quiet_watch, how):
    model = _mlp()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05)
    monitor = quiet_watch(model, opt)
    for x, y in batches(8, batch=8):
        F.mse_loss(model(x), y).backward()
        if how == "closure":

            def closure(x=x, y=y):
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            opt.zero_grad()
        else:
            opt.first_step(zero_grad=True)
            F.mse_loss(model(x), y).backward()
            opt.second_step(zero_grad=True)
    assert rules_of(monitor) == []


def test_lbfgs_evaluations_inside_its_step_are_silent(quiet_watch):
    model = _mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    monitor = quiet_watch(model, opt)
    for x, y in batches(5, batch=8):

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    assert [a for a in monitor.alerts if a.data.get("kind") == KIND] == []


def _gan():
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return gen, disc


@pytest.mark.parametrize("watched", ["both", "generator"])
@pytest.mark.parametrize("detach", [True, False], ids=["detached", "not_detached"])
def test_a_gan_whose_discriminator_backward_reaches_the_generator_is_silent(
    quiet_watch, detach, watched
):
    """Without .detach(), D's backward leaves gradients on G that g_opt.zero_grad() then
    clears before G's own backward: D's step comes between."""
    gen, disc = _gan()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    if watched == "both":
        monitor = quiet_watch(nn.ModuleDict({"g": gen, "d": disc}), [opt_d, opt_g])
    else:
        monitor = quiet_watch(gen, opt_g)
    bce = nn.BCEWithLogitsLoss()
    for _ in range(8):
        fake = gen(torch.randn(16, 4))
        opt_d.zero_grad()
        d_loss = bce(disc(torch.randn(16, 8) + 2.0), torch.ones(16, 1)) + bce(
            disc(fake.detach() if detach else fake), torch.zeros(16, 1)
        )
        d_loss.backward(retain_graph=not detach)
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), torch.ones(16, 1)).backward()
        opt_g.step()
    assert [a for a in monitor.alerts if a.data.get("kind") == KIND] == []


def test_wgan_gp_with_five_critic_steps_per_generator_step_is_silent(quiet_watch):
    gen, critic = _gan()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-4)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-4)
    monitor = quiet_watch(nn.ModuleDict({"g": gen, "c": critic}), [opt_c, opt_g])
    for _ in range(4):
        for _ in range(5):
            real = torch.randn(16, 8) + 2.0
            fake = gen(torch.randn(16, 4)).detach()
            opt_c.zero_grad()
            eps = torch.rand(16, 1)
            mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
            penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
            (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
            opt_c.step()
        opt_g.zero_grad()
        (-critic(gen(torch.randn(16, 4))).mean()).backward()
        opt_g.step()
    assert [a for a in monitor.alerts if a.data.get("kind") == KIND] == []


# -- Lightning ---------------------------------------------------------------
class ManualAccumulation(BoringNet):
    """Manual optimisation over micro-batches: a step every 4th batch."""

    def __init__(self, zero_grad_inside: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.inside = zero_grad_inside

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if self.inside:
            opt.zero_grad()
        x, y = batch
        loss = F.mse_loss(self(x), y) / 4
        self.manual_backward(loss)
        if (batch_idx + 1) % 4 == 0:
            opt.step()
            if not self.inside:
                opt.zero_grad()
        return loss


def _fit(tmp_path, model, **kwargs):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_epochs=2, limit_val_batches=0, num_sanity_val_steps=0, **kwargs
    )
    trainer.fit(model)
    return callback


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "after_the_step"])
def test_lightning_manual_optimisation_accumulating_micro_batches(tmp_path, inside):
    callback = _fit(tmp_path, ManualAccumulation(zero_grad_inside=inside))
    if inside:
        assert _told(callback.alerts) == [("zero_gradient", "", 0, KIND)]
        assert callback.alerts[0].data["backward_passes"] == 4
    else:
        assert callback.alerts == []


def test_lightning_automatic_accumulate_grad_batches_is_silent(tmp_path):
    callback = _fit(tmp_path, BoringNet(), accumulate_grad_batches=4)
    assert callback.alerts == []


# -- trainwatch run ----------------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
accum, where = int(sys.argv[1]), sys.argv[2]
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
for i in range(accum * 5):
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    if where == "inside":
        optimizer.zero_grad()
    loss = criterion(model(x), y) / accum
    loss.backward()
    if (i + 1) % accum == 0:
        optimizer.step()
        if where == "after":
            optimizer.zero_grad()
"""


def _run_alerts(out) -> list[tuple[str, str, int, str | None]]:
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    return [(a["rule"], a["module"], a["step"], a["data"].get("kind")) for a in alerts]


@pytest.mark.parametrize("accum,where", [(2, "inside"), (4, "after")])
def test_trainwatch_run_tells_it_in_an_unmodified_script(tmp_path, accum, where):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "run"
    assert (
        cli_main(["run", "--log-dir", str(out), "--no-console", str(script), str(accum), where])
        == 0
    )
    expected = [("zero_gradient", "", 0, KIND)] if where == "inside" else []
    assert _run_alerts(out) == expected


@pytest.mark.slow
def test_python_dash_m_trainwatch_run_tells_it_in_a_fresh_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(out), "--no-console"]
        + [str(script), "4", "inside"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert _run_alerts(out) == [("zero_gradient", "", 0, KIND)]


# -- backward passes of another optimizer, or writing no gradient -----------------
class OneModuleGAN(nn.Module):
    """Generator and discriminator in one module, watched with both optimizers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.G(z)


def test_a_gan_dropping_the_generator_loss_from_its_discriminator_is_silent(quiet_watch):
    """g_loss.backward() also writes D's gradients; d_opt.zero_grad() drops them before
    D's backward while G's stay for g_opt.step() at the end: no micro-batch wiped."""
    gan = OneModuleGAN()
    opt_g = torch.optim.Adam(gan.G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(gan.D.parameters(), lr=1e-3)
    monitor = quiet_watch(gan, [opt_g, opt_d])
    bce = nn.BCEWithLogitsLoss()
    for _ in range(8):
        fake = gan(torch.randn(16, 4))
        opt_g.zero_grad()
        bce(gan.D(fake), torch.ones(16, 1)).backward()
        opt_d.zero_grad()
        d_loss = bce(gan.D(torch.randn(16, 8) + 2.0), torch.ones(16, 1))
        (d_loss + bce(gan.D(fake.detach()), torch.zeros(16, 1))).backward()
        opt_d.step()
        opt_g.step()
    assert [a for a in monitor.alerts if a.data.get("kind") == KIND] == []


@pytest.mark.parametrize("where", ["inside", "after"])
def test_first_order_maml_inner_autograd_grad_passes_are_no_micro_batches(quiet_watch, where):
    """Each task's inner steps take torch.autograd.grad (no .grad written), then its
    query loss's backward accumulates into the meta-model's gradients."""
    from torch.func import functional_call

    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    data = batches(200, batch=8)
    for _ in range(5):
        if where == "after":
            opt.zero_grad()
        for _ in range(4):
            if where == "inside":
                opt.zero_grad()
            params = dict(model.named_parameters())
            for _ in range(3):
                x, y = next(data)
                loss = F.mse_loss(functional_call(model, params, (x,)), y)
                grads = torch.autograd.grad(loss, list(params.values()))
                params = {k: v - 0.02 * g.detach() for (k, v), g in zip(params.items(), grads)}
            x, y = next(data)
            (F.mse_loss(functional_call(model, params, (x,)), y) / 4).backward()
        opt.step()
    told = [
        (a.step, a.data["backward_passes"]) for a in monitor.alerts if a.data.get("kind") == KIND
    ]
    assert told == ([(0, 4)] if where == "inside" else [])


class TwoTasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU())
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 1), "b": nn.Linear(16, 1)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.encoder(x))


@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_head_only_a_wiped_micro_batch_reached_is_no_second_warning(quiet_watch, where):
    """Task a's backward, then task b's, one step: with zero_grad() before each, head
    a has no gradient at the step. That is the wipe's story, told once, not a layer
    backward never reaches."""
    model = TwoTasks()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    data = batches(40, batch=8)
    for _ in range(10):
        if where == "after":
            opt.zero_grad()
        for task in ("a", "b"):
            if where == "inside":
                opt.zero_grad()
            x, y = next(data)
            F.mse_loss(model(x, task), y).backward()
        opt.step()
    assert _told(monitor.alerts) == ([("zero_gradient", "", 0, KIND)] if where == "inside" else [])


def test_a_second_backward_at_every_step_that_is_no_micro_batch_is_looked_at_less_and_less(
    quiet_watch, monkeypatch
):
    """Only the generator watched, the discriminator's backward reaching it at every
    step: the look goes idle, rests, and each rest is twice as long."""
    from trainwatch.collect import between_backwards

    looked = 0
    starts = between_backwards.BetweenBackwards.starts

    def counted(self):
        nonlocal looked
        looked += 1
        return starts(self)

    monkeypatch.setattr(between_backwards.BetweenBackwards, "starts", counted)
    gen, disc = _gan()
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    monitor = quiet_watch(gen, opt_g)
    bce = nn.BCEWithLogitsLoss()
    for _ in range(400):  # 800 backward passes reach the generator
        fake = gen(torch.randn(16, 4))
        opt_d.zero_grad()
        d_loss = bce(disc(torch.randn(16, 8) + 2.0), torch.ones(16, 1))
        (d_loss + bce(disc(fake), torch.zeros(16, 1))).backward(retain_graph=True)
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), torch.ones(16, 1)).backward()
        opt_g.step()
    assert looked < 400  # about 300; every one of the 800 before
    assert [a for a in monitor.alerts if a.data.get("kind") == KIND] == []
