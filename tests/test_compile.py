"""torch.compile: a compiled model is watched as the model it wraps, and trainwatch adds
no graph break, no recompile and no warning.

Three ways to compile, each beside the same loop unwatched or unbroken:
``torch.compile(model)`` after ``tw.watch(model)``, ``tw.watch`` of the compiled
wrapper, and ``model.compile()`` in place. Inside a compiled graph every hook of
trainwatch steps aside; what it sees is the gradients and the optimizer (all
three ways) and, around ``torch.compile(model)``'s wrapper, the model's own
inputs and outputs. docs/compile.md lists what follows from that.

``aot_eager`` runs dynamo and AOT autograd (a compiled backward, as in real
use) without inductor's code generation, which takes half a minute per graph
on a small CPU; one slow test runs inductor itself.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import trainwatch as tw
from tests.conftest import TinyNet, batches, rules_of, train

WRAPPED = ["watch_then_compile", "compile_then_watch"]
STYLES = [*WRAPPED, "compile_in_place"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no graph, guard or counter leaks between tests."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def watch_compiled(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    style: str,
    quiet_watch: Callable[..., tw.Monitor],
    *,
    backend: str = "aot_eager",
    fullgraph: bool = False,
    **config,
) -> tuple[nn.Module, tw.Monitor]:
    """(what the loop calls, the monitor) for one way of compiling and watching."""
    if style == "watch_then_compile":
        monitor = quiet_watch(model, optimizer, **config)
        return torch.compile(model, backend=backend, fullgraph=fullgraph), monitor
    if style == "compile_then_watch":
        compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
        return compiled, quiet_watch(compiled, optimizer, **config)
    assert style == "compile_in_place"
    monitor = quiet_watch(model, optimizer, **config)
    model.compile(backend=backend, fullgraph=fullgraph)
    return model, monitor


def fresh(cls=TinyNet, **kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = cls(**kwargs)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


# -- healthy training --------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_healthy_compiled_training_matches_the_unwatched_run_exactly(style, quiet_watch):
    """Same losses, same graphs, no graph break (fullgraph), no warning, no alert."""
    model, opt = fresh()
    plain = torch.compile(model, backend="aot_eager", fullgraph=True)
    if style == "compile_in_place":
        model.compile(backend="aot_eager", fullgraph=True)
        plain = model
    with warnings.catch_warnings(record=True) as plain_warnings:
        warnings.simplefilter("always")
        plain_losses = train(plain, opt, 6)
    plain_graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()

    model, opt = fresh()
    with warnings.catch_warnings(record=True) as watched_warnings:
        warnings.simplefilter("always")
        forward, monitor = watch_compiled(model, opt, style, quiet_watch, fullgraph=True)
        watched_losses = train(forward, opt, 6)

    assert watched_losses == plain_losses
    assert counters["stats"]["unique_graphs"] == plain_graphs == 1
    assert graph_breaks() == 0
    assert [str(w.message) for w in watched_warnings] == [str(w.message) for w in plain_warnings]
    assert rules_of(monitor) == []
    assert monitor.step_count == 6
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}  # no "_orig_mod." prefix


@pytest.mark.parametrize("style", STYLES)
def test_grad_norms_of_a_compiled_model_match_a_plain_norm_per_layer(style, quiet_watch):
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    expected = {}

    def reference(step: int) -> None:
        for name in ("fc1", "fc2", "head"):
            grads = [p.grad for p in getattr(model, name).parameters()]
            expected[name] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))

    train(forward, opt, 3, before_step=reference)
    assert monitor.grad_norms() == pytest.approx({k: float(v) for k, v in expected.items()})


def _our_filters() -> list:
    return [f for f in warnings.filters if "global hooks on modules" in str(f[1])]


def test_closing_leaves_no_global_hook_and_no_warning_filter_behind(quiet_watch):
    """Else torch.compile(module) would warn at every call after trainwatch is gone."""
    model, opt = fresh()
    first, second = quiet_watch(model, opt), quiet_watch(TinyNet())
    assert len(_our_filters()) == 1
    first.close()
    assert len(_our_filters()) == 1  # held while any monitor is open
    second.close()
    assert _our_filters() == []
    assert not torch.nn.modules.module._has_any_global_hook()


# -- planted bugs that need only gradients and the optimizer: every style ----------------


@pytest.mark.parametrize("style", STYLES)
def test_detached_layer_is_zero_gradient_on_a_compiled_model(style, quiet_watch):
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    model.detach_fc1 = True
    train(forward, opt, 5)
    (alert,) = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    # Hooks do not run inside compiled code, so "never called" is never claimed there.
    assert (alert.module, alert.step, alert.data["kind"]) == ("fc1", 0, "none")
    assert alert.severity == "warning"
    assert alert.data["parameters"] == ["fc1.weight", "fc1.bias"]


@pytest.mark.parametrize("style", STYLES)
def test_missing_zero_grad_is_accumulated_gradient_on_a_compiled_model(style, quiet_watch):
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    train(forward, opt, 6, zero_grad_until=3)
    (alert,) = [a for a in monitor.alerts if a.rule == "accumulated_gradient"]
    assert alert.step == 3
    assert alert.data["modules"] == ["fc1", "fc2", "head"]


@pytest.mark.parametrize("style", STYLES)
def test_frozen_layer_and_replaced_head_are_found_on_a_compiled_model(style, quiet_watch):
    model, opt = fresh()
    model.fc2.requires_grad_(False)
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    train(forward, opt, 2)
    model.head = nn.Linear(16, 1)  # after the optimizer was built: never updated
    train(forward, opt, 2)
    found = {(a.rule, a.module) for a in monitor.alerts}
    assert ("frozen_in_optimizer", "fc2") in found
    assert ("not_optimized", "head") in found


def _scaled_mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred, y) * 1e10


def _train_with(forward, opt, steps, loss_fn=nn.functional.mse_loss, monitor=None, plant=None):
    for step, (x, y) in enumerate(batches(steps)):
        if plant is not None:
            x, y = plant(step, x, y)
        opt.zero_grad()
        loss = loss_fn(forward(x), y)
        loss.backward()
        if monitor is not None:
            monitor.step(loss=loss)
        opt.step()


def nonfinite(monitor: tw.Monitor) -> list[tw.Alert]:
    return [a for a in monitor.alerts if a.rule.startswith("nonfinite")]


@pytest.mark.parametrize("style", STYLES)
def test_update_that_blows_weights_up_is_nonfinite_parameter(style, quiet_watch):
    model, opt = fresh()
    opt.param_groups[0]["lr"] = 1e30  # lr * gradient lands past float32's range
    forward, monitor = watch_compiled(
        model, opt, style, quiet_watch, nonfinite_parameter={"check_every": 1}
    )
    _train_with(forward, opt, 3, loss_fn=_scaled_mse)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step) == ("nonfinite_parameter", 0)
    assert first.module in {"fc1", "fc2", "head"}


@pytest.mark.parametrize("style", WRAPPED)
def test_blown_up_weights_are_found_by_the_next_forward_around_the_wrapper(style, quiet_watch):
    """No per-update check: the wrapper's output meets the weights, an eager replay names them."""
    model, opt = fresh()
    opt.param_groups[0]["lr"] = 1e30
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    _train_with(forward, opt, 3, loss_fn=_scaled_mse)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_parameter", 0, "fc1")
    assert len(nonfinite(monitor)) == 1  # the cascade that follows is not reported


