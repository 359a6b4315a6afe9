"""``trainwatch demo``: a small training run on synthetic data with a planted bug.

Everything is made on the spot (no download, no GPU), so a first-time user
sees trainwatch catch a bug live within seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

import trainwatch as tw


class DemoNet(nn.Module):
    """A three-layer classifier with readable layer names for the alerts."""

    def __init__(self, inputs: int = 20, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.detach_fc1 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.detach_fc1:
            h = h.detach()  # the planted bug: fc1 is cut out of the graph
        h = torch.relu(self.fc2(h))
        return self.head(h)


@dataclass(frozen=True)
class Bug:
    name: str
    description: str
    expected_rule: str


BUGS: dict[str, Bug] = {
    bug.name: bug
    for bug in (
        Bug("missing_zero_grad", "optimizer.zero_grad() is dropped", "accumulated_gradient"),
        Bug("detached_layer", "fc1's output is .detach()ed", "zero_gradient"),
        Bug("frozen_layer", "fc2 is left frozen inside the optimizer", "frozen_in_optimizer"),
    )
}
DEFAULT_BUG = "missing_zero_grad"


def synthetic_data(
    samples: int = 512, inputs: int = 20, classes: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, inputs, generator=generator)
    teacher = torch.randn(inputs, classes, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return x, y


def run_demo(
    bug: str | None = DEFAULT_BUG,
    *,
    steps: int = 120,
    bug_at: int | None = None,
    log_dir: str | Path | None = None,
    delay: float = 0.01,
    console: Console | None = None,
    monitor_console: bool = True,
) -> tw.Monitor:
    """Train DemoNet for ``steps`` steps, planting ``bug`` at step ``bug_at``.

    By default the run is healthy for its first third and goes wrong after.
    """
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose from: {', '.join(BUGS)}")
    out = console or Console(stderr=True, highlight=False)
    bug_at = steps // 3 if bug_at is None else bug_at
    torch.manual_seed(0)
    x, y = synthetic_data()
    model = DemoNet()
    if bug == "frozen_layer":
        bug_at = 0
        for p in model.fc2.parameters():
            p.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    planted = f"'{bug}' ({BUGS[bug].description}) from step {bug_at}" if bug else "no bug"
    out.print(f"[bold]trainwatch demo[/]: {steps} steps of a 3-layer MLP, {planted}")
    monitor = tw.watch(model, optimizer, log_dir=log_dir, console=monitor_console)
    with monitor:
        for step in range(steps):
            buggy = bug is not None and step >= bug_at
            model.detach_fc1 = buggy and bug == "detached_layer"
            batch = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step))
            if not (buggy and bug == "missing_zero_grad"):
                optimizer.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            if step % 20 == 0 or step == steps - 1:
                out.print(
                    f"[dim]step {step:4d}  loss {loss.item():.4f}  "
                    f"grad norm {monitor.total_grad_norm or 0.0:.3f}[/]"
                )
            if delay:
                time.sleep(delay)
    if log_dir is not None:
        out.print(f"alerts written to {Path(log_dir) / 'alerts.jsonl'}")
    return monitor
