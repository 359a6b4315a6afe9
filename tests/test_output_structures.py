"""Outputs of any structure: every check skips what it does not apply to, silently.

Modules (and the model itself) return tensors, tuples, lists, dicts,
dataclasses, named tuples and a Hugging Face-style ModelOutput, nested, next
to values that are not tensors, integer/bool/complex/half tensors, empty and
0-d ones; batches of one, of none, unbatched inputs. Watched with every rule
on and every sampled check made every step, healthy training raises nothing
(no alert, no warning, no internal error), and planted bugs inside those
structures are still found and named.
"""

from __future__ import annotations

import dataclasses
import io
from collections import UserDict

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import CHECK_MODES, device_of, every_check
from tests.output_types import KINDS, LMOutput, Pair, unwrap, wrap
from trainwatch.collect.tensors import floating_tensors, tensor_leaves
from trainwatch.config import load_config
from trainwatch.rules import RULE_IDS

pytestmark = pytest.mark.usefixtures("warnings_are_errors")


class Block(nn.Module):
    """A layer whose output is ``tanh(fc(x))`` wrapped as ``kind``; ``make_nan`` takes its log."""

    def __init__(self, kind: str, inputs: int, outputs: int) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(inputs, outputs)
        self.make_nan = False

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.fc(x))
        if self.make_nan:
            h = h.log()  # NaN wherever tanh(fc(x)) < 0
        return wrap(self.kind, h)


