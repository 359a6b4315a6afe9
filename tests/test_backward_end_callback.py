"""The end-of-backward callback is queued only where backward's end has something to note.

Each queued callback is one more call into Python at every backward; on a
healthy step (gradients reset, one optimizer) backward's end has nothing
to record, so none is queued. Stale gradients, a loop without an optimizer
and a registered listener still get it.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.conftest import TinyNet, batches, calls_from_trainwatch, train


def _trainwatch_calls_in(run) -> set[str]:
    return set(calls_from_trainwatch(run))


def _one_backward(model) -> set[str]:
    x, y = next(batches(1))
    loss = nn.functional.mse_loss(model(x), y)
    return _trainwatch_calls_in(loss.backward)


def test_a_healthy_backward_queues_no_end_of_backward_call(quiet_watch):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(model, opt)
    train(model, opt, 5)
    opt.zero_grad()
    called = _one_backward(model)
    assert "backward_starts" in called
    assert "backward_ends" not in called


def test_a_backward_onto_stale_gradients_still_notes_their_versions_at_its_end(quiet_watch):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 5)
    called = _one_backward(model)  # no zero_grad: onto last step's gradients
    assert "backward_ends" in called
    opt.step()
    train(model, opt, 2, zero_grad_until=0)
    assert "accumulated_gradient" in {a.rule for a in monitor.alerts}


def test_end_of_backward_listeners_are_told_after_every_backward(quiet_watch):
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    ended: list[int] = []
    monitor.on_backward_end(lambda: ended.append(len(ended)))
    train(model, opt, 6)
    assert len(ended) == 6


def test_a_loop_without_an_optimizer_still_notes_what_each_backward_reached(quiet_watch):
    model = TinyNet()
    monitor = quiet_watch(model)
    for x, y in batches(4):
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        monitor.step()
    model.zero_grad()
    called_next = _one_backward(model)
    assert "backward_ends" in called_next