def _nan_target_at(bad_step: int):
    def plant(step, x, y):
        if step == bad_step:
            y = y.clone()
            y[3] = float("nan")
        return x, y

    return plant


@pytest.mark.parametrize("style", WRAPPED)
def test_nan_target_is_nonfinite_loss_around_the_wrapper(style, quiet_watch):
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    _train_with(forward, opt, 3, plant=_nan_target_at(1))
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_loss", 1, None)


@pytest.mark.parametrize("style", WRAPPED)
def test_nan_loss_handed_over_is_nonfinite_loss_around_the_wrapper(style, quiet_watch):
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    _train_with(forward, opt, 3, plant=_nan_target_at(1), monitor=monitor)
    (first,) = nonfinite(monitor)
    assert (first.rule, first.step, first.module) == ("nonfinite_loss", 1, None)
    assert "model's output was finite" in first.message


def test_nan_loss_of_a_model_compiled_in_place_does_not_claim_where_it_came_from(quiet_watch):
    """The output ran inside the graph: it may or may not have been finite already."""
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, "compile_in_place", quiet_watch)
    _train_with(forward, opt, 3, plant=_nan_target_at(1), monitor=monitor)
    (first,) = nonfinite(monitor)
    assert (first.rule, first.step, first.module) == ("nonfinite_loss", 1, None)
    assert first.data["cause"] == "unlocated"
    assert "not known" in first.message and "output was finite" not in first.message


