"""``trainwatch demo``: a small training run on synthetic data with a planted bug.

Everything is made on the spot (no download, no GPU), so a first-time user
sees trainwatch catch a bug live within seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw


class UnsafeLinear(nn.Linear):
    """``nn.Linear`` that can be told to take the log of its output: the NaN bug.

    The log of a pre-activation that can be negative is a classic source of a
    NaN produced inside one layer from finite inputs.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return torch.log(out) if self.log_output else out


class DemoNet(nn.Module):
    """A small classifier with readable layer names for the alerts.

    Dropout gives the train/eval mode bugs something to get wrong.
    """

    def __init__(self, inputs: int = 20, hidden: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.drop = nn.Dropout(0.1)
        self.fc2 = UnsafeLinear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.detach_fc1 = False
        self.skip_into_fc2 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        if self.detach_fc1:
            h = h.detach()  # the planted bug: fc1 is cut out of the graph
        if self.skip_into_fc2:
            # the planted bug: a skip connection concatenated in, fc2 not resized for it
            h = torch.cat([h, h], dim=1)
        h = torch.relu(self.fc2(h))
        return self.head(h)


class LoraLinear(nn.Module):
    """A LoRA adapter in PEFT's layout: ``base_layer`` frozen, ``lora_A``/``lora_B`` trained."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)  # the adapter starts as a no-op
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.lora_B["default"](self.lora_A["default"](x))
        return self.base_layer(x) + self.scaling * delta


class LoraDemoNet(DemoNet):
    """DemoNet with a side projection (a feature summary for logging) beside the classifier.

    The projection runs every step but its output never reaches the loss: the
    wrong place for adapters.
    """

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(self.fc1.out_features, self.fc1.out_features)
        self.feature_norm: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        self.feature_norm = self.side(h).norm()  # logged, never part of the loss
        h = torch.relu(self.fc2(h))
        return self.head(h)


def _inputs_require_grad(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    """PEFT's ``enable_input_require_grads``: lets gradients flow with a frozen first layer."""
    output.requires_grad_(True)


def lora_fine_tune(target: str) -> tuple[LoraDemoNet, list[nn.Parameter]]:
    """Freeze the model and wrap ``target`` with an adapter; the parameters to train."""
    model = LoraDemoNet()
    for param in model.parameters():
        param.requires_grad_(False)
    setattr(model, target, LoraLinear(getattr(model, target)))
    model.fc1.register_forward_hook(_inputs_require_grad)
    return model, [p for p in model.parameters() if p.requires_grad]


@dataclass(frozen=True)
class Bug:
    name: str
    description: str
    expected_rule: str
    module: str | None = None  # where the alert should point, when a module applies
    raises: bool = False  # the run stops with an exception whose note names the module


BUGS: dict[str, Bug] = {
    bug.name: bug
    for bug in (
        Bug("missing_zero_grad", "optimizer.zero_grad() is dropped", "accumulated_gradient"),
        Bug(
            "forgotten_eval",
            "the evaluation runs without model.eval(), dropout still on",
            "eval_in_train_mode",
            "drop",
        ),
        Bug(
            "forgotten_train_after_eval",
            "model.train() is not called after an evaluation",
            "train_in_eval_mode",
            "drop",
        ),
        Bug(
            "broadcast_loss",
            "a hand-written loss subtracts a (N, 1) from a (N,) tensor",
            "broadcast",
        ),
        Bug("detached_layer", "fc1's output is .detach()ed", "zero_gradient", "fc1"),
        Bug(
            "frozen_layer",
            "fc2 is left frozen inside the optimizer",
            "frozen_in_optimizer",
            "fc2",
        ),
        Bug(
            "nan_in_layer",
            "fc2 takes the log of its output, which can be negative",
            "nonfinite_forward",
            "fc2",
        ),
        Bug(
            "shape_error",
            "fc2 is fed a concatenation twice as wide as it takes",
            "(error note)",
            "fc2",
            raises=True,
        ),
        Bug(
            "lora_wrong_target",
            "LoRA adapters wrap 'side', whose output never reaches the loss, not fc2",
            "trainable_parameters",
            "side",
        ),
        Bug(
            "unshuffled",
            "the training data is stored sorted by label and read with shuffle=False",
            "unshuffled_data",
        ),
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


def demo_log_dir(root: str | Path = "runs/trainwatch") -> Path:
    """A fresh ``runs/trainwatch/demo-<timestamp>`` for one demo run."""
    from trainwatch.runner import default_log_dir

    return default_log_dir(root, prefix="demo-")


def _loss(logits: torch.Tensor, y: torch.Tensor, broadcast_slip: bool) -> torch.Tensor:
    """Cross-entropy; with the slip it is the classic hand-written one gone wrong."""
    if not broadcast_slip:
        return nn.functional.cross_entropy(logits, y)
    picked = logits.gather(1, y[:, None]).squeeze(1)  # (N,)
    # keepdim leaves (N, 1): minus (N,) broadcasts to (N, N), and the mean hides it
    return (logits.logsumexp(1, keepdim=True) - picked).mean()


def run_demo(
    bug: str | None = DEFAULT_BUG,
    *,
    steps: int = 120,
    bug_at: int | None = None,
    log_dir: str | Path | None = None,
    delay: float = 0.01,
    console: Console | None = None,
    monitor_console: bool = True,
    eval_every: int = 10,
) -> tw.Monitor:
    """Train DemoNet for ``steps`` steps, planting ``bug`` at step ``bug_at``.

    By default the run is healthy for its first third and goes wrong after.
    A bug that raises (``shape_error``) stops the run with its exception, the
    note under its traceback naming the module. An evaluation on held-out
    data runs every ``eval_every`` steps. With ``log_dir``, alerts go to
    ``alerts.jsonl`` and the loss curve to TensorBoard event files there.
    """
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose from: {', '.join(BUGS)}")
    out = console or Console(stderr=True, highlight=False)
    bug_at = steps // 3 if bug_at is None else bug_at
    torch.manual_seed(0)
    x, y = synthetic_data(samples=768)
    x, y, x_val, y_val = x[:512], y[:512], x[512:], y[512:]  # one teacher, held-out tail
    model = DemoNet()
    if bug in ("frozen_layer", "broadcast_loss", "shape_error", "lora_wrong_target", "unshuffled"):
        # Set-up mistakes, there from the first step (the broadcast audit looks
        # at the first steps only, where shape bugs show).
        bug_at = 0
    if bug == "frozen_layer":
        for p in model.fc2.parameters():
            p.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if bug == "lora_wrong_target":
        model, trainable = lora_fine_tune("side")  # meant: "fc2"
        optimizer = torch.optim.SGD(trainable, lr=0.05, momentum=0.9)
    planted = f"'{bug}' ({BUGS[bug].description}) from step {bug_at}" if bug else "no bug"
    out.print(
        f"[bold]trainwatch demo[/]: {steps} steps of a 3-layer MLP, {planted}", soft_wrap=True
    )
    loader = None
    if bug == "unshuffled":
        # Sorted by label, as a dataset gathered class by class often is, and
        # read in order: every batch holds one class.
        order = torch.argsort(y, stable=True)
        loader = DataLoader(TensorDataset(x[order], y[order]), batch_size=64, shuffle=False)
    batches = _endless(loader) if loader is not None else None
    writer = _writer(log_dir)
    monitor = tw.watch(model, optimizer, log_dir=log_dir, console=monitor_console, data=loader)
    try:
        with monitor:
            for step in range(steps):
                buggy = bug is not None and step >= bug_at
                model.detach_fc1 = buggy and bug == "detached_layer"
                if isinstance(model.fc2, UnsafeLinear):
                    model.fc2.log_output = buggy and bug == "nan_in_layer"
                model.skip_into_fc2 = buggy and bug == "shape_error"
                if batches is not None:
                    xb, yb = next(batches)
                else:
                    gen = torch.Generator().manual_seed(step)
                    batch = torch.randint(0, len(x), (64,), generator=gen)
                    xb, yb = x[batch], y[batch]
                if not (buggy and bug == "missing_zero_grad"):
                    optimizer.zero_grad()
                loss = _loss(model(xb), yb, buggy and bug == "broadcast_loss")
                loss.backward()
                monitor.step(loss=loss)  # optional with an optimizer: lets loss rules see it
                optimizer.step()
                if writer is not None:
                    writer.add_scalar("demo/loss", loss.item(), step)
                line = f"step {step:4d}  loss {loss.item():.4f}"
                if step % eval_every == eval_every - 1:
                    accuracy = _evaluate(model, x_val, y_val, bug if buggy else None)
                    line += f"  val acc {accuracy:.2f}"
                    if writer is not None:
                        writer.add_scalar("demo/val_accuracy", accuracy, step)
                if step == 0 or step % 20 == eval_every - 1 or step == steps - 1:
                    norm = monitor.total_grad_norm or 0.0
                    out.print(f"[dim]{line}  grad norm {norm:.3f}[/]")
                if delay:
                    time.sleep(delay)
    finally:
        if writer is not None:
            writer.close()
    if log_dir is not None:
        out.print(f"alerts written to {Path(log_dir) / 'alerts.jsonl'}", soft_wrap=True)
        out.print(f"see the run in TensorBoard: tensorboard --logdir {log_dir}", soft_wrap=True)
    return monitor


def _endless(loader: DataLoader) -> Iterator[Any]:
    """Epoch after epoch of ``loader``, as a loop over epochs would read it."""
    while True:
        yield from loader


def _evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bug: str | None) -> float:
    """Held-out accuracy; the mode bugs are planted here, where they happen in real code."""
    if bug != "forgotten_eval":
        model.eval()
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if bug != "forgotten_train_after_eval":
        model.train()
    return accuracy


def _writer(log_dir: str | Path | None) -> Any:
    """A TensorBoard writer for the demo's own curves; None without a log dir."""
    if log_dir is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(log_dir))
