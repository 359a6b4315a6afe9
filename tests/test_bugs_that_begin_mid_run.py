"""Bugs that begin mid-run, after hundreds of healthy steps, in plain loops under tw.watch.

Most planted bugs in the suite are there from step 0 and end within a hundred
steps, while trainwatch still audits its first steps and its sampled looks come
often. A bug that appears at step ``S`` = 350 meets the steady-state path
instead: the usual step, the sampled cadences past their warm-ups. Each loop
below trains for ``STEPS`` steps, healthy until ``S``, and the same loop run as
many steps without the bug is the control: it says nothing at all. A bug must
be told at the step it happens, naming the module (where its rule samples, at
its documented cadence), and nothing before it.

The same corpus under Lightning and ``trainwatch run``:
test_bugs_that_begin_mid_run_in_lightning.py and
test_bugs_that_begin_mid_run_under_trainwatch_run.py.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from trainwatch.alert import Alert

S = 350  # the first step the bug touches
STEPS = 420  # past dead_units' second sampled look and zero_gradient's 50-step wait


def told(alerts: list[Alert], severities=("warning", "error")) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts if a.severity in severities]


# How NaN/Inf are looked for: on the spot (CPU's default), at the step boundary
# (a GPU's default), and summed per module for the next step's readback (no op named).
CHECKS = ("auto", "step", "deferred")


def watch(model: nn.Module, opt: torch.optim.Optimizer, tmp_path, check: str) -> tw.Monitor:
    return tw.watch(
        model, opt, console=io.StringIO(), log_dir=tmp_path, nonfinite_forward={"check": check}
    )


def first_told(alerts: list[Alert]) -> tuple[str, int, str | None]:
    """The earliest finding, and that nothing came before the bug."""
    found = told(alerts, ("info", "warning", "error"))
    assert found, "the bug was not told"
    assert min(step for _, step, _ in found) >= S, found
    return min(found, key=lambda item: item[1])


# --- an MLP classifier, SGD with momentum ---------------------------------------


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act1 = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(64, 64)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(64, 4)
        # Set by the loop for a phase that trains the upper layers only.
        self.freeze_features = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act1(self.fc1(x)))
        if self.freeze_features:
            h = h.detach()
        return self.head(self.act2(self.fc2(h)))


def train_classifier(bug: str | None, tmp_path, check: str = "auto") -> list[Alert]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 4, generator=gen)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = watch(model, opt, tmp_path, check)
    warmup_until = S  # the learning rate warms up over the steps before S
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=gen)
        y = (x @ teacher).argmax(1)
        if bug == "nan_sample" and step == S:
            x[3, 2] = float("nan")  # one corrupt sample (a failed decode)
        if bug == "lr_multiplied" and step == S:
            for group in opt.param_groups:
                group["lr"] *= 1000  # a "restart" that multiplies the rate instead of resetting it
        if bug == "features_detached" and step == S:
            model.freeze_features = True  # the flag cuts fc1 off; the optimizer still holds it
        if bug == "layer_frozen" and step == S:
            model.fc1.requires_grad_(False)  # frozen, still in the optimizer
        if step < warmup_until:
            for group in opt.param_groups:
                group["lr"] = 0.05 * (step + 1) / warmup_until
            # Zeroing inside the warm-up branch: from its end on, no zero_grad().
            opt.zero_grad()
        elif bug != "zero_grad_under_warmup":
            opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    monitor.close()
    return monitor.alerts


def test_the_clean_classifier_loop_says_nothing(tmp_path):
    assert train_classifier(None, tmp_path) == []


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_sample_is_told_at_its_step_as_the_input(tmp_path, check):
    alerts = train_classifier("nan_sample", tmp_path, check)
    assert first_told(alerts) == ("nonfinite_forward", S, "fc1")
    assert alerts[0].data["cause"] == "input"
    assert told(alerts) == [("nonfinite_forward", S, "fc1")]


def test_a_learning_rate_multiplied_mid_run_is_an_exploding_gradient_the_next_step(tmp_path):
    """Step S's update is the first at the raised rate: its gradients are healthy,
    the next step's jump."""
    alerts = train_classifier("lr_multiplied", tmp_path)
    rule, step, module = first_told(alerts)
    assert (rule, step) == ("exploding_gradient", S + 1)
    assert module in {"fc1", "fc2", "head"}


