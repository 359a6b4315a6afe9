"""frozen_in_optimizer and not_optimized: parameters and optimizers that disagree."""

from __future__ import annotations

import io
import json
import math
import runpy
import sys

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import rules_of, train
from trainwatch.runner import run_script


def test_frozen_layer_inside_optimizer_is_reported_dated_at_attach(model, quiet_watch):
    for p in model.fc2.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    # Told once the first step boundaries have shown nothing moves it by hand.
    train(model, opt, 2)
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.step) == ("frozen_in_optimizer", "fc2", 0)
    assert alert.data["frozen"] == 2 and alert.data["trainable"] == 0
    train(model, opt, 5)
    assert [a.rule for a in monitor.alerts] == ["frozen_in_optimizer"]  # not repeated


def test_layer_frozen_mid_training_is_reported_at_that_step(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)

    def freeze(step: int) -> None:
        if step == 3:
            model.head.weight.requires_grad_(False)

    train(model, opt, 8, before_step=freeze)
    frozen = [a for a in monitor.alerts if a.rule == "frozen_in_optimizer"]
    assert [(a.module, a.step) for a in frozen] == [("head", 3)]
    assert frozen[0].data == {
        "frozen": 1,
        "trainable": 1,
        "parameters": ["head.weight"],
        "optimizer": 0,
    }


def test_param_group_added_later_is_checked(model, quiet_watch):
    for p in model.head.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 2)
    opt.add_param_group({"params": list(model.head.parameters())})
    train(model, opt, 3)
    assert [(a.rule, a.module, a.step) for a in monitor.alerts] == [
        # The head frozen while the layers feeding it train: a note from the audit.
        ("trainable_parameters", "head", 0),
        ("frozen_in_optimizer", "head", 2),
    ]


def test_fine_tuning_with_frozen_params_left_out_of_the_optimizer_is_clean(model, quiet_watch):
    for p in [*model.fc1.parameters(), *model.fc2.parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 5)
    assert rules_of(monitor) == []


def test_head_replaced_after_optimizer_was_built_is_not_optimized(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 2)
    model.head = nn.Linear(16, 1)  # the optimizer still holds the old head
    train(model, opt, 3)
    alerts = [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]
    assert alerts == [("not_optimized", "head", 2)]


class _TinyGPT(nn.Module):
    def __init__(self, tie: bool = False, vocab: int = 40, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.wte(idx)))


