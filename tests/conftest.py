"""Shared tiny models and loops: named layers so alerts are asserted by name."""

from __future__ import annotations

import io
import os
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

import trainwatch as tw

# The scripts the tests start (``trainwatch run``, torchrun ranks, the demo) train
# tiny models too: one OpenMP thread each, or two workers' children contend for the
# same cores (a ``trainwatch run`` test took a third longer with torch's default).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models on a small shared machine: more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class TinyNet(nn.Module):
    def __init__(self, inputs: int = 8, hidden: int = 16, outputs: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, outputs)
        self.detach_fc1 = False
        self.zero_fc2 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.detach_fc1:
            h = h.detach()
        h = torch.tanh(self.fc2(h))
        if self.zero_fc2:
            h = h * 0.0
        return self.head(h)


def batches(n: int, batch: int = 32, inputs: int = 8, outputs: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(batch, inputs, generator=gen)
        yield x, x[:, :outputs].sin() * 2.0


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    zero_grad_until: int | None = None,
    set_to_none: bool = True,
    accumulate: int = 1,
    clip: float | None = None,
    before_step=None,
) -> list[float]:
    """A plain loop; ``zero_grad_until=k`` drops zero_grad from step k on."""
    losses = []
    data = batches(steps * accumulate)
    for step in range(steps):
        if zero_grad_until is None or step < zero_grad_until:
            optimizer.zero_grad(set_to_none=set_to_none)
        for _ in range(accumulate):
            x, y = next(data)
            loss = nn.functional.mse_loss(model(x), y) / accumulate
            loss.backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if before_step is not None:
            before_step(step)
        optimizer.step()
    return losses


@pytest.fixture
def model() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet()


@pytest.fixture
def quiet_watch():
    """tw.watch with the console captured in a string, closed after the test."""
    opened: list[tw.Monitor] = []

    def make(*args, **kwargs) -> tw.Monitor:
        kwargs.setdefault("console", io.StringIO())
        monitor = tw.watch(*args, **kwargs)
        opened.append(monitor)
        return monitor

    yield make
    for monitor in opened:
        monitor.close()


def calls_from_trainwatch(run: Callable[[], object], event: str = "call") -> list[str]:
    """The names of the functions trainwatch's own code calls while ``run()`` runs, in
    order, as ``sys.setprofile`` sees them: ``"call"`` for Python functions (the
    callee's name), ``"c_call"`` for builtins and torch's C functions (``tolist``)."""
    names: list[str] = []

    def profile(frame, seen, arg) -> None:
        if seen != event:
            return
        if event == "c_call":
            if "/trainwatch/" in frame.f_code.co_filename:
                names.append(getattr(arg, "__name__", ""))
        elif "/trainwatch/" in frame.f_code.co_filename:
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return names


def rules_of(monitor: tw.Monitor, severities=("warning", "error")) -> list[str]:
    return [a.rule for a in monitor.alerts if a.severity in severities]


# How NaN/Inf are looked for: "auto" checks CPU tensors on the spot (one sum
# of the model's output, a replay to locate); "step" takes that verdict at the
# step boundary, the path a GPU takes by default, on CPU; "deferred" sums every
# module's output for the step's readback (no sync); "cuda" is the default
# path on a GPU (only where there is one).
CHECK_MODES = ("auto", "step", "deferred") + (
    (pytest.param("cuda", marks=pytest.mark.cuda),) if torch.cuda.is_available() else ()
)


def device_of(check: str) -> torch.device:
    return torch.device("cuda" if check == "cuda" else "cpu")


def every_check(check: str = "auto") -> dict:
    """tw.watch overrides: every rule on, and every sampled check made every step."""
    return {
        "nonfinite_forward": {"check": check if check in ("step", "deferred") else "auto"},
        "nonfinite_parameter": {"check_every": 1},
        "constant_output": {"every": 1},
        "dead_units": {"every": 1},
        "broadcast": {"audit_steps": 1000},
        "exploding_gradient": {"warmup": 2},
        "vanishing_gradient": {"warmup": 2},
    }


@pytest.fixture
def warnings_are_errors():
    """Any Python warning raised while the test runs fails it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
