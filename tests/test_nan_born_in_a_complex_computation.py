"""A NaN/Inf born inside a complex-valued computation is named where it was born.

FFT token mixing (FNet's ``fft2(x).real``), a spectral convolution (FNO's
``rfft2`` -> complex weights -> ``irfft2``), complex layers handing complex
tensors to one another, a complex linear layer kept as real storage
(``view_as_complex`` / ``view_as_real``), and an STFT front end. A complex
value is non-finite when either part is: the FFT whose spectrum overflowed,
or the complex op that made the NaN, is the origin, never the ``.real``,
``view_as_real`` or ``.abs()`` that later handed it to a real tensor, and a
complex NaN given to the model is told as coming from the data, never as
"finite". Beside each, a clean control; a NaN born in a real op after the
complex part is still blamed on that op.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.collect.grads import gradient_norms
from trainwatch.collect.op_trace import trace_first_nonfinite_op
from trainwatch.runner import run_script

L = pytest.importorskip("lightning")
from trainwatch.lightning import TrainWatchCallback  # noqa: E402

BAD_STEP = 2
REAL_VIEWS = ("aten::view_as_real", "aten::real", "aten::abs", "aten::_fft_c2r", "aten::complex")


# -- models, written as people write them ---------------------------------------


class FourierMixing(nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT over (tokens, hidden)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft2(x).real


class FNet(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.mixing = FourierMixing()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x + self.mixing(x))
        return self.head(x + self.ff(x)).mean(1)


class SpectralConv2d(nn.Module):
    """FNO's Fourier layer: complex weights on the lowest modes."""

    def __init__(self, width: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weights = nn.Parameter(
            torch.rand(width, width, modes, modes, dtype=torch.cfloat) / width**2
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, c, h, w // 2 + 1, dtype=torch.cfloat)
        out_ft[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], self.weights)
        return torch.fft.irfft2(out_ft, s=(h, w))


class FNO(nn.Module):
    def __init__(self, width: int = 4, modes: int = 3) -> None:
        super().__init__()
        self.lift = nn.Conv2d(1, width, 1)
        self.spectral = SpectralConv2d(width, modes)
        self.skip = nn.Conv2d(width, width, 1)
        self.proj = nn.Conv2d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        return self.proj(nn.functional.gelu(self.spectral(h) + self.skip(h)))


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


class Phase(nn.Module):
    """Keeps the phase, z / |z|: a NaN where z is 0."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z / z.abs()


class ComplexSqrt(nn.Module):
    """Finite at 0, but its derivative there is not."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(z)


class Gate(nn.Module):
    """Lets ``dead`` features through as exactly zero (a pruned channel)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("keep", torch.ones(n))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z * self.keep


class Magnitude(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.abs()


class ComplexMLP(nn.Module):
    """Complex tensors flow from one module to the next; the head reads magnitudes."""

    def __init__(self, act: nn.Module, n: int = 8) -> None:
        super().__init__()
        self.fc1 = ComplexLinear(n)
        self.gate = Gate(n)
        self.act = act
        self.fc2 = ComplexLinear(n)
        self.mag = Magnitude()
        self.head = nn.Linear(n, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.head(self.mag(self.fc2(self.act(self.gate(self.fc1(z))))))


class StoredComplexLinear(nn.Module):
    """A complex linear layer kept as real (..., 2) storage for the optimizer."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n, 2) / math.sqrt(2 * n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(x.contiguous())
        return torch.view_as_real(z @ torch.view_as_complex(self.weight).t())


class StoredComplexNet(nn.Module):
    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.cl = StoredComplexLinear(n)
        self.head = nn.Linear(2 * n, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cl(x).flatten(-2))


class LogSpectrogram(nn.Module):
    def __init__(self, n_fft: int = 32, eps: float = 1e-6) -> None:
        super().__init__()
        self.n_fft, self.eps = n_fft, eps
        self.register_buffer("window", torch.hann_window(n_fft))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wav, self.n_fft, hop_length=8, window=self.window, return_complex=True)
        return torch.log(spec.abs() + self.eps)


class AudioNet(nn.Module):
    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.front = LogSpectrogram(eps=eps)
        self.fc = nn.Linear(17, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.front(wav).transpose(1, 2)))).mean(1)