def _replace_the_head_at(step_count: int, tie: str, reset: str | None, steps: int = 10):
    """A tiny GPT trained with ``reset`` ("model": model.zero_grad(), "optimizer":
    opt.zero_grad(), None: none after the head is replaced), its head replaced once
    ``step_count`` steps were taken (tied to the embedding before or after that)."""
    torch.manual_seed(0)
    model = _TinyGPT(tie=tie == "tied_before")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            if step == step_count:
                model.lm_head = nn.Linear(16, 40, bias=False)
                if tie == "tied_after":
                    model.lm_head.weight = model.wte.weight
            if reset == "model" or step < step_count:
                model.zero_grad()
            elif reset == "optimizer":
                opt.zero_grad()
            idx = torch.randint(0, 40, (4, 9), generator=gen)
            logits = model(idx[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, 40), idx[:, 1:].reshape(-1)).backward()
            opt.step()
    return [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("reset", ["model", "optimizer"])
@pytest.mark.parametrize("tie", ["untied", "tied_before", "tied_after"])
def test_a_head_replaced_after_steps_is_only_not_optimized_whatever_resets_the_gradients(
    tie, reset
):
    """The old head's weight stays in the optimizer with its last gradient, which
    model.zero_grad() no longer reaches: no backward adds onto it, so no missing
    zero_grad. A new head tied to the embedding is optimized: nothing to tell."""
    expected = [] if tie == "tied_after" else [("not_optimized", "lm_head", 5)]
    assert _replace_the_head_at(5, tie, reset) == expected


def test_control_a_head_replaced_then_zero_grad_dropped_is_still_a_missing_zero_grad():
    alerts = _replace_the_head_at(5, "untied", None)
    assert sorted(alerts, key=str) == [
        ("accumulated_gradient", None, 5),
        ("not_optimized", "lm_head", 5),
    ]


def test_not_optimized_is_silent_without_any_watched_optimizer(model, quiet_watch):
    monitor = quiet_watch(model)
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        monitor.step()
    assert rules_of(monitor) == []


GAN_SCRIPT = """
import sys
import torch
from torch import nn


class GAN(nn.Module):
    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))


def set_trainable(module, flag):
    for p in module.parameters():
        p.requires_grad_(flag)


torch.manual_seed(0)
gan = GAN()
opt_g = torch.optim.Adam(gan.generator.parameters(), lr=2e-4)
opt_d = torch.optim.Adam(gan.discriminator.parameters(), lr=2e-4)
if sys.argv[1] == "left frozen":
    set_trainable(gan.discriminator[2], False)  # the bug: never unfrozen
bce = nn.functional.binary_cross_entropy_with_logits
for step in range(8):
    real = torch.randn(32, 2) * 0.5 + 2.0
    # generator update, the discriminator frozen meanwhile (the usual idiom)
    set_trainable(gan.discriminator, False)
    fake = gan.generator(torch.randn(32, 4))
    opt_g.zero_grad()
    bce(gan.discriminator(fake), torch.ones(32, 1)).backward()
    opt_g.step()
    set_trainable(gan.discriminator, True)
    if sys.argv[1] == "left frozen":
        set_trainable(gan.discriminator[2], False)
    # discriminator update
    opt_d.zero_grad()
    d_real, d_fake = gan.discriminator(real), gan.discriminator(fake.detach())
    (bce(d_real, torch.ones(32, 1)) + bce(d_fake, torch.zeros(32, 1))).backward()
    opt_d.step()
"""


@pytest.mark.parametrize("case", ["toggled", "left frozen"])
def test_an_optimizer_found_while_its_parameters_are_toggled_off_is_judged_at_its_step(
    tmp_path, case
):
    """Unmodified GAN code that freezes the discriminator around the generator's update
    (as Lightning's toggle_optimizer does): its optimizer, found then, is not frozen."""
    script = tmp_path / "gan.py"
    script.write_text(GAN_SCRIPT)
    run_script(script, [case], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    frozen = [
        (a["module"], a["data"]["frozen"])
        for a in map(json.loads, lines)
        if a["rule"] == "frozen_in_optimizer"
    ]
    # (trainwatch run watches the two networks the loop calls as models of their own)
    assert frozen == ([] if case == "toggled" else [("2", 2)])


def _frozen_then(unfreeze_at: int | None, steps: int = 40):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            if step == unfreeze_at:
                for p in model[0].parameters():
                    p.requires_grad_(True)
            x = torch.randn(16, 8)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    return [(a.rule, a.severity, a.step, a.module) for a in monitor.alerts]


def test_a_warm_up_freeze_undone_later_is_told_as_undone():
    assert _frozen_then(unfreeze_at=20) == [
        ("frozen_in_optimizer", "warning", 0, "0"),
        ("frozen_in_optimizer", "info", 20, "0"),
    ]


def test_control_a_freeze_never_undone_has_no_note():
    assert _frozen_then(unfreeze_at=None) == [("frozen_in_optimizer", "warning", 0, "0")]


class _MoCo(nn.Module):
    """MoCo's own recipe: the momentum (key) encoder lives in the model, frozen, and
    the optimizer is built from ``model.parameters()``; the loop moves it by hand."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.encoder_k = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.encoder_k.load_state_dict(self.encoder_q.state_dict())
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.how = how

    @torch.no_grad()
    def _momentum_update(self, m: float = 0.99) -> None:
        for q, k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            if self.how == "data":
                k.data = k.data * m + q.data * (1.0 - m)  # as MoCo's code writes it
            elif self.how == "lerp":
                k.lerp_(q, 1.0 - m)
            elif self.how == "data_in_place":
                k.data.mul_(m).add_(q.data, alpha=1.0 - m)  # DINO's idiom: no counter moves

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = nn.functional.normalize(self.encoder_q(x), dim=1)
        self._momentum_update()
        with torch.no_grad():
            k = nn.functional.normalize(self.encoder_k(x + 0.1 * torch.randn_like(x)), dim=1)
        return (q * k).sum(1)


@pytest.mark.parametrize("how", ["data", "lerp", "data_in_place", "never"])
def test_a_momentum_encoder_moved_by_hand_is_no_forgotten_freeze(quiet_watch, how):
    torch.manual_seed(0)
    model = _MoCo(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    for _ in range(10):
        loss = -model(torch.randn(16, 8)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    found = {(a.rule, a.module, a.step) for a in monitor.alerts if a.rule == "frozen_in_optimizer"}
    if how == "never":  # control: frozen and never moved, a forgotten freeze
        # (the key encoder frozen whole: one alert, at the module holding its layers)
        assert found == {("frozen_in_optimizer", "encoder_k", 0)}
    else:
        assert found == set()


class _TargetAfterStep(nn.Module):
    """BYOL's and DINO's recipe: the target (teacher) is a frozen copy of the online
    network inside the model, moved by hand after the optimizer's step."""

    def __init__(self) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.target = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.target.load_state_dict(self.online.state_dict())
        self.target.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            goal = self.target(x + 0.1 * torch.randn_like(x))
        return nn.functional.mse_loss(self.online(x), goal)


@pytest.mark.parametrize("every", [1, 2])
def test_a_target_moved_after_the_step_is_no_forgotten_freeze(quiet_watch, every):
    torch.manual_seed(0)
    model = _TargetAfterStep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    for step in range(10):
        loss = model(torch.randn(16, 8))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            with torch.no_grad():
                for k, q in zip(model.target.parameters(), model.online.parameters()):
                    k.lerp_(q, 0.01)
    assert rules_of(monitor) == []


# open_clip's initial temperature, 1/0.07; its clamp's bound is log(100).
CLIP_SCALE = math.log(1 / 0.07)


class _Clip(nn.Module):
    """A CLIP-style dual encoder with open_clip's learnable temperature."""

    def __init__(self, scale: float, trainable: bool) -> None:
        super().__init__()
        self.visual = nn.Linear(12, 8)
        self.text = nn.Embedding(40, 8)
        self.logit_scale = nn.Parameter(torch.tensor(scale), requires_grad=trainable)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        i = nn.functional.normalize(self.visual(images), dim=-1)
        t = nn.functional.normalize(self.text(tokens).mean(1), dim=-1)
        return self.logit_scale.exp() * i @ t.t()


def _clip_alerts(quiet_watch, *, trainable=False, scale=CLIP_SCALE, write="clamp", console=False):
    torch.manual_seed(0)
    model = _Clip(scale, trainable)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt, console=console)
    for _ in range(10):
        logits = model(torch.randn(16, 12), torch.randint(0, 40, (16, 5)))
        labels = torch.arange(16)
        loss = (
            nn.functional.cross_entropy(logits, labels)
            + nn.functional.cross_entropy(logits.t(), labels)
        ) / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            if write == "clamp":
                model.logit_scale.clamp_(0, math.log(100))
            elif write == "copy":
                model.logit_scale.copy_(model.logit_scale.detach().clone())
            elif write == "mul_one":
                model.logit_scale.mul_(1)
    return monitor, [(a.rule, a.module, a.step, a.data.get("parameters")) for a in monitor.alerts]


@pytest.mark.parametrize("write", ["clamp", "copy", "mul_one"])
def test_a_frozen_scale_written_in_place_unchanged_is_a_forgotten_freeze(quiet_watch, write):
    # Each write bumps the version counter; the values stay: nothing moves it.
    _, found = _clip_alerts(quiet_watch, write=write)
    assert found == [("frozen_in_optimizer", "", 0, ["logit_scale"])]


def test_a_frozen_scale_clamped_into_range_once_is_a_forgotten_freeze(quiet_watch):
    # Built beyond the clamp's bound: the first clamp changes it, no later one does.
    _, found = _clip_alerts(quiet_watch, scale=math.log(1 / 0.005))
    assert found == [("frozen_in_optimizer", "", 0, ["logit_scale"])]


@pytest.mark.parametrize(
    "scale", [CLIP_SCALE, math.log(1 / 0.005)], ids=["within_range", "beyond_range"]
)
def test_control_a_trainable_scale_clamped_every_step_is_silent(quiet_watch, scale):
    monitor, _ = _clip_alerts(quiet_watch, trainable=True, scale=scale)
    assert rules_of(monitor) == []


def test_the_setup_table_names_the_optimizer_holding_a_frozen_parameter(quiet_watch):
    shown = io.StringIO()
    monitor, _ = _clip_alerts(quiet_watch, console=shown)
    rows = {row.module: row for row in monitor.setup_audit.locations}
    assert (rows[""].optimizers, rows[""].frozen_held) == ([], [0])
    assert (rows["visual"].optimizers, rows["visual"].frozen_held) == ([0], [])
    assert "0 (frozen)" in shown.getvalue()


def test_control_the_setup_table_shows_no_optimizer_for_a_freeze_left_out(quiet_watch):
    torch.manual_seed(0)
    model = _Clip(CLIP_SCALE, trainable=False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    monitor = quiet_watch(model, opt)
    rows = {row.module: row for row in monitor.setup_audit.locations}
    assert (rows[""].optimizers, rows[""].frozen_held) == ([], [])


WARM_UP_FREEZE = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
model[2].requires_grad_(False)  # a warm-up freeze kept inside the optimizer
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 4), torch.randn(32, 1)
for step in range(20):
    if step == 10:
        model[2].requires_grad_(True)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def test_trainwatch_run_counts_the_freeze_and_its_undoing_apart(tmp_path):
    """The warning and the later 'unfrozen' line share (rule, module): the run's
    summary and alert_counts.json keep both, as tw.watch does."""
    script = tmp_path / "train.py"
    script.write_text(WARM_UP_FREEZE)
    run_script(script, log_dir=tmp_path / "log", console=False)
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())["counts"]
    found = sorted((c["rule"], c["module"], c["first_step"]) for c in counts)
    assert found == [("frozen_in_optimizer", "2", 0), ("frozen_in_optimizer", "2", 10)]


