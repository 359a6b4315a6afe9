"""What a DistributedDataParallel wrapper says, read whether the wrapper or the
module inside it is watched.

- Built with ``find_unused_parameters=True``, DDP copes with a layer used on
  some steps only: ``unused_parameter`` is a note, and a layer not run yet is
  given the usual patience, also when the module inside is watched (the Hugging
  Face Trainer wraps the model itself).
- ``model.eval()`` on the module inside leaves the wrapper's own flag as it was:
  a training step after it still runs the whole model in eval mode.

A one-process gloo group: DDP's reducer behaves as with more ranks.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainwatch as tw
from tests.test_never_called_in_optimizer import one_process_group


class _AuxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(20, 32)
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.relu(self.norm(self.body(x)))
        out = self.head(h)
        return out + self.aux(h) if use_aux else out


def _train(
    watch: str, wrap: bool, steps: int = 12, evaluate_at: int | None = None, alerts: bool = False
):
    torch.manual_seed(0)
    net = _AuxNet()
    model = DistributedDataParallel(net, find_unused_parameters=True) if wrap else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = tw.watch(net if watch == "inner" else model, opt, console=io.StringIO())
    for step in range(steps):
        x = torch.randn(16, 20)
        loss = nn.functional.cross_entropy(model(x, use_aux=step % 3 == 2), x[:, :4].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == evaluate_at:
            net.eval()  # the module inside: model.train() never comes back
            with torch.no_grad():
                model(torch.randn(16, 20))
    monitor.close()
    if alerts:
        return monitor.alerts
    return [(a.rule, a.severity, a.module) for a in monitor.alerts]


@pytest.mark.parametrize("watch", ["wrapper", "inner"])
def test_a_layer_used_on_some_steps_under_find_unused_parameters_is_a_note(watch):
    with one_process_group():
        found = _train(watch, wrap=True)
    aux = "module.aux" if watch == "wrapper" else "aux"
    assert found == [("unused_parameter", "info", aux)]


@pytest.mark.parametrize("watch", ["wrapper", "inner"])
def test_the_note_under_find_unused_parameters_says_ddp_copes_without_asking_for_the_flag(watch):
    with one_process_group():
        (note,) = _train(watch, wrap=True, alerts=True)
    assert "DDP copes, since it was built with find_unused_parameters=True" in note.message
    assert "hangs or fails" not in note.message and "fails or hangs" not in note.hint
    assert note.hint.startswith("a branch that only runs on some steps")
    assert "Nothing needs doing" in note.hint
    assert note.data["find_unused_parameters"] is True


def test_control_without_the_flag_the_warning_asks_for_it():
    with one_process_group():
        found = _train("inner", wrap=False, alerts=True)
    (warning,) = [a for a in found if a.rule == "unused_parameter"]
    assert "under DDP this hangs or fails unless find_unused_parameters=True" in warning.message
    assert "fails or hangs unless find_unused_parameters=True" in warning.hint
    assert warning.data["find_unused_parameters"] is False


def test_control_the_same_module_with_no_wrapper_in_sight_warns():
    """A launcher's wrapper not found among live objects may lack the flag."""
    with one_process_group():
        found = _train("inner", wrap=False)
    assert ("unused_parameter", "warning", "aux") in found


@pytest.mark.parametrize("watch", ["wrapper", "inner"])
def test_eval_on_the_module_inside_the_wrapper_is_a_training_step_in_eval_mode(watch):
    with one_process_group():
        found = _train(watch, wrap=True, evaluate_at=5)
    norm = "module.norm" if watch == "wrapper" else "norm"
    assert ("train_in_eval_mode", "warning", norm) in found
