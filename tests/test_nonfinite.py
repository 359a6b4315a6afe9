"""First-NaN localisation: exact step, module and op; silent on AMP and healthy runs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import trainwatch as tw

# "cpu-step" runs the CPU through the path a GPU takes by default (one scalar
# read at the step boundary, then a replay); "cpu-deferred" the no-sync path
# (judged after the step's readback, no op trace): both tested on every machine.
MODES = ["cpu", "cpu-step", "cpu-deferred"] + (
    [pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else []
)


@pytest.fixture(autouse=True)
def _seeded():
    """Fixed initial weights: a huge update overflows to Inf weights for ~99% of
    random inits, and for the rest the forward overflows from finite ones."""
    torch.manual_seed(0)


@pytest.fixture(params=MODES)
def mode(request, monkeypatch) -> str:
    if request.param in ("cpu-deferred", "cpu-step"):
        original = tw.watch
        check = request.param.removeprefix("cpu-")

        def checked_watch(*args, **kwargs):
            kwargs.setdefault("nonfinite_forward", {"check": check})
            return original(*args, **kwargs)

        monkeypatch.setattr(tw, "watch", checked_watch)
    return request.param


@pytest.fixture
def device(mode) -> torch.device:
    return torch.device(mode.split("-")[0])


@pytest.fixture
def traced(mode) -> bool:
    """Whether the op and line are named: a replay located it (not the no-sync path)."""
    return not mode.endswith("-deferred")


class Divide(nn.Module):
    """x / d, where d can be set to zero at a chosen step (forward-only fault)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("denominator", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.denominator


class Standardize(nn.Module):
    """Batch standardisation without an epsilon: NaN on a constant batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


class SqrtAtZero(nn.Module):
    """Finite forward (adds 0), infinite derivative of sqrt at 0: a backward-only fault."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x * 0.0)


class ZeroNorm(nn.Module):
    """Scales by a hand-written norm of a vector that is zero when ``armed``.

    Forward stays finite (the norm is 0); its derivative at 0 is 0/0 = NaN.
    (torch.linalg.vector_norm itself defines that gradient as 0.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x - x if self.armed else x
        return x * (v * v).sum(dim=1, keepdim=True).pow(0.5)


class NormalizedWithEpsilon(nn.Module):
    """``x / (sqrt(sum x^2) + eps)``: the epsilon guards the division, not sqrt's
    derivative at 0 (what a zero row meets once ``armed``)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x - x if self.armed else x
        return x / (torch.sqrt((v * v).sum(dim=1, keepdim=True)) + 1e-6)


class Net(nn.Module):
    def __init__(self, fault: nn.Module | None = None, where: str = "middle") -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.fault = fault if fault is not None else nn.Identity()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "first":
            x = self.fault(x)
        x = torch.tanh(self.fc1(x))
        if self.where == "middle":
            x = self.fault(x)
        x = torch.tanh(self.fc2(x))
        x = self.head(x)
        if self.where == "last":
            x = self.fault(x)
        return x


def run(model, device, steps, *, plant=None, loss_fn=None, monitor_kwargs=None, lr=0.01):
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    loss_fn = loss_fn or nn.functional.mse_loss
    monitor = tw.watch(model, opt, console=False, **(monitor_kwargs or {}))
    with monitor:
        for step in range(steps):
            x = torch.randn(32, 8, generator=gen).to(device)
            y = torch.randn(32, 1, generator=gen).to(device)
            if plant is not None:
                x, y = plant(step, model, x, y)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
    return monitor


def nonfinite(monitor):
    return [a for a in monitor.alerts if a.rule.startswith("nonfinite")]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_division_by_zero_is_located_at_its_module_step_and_op(device, traced, where):
    def plant(step, model, x, y):
        if step == 3:
            model.fault.denominator.zero_()
        return x, y

    monitor = run(Net(Divide(), where), device, 6, plant=plant)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 3, "fault")
    assert first.data["cause"] == "module"
    # Judged from a sum alone, +Inf and -Inf together read as NaN.
    assert first.data["kind"] == "inf" if traced else first.data["kind"] in {"inf", "nan_or_inf"}
    if traced:
        assert first.data["op"] == "aten::div"
        assert first.data["source"].endswith(
            f"test_nonfinite.py:{_line_of('x / self.denominator')}"
        )
        assert "epsilon" in first.hint
    assert len({a.rule for a in nonfinite(monitor)}) == 1  # no cascade alerts


