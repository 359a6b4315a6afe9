"""A NaN born in backward by a module's own code (not by one of its children).

``torch.sqrt`` of a zero distance inside a block's ``forward`` makes an
infinite derivative. A child reading the same tensor sees that tensor's whole
gradient (every reader's share summed), so the gradient hooks alone blamed
the child; with no child around the op, the NaN looked as if the loss had
made it. The replay's backward sees which autograd node made it: the
innermost module call whose part of the graph holds that node is named.
Each planted bug has its clean control beside it.
"""

from __future__ import annotations

import inspect
import io

import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.test_run import alerts as logged_alerts
from trainwatch.runner import run_script


class MessageBlock(nn.Module):
    """Graph message passing weighted by distance: a self-loop has distance 0."""

    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.eps = eps

    def forward(self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        dist = torch.sqrt(((h[src] - h[dst]) ** 2).sum(-1) + self.eps)
        weight = torch.exp(-dist)[:, None]
        return torch.zeros_like(h).index_add_(0, dst, self.lin(h)[src] * weight)


class GraphNet(nn.Module):
    def __init__(self, eps: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.block = MessageBlock(eps)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.block(self.inp(x), src, dst)))


def _graph_run(eps: float, self_loop_from: int) -> tw.Monitor:
    torch.manual_seed(0)
    net = GraphNet(eps)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x = torch.randn(10, 4)
    labels = torch.randint(0, 2, (10,))
    with tw.watch(net, opt, console=io.StringIO()) as monitor:
        for step in range(8):
            src = torch.tensor([0, 1, 2, 3, 4, 5])
            dst = torch.tensor([1, 2, 3, 4, 5, 5 if step >= self_loop_from else 6])
            opt.zero_grad()
            F.cross_entropy(net(x, src, dst), labels).backward()
            opt.step()
    return monitor


def _backward_origins(monitor: tw.Monitor) -> list[tuple[str | None, int, str | None]]:
    return [
        (a.module, a.step, a.data.get("op"))
        for a in monitor.alerts
        if a.rule.startswith("nonfinite")
    ]


def test_a_sqrt_in_a_blocks_own_forward_is_named_there_not_in_its_child():
    monitor = _graph_run(eps=0.0, self_loop_from=3)
    found = [a for a in monitor.alerts if a.rule.startswith("nonfinite")]
    assert found[0].rule == "nonfinite_backward"
    assert (found[0].module, found[0].step, found[0].data.get("op")) == (
        "block",
        3,
        "aten::sqrt",
    )


def test_the_same_graph_with_an_epsilon_under_the_sqrt_is_silent():
    monitor = _graph_run(eps=1e-12, self_loop_from=3)
    assert [a.key for a in monitor.alerts if a.severity != "info"] == []


class Scorer(nn.Module):
    """The model's own forward takes a norm between two children (``x / ||x||``)."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.encode = nn.Linear(6, 16, bias=False)
        self.head = nn.Linear(16, 1)
        self.safe = safe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.encode(x)
        length = torch.sqrt((z * z).sum(-1, keepdim=True) + (1e-12 if self.safe else 0.0))
        return self.head(z / (length + 1e-6))


def _scorer_run(safe: bool, clip: bool) -> tw.Monitor:
    torch.manual_seed(0)
    model = Scorer(safe)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(12):
            x = torch.randn(16, 6)
            if step == 7:
                x[3] = 0.0  # a blank sample: |z| = 0
            opt.zero_grad()
            F.mse_loss(model(x), torch.ones(16, 1)).backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    return monitor


def test_a_sqrt_in_the_models_own_forward_names_the_model_not_the_loss():
    for clip in (False, True):  # a clip spreads the NaN to every gradient: read before it
        monitor = _scorer_run(safe=False, clip=clip)
        found = [a for a in monitor.alerts if a.rule.startswith("nonfinite")]
        assert found, f"clip={clip}"
        assert (found[0].rule, found[0].module, found[0].step, found[0].data.get("op")) == (
            "nonfinite_backward",
            "",
            7,
            "aten::sqrt",
        ), f"clip={clip}"


def test_the_same_model_with_a_safe_norm_is_silent():
    for clip in (False, True):
        monitor = _scorer_run(safe=True, clip=clip)
        assert [a.key for a in monitor.alerts if a.severity != "info"] == [], f"clip={clip}"


class DistanceHead(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.distance = DistanceHead()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.distance(self.embed(a), self.embed(b))


def test_a_nan_born_inside_a_child_stays_with_the_child():
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(6):
            a = torch.randn(4, 5)
            b = a.clone() if step == 4 else torch.randn(4, 5)  # a pair identical: distance 0
            opt.zero_grad()
            model(a, b).mean().backward()
            opt.step()
    assert _backward_origins(monitor)[0] == ("distance", 4, "aten::sqrt")


# The same two classes, written out as an unmodified script's own.
GRAPH_SCRIPT = (
    "import torch\nfrom torch import nn\n\n\n"
    + inspect.getsource(MessageBlock)
    + "\n\n"
    + inspect.getsource(GraphNet)
    + """

torch.manual_seed(0)
net = GraphNet()
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x, labels = torch.randn(10, 4), torch.randint(0, 2, (10,))
for step in range(6):
    dst = torch.tensor([1, 2, 3, 4, 5, 5 if step >= 2 else 6])
    opt.zero_grad()
    nn.functional.cross_entropy(net(x, torch.arange(6), dst), labels).backward()
    opt.step()
"""
)


def test_trainwatch_run_names_the_block_whose_own_code_made_the_nan(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(GRAPH_SCRIPT)
    run_script(script, [], log_dir=tmp_path / "log")
    found = [a for a in logged_alerts(tmp_path / "log") if a["rule"].startswith("nonfinite")]
    assert (found[0]["rule"], found[0]["module"], found[0]["step"]) == (
        "nonfinite_backward",
        "block",
        2,
    )
    assert found[0]["data"]["op"] == "aten::sqrt"