# -- a plain loop ---------------------------------------------------------------


def _train(
    model: nn.Module, batch, steps: int = 4, watched: bool = True, check: str = "auto"
) -> list:
    """SGD on the mean square of the output; ``batch(step)`` gives each step's input."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    config = {"nonfinite_forward": {"check": check}}
    with tw.watch(model, opt, console=False, config=config) if watched else _unwatched() as monitor:
        for step in range(steps):
            opt.zero_grad()
            model(batch(step)).pow(2).mean().backward()
            opt.step()
    return [] if monitor is None else [a for a in monitor.alerts if a.rule.startswith("nonfin")]


class _unwatched:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _first(alerts: list):
    assert alerts, "nothing told"
    return alerts[0]


def _born_in_complex(alert, module: str, op_prefix: str) -> None:
    assert (alert.rule, alert.step, alert.module) == ("nonfinite_forward", BAD_STEP, module)
    assert alert.data["op"].startswith(op_prefix), alert.message
    assert alert.data["op"] not in REAL_VIEWS
    assert alert.data["op_basis"] == "re-run"


def _scaled(shape: tuple[int, ...], scale: float, positive: bool = False):
    """Unnormalised data: at BAD_STEP a batch read in the wrong units (finite, huge)."""

    def batch(step: int) -> torch.Tensor:
        x = torch.rand(*shape) if positive else torch.randn(*shape)
        return x * scale if step == BAD_STEP else x

    return batch


# -- FFT token mixing (FNet) --------------------------------------------------------


def test_an_fft_that_overflows_is_named_not_the_real_part_taken_after():
    torch.manual_seed(0)
    first = _first(_train(FNet(), _scaled((4, 6, 16), 3e37, positive=True)))
    _born_in_complex(first, "mixing", "aten::_fft_")
    assert "complex64" in first.message
    assert "from finite inputs in [" in first.message
    assert "FFT" in first.hint


def test_fnet_on_ordinary_data_stays_silent():
    torch.manual_seed(0)
    assert _train(FNet(), _scaled((4, 6, 16), 1.0, positive=True)) == []


# -- spectral convolution (FNO) -------------------------------------------------------


def test_an_overflowing_spectrum_in_a_spectral_conv_is_named_there():
    torch.manual_seed(0)
    first = _first(_train(FNO(), _scaled((2, 1, 8, 8), 1e38, positive=True)))
    _born_in_complex(first, "spectral", "aten::_fft_r2c")


def test_a_nan_complex_weight_is_no_op_making_it_from_finite_inputs():
    """The op reading a NaN complex weight was handed a NaN: no op made one."""
    torch.manual_seed(0)
    layer = SpectralConv2d(4, 3)
    x = torch.randn(2, 4, 8, 8)
    assert trace_first_nonfinite_op(layer, (x,), {}) is None  # healthy: nothing made
    with torch.no_grad():
        layer.weights[0, 0, 0, 0] = complex(math.nan, 0.0)
    assert trace_first_nonfinite_op(layer, (x,), {}) is None


def test_a_complex_nan_handed_to_view_as_real_is_not_made_there():
    class Doubles(nn.Module):
        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return torch.view_as_real(z * 2)

    z = torch.randn(3, 4, dtype=torch.cfloat)
    assert trace_first_nonfinite_op(Doubles(), (z,), {}) is None
    z[0, 0] = complex(1.0, math.inf)  # only the imaginary part
    assert trace_first_nonfinite_op(Doubles(), (z,), {}) is None


# -- complex layers handing complex tensors on -----------------------------------------


def _dead_feature_at_bad_step(model: ComplexMLP):
    def batch(step: int) -> torch.Tensor:
        model.gate.keep.fill_(1.0)
        if step == BAD_STEP:
            model.gate.keep[0] = 0.0
        return torch.randn(4, 8, dtype=torch.cfloat)

    return batch


def test_a_complex_nan_is_told_in_the_module_that_made_it_not_the_one_reading_it():
    torch.manual_seed(0)
    model = ComplexMLP(Phase())
    first = _first(_train(model, _dead_feature_at_bad_step(model)))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "act")
    assert first.data["op"] == "aten::div"
    assert first.data["dtype"] == "torch.complex64"
    assert "from finite inputs in [" in first.message


def test_a_complex_nan_is_told_in_the_module_that_made_it_with_no_sync():
    """``check: deferred`` sums every module's complex outputs too (no op traced)."""
    torch.manual_seed(0)
    model = ComplexMLP(Phase())
    first = _first(_train(model, _dead_feature_at_bad_step(model), check="deferred"))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "act")