def test_an_overflow_inside_a_torch_module_names_no_line_of_trainwatch(device, traced):
    """``nn.Linear``'s own ``addmm`` overflows (weights grown huge, as a learning rate
    far too high makes them): the re-run runs inside trainwatch, which is no line
    of the user's; the module and op say where."""

    def plant(step, model, x, y):
        if step == 3:
            with torch.no_grad():
                model.head.weight.fill_(3e38)
        return x, y

    first = nonfinite(run(Net(), device, 5, plant=plant))[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 3, "head")
    if traced:
        assert first.data["op"] == "aten::addmm"
    assert "trainwatch" not in first.data.get("source", "")


def test_a_backward_fault_behind_a_guarded_division_names_sqrt_not_the_division(device, traced):
    """The replay's backward sees which node made the first NaN/Inf: sqrt's derivative
    (computed as a division), not the division an epsilon already guards."""

    def plant(step, model, x, y):
        model.fault.armed = step >= 3
        return x, y

    first = nonfinite(run(Net(NormalizedWithEpsilon(), "middle"), device, 5, plant=plant))[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", 3, "fault")
    if traced:
        assert (first.data["op"], first.data["op_basis"]) == ("aten::sqrt", "re-run")
        assert "sqrt" in first.hint and "epsilon to the denominator" not in first.hint


def _line_of(text: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


def test_zero_std_of_a_constant_batch_names_the_standardisation(device, traced):
    def plant(step, model, x, y):
        return (torch.ones_like(x) if step == 2 else x), y

    monitor = run(Net(Standardize(), "first"), device, 4, plant=plant)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "fault")
    if traced:
        assert first.data["op"] == "aten::div"
        assert first.data["kind"] == "nan"
        assert first.data["input_min"] == first.data["input_max"] == 1.0
        assert first.data["shape"] == [32, 8]
    assert "fc1" in first.data["spread"] and first.data["spread_count"] >= 3


def test_functional_op_between_modules_is_traced_in_the_parent(device, traced):
    class LogInForward(Net):
        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            h = torch.log(h)  # NaN wherever tanh(fc1(x)) < 0
            return self.head(torch.tanh(self.fc2(h)))

    monitor = run(LogInForward(), device, 2)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 0, "")
    if traced:
        assert first.data["op"] == "aten::log"
        assert "log_softmax" in first.hint


def test_bad_input_data_is_blamed_on_the_data(device):
    def plant(step, model, x, y):
        if step == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        return x, y

    monitor = run(Net(), device, 3, plant=plant)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step) == ("nonfinite_forward", 1)
    assert first.data["cause"] == "input"
    assert "data" in first.hint


@pytest.mark.parametrize(
    ("fault", "op"),
    [(SqrtAtZero(), "aten::sqrt"), (ZeroNorm(), "aten::pow")],
    ids=["sqrt-at-zero", "norm-of-zero-vector"],
)
def test_backward_only_fault_names_module_step_and_op(device, traced, fault, op):
    def plant(step, model, x, y):
        if isinstance(model.fault, ZeroNorm):
            model.fault.armed = step >= 2
        return x, y

    if isinstance(fault, SqrtAtZero):
        plant = None  # sqrt sits at 0 on every batch: NaN from step 0
    monitor = run(Net(fault, "middle"), device, 4, plant=plant)
    alerts = nonfinite(monitor)
    first = alerts[0]
    expected_step = 0 if isinstance(fault, SqrtAtZero) else 2
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", expected_step, "fault")
    assert not any(a.rule == "nonfinite_forward" for a in alerts[:1])
    if traced:
        assert first.data["op"] == op


def test_weights_poisoned_by_a_reported_backward_nan_are_not_a_second_origin(device):
    """The update applies the bad gradients; the next forward meets the weights: cascade."""
    monitor = run(Net(SqrtAtZero(), "middle"), device, 4)
    assert [(a.rule, a.step, a.module) for a in nonfinite(monitor)] == [
        ("nonfinite_backward", 0, "fault")
    ]


