"""Under DDP without find_unused_parameters, a parameter that misses a backward pass
makes the next iteration fail; trainwatch's warning is on disk and on the console
by then, at the step where the parameter went unused, and DDP's error passes through.

A one-process gloo group: DDP's reducer behaves as with more ranks (it waits for
every parameter's gradient before the next forward); then two real gloo ranks,
where rank zero alone writes and the other rank's warning reaches it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.ranks import ranks_of
from tests.test_never_called_in_optimizer import one_process_group


class Branchy(nn.Module):
    """A trunk and a branch; ``branch_on(step)`` decides whether the branch reaches the loss."""

    def __init__(self, branch_on) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.branch_on = branch_on
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        extra = self.branch(h)
        if not self.branch_on(self.calls):
            extra = extra.detach()  # called, but cut out of the graph
        self.calls += 1
        return self.head(h + extra)


def _train_until_ddp_fails(model: nn.Module, tmp_path, find_unused: bool = False):
    console = io.StringIO()
    seen_on_disk: list[dict] = []
    with one_process_group():
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(0)
        error = None
        with tw.watch(ddp, opt, console=console, log_dir=tmp_path) as monitor:
            try:
                for _ in range(4):
                    x = torch.randn(16, 8, generator=gen)
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
                    opt.step()
            except RuntimeError as exc:
                error = exc
                lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
                seen_on_disk = [json.loads(line) for line in lines]
            steps = monitor.step_count
    return error, seen_on_disk, console.getvalue(), steps


def test_a_branch_unused_from_step_one_is_reported_there_before_ddp_fails(tmp_path):
    torch.manual_seed(0)
    error, on_disk, console, steps = _train_until_ddp_fails(
        Branchy(lambda call: call == 0), tmp_path
    )
    assert error is not None and "find_unused_parameters" in str(error)  # DDP's own error
    assert steps == 2  # steps 0 and 1 ran; step 2's forward failed
    assert [(a["rule"], a["module"], a["step"]) for a in on_disk] == [
        ("unused_parameter", "module.branch", 1)
    ]
    assert "unused_parameter" in console


def test_a_branch_cut_off_from_the_start_is_reported_at_step_zero_before_ddp_fails(tmp_path):
    torch.manual_seed(0)
    error, on_disk, console, steps = _train_until_ddp_fails(Branchy(lambda call: False), tmp_path)
    assert error is not None and "find_unused_parameters" in str(error)
    assert steps == 1
    assert [(a["rule"], a["module"], a["step"], a["severity"]) for a in on_disk] == [
        ("zero_gradient", "module.branch", 0, "warning")
    ]
    assert "next iteration fails" in on_disk[0]["message"]
    assert "zero_gradient" in console


def test_every_branch_used_every_step_is_clean_under_ddp(tmp_path):
    torch.manual_seed(0)
    error, _, _, steps = _train_until_ddp_fails(Branchy(lambda call: True), tmp_path)
    assert error is None and steps == 4
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == []


@pytest.mark.parametrize(
    ("branch_on", "expected"),
    [
        (lambda call: call == 0, [("unused_parameter", 1, None), ("zero_gradient", 1, 3)]),
        (lambda call: False, [("zero_gradient", 0, 3)]),
    ],
    ids=["used-once", "cut-off-from-the-start"],
)
def test_with_find_unused_parameters_ddp_goes_on_and_the_usual_patience_applies(
    tmp_path, branch_on, expected
):
    torch.manual_seed(0)
    error, _, _, steps = _train_until_ddp_fails(Branchy(branch_on), tmp_path, find_unused=True)
    assert error is None and steps == 4
    lines = (tmp_path / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    assert [(a["rule"], a["step"], a["data"].get("steps")) for a in found] == expected
    assert all("next iteration fails" not in a["message"] for a in found)


# -- two real ranks ------------------------------------------------------------


def _two_ranks(out: Path, mode: str) -> list[dict]:
    return ranks_of("ddp_unused_two_ranks.py", out, mode)


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "tw" / "alerts.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_with_two_ranks_the_warning_is_on_rank_zeros_disk_and_console_before_ddp_fails(
    tmp_path,
):
    zero, one = _two_ranks(tmp_path, "cut")
    for rank in (zero, one):
        assert "find_unused_parameters" in rank["error"]  # DDP's own error, unchanged
        assert rank["steps"] == 1  # step 1's forward failed
    at_error = zero["on_disk_at_error"]
    assert [(a["rule"], a["module"], a["step"], a["data"]["rank"]) for a in at_error] == [
        ("zero_gradient", "module.branch", 0, 0)
    ]
    assert "zero_gradient" in zero["console_at_error"]
    # Rank 1 found the same: one line (rank zero's), counted twice; rank 1 printed nothing.
    assert len(_lines(tmp_path)) == 1
    counts = json.loads((tmp_path / "tw" / "alert_counts.json").read_text())["counts"]
    assert [(c["rule"], c["count"]) for c in counts] == [("zero_gradient", 2)]
    assert one["console"] == ""


@pytest.mark.slow
def test_a_branch_cut_on_rank_one_only_reaches_rank_zeros_file_though_both_failed(tmp_path):
    """Rank 1's warning was posted when raised, before its DDP error; rank 0, failed
    by gloo when rank 1 went, writes it at close (no collective on the way out)."""
    zero, one = _two_ranks(tmp_path, "cut_on_one")
    assert "find_unused_parameters" in one["error"]
    assert zero["error"] and zero["on_disk_at_error"] == []
    assert [(a["rule"], a["module"], a["step"], a["data"]["rank"]) for a in _lines(tmp_path)] == [
        ("zero_gradient", "module.branch", 0, 1)
    ]
    assert "(rank 1)" in zero["console"] and one["console"] == ""


@pytest.mark.slow
def test_with_two_ranks_a_branch_kept_in_the_graph_trains_silently(tmp_path):
    zero, one = _two_ranks(tmp_path, "clean")
    assert zero["error"] is None and one["error"] is None
    assert zero["steps"] == one["steps"] == 4
    assert _lines(tmp_path) == [] and zero["alerts"] == one["alerts"] == []