@pytest.mark.parametrize("check", ["auto", "deferred"])
def test_complex_layers_without_a_zero_stay_silent(check):
    torch.manual_seed(0)
    model = ComplexMLP(Phase())
    assert _train(model, lambda step: torch.randn(4, 8, dtype=torch.cfloat), check=check) == []


def test_a_complex_nan_in_the_data_is_told_as_the_input():
    def batch(step: int) -> torch.Tensor:
        z = torch.randn(4, 8, dtype=torch.cfloat)
        if step == BAD_STEP:
            z[1, 3] = complex(0.5, math.nan)  # a corrupt sample, imaginary part only
        return z

    torch.manual_seed(0)
    first = _first(_train(ComplexMLP(nn.Identity()), batch))
    assert (first.rule, first.step, first.data["cause"]) == ("nonfinite_forward", 2, "input")
    assert "already non-finite before any module computed on it" in first.message
    assert "finite inputs" not in first.message
    assert "op" not in first.data


def test_a_complex_derivative_at_zero_is_named_in_backward():
    torch.manual_seed(0)
    model = ComplexMLP(ComplexSqrt())
    first = _first(_train(model, _dead_feature_at_bad_step(model)))
    assert (first.rule, first.step, first.module) == ("nonfinite_backward", BAD_STEP, "act")
    assert first.data["op"] == "aten::sqrt"
    assert first.data["source"].endswith(f"{__file__.rsplit('/', 1)[-1]}:{_SQRT_LINE}")


_SQRT_LINE = ComplexSqrt.forward.__code__.co_firstlineno + 1


def test_a_complex_sqrt_away_from_zero_stays_silent():
    torch.manual_seed(0)
    model = ComplexMLP(ComplexSqrt())
    assert _train(model, lambda step: torch.randn(4, 8, dtype=torch.cfloat)) == []


# -- a complex linear layer kept as real storage ---------------------------------------


def test_a_complex_matmul_that_overflows_is_named_not_view_as_real():
    torch.manual_seed(0)
    first = _first(_train(StoredComplexNet(32), _scaled((4, 32, 2), 3e38, positive=True)))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "cl")
    assert first.data["op"] == "aten::mm"
    assert first.data["dtype"] == "torch.complex64"
    assert "complex64's range (about 3.4e38)" in first.hint


def test_a_complex_linear_layer_on_ordinary_data_stays_silent():
    torch.manual_seed(0)
    assert _train(StoredComplexNet(), _scaled((4, 8, 2), 1.0)) == []


# -- an STFT front end -------------------------------------------------------------------


def test_an_stft_that_overflows_is_named_not_the_magnitude():
    torch.manual_seed(0)
    first = _first(_train(AudioNet(), _scaled((2, 128), 1e38, positive=True)))
    _born_in_complex(first, "front", "aten::_fft_r2c")


def test_a_log_of_a_silent_clip_after_the_stft_is_still_the_log():
    """A real op after the complex part: log of a zero magnitude, no epsilon."""

    def batch(step: int) -> torch.Tensor:
        wav = torch.randn(2, 128)
        if step == BAD_STEP:
            wav[1] = 0.0  # a silent clip
        return wav

    torch.manual_seed(0)
    first = _first(_train(AudioNet(eps=0.0), batch))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "front")
    assert first.data["op"] == "aten::log"