def test_nan_loss_with_finite_output_is_nonfinite_loss(device):
    def loss_fn(pred, y):
        return nn.functional.mse_loss(pred, y) + torch.log(torch.tensor(-1.0, device=y.device))

    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(2):
            x, y = torch.randn(8, 8, device=device), torch.randn(8, 1, device=device)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            monitor.step(loss=loss)
            opt.step()
    (alert,) = nonfinite(monitor)
    assert (alert.rule, alert.step, alert.module) == ("nonfinite_loss", 0, None)
    assert "nan" in alert.message.lower()


def test_nan_targets_are_nonfinite_loss_even_without_the_loss_value(device):
    def plant(step, model, x, y):
        if step == 1:
            y = y.clone()
            y[3] = float("nan")
        return x, y

    monitor = run(Net(), device, 3, plant=plant)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_loss", 1, None)
    assert first.data["cause"] == "loss"


def _scaled_mse(pred, y):
    return nn.functional.mse_loss(pred, y) * 1e10


def test_learning_rate_that_blows_up_parameters(device, traced):
    # lr * gradient lands past float32's range: the update itself overflows.
    monitor = run(Net(), device, 4, lr=1e30, loss_fn=_scaled_mse)
    alerts = nonfinite(monitor)
    first = alerts[0]
    if traced:
        assert (first.rule, first.step, first.module) == ("nonfinite_parameter", 0, "fc1")
    else:
        # Judged after the step, the weights were already updated again with
        # this step's NaN gradients: the forward that met them is named, and
        # both stories (an op, or the last update) are told.
        assert (first.rule, first.step, first.module) == ("nonfinite_forward", 1, "fc1")
        assert first.data["cause"] == "module_or_parameter"
    assert "learning rate" in first.hint
    # What follows is the cascade of that update: no second origin.
    assert len(alerts) == 1


def test_huge_learning_rate_shows_as_the_backward_overflow_it_causes(device, traced):
    monitor = run(Net(), device, 4, lr=1e37)  # finite but huge weights after step 0
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step) == ("nonfinite_backward", 1)
    assert first.data["kind"] == "inf" if traced else first.data["kind"] in {"inf", "nan_or_inf"}


def test_parameter_check_every_step_reports_at_the_update_itself(device):
    monitor = run(
        Net(),
        device,
        2,
        lr=1e30,
        loss_fn=_scaled_mse,
        monitor_kwargs={"nonfinite_parameter": {"check_every": 1}},
    )
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step) == ("nonfinite_parameter", 0)
    assert monitor.step_count == 2


def test_fp16_overflow_is_found(device, traced):
    class Amplify(nn.Module):
        def forward(self, x):
            return (x.half() * 5000.0 * 5000.0).float()

    monitor = run(Net(Amplify(), "middle"), device, 2)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 0, "fault")
    assert first.data["kind"] == "inf" if traced else first.data["kind"] in {"inf", "nan_or_inf"}
    if traced:
        assert first.data["op"] == "aten::mul"


def test_healthy_training_has_no_nonfinite_alert(device):
    monitor = run(Net(), device, 20)
    assert monitor.alerts == []


def test_grad_scaler_skipping_a_few_steps_is_silent(device):
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    with tw.watch(model, opt, console=False) as monitor:
        for i in range(12):
            x, y = torch.randn(8, 8, device=device), torch.randn(8, 1, device=device)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if i in (3, 4, 5):
                loss = loss * float("inf")  # overflowed scaled loss: the scaler skips
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert monitor.step_count == 9
    assert monitor.alerts == []


def test_grad_scaler_that_keeps_skipping_after_updates_began_warns_once(device):
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device.type)
    with tw.watch(model, opt, console=False) as monitor:
        for i in range(28):
            x, y = torch.randn(8, 8, device=device), torch.randn(8, 1, device=device)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if i >= 3:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert monitor.step_count == 3
    (alert,) = monitor.alerts
    assert alert.rule == "amp_skipped_steps" and alert.severity == "warning"
    assert alert.data["skipped"] >= 10


def test_bf16_autocast_raises_nothing(device):
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(6):
            x, y = torch.randn(16, 8, device=device), torch.randn(16, 1, device=device)
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
            opt.step()
    assert monitor.alerts == []


