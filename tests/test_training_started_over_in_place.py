"""One model and one optimizer started over in place between folds or trials.

A k-fold loop or a hyperparameter search that re-initialises its model and
optimizer in place (``model.load_state_dict`` of the initial weights with
``optimizer.load_state_dict`` of the initial state; ``reset_parameters()``
with ``optimizer.state.clear()``; every fold loaded from one warm checkpoint)
was told exploding_gradient at the new fold's first step ("gradient norm of 2
jumped to 0.604, 2.7e+03x its recent typical norm"), with "lower the learning
rate, clip, add warm-up": the fold before had trained to a near-zero loss,
and the model had simply started over. The optimizer's state, emptied or
loaded back to an earlier one, now says so: a new phase, with a warm-up of
its own (as with a new optimizer per fold), in which a run diverging from its
first steps is looked for again, as at the run's start.

Planted beside the clean folds: a new fold whose learning rate is 100x too
high, diverging within its first steps, is told. Controls: a state loaded at
or past the one it replaces (a resume, a round trip), an LR scheduler's warm
restart and an EMA weight swap start nothing over: a loss spike a few steps
after them is told at once, against the run's history.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

STEPS = 128  # per fold: each reaches a near-zero loss


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """Two separable classes: a fold trains to a loss of ~1e-5."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 16, generator=gen)
    y = (x[:, 0] + x[:, 1] > 0).long()
    x[:, :2] += 2.0 * (y.float() * 2 - 1).unsqueeze(1)
    return x, y


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=3e-3)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(model, opt, x, y, steps: int, gen: torch.Generator) -> None:
    for _ in range(steps):
        i = torch.randint(0, len(x), (50,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[i]), y[i]).backward()
        opt.step()


