"""Hand-written updates from gradients that never land in ``.grad``.

A loop without an optimizer may compute its gradients with ``torch.func``
(per-sample gradients, clipped and noised: DP-SGD written out) or with
``torch.autograd.grad(loss, params)``, and apply them by hand under
``no_grad``, calling ``monitor.step(loss=...)`` once per update. No parameter
ever holds a gradient, yet the weights move: the model trains, and no
``.detach()`` is to be looked for. A layer the update leaves out, while the
others move, is still told, as left out of the update.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from trainwatch.runner import run_script

X_DIM, CLASSES = 16, 4


class Net(nn.Module):
    def __init__(self, cut: bool = False) -> None:
        super().__init__()
        self.cut = cut
        self.fc1 = nn.Linear(X_DIM, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.cut:
            h = h.detach()  # the planted bug: fc1 is cut off from the loss
        return self.fc3(F.relu(self.fc2(h)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(512, X_DIM)
    return x, (x @ torch.randn(X_DIM, CLASSES)).argmax(1)


def _per_sample_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """DP-SGD's gradients: per sample (vmap over grad), clipped, noised, averaged."""

    def loss_of_one(params, xi, yi):
        return F.cross_entropy(functional_call(model, params, (xi[None],)), yi[None])

    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()))
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    out = {}
    for name, g in per_sample.items():
        clipped = (g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0)
        out[name] = (clipped + 0.5 * torch.randn_like(clipped)) / len(x)
    return out


def _autograd_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    names, params = zip(*model.named_parameters())
    return dict(zip(names, torch.autograd.grad(F.cross_entropy(model(x), y), params)))


GRADIENTS = {"torch_func": _per_sample_gradients, "autograd_grad": _autograd_gradients}


def _train(
    monitor_of,
    gradients,
    steps: int = 12,
    skip: str | None = None,
    through_data: bool = False,
    micro_batches: int = 1,
) -> tuple[list, float, float]:
    """The loop: per update, gradients computed outside .grad and applied by hand;
    ``monitor.step(loss=...)`` at each boundary. ``skip``: a layer the update leaves
    out. ``micro_batches``: boundaries per update (gradients summed in between)."""
    x_all, y_all = _data()
    model = Net()
    monitor = monitor_of(model)
    accuracy = []
    summed: dict = {}
    for step in range(steps * micro_batches):
        idx = torch.randint(0, len(x_all), (64,))
        x, y = x_all[idx], y_all[idx]
        for name, g in gradients(model, x, y).items():
            summed[name] = summed.get(name, 0) + g
        if (step + 1) % micro_batches == 0:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if skip is not None and name.startswith(skip):
                        continue
                    if through_data:
                        param.data.sub_(0.5 * summed[name])  # moves no version counter
                    else:
                        param.sub_(0.5 * summed[name])
            summed = {}
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
            if step == 0 or step == steps * micro_batches - 1:
                accuracy.append((model(x_all).argmax(1) == y_all).float().mean().item())
        monitor.step(loss=loss)
    return monitor.alerts, accuracy[0], accuracy[-1]


def _told(alerts) -> list[tuple[str, str | None, int, str | None]]:
    return sorted(
        (a.rule, a.module, a.step, a.data.get("kind")) for a in alerts if a.severity != "info"
    )


@pytest.mark.parametrize("through_data", [False, True], ids=["in_place", "through_data"])
@pytest.mark.parametrize("how", list(GRADIENTS))
def test_a_model_updated_by_hand_from_gradients_outside_grad_is_no_cut_graph(
    quiet_watch, how, through_data
):
    alerts, before, after = _train(quiet_watch, GRADIENTS[how], through_data=through_data)
    assert after > before + 0.1  # it trains
    assert _told(alerts) == []
    notes = [a for a in alerts if a.rule == "trainable_parameters"]
    assert [(a.severity, a.step, a.data["finding"], a.data["parameters"]) for a in notes] == [
        ("info", 0, "outside .grad", 6)
    ]
    assert "gradient norms" in notes[0].message