def test_origin_agrees_with_a_brute_force_layer_walk():
    """Run the layers one by one and check every output: the first bad one is the origin."""
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        Divide(),
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Linear(8, 1),
    )
    layers[3].denominator.zero_()
    x = torch.randn(4, 8)
    h, expected = x, None
    for name, layer in layers.named_children():
        h = layer(h)
        if expected is None and not bool(torch.isfinite(h).all()):
            expected = name
    opt = torch.optim.SGD(layers.parameters(), lr=0.01)
    with tw.watch(layers, opt, console=False) as monitor:
        opt.zero_grad()
        layers(x).sum().backward()
        opt.step()
    assert nonfinite(monitor)[0].module == expected == "3"


def test_halt_on_stops_at_the_end_of_the_step_where_it_was_born(tmp_path):
    def plant(step, model, x, y):
        if step == 2:
            model.fault.denominator.zero_()
        return x, y

    with pytest.raises(tw.TrainingHealthError) as caught:
        run(
            Net(Divide()),
            torch.device("cpu"),
            10,
            plant=plant,
            monitor_kwargs={"halt_on": ["nonfinite_forward"], "log_dir": tmp_path},
        )
    assert (caught.value.alert.rule, caught.value.alert.step) == ("nonfinite_forward", 2)
    assert "nonfinite_forward" in (tmp_path / "alerts.jsonl").read_text()


def test_tracing_the_op_leaves_rng_and_buffers_untouched():
    class DropoutDivide(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(self.bn(x)) / 0.0

    model = DropoutDivide()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    with tw.watch(model, opt, console=False) as monitor:
        torch.manual_seed(123)
        model(x).sum().backward()
        after_watched = torch.rand(1)
        stats = model.bn.running_mean.clone()
    torch.manual_seed(123)
    reference = DropoutDivide()
    reference(x)
    assert torch.equal(after_watched, torch.rand(1))
    assert torch.allclose(stats, reference.bn.running_mean)
    assert nonfinite(monitor) or monitor.step_count == 0
    assert not math.isnan(float(stats.sum()))


class LogSoftmax(nn.Module):
    def forward(self, x):
        return torch.log(torch.softmax(x * 1000.0, dim=-1))  # softmax underflows to 0


class ExpOverflow(nn.Module):
    def forward(self, x):
        return torch.exp(x * 1000.0)


@pytest.mark.parametrize(
    ("fault", "op", "advice"),
    [(LogSoftmax(), "aten::log", "log_softmax"), (ExpOverflow(), "aten::exp", "logits")],
    ids=["log-of-softmax", "exp-overflow"],
)
def test_hint_names_the_fix_for_the_op(fault, op, advice):
    monitor = run(Net(fault, "middle"), torch.device("cpu"), 1)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.module, first.data["op"]) == ("nonfinite_forward", "fault", op)
    assert advice in first.hint