CONTRASTIVE = '''
import sys
import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.projector = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.projector(torch.relu(self.body(x)))


class NTXent(nn.Module):
    """A contrastive loss with a learned temperature."""

    def __init__(self):
        super().__init__()
        self.log_t = nn.Parameter(torch.tensor(0.5).log())

    def forward(self, z1, z2):
        z = F.normalize(torch.cat([z1, z2]), dim=1)
        n = len(z1)
        sim = (z @ z.t() / self.log_t.exp()).masked_fill(
            torch.eye(2 * n, dtype=torch.bool), float("-inf")
        )
        return F.cross_entropy(sim, torch.cat([torch.arange(n, 2 * n), torch.arange(n)]))


def augment(x):
    return x + 0.1 * torch.randn_like(x)


torch.manual_seed(0)
model, criterion = Net(), NTXent()
frozen = sys.argv[1] if len(sys.argv) > 1 else "nothing"
if frozen == "projector":
    model.projector.requires_grad_(False)  # the planted bug: frozen, yet in the optimizer
elif frozen == "temperature":
    criterion.log_t.requires_grad_(False)
loose = [torch.zeros(3)] if frozen == "a bare tensor" else []
opt = torch.optim.Adam([*model.parameters(), *criterion.parameters(), *loose], lr=1e-3)
x = torch.randn(32, 8)


def train(steps=8):
    for _ in range(steps):
        loss = criterion(model(augment(x)), model(augment(x)))
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    train()
'''


