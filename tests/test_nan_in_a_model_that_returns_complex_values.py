"""A NaN/Inf in a model whose output is complex is told at the step and module it is born.

Complex-valued networks hand out complex tensors: a complex MLP whose last
layer keeps the phase (``z / |z|``) or takes a square root, an FNO layer's
spectrum (``rfft2``), a model returning a real head beside a complex one; the
loss is the squared magnitude of the error, ``(out - target).abs().pow(2)``.
The pass's trigger read only real floating outputs, and the gradient entering
the model only where it was real: such a NaN was caught later, by the
parameters' gradients, and told as a gradient no module was found to make,
in the first layer (``nonfinite_backward``, ``cause: parameter``). Now a
complex output counts in the trigger (non-finite where either part is), and
so does the complex gradient entering it: the module and op that made a
forward NaN are named, a complex NaN target is the loss's (its gradient told
as the complex tensor it is), a complex ``sqrt`` at 0 is named in backward.

Each beside its clean control, which stays silent (and raises no warning of
a complex value cast to real), on the spot, at the step boundary and with
every module's sums (``check: deferred``); under Lightning and ``trainwatch
run`` too; training goes on bit for bit as without trainwatch.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

BAD, STEPS = 2, 4
CHECKS = ("auto", "step", "deferred")
ON_THE_SPOT = ("auto", "step")  # where an op is traced


# -- models, written as people write them ---------------------------------------


class ComplexLinear(nn.Module):
    """complexPyTorch-style: real Linears on the real and imaginary parts."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc_r = nn.Linear(n, n)
        self.fc_i = nn.Linear(n, n)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.complex(
            self.fc_r(z.real) - self.fc_i(z.imag), self.fc_r(z.imag) + self.fc_i(z.real)
        )


class Gate(nn.Module):
    """Lets a pruned feature through as exactly zero."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("keep", torch.ones(n))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.keep


class Phase(nn.Module):
    """Keeps the phase, z / |z|: a NaN where z is 0."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z / z.abs()


class ComplexSqrt(nn.Module):
    """Finite at 0, its derivative there is not."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(z)


class ComplexNet(nn.Module):
    """Complex in, complex out."""

    def __init__(self, act: nn.Module, n: int = 8) -> None:
        super().__init__()
        self.fc1 = ComplexLinear(n)
        self.fc2 = ComplexLinear(n)
        self.gate = Gate(n)
        self.act = act

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.act(self.gate(self.fc2(self.fc1(z))))


class Spectrum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft2(x)


class SpectralNet(nn.Module):
    """An FNO's lifting layer, handing out the spectrum its Fourier layer works on."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Conv2d(1, 4, 1)
        self.spectrum = Spectrum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spectrum(self.lift(x))


class TwoHeads(nn.Module):
    """A real head beside a complex one."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.fc = ComplexLinear(n)
        self.gate = Gate(n)
        self.act = Phase()
        self.head = nn.Linear(n, 1)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(z.real), self.act(self.gate(self.fc(z)))


def _error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).abs().pow(2).mean()


def _two_heads_error(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor):
    return out[0].pow(2).mean() + _error(out[1], target)


def _complex_batch(step: int, bug: str) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.randn(4, 8, dtype=torch.cfloat)
    target = torch.randn(4, 8, dtype=torch.cfloat)
    if step == BAD and bug == "nan_target":
        target[1, 2] = complex(math.nan, 0.0)  # a corrupt sample
    return z, target


def _spectral_batch(step: int, bug: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.rand(2, 1, 8, 8)
    if step == BAD and bug == "overflow":
        x = x * 1e38  # a batch read in the wrong units: finite, past the FFT's range
    return x, torch.randn(2, 4, 8, 5, dtype=torch.cfloat)


def train(
    model: nn.Module,
    bug: str = "none",
    check: str | None = "auto",
    batch: Callable[[int, str], tuple[torch.Tensor, torch.Tensor]] = _complex_batch,
    loss_fn: Callable[..., torch.Tensor] = _error,
) -> tuple[list[tw.Alert], list[str]]:
    """SGD on the loss; ``bug == "zero"`` prunes a feature at BAD (a zero into the
    last layer). Returns the alerts (None ``check``: unwatched) and the warnings."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    monitor = None
    if check is not None:
        config = {"nonfinite_forward": {"check": check}}
        monitor = tw.watch(model, opt, console=False, config=config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, target = batch(step, bug)
            gate = getattr(model, "gate", None)
            if gate is not None:
                gate.keep.fill_(1.0)
                if step == BAD and bug == "zero":
                    gate.keep[0] = 0.0
            opt.zero_grad()
            loss = loss_fn(model(x), target)
            loss.backward()
            opt.step()
        if monitor is not None:
            monitor.close()
    return ([] if monitor is None else list(monitor.alerts)), [str(w.message) for w in caught]


def told(alerts: list[tw.Alert]) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts]