@pytest.mark.parametrize("bad_step", [2, 3], ids=["mid-run", "last-step"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_loss_handed_over_after_the_step_is_judged_for_that_step(where, bad_step):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bad = torch.tensor(float("nan"))
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(4):
            x, y = torch.randn(8, 8), torch.randn(8, 1)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            reported = loss.detach() + (bad if step == bad_step else 0.0)
            if where == "before":
                monitor.step(loss=reported)
            opt.step()
            if where == "after":
                monitor.step(loss=reported)  # as Lightning's on_train_batch_end does
    (alert,) = nonfinite(monitor)
    assert (alert.rule, alert.step) == ("nonfinite_loss", bad_step)


def test_a_model_that_stays_broken_is_not_replayed_every_step():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x

    counter = Counting()
    net = Net(counter, "middle")
    with torch.no_grad():
        net.fc1.weight.fill_(float("nan"))  # broken from the start, forever
    monitor = run(net, torch.device("cpu"), 20)
    assert nonfinite(monitor)  # reported
    assert counter.calls <= 20 + 2 * 3  # one call per step, plus a few replays


def test_replays_are_invisible_to_the_other_checks():
    """A replay is a no-grad pass in train mode: the mode check must not take it for an eval."""

    class DropDivide(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.drop = nn.Dropout(0.1)
            self.fault = Divide()

        def forward(self, x):
            return self.fault(self.drop(self.fc(x))).sum(1, keepdim=True)

    def plant(step, model, x, y):
        if step == 1:
            model.fault.denominator.zero_()
        return x, y

    monitor = run(DropDivide(), torch.device("cpu"), 3, plant=plant)
    rules = [a.rule for a in monitor.alerts]
    assert rules[0] == "nonfinite_forward"
    assert "eval_in_train_mode" not in rules


def test_a_no_grad_pass_between_forward_and_backward_keeps_the_backward_fault_located(
    device, traced
):
    """A DQN-style step: the target is the same network's pass under no_grad, made
    after the prediction and before its backward."""
    model = Net(ZeroNorm(), "middle").to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(4):
            model.fault.armed = step >= 2
            x, x_next = (torch.randn(32, 8, generator=gen).to(device) for _ in range(2))
            opt.zero_grad()
            predicted = model(x)
            with torch.no_grad():
                target = 0.5 + 0.9 * model(x_next)
            nn.functional.mse_loss(predicted, target).backward()
            opt.step()
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", 2, "fault")
    if traced:
        assert first.data["op"] == "aten::pow"


def _two_passes_a_step(model, device, second="summed", steps=4):
    """Two batches of different sizes through the model each step. ``second``:
    ``summed`` into the one loss, or ``left out`` of it (a metric taken with grad
    on, no ``no_grad``, between the training pass and its backward)."""
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            if isinstance(model.fault, ZeroNorm):
                model.fault.armed = step >= 2
            large = model(torch.randn(16, 8, generator=gen).to(device))
            small = model(torch.randn(4, 8, generator=gen).to(device))
            opt.zero_grad()
            if second == "summed":
                (large.pow(2).mean() + small.pow(2).mean()).backward()
            else:
                small.mean().item()  # logged, not trained on
                large.pow(2).mean().backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("second", ["summed", "left out"])
def test_two_passes_a_step_locate_a_backward_fault_at_its_module(device, traced, second):
    """The replay runs the pass backward reached (the last, when both were), with the
    gradient that entered that pass (not the other's)."""
    first = nonfinite(_two_passes_a_step(Net(ZeroNorm(), "middle"), device, second))[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", 2, "fault")
    if traced:
        assert first.data["op"] == "aten::pow"


@pytest.mark.parametrize("second", ["summed", "left out"])
def test_two_healthy_passes_a_step_are_clean(device, second):
    assert nonfinite(_two_passes_a_step(Net(), device, second)) == []


class _TinyVAE(nn.Module):
    """The reparameterisation in the model's own forward: ``logvar.exp()`` overflows
    on a batch scaled far out of range, and the decoder turns the Inf into NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.mu = nn.Linear(32, 4)
        self.logvar = nn.Linear(32, 4)
        self.dec = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        std = torch.exp(0.5 * self.logvar(h))
        z = self.mu(h) + std * torch.randn_like(std)
        return torch.sigmoid(self.dec(z))


def test_a_functional_ops_overflow_is_told_with_the_tensor_that_op_made(quiet_watch):
    torch.manual_seed(0)
    model = _TinyVAE()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(4):
        x = torch.rand(8, 16) * (1e4 if step == 2 else 1.0)
        loss = nn.functional.mse_loss(model(x), x.clamp(0, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    first = monitor.alerts[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "")
    assert first.data["op"] == "aten::exp"
    # The exp's own output (8, 4), Inf, not the decoder's NaN (8, 16) it became.
    assert first.data["shape"] == [8, 4] and first.data["kind"] == "inf"


@pytest.mark.parametrize(("frozen", "through"), [(True, "param"), (True, "data"), (False, "param")])
def test_an_inf_written_into_a_weight_is_told_as_written_at_the_step_that_met_it(
    quiet_watch, through, frozen
):
    """A frozen weight (a LoRA model's base layer) is no optimizer's to update: one
    gone non-finite was written, as a trained weight written after its update is.
    (A trained weight written through ``.data`` moves no counter: it is taken for
    the update's doing, as documented.)"""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    if frozen:
        model[2].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(12):
        if step == 8:
            with torch.no_grad():
                target = model[2].weight.data if through == "data" else model[2].weight
                target[0, 0] = float("inf")
        x = torch.randn(16, 20)
        loss = nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    first = next(a for a in monitor.alerts if a.severity != "info")
    assert (first.rule, first.step, first.module) == ("nonfinite_parameter", 8, "2")
    assert first.data["cause"] == "written"
