"""Thousands of steps with every rule on: trainwatch's memory stays flat."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet


def _trainwatch_bytes(snapshot: tracemalloc.Snapshot) -> int:
    only_ours = snapshot.filter_traces([tracemalloc.Filter(True, "*trainwatch/*")])
    return sum(stat.size for stat in only_ours.statistics("filename"))


@pytest.mark.slow
@pytest.mark.parametrize("buggy", [False, True], ids=["healthy", "alert-every-step"])
def test_5000_steps_keep_trainwatch_memory_flat(buggy):
    torch.manual_seed(0)
    model = TinyNet()
    model.detach_fc1 = buggy  # zero_gradient streak that never ends
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def run(steps: int) -> None:
        for _ in range(steps):
            if not buggy:
                opt.zero_grad()  # buggy: accumulated_gradient every step too
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if buggy:
                opt.param_groups[0]["params"][0].grad = None  # keep the numbers finite

    with tw.watch(model, opt, console=False) as monitor:
        tracemalloc.start()
        run(300)
        gc.collect()
        before = _trainwatch_bytes(tracemalloc.take_snapshot())
        run(5000)
        gc.collect()
        after = _trainwatch_bytes(tracemalloc.take_snapshot())
        tracemalloc.stop()
    assert monitor.step_count == 5300
    assert after - before < 16 * 1024, f"trainwatch grew by {after - before} bytes"
    if buggy:
        assert len(monitor.alerts) <= 3  # first occurrences only; repeats counted