def test_nan_gradients_of_a_model_compiled_in_place_are_reported_unlocated(quiet_watch):
    model, opt = fresh()
    forward, monitor = watch_compiled(model, opt, "compile_in_place", quiet_watch)
    _train_with(forward, opt, 3, plant=_nan_target_at(1))  # no loss handed over
    (first,) = nonfinite(monitor)
    assert (first.rule, first.step, first.data["cause"]) == ("nonfinite_backward", 1, "unlocated")
    assert first.module in {"fc1", "fc2", "head"}
    assert "not located" in first.message


# -- the forward pass: seen around torch.compile(model)'s wrapper ------------------------


class Divide(nn.Module):
    """x / d; d is set to zero to plant a NaN born inside this module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("denominator", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.denominator


class DivideNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fault = Divide()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fault(torch.tanh(self.fc1(x))))


def _zero_denominator_at(model: DivideNet, bad_step: int):
    def plant(step, x, y):
        if step == bad_step:
            model.fault.denominator.zero_()  # x / 0: Inf
        return x, y

    return plant


@pytest.mark.parametrize("style", WRAPPED)
def test_nan_born_in_a_module_is_located_by_an_eager_replay(style, quiet_watch):
    model, opt = fresh(DivideNet)
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)
    _train_with(forward, opt, 4, plant=_zero_denominator_at(model, 2))
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "fault")
    assert first.data["op"] == "aten::div"
    assert first.data["source"].endswith("test_compile.py:" + str(_line("x / self.denominator")))


@pytest.mark.parametrize("style", WRAPPED)
def test_nan_judged_after_the_step_names_the_model_around_the_wrapper(style, quiet_watch):
    """The CUDA path (sums read back with the step, no replay), run on CPU: only the
    wrapper's sums exist, so the model itself is named, at the right step."""
    model, opt = fresh(DivideNet)
    forward, monitor = watch_compiled(
        model, opt, style, quiet_watch, nonfinite_forward={"check": "deferred"}
    )
    _train_with(forward, opt, 4, plant=_zero_denominator_at(model, 2))
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "")


