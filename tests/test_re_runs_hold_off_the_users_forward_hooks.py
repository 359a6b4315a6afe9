"""trainwatch's re-runs of a model leave no trace of the user's hooks: training stays bit for bit.

stalled_training re-runs the model on a few rows of its first batch, the
eval-mode look re-runs a module that draws random numbers, and a NaN replay
re-runs a pass whose output overflowed. Each called the user's forward hooks
once more: a hook that keeps an activation for a penalty
(``model[3].register_forward_hook(lambda m, i, o: feats.append(o))``, cleared
after the loss reads it) found a stale eval-mode activation in its list after
the re-run, and every loss from then on differed from the same script run
without trainwatch. Put back only where the list lived in the module defining
the model's class; an ``nn.Sequential``, a model imported from another file or
a list held in a closure kept the trace.

Planted: that hook on an ``nn.Sequential`` (the list a global of this file)
and on a model of this file (the list in a closure), a forward pre-hook
keeping the inputs the same way, and a hook counting and printing the calls,
each trained with and without trainwatch (``tw.watch`` re-running at every
other step, the eval-mode look, a GradScaler overflow replayed, ``trainwatch
run`` of an unmodified script): losses, weights, the lists, the counts and
the lines printed are the same. The hooks torch's own utilities install
still run in a re-run: a pruned, a ``weight_norm`` and a ``spectral_norm``
model are re-run on the weights their pre-hooks compute (what the model
computes), and still stall at the first check past warm-up at a learning
rate of 0, and only then.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.utils.prune
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from tests.same_training import plain_and_under_run
from trainwatch.collect.rerun_effects import UndoneEffects
from trainwatch.collect.rerun_guard import rerun_guarded

OFTEN = {"every": 2, "warmup": 1}  # the reference, then a re-run at every other step
STEPS = 12
FEATS: list[torch.Tensor] = []  # a global of this file: the model's class is torch's
INPUTS: list[torch.Tensor] = []


def _internal(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "internal_error"]


def _stalls(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "stalled_training"]


def _sequential() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.layer2 = nn.Sequential(nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(x)))


class CallLog:
    """A hook object: counts the calls it sees and prints a statistic of each."""

    def __init__(self) -> None:
        self.calls = 0

    def hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.calls += 1
        print(f"layer mean {float(output.detach().mean()):.6f}")


# -- the shapes: (model, its loss, what the hooks keep) -------------------------------------
def _penalised(kept: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = F.cross_entropy(model(x), y) + 1e-2 * sum(f.pow(2).mean() for f in kept) / len(kept)
        kept.clear()
        return out

    return loss


def _plain_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def global_list():
    """The sweep's shape: an nn.Sequential, the activations kept in a global list."""
    model = _sequential()
    model[3].register_forward_hook(lambda module, args, output: FEATS.append(output))
    return model, _penalised(FEATS), lambda: len(FEATS)


def closure_list():
    """A model of this file, the activations kept in a list its closure holds."""
    model = Backbone()
    kept: list[torch.Tensor] = []
    model.layer2.register_forward_hook(lambda module, args, output: kept.append(output))
    return model, _penalised(kept), lambda: len(kept)


def pre_hook_list():
    """A forward pre-hook keeping the inputs of a layer (it runs in a re-run: its
    list is put back)."""
    model = _sequential()
    model[2].register_forward_pre_hook(lambda module, args: INPUTS.append(args[0]))
    return model, _penalised(INPUTS), lambda: len(INPUTS)


def counting_hook():
    """A hook object of this file counting and printing the calls (not the model's)."""
    model = _sequential()
    log = CallLog()
    model[2].register_forward_hook(log.hook)
    return model, _plain_loss, lambda: log.calls


SHAPES = {f.__name__: f for f in (global_list, closure_list, pre_hook_list, counting_hook)}


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=gen)
    return x, (x[:, :4] * x[:, 4:8]).argmax(1), gen