@pytest.mark.parametrize(
    ("frozen", "expected"),
    [
        ("projector", [("projector", "Net")]),  # frozen whole: one alert
        ("temperature", [("", "NTXent")]),
        ("a bare tensor", [("<outside the model>", "Net")]),
        ("nothing", []),
    ],
)
def test_under_run_a_freeze_in_an_optimizer_shared_with_a_loss_module_is_told_once(
    tmp_path, frozen, expected
):
    """``trainwatch run`` watches the loss module (it holds a parameter) as a model of
    its own, whose monitor sees the other model's parameters in the shared optimizer:
    they are that model's monitor's to judge, not a second alert '<outside the model>'.
    A bare tensor neither model holds is told once, by one of them."""
    script = tmp_path / "train.py"
    script.write_text(CONTRASTIVE)
    assert run_script(script, [frozen], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    told = [(a["module"], a["data"]["model"]) for a in found if a["rule"] == "frozen_in_optimizer"]
    assert told == expected
    if frozen == "nothing":
        assert found == []


@pytest.mark.parametrize(
    ("frozen", "expected"),
    [
        (
            "projector",  # frozen whole: one alert, at the module holding its layers
            [
                (
                    "projector",
                    [
                        "projector.0.weight",
                        "projector.0.bias",
                        "projector.2.weight",
                        "projector.2.bias",
                    ],
                ),
            ],
        ),
        ("temperature", [("<outside the model>", ["NTXent.log_t"])]),
        (
            "a bare tensor",
            [("<outside the model>", ["param_groups[0]['params'][7] of shape (3,)"])],
        ),
        ("nothing", []),
    ],
)
def test_under_watch_a_frozen_parameter_beside_the_model_is_named_where_it_lives(
    tmp_path, monkeypatch, quiet_watch, frozen, expected
):
    """``tw.watch(model, opt)`` with the loss module's temperature (or a bare tensor)
    frozen in the model's optimizer: no other monitor judges it, so this one tells it,
    named as its module names it, or by its place in the optimizer, not by a counter."""
    script = tmp_path / "train.py"
    script.write_text(CONTRASTIVE)
    monkeypatch.setattr(sys, "argv", [str(script), frozen])
    loop = runpy.run_path(str(script), run_name="contrastive")
    monitor = quiet_watch(loop["model"], loop["opt"])
    loop["train"]()
    told = [
        (a.module, a.data["parameters"]) for a in monitor.alerts if a.rule == "frozen_in_optimizer"
    ]
    assert told == expected
    if frozen == "nothing":
        assert rules_of(monitor) == []