class Returns(nn.Module):
    """A module without parameters that returns a value that is not a tensor."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> object:
        return self.value


class StructuredNet(nn.Module):
    """Its encoder returns ``inner``, the model itself returns ``outer``."""

    def __init__(self, inner: str = "tensor", outer: str = "tensor") -> None:
        super().__init__()
        self.inner, self.outer = inner, outer
        self.encoder = Block(inner, 8, 16)
        self.nothing = Returns(None)
        self.scale = Returns(1.0)
        self.count = Returns(3)
        self.tag = Returns("ok")
        self.head = nn.Linear(16, 1)
        self.collapse = False

    def forward(self, x: torch.Tensor):
        h = unwrap(self.inner, self.encoder(x))
        assert self.nothing(h) is None and self.tag(h) == "ok"
        h = h * self.scale(h) * (self.count(h) / 3)
        out = self.head(h)
        if self.collapse:
            out = out * 0.0 + self.head.bias  # the same prediction for every sample
        return wrap(self.outer, out)


def fit(model, steps, *, check="auto", batches=(16,), plant=None, loss_fn=None, inputs=8):
    """Adam on a smooth regression of x; ``batches`` cycles through the batch sizes."""
    loss_fn = loss_fn or (lambda out, y: nn.functional.mse_loss(unwrap(model.outer, out), y))
    device = device_of(check)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = tw.watch(model, opt, console=io.StringIO(), **every_check(check))
    gen = torch.Generator().manual_seed(0)
    with monitor:
        for step in range(steps):
            if plant is not None:
                plant(step)
            n = batches[step % len(batches)]
            x = torch.randn(n, inputs, generator=gen).to(device)
            opt.zero_grad()
            loss_fn(model(x), x[:, :1].sin()).backward()
            opt.step()
    return monitor


def internal_errors(monitor) -> list:
    return [a for a in monitor.alerts if a.rule == "internal_error"]


def test_every_rule_is_on_in_these_tests():
    config = load_config(None, every_check())
    sections = [config.rule(rule) for rule in RULE_IDS]
    assert all(section.enabled for section in sections if section is not None)


# -- healthy models raise nothing --------------------------------------------------


@pytest.mark.parametrize("check", CHECK_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_submodule_returning_any_structure_raises_nothing(kind, check):
    torch.manual_seed(0)
    monitor = fit(StructuredNet(inner=kind), 8, check=check)
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_model_returning_any_structure_raises_nothing(kind, check):
    torch.manual_seed(0)
    monitor = fit(StructuredNet(outer=kind), 8, check=check)
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_structures_inside_structures_inside_and_out_raise_nothing(check):
    torch.manual_seed(0)
    monitor = fit(StructuredNet(inner="nested", outer="model_output"), 8, check=check)
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_batches_of_one_raise_nothing(check):
    torch.manual_seed(0)
    monitor = fit(StructuredNet(inner="dict", outer="model_output"), 8, check=check, batches=(1,))
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_an_empty_batch_now_and_then_raises_nothing(check):
    def summed(out, y):  # a mean over no samples is NaN; a sum is 0
        pred = unwrap("dict", out)
        return ((pred - y) ** 2).sum() / max(len(y), 1)

    torch.manual_seed(0)
    model = StructuredNet(inner="empty", outer="dict")
    monitor = fit(model, 10, check=check, batches=(16, 0, 16, 1, 16), loss_fn=summed)
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_unbatched_inputs_raise_nothing(check):
    class Unbatched(StructuredNet):
        def forward(self, x):
            return super().forward(x[0])  # one sample of shape (8,), no batch axis

    torch.manual_seed(0)
    model = Unbatched(inner="dataclass", outer="tuple")
    monitor = fit(
        model, 8, check=check, loss_fn=lambda out, y: nn.functional.mse_loss(out[0], y[0])
    )
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_scalar_inputs_and_outputs_raise_nothing(check):
    class Affine(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.tensor(0.5))
            self.bias = nn.Parameter(torch.tensor(0.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x + self.bias

    class ScalarNet(nn.Module):
        outer = "scalars"

        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Affine(), Affine()

        def forward(self, x: torch.Tensor):
            t = x[0, 0]  # a 0-d input
            return (self.second(torch.tanh(self.first(t))), t.sum())

    torch.manual_seed(0)
    monitor = fit(ScalarNet(), 8, check=check, loss_fn=lambda out, y: (out[0] - y[0, 0]) ** 2)
    assert monitor.alerts == []


@pytest.mark.parametrize("check", CHECK_MODES)
def test_evaluation_passes_on_structured_outputs_raise_nothing(check):
    torch.manual_seed(0)
    model = StructuredNet(inner="namedtuple", outer="model_output")

    def evaluate(step: int) -> None:
        model.eval()
        with torch.no_grad():
            model(torch.randn(4, 8, device=device_of(check)))
        with torch.inference_mode():
            model(torch.randn(4, 8, device=device_of(check)))
        model.train()

    monitor = fit(model, 6, check=check, plant=evaluate)
    assert monitor.alerts == []


# -- planted bugs inside structures are still found -------------------------------


@pytest.mark.parametrize("check", CHECK_MODES)
@pytest.mark.parametrize("kind", ["dict", "dataclass", "model_output", "nested"])
def test_nan_inside_a_structured_output_is_located_at_its_module(kind, check):
    torch.manual_seed(0)
    model = StructuredNet(inner=kind)

    def plant(step: int) -> None:
        model.encoder.make_nan = step >= 3

    monitor = fit(model, 5, check=check, plant=plant)
    first = monitor.alerts[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 3, "encoder")
    if check != "deferred":
        assert first.data["op"] == "aten::log"
    assert {a.module for a in monitor.alerts if a.rule == "nonfinite_forward"} == {"encoder"}
    assert internal_errors(monitor) == []


@pytest.mark.parametrize("check", CHECK_MODES)
@pytest.mark.parametrize("kind", ["dict", "dataclass", "model_output", "nested"])
def test_clean_control_for_the_nan_inside_a_structured_output(kind, check):
    torch.manual_seed(0)
    assert fit(StructuredNet(inner=kind), 5, check=check).alerts == []


@pytest.mark.parametrize("kind", ["dataclass", "model_output", "namedtuple"])
def test_model_output_that_stops_varying_inside_a_structure_is_named(kind):
    torch.manual_seed(0)
    model = StructuredNet(outer=kind)

    def plant(step: int) -> None:
        model.collapse = step >= 3

    monitor = fit(model, 6, plant=plant)
    (alert,) = [a for a in monitor.alerts if a.rule == "constant_output"]
    assert (alert.module, alert.step) == ("", 3)
    assert alert.data["output"] == {"dataclass": "hidden", "model_output": "logits"}.get(
        kind, "value"
    )
    assert internal_errors(monitor) == []


@pytest.mark.parametrize("kind", ["dataclass", "model_output", "namedtuple"])
def test_clean_control_for_the_model_output_that_stops_varying(kind):
    torch.manual_seed(0)
    assert fit(StructuredNet(outer=kind), 6).alerts == []


class SummaryThenPrediction(nn.Module):
    """Returns a (5,) summary that is not batch-first, then the (N, 1) prediction."""

    outer = "tuple"

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.collapse = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.fc(x))
        out = self.head(h)
        if self.collapse:
            out = out * 0.0 + self.head.bias
        return h[:, :5].mean(0), out


def _second(out, y):
    return nn.functional.mse_loss(out[1], y) + out[0].pow(2).mean()


def test_a_vector_ahead_of_the_prediction_does_not_take_its_place():
    torch.manual_seed(0)
    model = SummaryThenPrediction()

    def plant(step: int) -> None:
        model.collapse = step >= 3

    monitor = fit(model, 6, plant=plant, loss_fn=_second)
    (alert,) = [a for a in monitor.alerts if a.rule == "constant_output"]
    assert (alert.module, alert.step, alert.data["output"]) == ("", 3, "1")
    assert "the model's output (1) collapsed" in alert.message


def test_clean_control_for_the_vector_ahead_of_the_prediction():
    torch.manual_seed(0)
    assert fit(SummaryThenPrediction(), 6, loss_fn=_second).alerts == []


@dataclasses.dataclass
class Encoded:
    hidden: torch.Tensor
    pooled: torch.Tensor
    lengths: torch.Tensor


class PoolingEncoder(nn.Module):
    """Returns its features and a pooled summary; ``gate = 0`` silences the summary."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.gate = 1.0

    def forward(self, x: torch.Tensor) -> Encoded:
        h = torch.tanh(self.fc(x))
        pooled = h.mean(-1, keepdim=True) * self.gate
        return Encoded(h, pooled, torch.full((x.shape[0],), 16))


