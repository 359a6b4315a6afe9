"""The NaN-gradient trap ``torch.where(h > 0, torch.sqrt(h), 0)``.

The forward is finite: ``where`` masks the NaN that sqrt made of every
negative ``h``. Its backward is not: sqrt's derivative divides by that saved
NaN result, and the zero gradient ``where`` sends into the masked branch
does not cancel it (``0 / NaN`` is NaN). No op of that backward has finite
inputs, so the replay's op watch saw nothing, and when the op sat in a module
with children (or in the model's own forward), whose input is the data, no
module's input gradient went bad either: the NaN was told as a non-finite
loss, though the loss is finite. It is the module whose own forward holds
the op, with the op and its line; the weights its update poisons are its
knock-on, not a second error. Each planted bug has its clean control.
"""

from __future__ import annotations

import inspect
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.test_run import alerts as logged_alerts
from trainwatch.collect.nonfinite_locate import FINITE, NAN, ForwardCall, locate_backward
from trainwatch.runner import run_script

# "auto" judges each pass as it ends on CPU; "step" takes the path a GPU takes
# (one scalar read at the step boundary, then a replay); "deferred" sums every
# module's gradient and names no op.
CHECKS = ["auto", "step", "deferred"]


class Features(nn.Module):
    """A projection, then (``masked``) the masked sqrt in this module's own forward."""

    def __init__(self, masked: bool, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 16)
        self.masked, self.eps = masked, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if not self.masked:
            return h
        return torch.where(h > 0, torch.sqrt(h.clamp_min(self.eps) if self.eps else h), 0.0)


class SqrtActivation(nn.Module):
    """The masked sqrt alone, in a module with no children."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(h > 0, torch.sqrt(h.clamp_min(self.eps) if self.eps else h), 0.0)


class Net(nn.Module):
    """``where``: "child" (in ``feat``), "model" (in this forward), "leaf" (``act``)."""

    def __init__(self, where: str, eps: float = 0.0) -> None:
        super().__init__()
        self.where, self.eps = where, eps
        self.feat = Features(where == "child", eps)
        self.act = SqrtActivation(eps)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.feat(x)
        if self.where == "model":
            h = torch.where(h > 0, torch.sqrt(h.clamp_min(self.eps) if self.eps else h), 0.0)
        if self.where == "leaf":
            h = self.act(h)
        return self.head(h)


def _line(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _train(where: str, check: str, eps: float = 0.0, loss_of=None, steps: int = 6) -> tw.Monitor:
    torch.manual_seed(0)
    model = Net(where, eps)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tw.watch(model, opt, console=io.StringIO(), nonfinite_forward={"check": check}) as monitor:
        for _ in range(steps):
            x, y = torch.randn(32, 3), torch.randint(0, 3, (32,))
            opt.zero_grad()
            out = model(x)
            loss = (loss_of or F.cross_entropy)(out, y)
            loss.backward()
            monitor.step(loss=loss)
            opt.step()
    return monitor


def _nonfinite(monitor: tw.Monitor) -> list[tw.Alert]:
    return [a for a in monitor.alerts if a.rule.startswith("nonfinite")]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize(
    ("where", "module", "function"),
    [
        ("child", "feat", Features.forward),
        ("model", "", Net.forward),
        ("leaf", "act", SqrtActivation.forward),
    ],
    ids=["in-a-module-with-children", "in-the-models-own-forward", "in-a-childless-module"],
)
def test_a_masked_sqrt_is_the_backward_of_the_module_whose_own_forward_holds_it(
    where, module, function, check
):
    found = _nonfinite(_train(where, check))
    assert [(a.rule, a.module, a.step, a.data["cause"]) for a in found] == [
        ("nonfinite_backward", module, 0, "module")
    ], [(a.rule, a.module, a.step, a.message) for a in found]
    if check != "deferred":  # a replay names the op and the line
        assert found[0].data["op"] == "aten::sqrt"
        assert found[0].data["source"] == f"{__file__}:{_line(function, 'torch.sqrt')}"
        assert found[0].data["kind"] == "nan"


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("where", ["child", "model", "leaf"])
def test_the_same_sqrt_of_a_clamped_argument_is_silent(where, check):
    monitor = _train(where, check, eps=1e-12)
    assert [a.key for a in monitor.alerts if a.severity != "info"] == []


def _log_of_a_zero_probability(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A loss that takes the log of a probability the mask made exactly 0."""
    probs = F.softmax(out, -1) * (torch.arange(3) != 0).float()
    return F.nll_loss(torch.log(probs), torch.zeros_like(y))


@pytest.mark.parametrize("check", CHECKS)
def test_a_log_of_zero_in_the_loss_is_still_a_nonfinite_loss(check):
    found = _nonfinite(_train("child", check, eps=1e-12, loss_of=_log_of_a_zero_probability))
    assert [(a.rule, a.step) for a in found] == [("nonfinite_loss", 0)], [
        (a.rule, a.module, a.message) for a in found
    ]


SCRIPT = """\
import torch
from torch import nn
import torch.nn.functional as F


class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 16)

    def forward(self, x):
        h = self.proj(x)
        return torch.where(h > 0, torch.sqrt(h{clamp}), 0.0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.feat = Features()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.feat(x))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    x, y = torch.randn(32, 3), torch.randint(0, 3, (32,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
"""


@pytest.mark.parametrize("clamp", ["", ".clamp_min(1e-12)"], ids=["bare", "clamped"])
def test_trainwatch_run_names_the_module_holding_the_masked_sqrt(tmp_path, clamp):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(clamp=clamp))
    run_script(script, [], log_dir=tmp_path / "log")
    logged = logged_alerts(tmp_path / "log")
    found = [(a["rule"], a["module"], a["step"]) for a in logged if a["rule"].startswith("nonf")]
    if clamp:
        assert [a["rule"] for a in logged if a["severity"] != "info"] == []
        return
    assert found == [("nonfinite_backward", "feat", 0)]
    first = next(a for a in logged if a["rule"] == "nonfinite_backward")
    assert first["data"]["op"] == "aten::sqrt"
    assert first["data"]["source"] == f"{script}:13"


def _call(module: int) -> ForwardCall:
    return ForwardCall(module, [], [], (32, 16), "torch.float32", "cpu")


NAMES = ["", "feat", "feat.proj", "head"]


def test_without_a_replay_the_holder_of_the_child_whose_output_gradient_went_bad_is_named():
    """Deferred sums, hand-built. Gradient 0 (the model's and head's output) and 1
    (head's input) are finite; 2 is not: in ``feat``, proj's output; in the
    model's own forward, what proj and feat both return."""
    from trainwatch.collect.nonfinite_locate import owners  # new with the fix

    model, feat, proj, head = _call(0), _call(1), _call(2), _call(3)
    start = [(head, "out", 0), (model, "out", 0), (head, "in", 1)]
    codes = [FINITE, FINITE, NAN]
    finite = [True, True, False]
    in_feat = [*start, (feat, "out", 1), (proj, "out", 2)]
    found = locate_backward(in_feat, finite, codes, owners(NAMES))
    assert (found.module, found.cause) == (1, "module")
    in_model = [*start, (proj, "out", 2), (feat, "out", 2)]
    found = locate_backward(in_model, finite, codes, owners(NAMES))
    assert (found.module, found.cause) == (0, "module")
    # Bad where it enters the model: the loss made it.
    found = locate_backward(in_feat, [False] * 3, [NAN] * 3, owners(NAMES))
    assert found.cause == "loss"