def test_zero_grad_inside_a_warm_up_branch_is_told_at_the_first_step_after_it(tmp_path):
    alerts = train_classifier("zero_grad_under_warmup", tmp_path)
    assert first_told(alerts) == ("accumulated_gradient", S, None)
    assert alerts[0].data["modules"] == ["fc1", "fc2", "head"]


def test_features_detached_by_a_flag_are_a_zero_gradient_at_that_step(tmp_path):
    alerts = train_classifier("features_detached", tmp_path)
    assert told(alerts, ("info", "warning", "error")) == [
        ("unused_parameter", S, "fc1"),
        ("zero_gradient", S, "fc1"),
    ]


def test_a_layer_frozen_mid_run_inside_the_optimizer_is_told_at_that_step(tmp_path):
    alerts = train_classifier("layer_frozen", tmp_path)
    assert told(alerts, ("info", "warning", "error")) == [("frozen_in_optimizer", S, "fc1")]


# --- a small CNN with batch norm and dropout, plain SGD -------------------------


class Standardize(nn.Module):
    """Per-batch standardisation of each pixel: a pixel constant over the batch
    (a stuck sensor) has a std of 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.standardize = Standardize()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.act2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.bn1(self.conv1(self.standardize(x))))
        h = self.act2(self.conv2(h))
        return self.head(self.drop(self.pool(h).flatten(1)))


def prune_small_weights(conv: nn.Conv2d, threshold: float) -> None:
    """Magnitude pruning: zero the small weights, and the bias of a channel left
    with no weight at all."""
    with torch.no_grad():
        keep = conv.weight.abs() > threshold
        conv.weight.mul_(keep)
        conv.bias.mul_(keep.flatten(1).any(1))


def train_convnet(bug: str | None, tmp_path, check: str = "auto") -> list[Alert]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    prototypes = torch.randn(4, 1, 6, 6, generator=gen)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = watch(model, opt, tmp_path, check)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 4, (16,), generator=gen)
        return prototypes[y] + 0.5 * torch.randn(16, 1, 6, 6, generator=gen), y

    for step in range(STEPS):
        x, y = batch()
        if bug == "stuck_pixel" and step == S:
            x[:, :, 0, 0] = 0.3  # one sensor stuck for this batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if bug == "pruned_away" and step == S:
            prune_small_weights(model.conv2, 5.0)  # meant 5e-3: every weight is below it
        if step % 50 == 0:
            model.eval()
            with torch.no_grad():
                val_x, val_y = batch()
                F.cross_entropy(model(val_x), val_y)
            if not (bug == "left_in_eval" and step >= S):
                model.train()
    monitor.close()
    return monitor.alerts


def test_the_clean_convnet_loop_says_nothing(tmp_path):
    assert train_convnet(None, tmp_path) == []


def test_a_division_by_a_zero_std_is_told_at_its_step_naming_the_module_and_op(tmp_path):
    alerts = train_convnet("stuck_pixel", tmp_path)
    assert first_told(alerts) == ("nonfinite_forward", S, "standardize")
    assert alerts[0].data["op"] == "aten::div"


def test_a_layer_pruned_to_zero_is_dead_units_at_the_next_sampled_look(tmp_path):
    """The pruning follows step S's update: step S + 1 is the first pass through
    the dead layer. dead_units looks every 25 steps (two looks in a row), so its
    finding is dated at its first look after S + 1; zero_gradient waits 50 steps
    for a layer that had gradients before (a branch dropped by stochastic depth)
    and dates its finding at the first zero."""
    alerts = train_convnet("pruned_away", tmp_path)
    every = tw.Config().dead_units.every
    assert min(a.step for a in alerts) == S + 1
    dead = [a for a in alerts if a.rule == "dead_units"]
    assert [a.module for a in dead] == ["act2"]
    assert S + 1 <= dead[0].step <= S + every
    zero = {a.module: a.step for a in alerts if a.rule == "zero_gradient"}
    assert zero["conv2"] == S + 1


def test_validation_that_leaves_the_model_in_eval_is_told_at_the_next_step(tmp_path):
    alerts = train_convnet("left_in_eval", tmp_path)
    assert told(alerts, ("info", "warning", "error")) == [("train_in_eval_mode", S + 1, "bn1")]


# --- a regressor with a hand-written norm feature, Adam --------------------------


class WithLength(nn.Module):
    """Appends each row's Euclidean length, written out by hand."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, (h * h).sum(-1, keepdim=True).sqrt()], -1)


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.features = WithLength()
        self.body = nn.Sequential(nn.Linear(17, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.features(self.proj(x))))


