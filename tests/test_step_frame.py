"""The step frame: every device number of a step read back in one transfer, by handle."""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import TinyNet, batches, calls_from_trainwatch
from trainwatch.frame import StepFrame


def test_every_piece_comes_back_by_its_handle_including_the_first():
    frame = StepFrame()
    first = frame.add(torch.tensor([float("nan")]))
    norms = frame.add(torch.tensor([1.0, 2.0, 3.0]))
    scalar = frame.add(torch.tensor(4.0))
    frame.read()
    assert frame.transfers == 0  # CPU tensors are on the host already: nothing is copied
    values = first.values()
    assert len(values) == 1 and values[0] != values[0]  # the NaN, from slot 0
    assert norms.values() == [1.0, 2.0, 3.0]
    assert scalar.value() == 4.0


def test_an_empty_frame_reads_nothing():
    frame = StepFrame()
    frame.read()
    assert frame.transfers == 0


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def test_nan_loss_handed_over_after_the_step_is_reported_when_it_is_the_frames_first_piece(
    quiet_watch,
):
    """The next step has no gradients (nothing else in its frame): the loss is piece 0."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    ((x, y),) = batches(1)
    _step(model, opt, x, y)
    monitor.step(loss=torch.tensor(float("nan")))  # after optimizer.step(): step 0's loss
    opt.zero_grad()
    opt.step()  # no backward: no gradients, nothing else to read back
    monitor.close()
    losses = [a for a in monitor.alerts if a.rule == "nonfinite_loss"]
    assert [(a.step, a.module) for a in losses] == [(0, None)]


def test_finite_loss_handed_over_after_the_step_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    ((x, y),) = batches(1)
    loss = _step(model, opt, x, y)
    monitor.step(loss=loss)
    opt.zero_grad()
    opt.step()
    monitor.close()
    assert [a for a in monitor.alerts if a.rule.startswith("nonfinite")] == []


def test_a_piece_read_on_the_host_already_is_kept_not_read_again():
    frame = StepFrame()
    norms = frame.add(torch.tensor([1.0, 2.0]), [1.0, 2.0])
    other = frame.add(torch.tensor([3.0]))
    frame.read()
    assert norms.values() == [1.0, 2.0] and other.values() == [3.0]


def _host_reads_in_a_healthy_step(quiet_watch) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(model, opt)
    x, y = torch.randn(8, 8), torch.randn(8, 32)  # an output of 256 values: summed

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for _ in range(7):  # past the first sampled steps
        step()
    return calls_from_trainwatch(step, "c_call").count("tolist")


def test_a_cpu_step_reads_its_gradient_norms_to_the_host_once(quiet_watch):
    # The trigger before the update reads them; the frame keeps that list.
    assert _host_reads_in_a_healthy_step(quiet_watch) == 1