MODELS = {
    "phase": (lambda: ComplexNet(Phase()), _complex_batch, _error),
    "sqrt": (lambda: ComplexNet(ComplexSqrt()), _complex_batch, _error),
    "spectrum": (SpectralNet, _spectral_batch, _error),
    "two heads": (TwoHeads, _complex_batch, _two_heads_error),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("kind", MODELS)
def test_healthy_complex_models_say_nothing(kind, check):
    make, batch, loss_fn = MODELS[kind]
    torch.manual_seed(0)
    alerts, caught = train(make(), check=check, batch=batch, loss_fn=loss_fn)
    assert alerts == []
    assert not [w for w in caught if "imaginary part" in w]


@pytest.mark.parametrize("check", CHECKS)
def test_a_nan_made_by_the_module_handing_out_the_complex_output_is_named_there(check):
    torch.manual_seed(0)
    alerts, _ = train(ComplexNet(Phase()), "zero", check)
    assert told(alerts) == [("nonfinite_forward", BAD, "act")]
    assert alerts[0].data["dtype"] == "torch.complex64"
    if check in ON_THE_SPOT:
        assert alerts[0].data["op"] == "aten::div"
        assert "from finite inputs in [" in alerts[0].message


@pytest.mark.parametrize("check", ON_THE_SPOT)
def test_a_spectrum_that_overflows_is_named_at_the_fft(check):
    torch.manual_seed(0)
    alerts, _ = train(SpectralNet(), "overflow", check, _spectral_batch)
    assert told(alerts) == [("nonfinite_forward", BAD, "spectrum")]
    assert alerts[0].data["op"] == "aten::_fft_r2c"


@pytest.mark.parametrize("check", CHECKS)
def test_a_complex_nan_target_is_the_loss_with_its_complex_gradient(check):
    torch.manual_seed(0)
    alerts, _ = train(ComplexNet(Phase()), "nan_target", check)
    assert told(alerts) == [("nonfinite_loss", BAD, None)]
    assert alerts[0].data["cause"] == "loss"
    if check in ON_THE_SPOT:
        data = alerts[0].data
        assert data["kind"] == "nan"
        assert (data["entering_dtype"], data["entering_shape"]) == ("torch.complex64", [4, 8])
        assert data["entering_count"] == 1  # one complex value, NaN in its real part


@pytest.mark.parametrize("check", ON_THE_SPOT)
def test_a_complex_nan_target_beside_a_real_head_is_the_loss(check):
    torch.manual_seed(0)
    alerts, _ = train(TwoHeads(), "nan_target", check, loss_fn=_two_heads_error)
    assert told(alerts) == [("nonfinite_loss", BAD, None)]


@pytest.mark.parametrize("check", ON_THE_SPOT)
def test_a_complex_sqrt_at_zero_in_the_last_module_is_named_in_backward(check):
    torch.manual_seed(0)
    alerts, _ = train(ComplexNet(ComplexSqrt()), "zero", check)
    assert told(alerts) == [("nonfinite_backward", BAD, "act")]
    assert alerts[0].data["op"] == "aten::sqrt"


@pytest.mark.parametrize("bug", ["none", "zero", "nan_target"])
def test_training_is_bit_identical_with_and_without_trainwatch(bug):
    states = []
    for check in (None, "auto"):
        torch.manual_seed(0)
        model = ComplexNet(Phase())
        train(model, bug, check)
        states.append(model.state_dict())
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=0, atol=0, equal_nan=True)


# -- Lightning ---------------------------------------------------------------------------


@pytest.mark.parametrize("bug", ["none", "nan_target"])
def test_lightning_a_complex_nan_target_is_the_loss(tmp_path, bug):
    L = pytest.importorskip("lightning")
    from trainwatch.lightning import TrainWatchCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = ComplexNet(Phase())

        def forward(self, z):
            return self.net(z)

        def training_step(self, batch, index):
            z, target = batch
            if bug == "nan_target" and self.global_step == BAD:
                target = target.clone()
                target[1, 2] = complex(math.nan, 0.0)
            return _error(self(z), target)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    torch.manual_seed(0)
    z = torch.randn(4 * STEPS, 8, dtype=torch.cfloat)
    data = torch.utils.data.TensorDataset(z, torch.randn(4 * STEPS, 8, dtype=torch.cfloat))
    callback = TrainWatchCallback(log_dir=str(tmp_path), console=False)
    trainer = L.Trainer(
        max_epochs=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    found = [a for a in callback.monitor.alerts if a.severity != "info"]
    assert told(found) == ([] if bug == "none" else [("nonfinite_loss", BAD, None)])


# -- trainwatch run: the unmodified script -----------------------------------------------

SCRIPT = """
import sys

import torch
from torch import nn

BUG = sys.argv[1]


class ComplexLinear(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc_r = nn.Linear(n, n)
        self.fc_i = nn.Linear(n, n)

    def forward(self, z):
        return torch.complex(
            self.fc_r(z.real) - self.fc_i(z.imag), self.fc_r(z.imag) + self.fc_i(z.real)
        )


class Phase(nn.Module):
    def forward(self, z):
        return z / z.abs()


class ComplexNet(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.fc1 = ComplexLinear(n)
        self.fc2 = ComplexLinear(n)
        self.act = Phase()

    def forward(self, z):
        return self.act(self.fc2(self.fc1(z)))


torch.manual_seed(0)
model = ComplexNet()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(4):
    z = torch.randn(4, 8, dtype=torch.cfloat)
    target = torch.randn(4, 8, dtype=torch.cfloat)
    if BUG == "nan_target" and step == 2:
        target[1, 2] = complex(float("nan"), 0.0)
    opt.zero_grad()
    loss = (model(z) - target).abs().pow(2).mean()
    loss.backward()
    opt.step()
print("loss", loss.item())
"""


@pytest.fixture
def _forget_script_module():
    yield
    sys.modules.pop("complex_net", None)


@pytest.mark.usefixtures("_forget_script_module")
@pytest.mark.parametrize("bug", ["none", "nan_target"])
def test_trainwatch_run_tells_the_same_of_the_unmodified_script(tmp_path: Path, bug):
    script = tmp_path / "complex_net.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log_dir = tmp_path / "log"
    assert run_script(script, [bug], log_dir=log_dir, console=False) == 0
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    assert found == ([] if bug == "none" else [("nonfinite_loss", BAD, None)])