def test_a_magnitude_that_overflows_is_still_the_magnitude():
    """|z| past fp32's range from finite parts: ``abs`` made the Inf itself."""

    class ModReLU(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.b = nn.Parameter(torch.zeros(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = torch.view_as_complex(x.contiguous())
            mag = z.abs()
            return torch.view_as_real(z * (torch.relu(mag + self.b) / mag))

    model = nn.Sequential(ModReLU(8), nn.Flatten(-2), nn.Linear(16, 1))
    torch.manual_seed(0)
    first = _first(_train(model, lambda step: torch.full((4, 8, 2), 3e38 if step == 2 else 1.0)))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "0")
    assert first.data["op"] == "aten::abs"


def test_a_nan_in_the_audio_is_told_as_the_input():
    def batch(step: int) -> torch.Tensor:
        wav = torch.randn(2, 128)
        if step == BAD_STEP:
            wav[0, 40] = math.nan
        return wav

    torch.manual_seed(0)
    first = _first(_train(AudioNet(), batch))
    assert (first.step, first.data["cause"]) == (BAD_STEP, "input")
    assert "finite inputs" not in first.message


# -- healthy complex models: silent, and trained exactly as without trainwatch -----------


@pytest.mark.parametrize(
    ("make", "batch"),
    [
        (FNet, _scaled((4, 6, 16), 1.0, positive=True)),
        (FNO, _scaled((2, 1, 8, 8), 1.0)),
        (lambda: ComplexMLP(ComplexSqrt()), lambda step: torch.randn(4, 8, dtype=torch.cfloat)),
        (StoredComplexNet, _scaled((4, 8, 2), 1.0)),
        (AudioNet, _scaled((2, 128), 1.0)),
    ],
    ids=["fnet", "fno", "complex_mlp", "stored_complex", "stft"],
)
def test_healthy_complex_models_train_bit_identically_and_silently(make, batch):
    trained = []
    for watched in (False, True):
        torch.manual_seed(0)
        model = make()
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no complex value cast to real
            assert _train(model, batch, steps=6, watched=watched) == []
        trained.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_the_gradient_norm_of_a_complex_weight_sees_its_imaginary_part():
    z = torch.zeros(3, dtype=torch.cfloat)
    z[1] = complex(0.0, math.inf)
    norms = gradient_norms([torch.ones(4), z, torch.full((2,), 3 + 4j)])
    assert norms[0] == 2.0 and math.isinf(norms[1]) and norms[2] == pytest.approx(50**0.5)


# -- Lightning, and `trainwatch run` on an unmodified script ----------------------------


class FNetModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FNet()

    def training_step(self, batch, i):
        (x,) = batch
        return self.model(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("bug", [True, False])
def test_fnet_overflow_under_lightning(tmp_path, bug):
    L.seed_everything(0, verbose=False)
    frames = torch.rand(16, 6, 16)
    if bug:
        frames[8:12] *= 3e37  # the third batch of four, read in the wrong units
    callback = TrainWatchCallback(log_dir=str(tmp_path), console=False)
    trainer = L.Trainer(
        max_steps=4,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=str(tmp_path),
    )
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(frames), batch_size=4)
    trainer.fit(FNetModule(), loader)
    alerts = [a for a in callback.alerts if a.rule.startswith("nonfinite")]
    if not bug:
        assert alerts == []
        return
    _born_in_complex(alerts[0], "model.mixing", "aten::_fft_")


_SCRIPT = """
    import json, sys
    import torch
    from torch import nn


    class FourierMixing(nn.Module):
        def forward(self, x):
            return torch.fft.fft2(x).real


    class FNet(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.mixing = FourierMixing()
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, 3)

        def forward(self, x):
            return self.head(self.norm(x + self.mixing(x)).mean(1))


    torch.manual_seed(0)
    model = FNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(4):
        x = torch.rand(8, 10, 16)
        if step == 2 and "bug" in sys.argv:
            x = x * 3e37
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 3, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print("trained")
"""


@pytest.mark.parametrize("bug", [True, False])
def test_fnet_overflow_under_trainwatch_run(tmp_path, capsys, bug):
    script = tmp_path / "fnet_train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    log = tmp_path / "log"
    code = run_script(script, ["bug"] if bug else [], log_dir=log, console=False)
    assert code == 0
    assert "trained" in capsys.readouterr().out
    path = log / "alerts.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    found = [a for a in found if a["rule"].startswith("nonfinite")]
    if not bug:
        assert found == []
        return
    first = found[0]
    assert (first["rule"], first["step"], first["module"]) == ("nonfinite_forward", 2, "mixing")
    assert first["data"]["op"].startswith("aten::_fft_")
    assert first["data"]["source"].endswith("fnet_train.py:9")
    sys.modules.pop("fnet_train", None)
