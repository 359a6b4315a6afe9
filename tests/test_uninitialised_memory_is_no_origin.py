"""A NaN's origin is the op that computed it, never an allocation that happened to
hold NaN bits. Under deterministic algorithms torch fills every uninitialised float
tensor with NaN, which makes "the allocation held NaN" happen at every run."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from trainwatch.collect.op_trace import trace_first_nonfinite_op


class BufferThenLog(nn.Module):
    """Allocates a scratch tensor and fills it (as fused code often does), then,
    with ``bug``, takes the log of a negative."""

    def __init__(self, bug: bool, into_buffer: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bug = bug
        self.into_buffer = into_buffer  # the log written into a fresh out= buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        scratch = torch.empty_like(h)
        scratch.copy_(h)
        if self.bug and self.into_buffer:
            scratch = torch.log(scratch - 10.0, out=torch.empty_like(h))
        elif self.bug:
            scratch = torch.log(scratch - 10.0)
        return scratch


@contextlib.contextmanager
def _uninitialised_memory_is_nan():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_log_is_named_not_the_allocation_that_held_nan():
    torch.manual_seed(0)
    with _uninitialised_memory_is_nan():
        assert torch.isnan(torch.empty(4)).all()  # the premise: fresh memory reads NaN
        found = trace_first_nonfinite_op(BufferThenLog(bug=True), (torch.randn(4, 8),), {})
    assert found is not None
    assert found.op == "aten::log"


def test_a_log_written_into_a_fresh_out_buffer_is_still_the_origin():
    torch.manual_seed(0)
    model = BufferThenLog(bug=True, into_buffer=True)
    with _uninitialised_memory_is_nan():
        found = trace_first_nonfinite_op(model, (torch.randn(4, 8),), {})
    assert found is not None
    assert found.op == "aten::log"


def test_a_filled_allocation_alone_is_no_origin():
    torch.manual_seed(0)
    with _uninitialised_memory_is_nan():
        found = trace_first_nonfinite_op(BufferThenLog(bug=False), (torch.randn(4, 8),), {})
    assert found is None