def _folds(restart: str, kind: str) -> list[tw.Alert]:
    """Three folds of one model and optimizer under ``tw.watch``, started over in
    place by ``restart``, each trained to a near-zero loss."""
    x, y = _data()
    model = _model()
    opt = _optimizer(model, kind)
    gen = torch.Generator().manual_seed(1)
    with tw.watch(model, opt, console=False) as monitor:
        if restart == "warm":  # every fold from one checkpoint, its optimizer state kept
            _train(model, opt, x, 1 - y, 32, gen)  # another task first
        start = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        for fold in range(3):
            if fold and restart in ("load", "warm"):
                model.load_state_dict(start[0])
                opt.load_state_dict(start[1])
            elif fold and restart == "clear":
                torch.manual_seed(fold)
                for module in model.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
                opt.state.clear()
            _train(model, opt, x, y, STEPS, gen)
    return [a for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("restart", ["load", "clear", "warm"])
def test_folds_started_over_in_place_are_no_explosion(restart, kind):
    assert _folds(restart, kind) == []


def _regression_folds(restart: str, boosted_fold: int | None, factor: float) -> list[tw.Alert]:
    """Three folds of a regression (SGD with momentum) started over in place by
    ``restart``; ``boosted_fold`` trains at a learning rate ``factor`` times too
    high, whose loss and gradients grow tenfold a step within a few steps."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 16, generator=gen)
    y = x @ torch.randn(16, 1, generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.1), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    with tw.watch(model, opt, console=False) as monitor:
        for fold in range(3):
            if fold and restart == "load":
                model.load_state_dict(start[0])
                opt.load_state_dict(start[1])
            elif fold and restart == "clear":
                for module in model.modules():
                    if hasattr(module, "reset_parameters"):
                        module.reset_parameters()
                opt.state.clear()
            for group in opt.param_groups:
                group["lr"] = 0.05 * (factor if fold == boosted_fold else 1.0)
            for _ in range(STEPS):
                i = torch.randint(0, len(x), (50,), generator=gen)
                opt.zero_grad()
                nn.functional.mse_loss(model(x[i]), y[i]).backward()
                opt.step()
    return [a for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("restart", ["load", "clear"])
def test_a_fold_started_over_at_a_learning_rate_20x_too_high_is_told_diverging(restart):
    """The new fold's per-layer histories start over with a warm-up; a run diverging
    from its first steps is looked for again, as at the run's start."""
    alerts = _regression_folds(restart, boosted_fold=1, factor=20.0)
    first = alerts[0]
    assert (first.rule, first.module, first.data.get("kind")) == (
        "exploding_gradient",
        None,
        "diverging",
    )
    assert STEPS < first.step <= STEPS + 5  # within the new fold's first steps
    assert first.data["growth"] >= 1e3 and "learning rate" in first.hint


@pytest.mark.parametrize("restart", ["load", "clear"])
def test_a_fold_started_over_at_a_learning_rate_100x_too_high_is_told(restart):
    """Faster still: its gradients overflow, or turn non-finite, within three steps."""
    alerts = _regression_folds(restart, boosted_fold=1, factor=100.0)
    first = alerts[0]
    assert first.rule == "exploding_gradient" or first.rule.startswith("nonfinite")
    assert STEPS < first.step <= STEPS + 5


@pytest.mark.parametrize("restart", ["load", "clear"])
def test_control_the_same_regression_folds_at_their_learning_rate_are_silent(restart):
    assert _regression_folds(restart, boosted_fold=None, factor=1.0) == []


SCRIPT = """
import copy, sys
import torch
from torch import nn

task, boosted = sys.argv[1], int(sys.argv[2])
gen = torch.Generator().manual_seed(0)
x = torch.randn(1000, 16, generator=gen)
torch.manual_seed(0)
if task == "classifier":  # separable: each fold reaches a loss of ~1e-5
    y = (x[:, 0] + x[:, 1] > 0).long()
    x[:, :2] += 2.0 * (y.float() * 2 - 1).unsqueeze(1)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)
    )
    loss_fn, lr = nn.functional.cross_entropy, 3e-3
    opt = torch.optim.Adam(model.parameters(), lr=lr)
else:
    y = x @ torch.randn(16, 1, generator=gen)
    model = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.1), nn.Linear(64, 1))
    loss_fn, lr = nn.functional.mse_loss, 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
init_model, init_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
for fold in range(3):
    model.load_state_dict(init_model)
    opt.load_state_dict(init_opt)
    for group in opt.param_groups:
        group["lr"] = lr * (20.0 if fold == boosted else 1.0)
    for step in range(128):
        i = torch.randint(0, 1000, (50,), generator=gen)
        opt.zero_grad()
        loss_fn(model(x[i]), y[i]).backward()
        opt.step()
"""


def _run(tmp_path, task: str, boosted: int = -1) -> list[dict]:
    script = tmp_path / "folds.py"
    script.write_text(SCRIPT)
    run_script(script, [task, str(boosted)], log_dir=tmp_path / "tw", console=False)
    alerts = [json.loads(line) for line in (tmp_path / "tw" / "alerts.jsonl").open()]
    return [a for a in alerts if a["severity"] != "info"]


@pytest.mark.parametrize("task", ["classifier", "regression"])
def test_trainwatch_run_on_folds_reloaded_from_the_initial_state_is_silent(tmp_path, task):
    assert _run(tmp_path, task) == []


def test_trainwatch_run_tells_the_fold_that_diverges(tmp_path):
    first = _run(tmp_path, "regression", boosted=1)[0]
    assert (first["rule"], first["data"].get("kind")) == ("exploding_gradient", "diverging")
    assert STEPS < first["step"] <= STEPS + 5


# -- what starts nothing over -------------------------------------------------

SPIKE_AT = 105  # a few steps after the event at step 100: within a new warm-up


def _event_then_spike(event: str, kind: str, spike: bool) -> list[tw.Alert]:
    """One run; at step 100 ``event``; at ``SPIKE_AT`` (with ``spike``) the loss
    scaled 1e4x for one batch, a jump a history kept through the event tells."""
    x, y = _data()
    model = _model()
    opt = _optimizer(model, kind)
    gen = torch.Generator().manual_seed(1)
    scheduler = None
    if event == "lr_warm_restart":
        scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50)
    ema = [p.detach().clone() for p in model.parameters()]
    later = None
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(140):
            if step == 90 and event == "later_state":
                # A checkpoint ahead of this run (trained on by a copy) to resume from.
                ahead = copy.deepcopy(model)
                ahead_opt = _optimizer(ahead, kind)
                ahead_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
                _train(ahead, ahead_opt, x, y, 10, torch.Generator().manual_seed(2))
                later = ahead.state_dict(), ahead_opt.state_dict()
            if step == 100:
                if event == "round_trip":  # a checkpoint of this very step, reloaded
                    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
                    model.load_state_dict(saved[0])
                    opt.load_state_dict(saved[1])
                elif event == "later_state":
                    model.load_state_dict(later[0])
                    opt.load_state_dict(later[1])
                elif event == "ema_swap":  # evaluate the average's weights, then swap back
                    kept = [p.detach().clone() for p in model.parameters()]
                    with torch.no_grad():
                        for p, e in zip(model.parameters(), ema, strict=True):
                            p.copy_(e)
                        model(x[:100])
                        for p, k in zip(model.parameters(), kept, strict=True):
                            p.copy_(k)
            i = torch.randint(0, len(x), (50,), generator=gen)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[i]), y[i])
            if spike and step == SPIKE_AT:
                loss = loss * 1e4  # a loss term that blows up for one batch
            loss.backward()
            opt.step()
            if scheduler is not None:
                scheduler.step()
            with torch.no_grad():
                for p, e in zip(model.parameters(), ema, strict=True):
                    e.lerp_(p, 0.01)
    return [a for a in monitor.alerts if a.severity != "info"]


# A checkpoint loaded mid-run is told from a restart by its step counts: Adam
# keeps them, SGD does not (its load with the whole model's is taken for one).
EVENTS = [
    ("round_trip", "adam"),
    ("later_state", "adam"),
    ("ema_swap", "adam"),
    ("ema_swap", "sgd"),
    ("lr_warm_restart", "adam"),
    ("lr_warm_restart", "sgd"),
]


@pytest.mark.parametrize(("event", "kind"), EVENTS)
def test_a_spike_after_a_resume_or_a_swap_is_told_against_the_runs_history(event, kind):
    alerts = _event_then_spike(event, kind, spike=True)
    assert [(a.rule, a.step) for a in alerts][:1] == [("exploding_gradient", SPIKE_AT)]
    assert alerts[0].data["ratio"] > 100


@pytest.mark.parametrize(("event", "kind"), EVENTS)
def test_control_the_same_runs_without_the_spike_are_silent(event, kind):
    assert _event_then_spike(event, kind, spike=False) == []