class PooledNet(nn.Module):
    outer = "tensor"

    def __init__(self) -> None:
        super().__init__()
        self.encoder = PoolingEncoder()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        encoded = self.encoder(x)
        return self.head(encoded.hidden) + encoded.pooled


def test_a_second_field_of_a_dataclass_that_stops_varying_is_named_with_its_field():
    torch.manual_seed(0)
    model = PooledNet()

    def plant(step: int) -> None:
        model.encoder.gate = 0.0 if step >= 4 else 1.0

    monitor = fit(model, 7, plant=plant)
    (alert,) = [a for a in monitor.alerts if a.rule == "constant_output"]
    assert (alert.module, alert.step, alert.data["output"]) == ("encoder", 4, "pooled")
    assert "(pooled)" in alert.message
    assert [a.rule for a in monitor.alerts] == ["constant_output"]


def test_clean_control_for_the_second_field_that_stops_varying():
    torch.manual_seed(0)
    assert fit(PooledNet(), 7).alerts == []


def _broadcast_loss(kind: str, target_shape: str):
    def loss(out, y):
        logits = {"dict": lambda: out["h"], "model_output": lambda: out["logits"]}.get(
            kind, lambda: out.hidden
        )()
        target = y.squeeze(-1) if target_shape == "(N,)" else y
        return ((logits - target) ** 2).mean()

    return loss


@pytest.mark.parametrize("kind", ["dict", "dataclass", "model_output"])
def test_broadcast_loss_on_a_field_of_the_output_is_caught(kind):
    torch.manual_seed(0)
    monitor = fit(StructuredNet(outer=kind), 3, loss_fn=_broadcast_loss(kind, "(N,)"))
    first = monitor.alerts[0]
    assert (first.rule, first.step) == ("broadcast", 0)
    assert first.data["shapes"] == [[16, 1], [16]]
    assert internal_errors(monitor) == []


@pytest.mark.parametrize("kind", ["dict", "dataclass", "model_output"])
def test_clean_control_for_the_broadcast_on_a_field(kind):
    torch.manual_seed(0)
    assert fit(StructuredNet(outer=kind), 3, loss_fn=_broadcast_loss(kind, "(N, 1)")).alerts == []


class DropoutNet(StructuredNet):
    def __init__(self, outer: str) -> None:
        super().__init__(inner="dict", outer=outer)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor):
        return super().forward(self.drop(x))


@pytest.mark.parametrize("kind", ["model_output", "nested"])
def test_training_in_eval_mode_is_seen_through_a_structured_output(kind):
    torch.manual_seed(0)
    model = DropoutNet(kind)
    model.eval()  # and never model.train()
    monitor = fit(model, 3)
    assert [a.rule for a in monitor.alerts] == ["train_in_eval_mode"]


@pytest.mark.parametrize("kind", ["model_output", "nested"])
def test_clean_control_for_training_in_eval_mode(kind):
    torch.manual_seed(0)
    assert fit(DropoutNet(kind), 3).alerts == []


# -- the walker every check shares -------------------------------------------------


def test_every_tensor_is_found_with_its_path_through_any_container():
    a, b, ids = torch.ones(2, 3), torch.zeros(2), torch.arange(2)
    output = {
        "lm": LMOutput(logits=a, hidden_states=(b, None)),
        "pair": Pair(ids, [UserDict(x=b), "text", 3]),
        "dc": Encoded(a, b, ids),
    }
    paths = [path for path, _ in tensor_leaves(output)]
    assert paths == [
        "lm.logits",
        "lm.hidden_states.0",
        "pair.value",
        "pair.index.0.x",
        "dc.hidden",
        "dc.pooled",
        "dc.lengths",
    ]
    assert len(list(floating_tensors(output))) == 5  # not the integer ids