def test_boundaries_between_updates_outside_grad_say_nothing(quiet_watch):
    """Per-sample gradients summed over two boundaries before each update: once the
    weights were seen moving, a boundary where none moved had no update."""
    alerts, _, _ = _train(quiet_watch, _per_sample_gradients, steps=8, micro_batches=2)
    assert _told(alerts) == []


@pytest.mark.parametrize("how", list(GRADIENTS))
def test_a_layer_left_out_of_the_hand_written_update_is_told_as_not_updated(quiet_watch, how):
    alerts, _, _ = _train(quiet_watch, GRADIENTS[how], skip="fc3")
    assert _told(alerts) == [("zero_gradient", "fc3", 0, "not_updated")]
    alert = next(a for a in alerts if a.rule == "zero_gradient")
    assert alert.data["parameters"] == ["fc3.weight", "fc3.bias"]
    assert ".detach()" not in alert.hint and "leaves these parameters out" in alert.hint


def test_a_loop_that_moves_nothing_without_gradients_is_still_told(quiet_watch):
    """The control: the loss handed over, no gradient anywhere and no weight moving
    (the update forgotten): nothing trains, told as before, at step 0."""
    x_all, y_all = _data()
    model = Net()
    monitor = quiet_watch(model)
    for step in range(5):
        x, y = x_all[step * 8 : step * 8 + 8], y_all[step * 8 : step * 8 + 8]
        _per_sample_gradients(model, x, y)
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
        monitor.step(loss=loss)
    told = _told(monitor.alerts)
    assert ("trainable_parameters", "", 0, None) in told
    assert {(rule, module, kind) for rule, module, _, kind in told} >= {
        ("zero_gradient", layer, "none") for layer in ("fc1", "fc2", "fc3")
    }


def test_a_real_detach_in_a_loop_with_an_optimizer_is_still_told(quiet_watch):
    """The control: backward writes .grad and stops at the .detach()."""
    x_all, y_all = _data()
    model = Net(cut=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    for step in range(5):
        x, y = x_all[step * 8 : step * 8 + 8], y_all[step * 8 : step * 8 + 8]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert _told(monitor.alerts) == [("zero_gradient", "fc1", 0, "none")]


def test_a_real_detach_in_a_hand_written_loop_is_still_told(quiet_watch):
    """The control: backward reaches fc2 and fc3, whose gradients the loop applies
    and clears before monitor.step() (no gradient left anywhere, as in the loops
    above); fc1, cut off, keeps the .detach() story."""
    x_all, y_all = _data()
    model = Net(cut=True)
    monitor = quiet_watch(model)
    for step in range(5):
        x, y = x_all[step * 8 : step * 8 + 8], y_all[step * 8 : step * 8 + 8]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= 0.1 * param.grad
                    param.grad = None
        monitor.step(loss=loss)
    told = _told(monitor.alerts)
    assert ("zero_gradient", "fc1", 0, "none") in told
    assert all(kind != "not_updated" for *_, kind in told)


SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
skip = sys.argv[1] == "skip"
for step in range(10):
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(F.cross_entropy(model(x), y), params)
    with torch.no_grad():
        for name, param, g in zip(names, params, grads):
            if not (skip and name.startswith("2.")):
                param.sub_(0.1 * g)
"""


@pytest.mark.parametrize("variant", ["all", "skip"])
def test_autograd_grad_updates_under_trainwatch_run(tmp_path, variant):
    """Under ``trainwatch run`` each autograd.grad's end is a step boundary."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run_script(script, [variant], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    told = [
        (a["rule"], a["module"], a["data"].get("kind"))
        for a in map(json.loads, lines)
        if a["severity"] != "info"
    ]
    assert told == ([] if variant == "all" else [("zero_gradient", "2", "not_updated")])
