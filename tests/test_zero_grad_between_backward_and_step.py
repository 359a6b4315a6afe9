"""zero_gradient, kind reset_before_step: zero_grad() between backward and the step.

The gradients backward made are wiped before the optimizer uses them, so the
model never learns. That is one finding about the loop (dated at its first
step, naming the model), not a layer cut off by a .detach() per layer, nor
trainable parameters the loss never reaches. Each planted bug runs beside the
same loop with its zero_grad in a legitimate place.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

from tests.conftest import batches, rules_of
from tests.lightning_models import ManualNet, quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

RESETS = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer_in_place": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model": lambda model, opt: model.zero_grad(),
    "model_in_place": lambda model, opt: model.zero_grad(set_to_none=False),
}
CAUSE = {
    "optimizer": "set_to_none",
    "optimizer_in_place": "zeroed_in_place",
    "model": "set_to_none",
    "model_in_place": "zeroed_in_place",
}


class TinyLM(nn.Module):
    """A small causal transformer language model."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        return self.lm_head(self.ln_f(self.block(self.wte(idx), src_mask=mask, is_causal=True)))


def _mlp_steps(model, opt, reset, steps: int = 8, where: str = "between"):
    for x, y in batches(steps):
        if where == "before":
            reset(model, opt)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if where == "between":
            reset(model, opt)
        opt.step()


def _lm_steps(model, opt, reset, steps: int = 6, where: str = "between"):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, 32, (4, 9), generator=gen)
        if where == "before":
            reset(model, opt)
        logits = model(idx[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1)).backward()
        if where == "between":
            reset(model, opt)
        opt.step()


def _told(alerts) -> list[tuple[str, str | None, int, str | None]]:
    return [(a.rule, a.module, a.step, a.data.get("kind")) for a in alerts if a.severity != "info"]


@pytest.mark.parametrize("how", list(RESETS))
def test_zero_grad_between_backward_and_step_is_one_alert_at_step_0_naming_the_model(
    model, quiet_watch, how
):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _mlp_steps(model, opt, RESETS[how])
    assert _told(monitor.alerts) == [("zero_gradient", "", 0, "reset_before_step")]
    (alert,) = monitor.alerts
    assert alert.data["cause"] == CAUSE[how]
    assert alert.data["count"] == 6 and alert.data["optimizer"] == 0
    assert "before optimizer.step()" in alert.message
    assert "before backward" in alert.hint


@pytest.mark.parametrize("how", list(RESETS))
def test_the_same_zero_grad_before_backward_is_silent(model, quiet_watch, how):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _mlp_steps(model, opt, RESETS[how], where="before")
    assert rules_of(monitor) == []


@pytest.mark.parametrize("where", ["between", "before"])
@pytest.mark.parametrize("how", ["optimizer", "model_in_place"])
def test_a_small_transformer_lm_is_told_once_and_its_control_is_silent(quiet_watch, how, where):
    torch.manual_seed(0)
    lm = TinyLM()
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    monitor = quiet_watch(lm, opt)
    _lm_steps(lm, opt, RESETS[how], where=where)
    if where == "between":
        assert _told(monitor.alerts) == [("zero_gradient", "", 0, "reset_before_step")]
    else:
        assert rules_of(monitor) == []


@pytest.mark.parametrize("zero_grad", ["after_the_step", "just_before_the_step"])
def test_gradient_accumulation_is_told_only_with_zero_grad_just_before_the_step(
    model, quiet_watch, zero_grad
):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(12)):
        (nn.functional.mse_loss(model(x), y) / 3).backward()
        if i % 3 == 2:
            if zero_grad == "just_before_the_step":
                opt.zero_grad()
            opt.step()
            if zero_grad == "after_the_step":
                opt.zero_grad()
    assert monitor.step_count == 4
    if zero_grad == "after_the_step":
        assert rules_of(monitor) == []
    else:
        assert _told(monitor.alerts) == [("zero_gradient", "", 0, "reset_before_step")]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_loop_that_skips_backward_on_some_batches_is_not_told_a_reset(
    model, quiet_watch, set_to_none
):
    """zero_grad in its place, backward skipped on two batches of three: the steps
    without a backward have no gradient, which is no reset after a backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(12)):
        opt.zero_grad(set_to_none=set_to_none)
        loss = nn.functional.mse_loss(model(x), y)
        if i % 3 == 0:
            loss.backward()
        opt.step()
    assert [a for a in monitor.alerts if a.data.get("kind") == "reset_before_step"] == []


def test_dropping_the_gradients_of_an_odd_bad_batch_before_the_step_is_silent(model, quiet_watch):
    """A loop that wipes one batch's gradients on purpose and steps all the same."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(12)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if i in (0, 5):
            opt.zero_grad()  # "a bad batch": its update is dropped
        opt.step()
    assert rules_of(monitor) == []


