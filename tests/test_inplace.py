"""In-place modules and ops: trainwatch's hooks survive them and never change the numbers.

Full backward hooks break on in-place ops (PyTorch issue 61519); trainwatch
uses forward hooks and tensor hooks only. Every model here trains without
trainwatch first (in-place ops are easy to get wrong in the model itself);
watched with every rule on, in both NaN check paths, it raises nothing, its
losses and parameters are bit-identical to the unwatched run, and a NaN
planted in it is still named where it was born, also when the module that
makes it works in place.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import CHECK_MODES, device_of, every_check
from tests.output_types import Features, LMOutput
from trainwatch.collect.tensors import detached_copies

pytestmark = pytest.mark.usefixtures("warnings_are_errors")


class Fault(nn.Module):
    """x / d: d is 1 until a test sets it to 0 (Inf and 0/0 = NaN from there)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("denominator", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.denominator


class InplaceActivations(nn.Module):
    """ReLU, Dropout and LeakyReLU, all in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.act1 = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.2, inplace=True)
        self.act2 = nn.LeakyReLU(0.1, inplace=True)
        self.fault = Fault()
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.fc1(x))
        h = self.act2(self.drop(self.fc2(h)))
        return self.head(self.fault(h))


class StandardizeInPlace(nn.Module):
    """Standardises the batch it is given, in place (a preprocessing layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sub_(x.mean(0)).div_(x.std(0) + 1e-5)


class InplaceArithmetic(nn.Module):
    """``x += residual``, ``torch.relu_``, ``out += bias`` on a Linear's output after its hook."""

    def __init__(self) -> None:
        super().__init__()
        self.standardize = StandardizeInPlace()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fault = Fault()
        self.head = nn.Linear(32, 1)
        self.bias2 = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(self.standardize(x)))
        r = self.fc2(h)
        r += h  # in-place residual on a Linear's output (Linear keeps its input, not its output)
        r = torch.relu_(r)
        out = self.head(self.fault(r))
        out += self.bias2  # after the head's forward hook saw `out`
        return out


class ShiftedSqrtInPlace(nn.Module):
    """sqrt(x + shift), computed in place on its input; a negative shift makes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.shift).sqrt_()


class InplaceOrigin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.sqrt = ShiftedSqrtInPlace()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sqrt(self.fc2(torch.tanh(self.fc1(x)))))


MODELS = {
    "activations": InplaceActivations,
    "arithmetic": InplaceArithmetic,
    "inplace-origin": InplaceOrigin,
}


def train(make, steps, *, check=None, plant=None, on=None):
    """``steps`` Adam steps with dropout on; ``check`` None: without trainwatch.

    ``on``: the device (default: the one ``check`` runs on).

    Returns the losses, the parameters after training, the RNG state, and
    the monitor's alerts (None without trainwatch).
    """
    device = on if on is not None else device_of(check or "auto")
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if check is not None:
        monitor = tw.watch(model, opt, console=io.StringIO(), **every_check(check))
    losses = []
    for step in range(steps):
        if plant is not None:
            plant(step, model)
        x = torch.randn(16, 8).to(device)
        y = x[:, :1].sin()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    rng = torch.get_rng_state()
    if device.type == "cuda":
        rng = torch.cat([rng, torch.cuda.get_rng_state(device)])
    alerts = None
    if monitor is not None:
        monitor.close()
        alerts = monitor.alerts
    return losses, [p.detach().clone() for p in model.parameters()], rng, alerts


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaNs included."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_bit_identical(plain, watched) -> None:
    assert [struct_bits(v) for v in plain[0]] == [struct_bits(v) for v in watched[0]]
    assert all(same_bits(a, b) for a, b in zip(plain[1], watched[1]))
    assert torch.equal(plain[2], watched[2])


def struct_bits(value: float) -> str:
    return "nan" if math.isnan(value) else value.hex()


def arm_fault(at: int):
    def plant(step: int, model: nn.Module) -> None:
        if step == at:
            model.fault.denominator.zero_()

    return plant


# -- (a) + (b): nothing raised, nothing changed --------------------------------------


@pytest.mark.parametrize("check", CHECK_MODES)
@pytest.mark.parametrize("name", list(MODELS))
def test_in_place_models_train_silently_and_bit_identically(name, check):
    plain = train(MODELS[name], 8, on=device_of(check))
    assert all(math.isfinite(v) for v in plain[0])  # a valid model without trainwatch
    watched = train(MODELS[name], 8, check=check)
    assert watched[3] == []
    assert_bit_identical(plain, watched)


@pytest.mark.parametrize("check", CHECK_MODES)
def test_a_replay_through_a_layer_that_changes_the_batch_in_place_changes_nothing(check):
    # A NaN at step 2 makes trainwatch re-run the pass (on the CPU path) to
    # locate it; the first layer standardises the batch in place, so a re-run
    # on the user's own batch would change it twice and break their backward.
    plain = train(InplaceArithmetic, 5, plant=arm_fault(2), on=device_of(check))
    watched = train(InplaceArithmetic, 5, check=check, plant=arm_fault(2))
    assert_bit_identical(plain, watched)
    first = watched[3][0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "fault")


# -- (c): planted NaN still located -----------------------------------------------


@pytest.mark.parametrize("check", CHECK_MODES)
@pytest.mark.parametrize("name", ["activations", "arithmetic"])
def test_nan_in_a_model_full_of_in_place_ops_is_named_at_its_module(name, check):
    *_, alerts = train(MODELS[name], 5, check=check, plant=arm_fault(3))
    first = alerts[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 3, "fault")
    if check != "deferred":
        assert first.data["op"] == "aten::div"
    assert {a.module for a in alerts if a.rule == "nonfinite_forward"} == {"fault"}
    assert not [a for a in alerts if a.rule == "internal_error"]


@pytest.mark.parametrize("check", CHECK_MODES)
def test_nan_made_by_a_module_working_in_place_on_its_input_is_named_there(check):
    def plant(step: int, model: nn.Module) -> None:
        if step == 3:
            model.sqrt.shift.fill_(-10.0)  # sqrt of negatives from here on

    *_, alerts = train(InplaceOrigin, 5, check=check, plant=plant)
    first = alerts[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 3, "sqrt")
    assert first.data["cause"] == "module"  # its input was finite before it changed it
    if check != "deferred":
        assert first.data["op"] == "aten::sqrt_"
    assert not [a for a in alerts if a.rule == "internal_error"]


def test_dead_units_behind_an_in_place_relu_are_named():
    def kill(step: int, model: nn.Module) -> None:
        if step == 4:
            with torch.no_grad():
                model.fc1.bias.fill_(-100.0)  # what one huge update does

    *_, alerts = train(InplaceActivations, 8, check="auto", plant=kill)
    dead = [a for a in alerts if a.rule == "dead_units"]
    assert [(a.module, a.step) for a in dead] == [("act1", 4)]


def test_clean_control_for_dead_units_behind_an_in_place_relu():
    *_, alerts = train(InplaceActivations, 8, check="auto")
    assert alerts == []


# -- which hooks -----------------------------------------------------------------


def test_trainwatch_registers_no_backward_hooks_on_modules():
    """Full (and old-style) module backward hooks break on in-place ops: none anywhere."""
    package = Path(tw.__file__).parent
    banned = ("register_full_backward", "register_backward_hook", "register_module_backward")
    banned += ("register_module_full_backward",)
    offenders = [
        f"{path.relative_to(package)}: {word}"
        for path in package.rglob("*.py")
        for word in banned
        if word in path.read_text()
    ]
    assert offenders == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_a_parameter_handed_to_a_module_collects_no_hooks(check):
    class LearnedQueries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.queries = nn.Parameter(torch.randn(4, 8))
            self.proj = nn.Linear(8, 8)  # called on the parameter itself

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.proj(self.queries).t()

    torch.manual_seed(0)
    device = device_of(check)
    model = LearnedQueries().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counts = []
    with tw.watch(model, opt, console=io.StringIO(), **every_check(check)) as monitor:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(16, 8, device=device)).pow(2).mean().backward()
            opt.step()
            counts.append(len(model.queries._backward_hooks or {}))
    assert len(set(counts)) == 1  # the same few hooks all along, not one more per step
    assert not model.queries._backward_hooks
    assert monitor.alerts == []


def test_a_re_run_gets_copies_that_keep_their_aliasing_and_spare_the_originals():
    x = torch.ones(3)
    args = (x, [x], {"x": x}, Features(x), LMOutput(logits=x))
    copied = detached_copies(args)
    leaves = [copied[0], copied[1][0], copied[2]["x"], copied[3].hidden, copied[4]["logits"]]
    assert all(leaf is leaves[0] for leaf in leaves)  # one copy, shared as x was
    assert copied[4].logits is leaves[0] and type(copied[4]) is LMOutput
    leaves[0].add_(1.0)
    assert torch.equal(x, torch.ones(3)) and x._version == 0