class SqrtAtZero(nn.Module):
    """Finite forward (adds 0), infinite derivative of sqrt at 0 once ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x * 0.0) if self.armed else x


class SqrtNet(DivideNet):
    def __init__(self) -> None:
        super().__init__()
        self.fault = SqrtAtZero()


@pytest.mark.parametrize("style", WRAPPED)
def test_nan_born_in_the_compiled_backward_is_located_by_an_eager_replay(style, quiet_watch):
    model, opt = fresh(SqrtNet)
    forward, monitor = watch_compiled(model, opt, style, quiet_watch)

    def arm(step, x, y):
        model.fault.armed = step >= 2
        return x, y

    _train_with(forward, opt, 4, plant=arm)
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", 2, "fault")
    assert first.data["op"] == "aten::sqrt"


@pytest.mark.parametrize("style", WRAPPED)
def test_backward_nan_judged_after_the_step_names_the_first_bad_parameter(style, quiet_watch):
    """The CUDA path around the wrapper: no module gradients inside the graph; the
    weights it poisons are the cascade, not a second origin."""
    model, opt = fresh(SqrtNet)
    forward, monitor = watch_compiled(
        model, opt, style, quiet_watch, nonfinite_forward={"check": "deferred"}
    )

    def arm(step, x, y):
        model.fault.armed = step >= 2
        return x, y

    _train_with(forward, opt, 5, plant=arm)
    (only,) = nonfinite(monitor)
    assert (only.rule, only.step, only.data["cause"]) == ("nonfinite_backward", 2, "parameter")
    assert only.module in {"fc1", "head"}


def test_nan_in_a_model_compiled_in_place_is_reported_unlocated(quiet_watch):
    """No eager point around model.compile(): the gradient shows it, the origin stays open."""
    model, opt = fresh(DivideNet)
    forward, monitor = watch_compiled(model, opt, "compile_in_place", quiet_watch)
    _train_with(forward, opt, 4, plant=_zero_denominator_at(model, 2))
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step) == ("nonfinite_backward", 2)
    assert first.data["cause"] == "unlocated"
    assert "not located" in first.message and "torch.compile(model)" in first.hint


def test_healthy_divide_net_is_silent_in_every_style(quiet_watch):
    for style in STYLES:
        torch._dynamo.reset()
        model, opt = fresh(DivideNet)
        forward, monitor = watch_compiled(model, opt, style, quiet_watch)
        _train_with(forward, opt, 4)
        assert rules_of(monitor) == [], style


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.fc1(x))))


def _evaluate(forward, passes: int = 3) -> None:
    with torch.no_grad():
        for x, _ in batches(passes, seed=9):
            forward(x)


@pytest.mark.parametrize("style", WRAPPED)
def test_evaluation_in_training_mode_is_caught_around_the_wrapper(style, quiet_watch):
    model, opt = fresh(DropNet)
    forward, monitor = watch_compiled(model, opt, style, quiet_watch, backend="eager")
    train(forward, opt, 2)
    _evaluate(forward)  # model.eval() forgotten
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (2, "drop")
    assert monitor.alert_counts[("eval_in_train_mode", "drop")] == 3  # each pass once


def test_compiled_code_run_eagerly_is_one_pass_not_two(quiet_watch):
    """Forced eager (or a fallback to eager), the wrapper and the model both run as
    Python and both are seen: each evaluation pass still counts once."""
    model, opt = fresh(DropNet)
    forward, monitor = watch_compiled(
        model, opt, "watch_then_compile", quiet_watch, backend="eager"
    )
    with torch.compiler.set_stance("force_eager"):
        train(forward, opt, 2)
        _evaluate(forward)
    assert monitor.alert_counts[("eval_in_train_mode", "drop")] == 3  # three passes, each once


@pytest.mark.parametrize("style", WRAPPED)
def test_training_in_eval_mode_is_caught_around_the_wrapper(style, quiet_watch):
    model, opt = fresh(DropNet)
    forward, monitor = watch_compiled(model, opt, style, quiet_watch, backend="eager")
    model.eval()  # model.train() never called again
    train(forward, opt, 2)
    (alert,) = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert (alert.step, alert.module) == (0, "drop")


@pytest.mark.parametrize("style", WRAPPED)
def test_evaluation_done_right_is_silent_around_the_wrapper(style, quiet_watch):
    model, opt = fresh(DropNet)
    forward, monitor = watch_compiled(model, opt, style, quiet_watch, backend="eager")
    train(forward, opt, 2)
    model.eval()
    _evaluate(forward)
    model.train()
    train(forward, opt, 2)
    assert rules_of(monitor) == []


def _regress(forward, opt, steps: int, broadcast_bug: bool) -> None:
    for x, y in batches(steps):
        opt.zero_grad()
        target = y.squeeze(-1) if broadcast_bug else y
        ((forward(x) - target) ** 2).mean().backward()
        opt.step()


@pytest.mark.parametrize("style", WRAPPED)
def test_broadcast_in_the_loss_and_the_collapse_it_causes_are_caught(style, quiet_watch):
    model, opt = fresh()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward, monitor = watch_compiled(
        model, opt, style, quiet_watch, backend="eager", constant_output={"every": 1}
    )
    _regress(forward, opt, 40, broadcast_bug=True)
    found = {(a.rule, a.module) for a in monitor.alerts}
    assert ("broadcast", None) in found
    assert ("constant_output", "") in found  # the model's output, seen from the wrapper


@pytest.mark.parametrize("style", WRAPPED)
def test_regression_without_the_broadcast_is_silent(style, quiet_watch):
    model, opt = fresh()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward, monitor = watch_compiled(
        model, opt, style, quiet_watch, backend="eager", constant_output={"every": 1}
    )
    _regress(forward, opt, 40, broadcast_bug=False)
    assert rules_of(monitor) == []


# -- what a compiled graph hides: silent, never wrong --------------------------------------


def test_forward_checks_inside_a_model_compiled_in_place_stay_silent(quiet_watch):
    """model.compile() leaves no eager call to hook: mode, broadcast and activation checks
    see nothing, and say nothing, whatever the bugs."""
    model, opt = fresh(DropNet)
    forward, monitor = watch_compiled(
        model, opt, "compile_in_place", quiet_watch, backend="eager", constant_output={"every": 1}
    )
    _regress(forward, opt, 4, broadcast_bug=True)
    _evaluate(forward)
    assert rules_of(monitor) == []


class HiddenCollapse(nn.Module):
    """A hidden layer whose output is constant across the batch: seen only eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.relu(self.fc1(x) - 1e3))  # every unit dead


