"""A layer frozen after DDP wrapped the model: its reducer waits for gradients that never come.

``DistributedDataParallel`` (``find_unused_parameters=False``) takes the
parameters that require grad when it is built; one frozen afterwards gets no
gradient, and the next forward fails with "Expected to have finished reduction
in the prior iteration", naming reducer indices only. ``trainable_parameters``
tells it at the setup audit that sees the freeze (the attach, or the step
boundary of a ``requires_grad`` flip), naming the parameters, before DDP's
error; the error itself gets a note naming the indices. Two real gloo ranks
run every case in one launch (tests/scripts/ddp_frozen_after.py); the rest
runs on a one-process gloo group, whose reducer behaves as with more ranks.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import trainwatch as tw
from tests.ranks import ranks_of
from tests.test_never_called_in_optimizer import one_process_group

FREEZE_AT = 2
NAMES = ["module.0.weight", "module.0.bias"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return ranks_of("ddp_frozen_after.py", tmp_path_factory.mktemp("frozen_after"))


def _told(alerts: list[dict]) -> list[tuple]:
    return [
        (a["module"], a["step"], a["severity"], a["data"].get("finding"))
        for a in alerts
        if a["rule"] == "trainable_parameters"
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "module", "step", "names"),
    [
        ("frozen_after", "module.0", 0, NAMES),
        ("frozen_after_inner", "0", 0, ["0.weight", "0.bias"]),
        ("frozen_after_attach", "module.0", FREEZE_AT, NAMES),
    ],
)
def test_a_layer_frozen_after_ddp_was_built_is_told_before_ddp_fails(
    cases, case, module, step, names
):
    """Watching the wrapper or the model inside it; frozen before or after the attach."""
    zero, one = (record[case] for record in cases)
    for rank in (zero, one):
        assert "Expected to have finished reduction" in rank["error"]  # DDP's own error
        assert rank["steps"] == step + 1  # the forward after the freeze's step failed
        assert _told(rank["alerts"]) == [(module, step, "warning", "frozen after DDP")]
    # On rank zero's disk and console when DDP's error was caught.
    (alert,) = zero["on_disk_at_error"]
    assert _told([alert]) == [(module, step, "warning", "frozen after DDP")]
    assert alert["data"]["parameters"] == names
    assert (alert["data"]["synced"], alert["data"]["trainable"]) == (4, 2)
    assert "frozen now (requires_grad=False)" in alert["message"]
    assert "Expected to have finished reduction" in alert["message"]
    assert "Freeze the layer before wrapping the model in DDP" in alert["hint"]
    assert "find_unused_parameters=True" in alert["hint"]
    assert "trainable_parameters" in zero["console_at_error"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["frozen_after", "frozen_after_attach"])
def test_ddps_error_gets_a_note_naming_the_parameter_indices_it_lists(cases, case):
    for rank, record in enumerate(cases):
        assert record[case]["notes"][1:] == [
            f"trainwatch: DDP's parameter indices 0 1 (rank {rank}) are "
            "module.0.weight, module.0.bias"
        ]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["frozen_before", "find_unused"])
def test_control_frozen_before_wrapping_or_with_find_unused_parameters_trains_on_silently(
    cases, case
):
    """Frozen before DDP took the layer, or frozen after with find_unused_parameters=True:
    DDP copes; only the freeze left in the optimizer is told, as ever."""
    for record in cases:
        assert record[case]["error"] is None and record[case]["steps"] == 5
        assert _told(record[case]["alerts"]) == []
        assert [a["rule"] for a in record[case]["alerts"]] == ["frozen_in_optimizer"]


# -- one process ---------------------------------------------------------------


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )


def _loop(ddp, opt, steps: int, freeze_at: dict[int, nn.Module]):
    """Steps until DDP fails; ``freeze_at``: step -> the layer frozen before its forward
    (step -1: before the monitor attaches)."""
    gen = torch.Generator().manual_seed(0)
    if -1 in freeze_at:
        freeze_at[-1].requires_grad_(False)
    monitor = tw.watch(ddp, opt, console=io.StringIO())
    error = None
    try:
        for step in range(steps):
            if step in freeze_at:
                freeze_at[step].requires_grad_(False)
            x = torch.randn(16, 8, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
            opt.step()
    except RuntimeError as exc:
        error = exc
    monitor.close()
    return error, [a for a in monitor.alerts if a.rule == "trainable_parameters"]


def test_a_layer_frozen_after_wrapping_beside_one_frozen_before_is_named_alone_once_seen_training():
    """net[0] frozen before DDP took it, net[2] after: the monitor, attached between,
    names net[2] alone at the flip's step."""
    net = _net()
    with one_process_group():
        net[0].requires_grad_(False)
        ddp = DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        error, told = _loop(ddp, opt, 4, {1: net[2]})
    assert error is not None and "Expected to have finished reduction" in str(error)
    (alert,) = told
    assert (alert.module, alert.step, alert.data["finding"]) == ("module.2", 1, "frozen after DDP")
    assert alert.data["parameters"] == ["module.2.weight", "module.2.bias"]
    assert "module.2.weight, module.2.bias, trainable when DDP was built" in alert.message


def test_with_no_audit_before_the_freeze_the_frozen_ones_are_named_with_the_count_ddp_waits_for():
    """Both frozen before the attach, one of them before wrapping: which of the four
    DDP holds is not known, how many is."""
    net = _net()
    with one_process_group():
        net[0].requires_grad_(False)
        ddp = DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        error, told = _loop(ddp, opt, 4, {-1: net[2]})
    assert error is not None
    (alert,) = told
    assert (alert.module, alert.step) == ("module", 0)
    assert alert.data["parameters"] == [
        f"module.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")
    ]
    assert "2 of the parameter tensors frozen now" in alert.message
    assert (alert.data["synced"], alert.data["trainable"]) == (4, 2)


@pytest.mark.parametrize(
    "flags",
    [{"find_unused_parameters": True}, {"static_graph": True}],
    ids=["find_unused", "static_graph"],
)
def test_control_ddp_that_copes_with_a_layer_frozen_after_wrapping_is_not_told(flags):
    """find_unused_parameters=True finds it each step; a static graph, frozen before its
    first iteration, records it as unused."""
    net = _net()
    with one_process_group():
        ddp = DistributedDataParallel(net, **flags)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        error, told = _loop(ddp, opt, 4, {-1: net[0]})
    assert error is None and told == []


def test_control_a_layer_frozen_before_wrapping_is_not_told():
    net = _net()
    with one_process_group():
        net[0].requires_grad_(False)
        ddp = DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        error, told = _loop(ddp, opt, 4, {})
    assert error is None and told == []


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.head(h + self.branch(h).detach())  # the branch cut out of the graph


def test_ddps_error_for_a_branch_without_gradient_names_its_parameters():
    """Nothing frozen: the reducer's indices are those of the trainable parameters."""
    torch.manual_seed(0)
    with one_process_group():
        ddp = DistributedDataParallel(_Branchy())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(0)
        with pytest.raises(RuntimeError) as raised:
            with tw.watch(ddp, opt, console=io.StringIO()):
                for _ in range(3):
                    x = torch.randn(16, 8, generator=gen)
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
                    opt.step()
    assert raised.value.__notes__[1:] == [
        "trainwatch: DDP's parameter indices 2 3 (rank 0) are "
        "module.branch.weight, module.branch.bias"
    ]