CLIPS = {
    "norm": lambda model: nn.utils.clip_grad_norm_(model.parameters(), 1.0),
    "norm_tiny": lambda model: nn.utils.clip_grad_norm_(model.parameters(), 1e-6),
    "value": lambda model: nn.utils.clip_grad_value_(model.parameters(), 0.05),
    "norm_then_value": lambda model: (
        nn.utils.clip_grad_norm_(model.parameters(), 1.0),
        nn.utils.clip_grad_value_(model.parameters(), 0.05),
    ),
}


def _clipped_steps(model, opt, reset, clip, where: str, steps: int = 8):
    for x, y in batches(steps):
        if where == "before":
            reset(model, opt)
        nn.functional.mse_loss(model(x), y).backward()
        clip(model)
        if where == "between":
            reset(model, opt)
        opt.step()


@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("how", list(RESETS))
def test_zero_grad_between_the_clip_and_the_step_is_told_at_step_0(model, quiet_watch, how, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _clipped_steps(model, opt, RESETS[how], CLIPS[clip], "between")
    assert _told(monitor.alerts) == [("zero_gradient", "", 0, "reset_before_step")]
    assert monitor.alerts[0].data["cause"] == CAUSE[how]


@pytest.mark.parametrize("clip", list(CLIPS))
@pytest.mark.parametrize("how", ["optimizer", "model_in_place"])
def test_clipping_with_zero_grad_before_backward_is_silent(model, quiet_watch, how, clip):
    """A clip that scales the gradients down to almost nothing, or clips them twice
    in place, is no reset."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    _clipped_steps(model, opt, RESETS[how], CLIPS[clip], "before")
    assert monitor.step_count == 8
    assert rules_of(monitor) == []


def _told_only_where_reset_between(monitor, where: str, steps_applied: int) -> None:
    """The reset between backward and step is one warning at the model; the control
    (reset before the forward) applies every step the scaler did not skip, silently."""
    if where == "between":
        assert _told(monitor.alerts) == [("zero_gradient", "", 0, "reset_before_step")]
    else:
        assert monitor.step_count == steps_applied
        assert rules_of(monitor) == []


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("where", ["between", "before"])
def test_amp_unscale_clip_and_zero_grad_before_the_scalers_step(
    model, quiet_watch, where, set_to_none
):
    """bf16 autocast with a GradScaler, unscaled and clipped, steps it skips among
    them: the reset after the clip is told; zero_grad in its place is silent."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(10)):
        if where == "before":
            opt.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if i in (0, 4, 5):
            loss = loss * float("inf")  # the scaler skips these steps
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if where == "between":
            opt.zero_grad(set_to_none=set_to_none)
        scaler.step(opt)
        scaler.update()
    _told_only_where_reset_between(monitor, where, steps_applied=7)


@pytest.mark.parametrize("where", ["between", "before"])
def test_grad_scaler_with_skipped_steps(model, quiet_watch, where):
    """Steps the scaler skips (an inf at the first and later batches) are no reset;
    the reset after backward is told through the scaler too."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    monitor = quiet_watch(model, opt)
    for i, (x, y) in enumerate(batches(10)):
        if where == "before":
            opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if i in (0, 4, 5):
            loss = loss * float("inf")  # the scaler skips these steps
        scaler.scale(loss).backward()
        if where == "between":
            # (set to None, the scaler finds no gradient to unscale and raises)
            opt.zero_grad(set_to_none=False)
        scaler.step(opt)
        scaler.update()
    _told_only_where_reset_between(monitor, where, steps_applied=7)


def test_a_layer_cut_off_by_detach_is_still_named_per_layer(model, quiet_watch):
    """The control: a real .detach() leaves the other layers' gradients, so no reset."""
    model.detach_fc1 = True
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _mlp_steps(model, opt, RESETS["optimizer"], steps=5, where="before")
    assert _told(monitor.alerts) == [("zero_gradient", "fc1", 0, "none")]


def test_a_model_frozen_by_mistake_is_still_told_by_trainable_parameters(quiet_watch):
    """The control: no gradient reaches the trainable parameters at all (an adapter on a
    branch the loss never uses), zero_grad in its place: no reset to tell."""

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 1)
            self.unused = nn.Linear(8, 1)
            self.body.requires_grad_(False)
            self.scale = nn.Parameter(torch.ones(()), requires_grad=False)

        def forward(self, x):
            return self.body(x) * self.scale + x[:, :1] * 0.0

    torch.manual_seed(0)
    net = Unused()
    opt = torch.optim.SGD(net.unused.parameters(), lr=0.01)
    monitor = quiet_watch(net, opt)
    for x, y in batches(4):
        opt.zero_grad()
        x.requires_grad_(True)  # the loss has a graph, none of it through a trainable weight
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    told = _told(monitor.alerts)
    assert ("trainable_parameters", "unused", 0, None) in told
    assert all(kind != "reset_before_step" for *_, kind in told)


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
def test_two_optimizers_the_discriminators_reset_after_its_backward_is_told_naming_it(
    quiet_watch, clip
):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gan = nn.ModuleDict({"generator": gen, "discriminator": disc})
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    monitor = quiet_watch(gan, [opt_d, opt_g])
    bce = nn.BCEWithLogitsLoss()
    for _ in range(6):
        fake = gen(torch.randn(16, 4))
        d_loss = bce(disc(torch.randn(16, 8) + 2.0), torch.ones(16, 1)) + bce(
            disc(fake.detach()), torch.zeros(16, 1)
        )
        d_loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(disc.parameters(), 1.0)
        opt_d.zero_grad()  # the bug: after the discriminator's backward
        opt_d.step()
        opt_g.zero_grad()
        bce(disc(fake), torch.ones(16, 1)).backward()
        if clip:
            nn.utils.clip_grad_norm_(gen.parameters(), 1.0)
        opt_g.step()
    told = _told(monitor.alerts)
    assert told == [("zero_gradient", "discriminator", 0, "reset_before_step")]
    assert monitor.alerts[0].data["optimizer"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("after", [True, False], ids=["after_backward", "before_backward"])
def test_lightning_manual_optimisation_with_zero_grad_after_manual_backward(tmp_path, after):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=5, limit_val_batches=0, num_sanity_val_steps=0
    )
    trainer.fit(ManualNet(zero_grad_after_backward=after))
    if after:
        assert _told(callback.alerts) == [("zero_gradient", "", 0, "reset_before_step")]
    else:
        assert callback.alerts == []


SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(8):
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    if sys.argv[1] == "before":
        opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if sys.argv[2] == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if sys.argv[1] == "between":
        opt.zero_grad()
    opt.step()
"""


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["clip", "noclip"])
@pytest.mark.parametrize("where", ["between", "before"])
def test_trainwatch_run_tells_it_in_an_unmodified_script(tmp_path, where, clip):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "run"
    assert run_script(script, [where, clip], log_dir=out, console=False) == 0
    alerts = [json.loads(line) for line in (out / "alerts.jsonl").read_text().splitlines()]
    told = [(a["rule"], a["module"], a["step"], a["data"].get("kind")) for a in alerts]
    if where == "between":
        assert told == [("zero_gradient", "", 0, "reset_before_step")]
    else:
        assert told == []