def train_regressor(bug: str | None, tmp_path, check: str = "auto") -> list[Alert]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, generator=gen) / 3
    model = Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = watch(model, opt, tmp_path, check)
    for step in range(STEPS):
        x = torch.randn(32, 8, generator=gen)
        y = torch.sin(x @ w)
        if bug == "zero_row" and step == S:
            x[5] = 0.0  # a padding row: its length's sqrt(0) has an infinite derivative
        if bug == "nan_target" and step == S:
            y[7] = float("nan")  # a missing label read as NaN
        if bug == "fine_tune_phase" and step == S:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            monitor.add_optimizer(opt)
        opt.zero_grad()
        pred = model(x)
        if bug in ("fine_tune_phase", "loss_switched") and step >= S:
            loss = F.huber_loss(pred, y)  # (N, 1) against (N,): (N, N)
        else:
            loss = F.mse_loss(pred.squeeze(1), y)
        loss.backward()
        opt.step()
    monitor.close()
    return monitor.alerts


def test_the_clean_regressor_loop_says_nothing(tmp_path):
    assert train_regressor(None, tmp_path) == []


@pytest.mark.parametrize("check", CHECKS)
def test_a_sqrt_of_zero_in_backward_is_told_at_its_step_naming_the_module(tmp_path, check):
    alerts = train_regressor("zero_row", tmp_path, check)
    assert first_told(alerts) == ("nonfinite_backward", S, "features")
    assert alerts[0].data.get("op") == (None if check == "deferred" else "aten::sqrt")


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_target_is_a_nonfinite_loss_at_its_step(tmp_path, check):
    alerts = train_regressor("nan_target", tmp_path, check)
    assert first_told(alerts) == ("nonfinite_loss", S, None)


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_broadcasting_loss_of_a_new_phase_is_told_at_its_first_step(tmp_path):
    """A new optimizer handed over starts a phase, audited from its first step."""
    alerts = train_regressor("fine_tune_phase", tmp_path)
    assert first_told(alerts) == ("broadcast", S, None)
    (broadcast,) = [a for a in alerts if a.rule == "broadcast"]
    assert broadcast.data["phase"] == "training"


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_loss_switched_alone_is_told_within_its_kinds_cadence(tmp_path):
    """With no sign of a new phase, the loss's kind (its autograd ops back to the
    model's output) is read on the class target look's sampled steps, at most
    ``loss_kind_every`` apart: a new one has the next step audited. S is such a
    step (the 400 recheck would come 50 steps later)."""
    alerts = train_regressor("loss_switched", tmp_path)
    assert S % tw.Config().broadcast.loss_kind_every == 0
    assert told(alerts) == [("broadcast", S + 1, None)]
