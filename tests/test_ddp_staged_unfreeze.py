"""A layer frozen when DDP wraps the model and unfrozen later is never all-reduced.

DDP's reducer takes the parameters that require grad when it is built; a
staged fine-tune that unfreezes a layer afterwards trains one copy of it per
rank, and the copies drift apart with no error. ``trainable_parameters`` tells
it at the setup audit of the unfreeze. Two real gloo ranks on CPU run every
case in one launch (tests/scripts/ddp_staged_unfreeze.py); each case checks
that the ranks' copies of the layer really differ, or really agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.ranks import ranks_of, run
from tests.test_never_called_in_optimizer import one_process_group

UNFREEZE_AT = 3
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    zero, one = ranks_of("ddp_staged_unfreeze.py", tmp_path_factory.mktemp("staged"))
    return zero, one


def _told(record: dict) -> list[dict]:
    return [a for a in record["alerts"] if a["rule"] == "trainable_parameters"]


def _drift(cases, case: str) -> float:
    zero, one = (record[case]["weight"] for record in cases)
    return max(abs(a - b) for a, b in zip(zero, one))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "module", "names"),
    [
        ("frozen_at_wrap", "module.0", ["module.0.weight", "module.0.bias"]),
        ("frozen_at_wrap_inner", "0", ["0.weight", "0.bias"]),
    ],
)
def test_a_layer_unfrozen_after_ddp_was_built_is_told_not_synced_at_the_unfreeze(
    cases, case, module, names
):
    """Watching the DDP model, or the model inside it (the wrapper found by a scan)."""
    assert _drift(cases, case) > 1e-4  # the bug is real: each rank trained its own copy
    for record in cases:
        (alert,) = _told(record[case])
        assert (alert["module"], alert["step"], alert["severity"]) == (
            module,
            UNFREEZE_AT,
            "warning",
        )
        assert alert["data"]["finding"] == "not synced by DDP"
        assert alert["data"]["parameters"] == names
        assert (alert["data"]["synced"], alert["data"]["trainable"]) == (2, 4)
        assert "frozen when DDP was built" in alert["message"]
        assert "Wrap the model in DDP again after unfreezing" in alert["hint"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["unfrozen_before_wrap", "rebuilt", "never_frozen", "frozen_for_good"]
)
def test_ddp_built_over_every_parameter_that_trains_stays_silent(cases, case):
    """Unfrozen before wrapping, wrapped again after unfreezing (the old wrapper still
    alive beside the new one), never frozen, or frozen for good."""
    assert _drift(cases, case) == 0.0
    for record in cases:
        assert _told(record[case]) == []


@pytest.mark.slow
def test_lightning_base_finetuning_unfreezing_under_the_ddp_strategy_is_told(tmp_path):
    """Lightning's BaseFinetuning freezes in setup(), before the DDP strategy wraps
    the model, and unfreezes at an epoch's start: the same bug, told by the callback."""
    run(str(SCRIPTS / "ddp_lightning_finetune.py"), str(tmp_path), out=tmp_path)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert max(abs(a - b) for a, b in zip(zero["weight"], one["weight"])) > 1e-5
    for record in (zero, one):
        assert record["told"] == [["fc1", 2, "not synced by DDP", ["fc1.weight", "fc1.bias"]]]


def _one_rank_loop(ddp, opt, steps: int, flips: dict[int, tuple[nn.Module, bool]]):
    """A one-rank loop under ``tw.watch``; ``flips``: step -> (layer, requires_grad)."""
    gen = torch.Generator().manual_seed(0)
    with tw.watch(ddp, opt, console=False) as monitor:
        for step in range(steps):
            if step in flips:
                layer, flag = flips[step]
                layer.requires_grad_(flag)
            x = torch.randn(16, 8, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
            opt.step()
    return [a for a in monitor.alerts if a.rule == "trainable_parameters"]


def test_a_ddp_out_of_step_before_the_monitor_attached_is_told_at_attach_once():
    """No audit saw the layer frozen: every trainable parameter is named, at attach;
    a layer DDP holds, frozen and unfrozen later, adds nothing."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with one_process_group():
        net[0].requires_grad_(False)
        # (find_unused_parameters: net[2] is frozen for a while after DDP took it.)
        ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=True)
        net[0].requires_grad_(True)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        told = _one_rank_loop(ddp, opt, 5, {2: (net[2], False), 3: (net[2], True)})
    (alert,) = told
    assert (alert.module, alert.step, alert.data["finding"]) == ("module", 0, "not synced by DDP")
    assert alert.data["parameters"] == [
        f"module.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")
    ]
    assert "DDP all-reduces only 2 of the 4 parameter tensors" in alert.message
    assert alert.data["find_unused_parameters"] is True


def test_each_stage_of_a_gradual_unfreeze_is_its_own_finding():
    """net[2] then net[0], both frozen when DDP was built: each told at its unfreeze."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    with one_process_group():
        net[0].requires_grad_(False)
        net[2].requires_grad_(False)
        ddp = nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        told = _one_rank_loop(ddp, opt, 6, {2: (net[2], True), 4: (net[0], True)})
    assert [(a.module, a.step, a.data["parameters"], a.data["synced"]) for a in told] == [
        ("module.2", 2, ["module.2.weight", "module.2.bias"], 2),
        ("module.0", 4, ["module.0.weight", "module.0.bias"], 2),
    ]


def test_the_freeze_undone_note_under_ddp_points_at_the_sync_finding():
    """frozen_in_optimizer's note that a freeze ended does not say "nothing to do"
    alone under a process group: the wrapper may not sync what it unfroze."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    gen = torch.Generator().manual_seed(0)
    with one_process_group():
        net[0].requires_grad_(False)
        ddp = nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        with tw.watch(ddp, opt, console=False) as monitor:
            for step in range(8):
                if step == 5:
                    net[0].requires_grad_(True)
                x = torch.randn(16, 8, generator=gen)
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
                opt.step()
    (note,) = [a for a in monitor.alerts if a.data.get("kind") == "unfrozen"]
    assert "trainable_parameters" in note.hint and "DistributedDataParallel" in note.hint
    assert any(a.data.get("finding") == "not synced by DDP" for a in monitor.alerts)


def test_control_the_freeze_undone_note_on_one_process_says_nothing_to_do(quiet_watch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    net[0].requires_grad_(False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    monitor = quiet_watch(net, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        if step == 5:
            net[0].requires_grad_(True)
        x = torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), x[:, :1]).backward()
        opt.step()
    (note,) = [a for a in monitor.alerts if a.data.get("kind") == "unfrozen"]
    assert note.hint == "nothing to do: a freeze for warm-up or fine-tuning, ended as planned"