@pytest.mark.parametrize("style", STYLES)
def test_dead_hidden_units_inside_the_graph_are_not_seen(style, quiet_watch):
    model, opt = fresh(HiddenCollapse)
    forward, monitor = watch_compiled(
        model,
        opt,
        style,
        quiet_watch,
        backend="eager",
        dead_units={"every": 1},
        constant_output={"every": 1},
        zero_gradient=False,
    )
    train(forward, opt, 4)
    assert not [a for a in monitor.alerts if a.rule == "dead_units"]
    assert not [a for a in monitor.alerts if a.rule == "constant_output" and a.module != ""]


def test_dead_hidden_units_are_seen_eagerly(quiet_watch):
    """The control: the same model uncompiled."""
    model, opt = fresh(HiddenCollapse)
    monitor = quiet_watch(model, opt, dead_units={"every": 1}, zero_gradient=False)
    train(model, opt, 4)
    assert ("dead_units", "relu") in {(a.rule, a.module) for a in monitor.alerts}


# -- structure ---------------------------------------------------------------------------


def test_a_submodule_compiled_on_its_own_keeps_its_user_names(quiet_watch):
    model, opt = fresh()
    model.fc2 = torch.compile(model.fc2, backend="aot_eager")
    monitor = quiet_watch(model, opt)
    model.detach_fc1 = True
    train(model, opt, 4)
    (alert,) = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert alert.module == "fc1"
    assert set(monitor.grad_norms()) == {"fc2", "head"}


def test_a_nan_inside_a_compiled_submodule_is_located_in_it(quiet_watch):
    model, opt = fresh(DivideNet)
    model.fault = torch.compile(model.fault, backend="aot_eager")
    monitor = quiet_watch(model, opt)
    _train_with(model, opt, 4, plant=_zero_denominator_at(model, 2))
    first = nonfinite(monitor)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "fault")