def _train(shape: str, watch=None, lr: float = 1e-2, steps: int = STEPS, **config):
    """Each step's loss and what the hooks keep after it; the final weights; the alerts."""
    FEATS.clear()
    INPUTS.clear()
    torch.manual_seed(0)
    model, loss_fn, kept = SHAPES[shape]()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    monitor = watch(model, opt, **config) if watch is not None else None
    x, y, gen = _data()
    steps_seen = []
    for _ in range(steps):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        loss = loss_fn(model, x[idx], y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps_seen.append((loss.item(), kept()))
    alerts = []
    if monitor is not None:
        monitor.close()
        alerts = monitor.alerts
    return steps_seen, model.state_dict(), alerts


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- stalled_training's re-runs ---------------------------------------------------------------
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_hooked_model_trains_as_without_trainwatch_under_stalled_training(
    quiet_watch, capsys, shape
):
    plain, plain_weights, _ = _train(shape)
    printed = capsys.readouterr().out
    watched, weights, alerts = _train(shape, quiet_watch, stalled_training=OFTEN)
    assert watched == plain  # losses, and the lists (counts) after every step
    assert _same_weights(weights, plain_weights)
    assert capsys.readouterr().out == printed  # no line printed by a re-run
    assert alerts == []


def test_control_without_trainwatch_the_lists_are_emptied_at_every_step():
    for shape in ("global_list", "closure_list", "pre_hook_list"):
        steps, _, _ = _train(shape)
        assert [kept for _, kept in steps] == [0] * STEPS


def test_control_the_counting_hook_counts_every_training_call(quiet_watch, capsys):
    steps, _, _ = _train("counting_hook", quiet_watch, stalled_training=OFTEN)
    assert [kept for _, kept in steps] == list(range(1, STEPS + 1))
    assert capsys.readouterr().out.count("layer mean") == STEPS


# -- the eval-mode look at a module drawing random numbers ------------------------------------
class DropPath(nn.Module):
    """Stochastic depth (timm's): a Bernoulli mask in training, nothing in eval."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        mask = x.new_empty((x.shape[0], 1)).bernoulli_(0.8)
        return x * mask / 0.8


class ResidualNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.drop = DropPath()
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.drop(self.block(h)))


def _train_drop_path(watch=None) -> tuple[list[tuple[float, int]], list[tw.Alert]]:
    torch.manual_seed(0)
    model = ResidualNet()
    kept: list[torch.Tensor] = []
    model.drop.register_forward_hook(lambda module, args, output: kept.append(output))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = watch(model, opt, stalled_training=False) if watch is not None else None
    x, y, gen = _data()
    steps = []
    for _ in range(8):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        loss = _penalised(kept)(model, x[idx], y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append((loss.item(), len(kept)))
    if monitor is None:
        return steps, []
    monitor.close()
    return steps, monitor.alerts


def test_the_eval_mode_look_at_a_drop_path_leaves_its_hook_alone(quiet_watch):
    """The look re-runs the DropPath in eval mode right after its training call:
    its own hook still saw that call once, and the re-run nothing."""
    plain, _ = _train_drop_path()
    watched, alerts = _train_drop_path(quiet_watch)
    assert watched == plain
    assert _internal(alerts) == []


# -- a NaN replay ----------------------------------------------------------------------------
def _train_overflow(shape: str, watch=None) -> tuple[list[tuple[str, int]], dict, list[tw.Alert]]:
    """fp16 autocast under a GradScaler; one batch overflows fp16 and its step is
    skipped: trainwatch replays that pass to locate the overflow."""
    FEATS.clear()
    torch.manual_seed(0)
    model, loss_fn, kept = SHAPES[shape]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    monitor = None
    if watch is not None:
        monitor = watch(model, opt, scaler=scaler, stalled_training=False)
    x, y, gen = _data()
    steps = []
    for step in range(16):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        batch = x[idx].clone()
        if step == 10:
            batch[:, 0] = 1e30  # a corrupt sample: inf in fp16
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, batch, y[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        steps.append((repr(loss.item()), kept()))
    if monitor is None:
        return steps, model.state_dict(), []
    monitor.close()
    return steps, model.state_dict(), monitor.alerts


@pytest.mark.parametrize("shape", ["global_list", "counting_hook"])
def test_the_replay_of_an_overflow_leaves_the_hooks_alone(quiet_watch, capsys, shape):
    """(The replay runs as the pass ends, before the loss reads the list: the
    list's extra entry is cleared with the others; a count keeps it.)"""
    plain, plain_weights, _ = _train_overflow(shape)
    printed = capsys.readouterr().out
    watched, weights, alerts = _train_overflow(shape, quiet_watch)
    assert watched == plain
    assert capsys.readouterr().out == printed
    assert _same_weights(weights, plain_weights)
    assert [a.rule for a in alerts] == ["nonfinite_forward"]  # located: the replay ran


# -- trainwatch run ------------------------------------------------------------------------------
SCRIPT = """
import json, sys
import torch, torch.nn as nn, torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
feats = []
model[3].register_forward_hook(lambda m, i, o: feats.append(o))
X = torch.randn(2048, 16)
Y = (X[:, :4] * X[:, 4:8]).argmax(1)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
steps = []
for step in range(12):
    idx = torch.randint(0, 2048, (64,))
    out = model(X[idx])
    loss = F.cross_entropy(out, Y[idx]) + 1e-2 * sum(f.pow(2).mean() for f in feats) / len(feats)
    feats.clear()
    opt.zero_grad()
    loss.backward()
    opt.step()
    steps.append([loss.item(), len(feats)])
json.dump(steps, open(sys.argv[1], "w"))
"""


def _run_script(tmp_path: Path, script: str) -> tuple[Any, Any, list[str]]:
    """The script run plain and under ``trainwatch run`` (a re-run at every other
    step): what each wrote, and the rules the watched run told."""
    return plain_and_under_run(tmp_path, script, every=2)


@pytest.mark.slow
def test_trainwatch_run_of_a_script_keeping_activations_in_a_hook_trains_as_without(tmp_path):
    plain, watched, rules = _run_script(tmp_path, SCRIPT)
    assert watched == plain
    assert all(left == 0 for _, left in watched)
    assert "internal_error" not in rules


# -- the hooks torch's utilities install still run ------------------------------------------
def _pruned() -> nn.Module:
    model = _sequential()
    torch.nn.utils.prune.l1_unstructured(model[2], "weight", amount=0.5)
    return model


def _weight_normed() -> nn.Module:
    model = _sequential()
    torch.nn.utils.weight_norm(model[2])  # the old kind: a forward pre-hook
    return model


def _spectral_normed() -> nn.Module:
    model = _sequential()
    torch.nn.utils.spectral_norm(model[2])  # the old kind: a forward pre-hook
    torch.nn.utils.spectral_norm(model[4])
    return model


REWEIGHTED = {"pruned": _pruned, "weight_norm": _weight_normed, "spectral_norm": _spectral_normed}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", list(REWEIGHTED))
def test_a_re_run_computes_the_weights_torchs_pre_hooks_make_and_holds_off_the_users_hook(kind):
    """After an update, the re-run's output is the model's own (its pre-hook made
    the weight from the updated parameters), and the user's hook saw nothing."""
    torch.manual_seed(0)
    model = REWEIGHTED[kind]()
    seen: list[torch.Tensor] = []
    model[2].register_forward_hook(lambda module, args, output: seen.append(output))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    seen.clear()
    model.eval()
    subs = list(model.modules())
    with rerun_guarded(model, subs, [], UndoneEffects(subs)):
        rerun = model(x)
    assert seen == []
    with torch.no_grad():
        expected = model(x)
    assert len(seen) == 1  # the user's hook is back for the user's calls
    assert torch.equal(rerun, expected)


# At the first check past warm-up, by the output; spectral_norm's power iteration
# moves its weight (its ``u`` and ``v`` buffers) at every training call, lr 0 or
# not: its output still moves at that check, and the stall is told at the next.
STALLED_AT = {
    "pruned": (39, "output_change"),
    "weight_norm": (39, "output_change"),
    "spectral_norm": (59, "updates_stopped"),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("kind", list(REWEIGHTED))
@pytest.mark.parametrize("lr, stalls", [(0.0, True), (1e-2, False)])
def test_pruned_and_normalised_models_still_stall_at_a_learning_rate_of_0_only(
    quiet_watch, kind, lr, stalls
):
    """Their weights are made by torch's pre-hooks at every call, re-runs included;
    a hook of the user's on them keeps its list as without trainwatch."""
    torch.manual_seed(0)
    model = REWEIGHTED[kind]()
    kept: list[torch.Tensor] = []
    model[3].register_forward_hook(lambda module, args, output: kept.append(output))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    monitor = quiet_watch(model, opt, stalled_training={"every": 20, "warmup": 40})
    x, y, gen = _data()
    for _ in range(65):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        loss = _penalised(kept)(model, x[idx], y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert kept == []
    found = [(a.step, a.data["criterion"]) for a in _stalls(monitor.alerts)]
    assert found == ([STALLED_AT[kind]] if stalls else [])
    assert _internal(monitor.alerts) == []