def test_watching_the_model_and_its_wrapper_is_watching_twice(quiet_watch):
    model, opt = fresh()
    quiet_watch(model, opt)
    with pytest.raises(tw.WatchError, match="already watched"):
        tw.watch(torch.compile(model, backend="eager"), opt, console=False)


# -- trainwatch run ------------------------------------------------------------------------

SCRIPT = """
import sys
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.head = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))

torch.manual_seed(0)
net = Net()
model = net
if sys.argv[1] == "wrapper":
    model = torch.compile(net, backend="aot_eager")
else:
    net.compile(backend="aot_eager")
opt = torch.optim.SGD(net.parameters(), lr=0.05)
for step in range(6):
    x = torch.randn(32, 8)
    if step < 3:
        opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
    opt.step()
"""


def _run(tmp_path, how: str) -> tuple[int, list[dict]]:
    import json

    from trainwatch.runner import run_script

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code = run_script(script, [how], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return code, [json.loads(line) for line in lines]


def test_trainwatch_run_finds_a_compiled_model_by_its_wrapper(tmp_path):
    code, found = _run(tmp_path, "wrapper")
    assert code == 0
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 3)]
    assert found[0]["data"]["model"] == "Net"
    assert found[0]["data"]["modules"] == ["fc1", "head"]


def test_trainwatch_run_finds_a_model_compiled_in_place_by_its_parameters(tmp_path):
    """No eager call of the model to discover it by: after two steps of its optimizer
    the model is looked for by its parameters, and watched from the third step on."""
    code, found = _run(tmp_path, "in_place")
    assert code == 0
    assert [(a["rule"], a["step"]) for a in found] == [("accumulated_gradient", 3)]
    assert found[0]["data"]["model"] == "Net"


@pytest.mark.slow
def test_inductor_compiled_training_is_watched_with_no_graph_break(quiet_watch):
    """The default backend, once: healthy steps silent, a detached layer caught.

    Inductor warns about its own internals (deprecations): only warnings about
    hooks, or from trainwatch's own files, would be trainwatch's doing.
    """
    model, opt = fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor = quiet_watch(model, opt)
        forward = torch.compile(model, fullgraph=True)
        train(forward, opt, 4)
    package = os.path.dirname(tw.__file__)
    ours = [w for w in caught if w.filename.startswith(package) or "hook" in str(w.message)]
    assert ours == []
    assert rules_of(monitor) == [] and graph_breaks() == 0
    model.detach_fc1 = True
    train(forward, opt, 4)
    (alert,) = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert (alert.module, alert.step) == ("fc1", 4)


def _line(text: str) -> int:
    with open(__file__) as source:
        for number, line in enumerate(source, start=1):
            if text in line and "_line(" not in line:
                return number
    raise AssertionError(text)


RUN_SCRIPT = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))
model = torch.compile(model, backend="aot_eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(256, 32)
y = x[:, :4].argmax(1)
for step in range(40):
    loss = F.cross_entropy(model(x[:64]), y[:64])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
"""


def test_trainwatch_run_compiles_the_script_s_graphs_no_more_often_than_without_it(tmp_path):
    """Under run the global forward hooks that find models stay once a graph was
    traced with them (dynamo guards on the global hook tables): taking them off
    after two steps and back on for each no_grad block recompiled every time."""
    from trainwatch.runner import run_script

    script = tmp_path / "compiled.py"
    script.write_text(RUN_SCRIPT)
    exec(compile(RUN_SCRIPT, str(script), "exec"), {"__name__": "__main__"})
    plain = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    assert counters["stats"]["unique_graphs"] == plain == 2  # train and eval
    assert (tmp_path / "log" / "alerts.jsonl").read_text() == ""
