"""How stalled_training's min_change was chosen: how far healthy and stalled runs move the output.

Trains healthy models of several families (an MLP, a CNN with batch norm, a
small transformer and an LSTM language model, a 'pretrained-like' model
fine-tuned at lr 1e-5 with Adam and with SGD) and stalled ones (a learning
rate of 1e-12, adapters on a module whose output is scaled by 1e-6, an
optimizer holding a copy of the model), and prints for each the smallest move
of the output on the first batch over its spread (what stalled_training
compares with ``min_change``) at or past the warm-up, and the median
update-to-weight ratio. The default sits between the two groups with orders
of magnitude to spare. Takes a minute or two on one CPU thread.

    python benchmarks/tune_stalled_training.py
    python benchmarks/tune_stalled_training.py --steps 20 --every 5   # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import _cnn, _Transformer

import trainwatch as tw
from trainwatch.config import Config
from trainwatch.sinks import Sink, StepNumbers

VOCAB = 200


class _Changes(Sink):
    """Keeps the figures of stalled_training's sampled steps."""

    def __init__(self) -> None:
        self.changes: list[tuple[int, float]] = []
        self.ratios: list[float] = []

    def emit(self, alert: tw.Alert) -> None:
        return None

    def on_step(self, numbers: StepNumbers) -> None:
        if numbers.output_change is not None:
            self.changes.append((numbers.step, numbers.output_change))
        if numbers.update_ratios:
            self.ratios.append(statistics.median(numbers.update_ratios.values()))


def run(
    name: str,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    steps: int,
    every: int,
    warmup: int,
    watch_optimizer: bool = True,
) -> tuple[float, bool]:
    """The smallest move past the warm-up, and whether the rule fired."""
    torch.manual_seed(0)
    config = Config.from_dict({"stalled_training": {"every": every, "warmup": warmup}})
    changes = _Changes()
    # An optimizer over another copy of the model is refused when watched with
    # it (no parameter of the model): that run is watched with monitor.step().
    optimizers = [opt] if watch_optimizer else []
    monitor = tw.Monitor(model, optimizers, config=config, sinks=[changes])
    try:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            monitor.step(loss=loss)
    finally:
        monitor.close()
    late = [change for step, change in changes.changes if step + 1 >= warmup]
    smallest = min(late) if late else float("nan")
    ratio = statistics.median(changes.ratios) if changes.ratios else float("nan")
    fired = any(a.rule == "stalled_training" for a in monitor.alerts)
    print(
        f"{name:24s} smallest move past warm-up {smallest:9.2e}   "
        f"median ||dW||/||W|| {ratio:9.2e}   fired: {fired}",
        flush=True,
    )
    return smallest, fired


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(tokens))[0]).flatten(0, 1)


class Scaled(nn.Module):
    """A branch whose output the model scales down to almost nothing."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner = inner
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B @ A`` (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        for param in base.parameters():
            param.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


class Backbone(nn.Module):
    """A 'pretrained-like' regressor: a trunk, a side branch scaled by 1e-6, a head."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width))
        self.side = Scaled(nn.Linear(width, width), 1e-6)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return self.head(h + self.side(h))


def pretrained(seed: int = 0) -> Backbone:
    """A backbone trained for a while on a task of its own (no download)."""
    torch.manual_seed(seed)
    model = Backbone()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(150):
        x = torch.randn(64, 16, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), _target(x)).backward()
        opt.step()
    return model


def _target(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x[:, :4].sum(1).sin(), x[:, 4:8].prod(1), x[:, 8].cos(), x[:, 9]], 1)


def _fine_tune_batch(seed: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 16, generator=gen)
        return x, _target(x) + 0.3 * x[:, 10:14]  # a shifted task: fine-tuning has work to do

    return batch


def with_lora(model: Backbone, target: str) -> Backbone:
    """Adapters on ``target`` (a Linear inside the model), everything else frozen."""
    for param in model.parameters():
        param.requires_grad_(False)
    parent_name, _, child = target.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, child, LoRALinear(getattr(parent, child)))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps, every, warmup = args.steps, args.every, args.warmup
    gen = torch.Generator().manual_seed(1)
    ce, mse = nn.functional.cross_entropy, nn.functional.mse_loss
    healthy: list[float] = []
    stalled: list[float] = []

    def both(name: str, model, opt, batch, loss_fn, sick: bool, watched: bool = True) -> None:
        smallest, _ = run(name, model, opt, batch, loss_fn, steps, every, warmup, watched)
        (stalled if sick else healthy).append(smallest)

    x = torch.randn(2048, 64, generator=gen)
    y = x[:, :10].argmax(1)

    def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * 64) % (len(x) - 64)
        return x[start : start + 64], y[start : start + 64]

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    model = mlp()
    both("mlp adam 1e-3", model, torch.optim.Adam(model.parameters(), 1e-3), mlp_batch, ce, False)
    model = mlp()
    both("mlp sgd 1e-3", model, torch.optim.SGD(model.parameters(), 1e-3), mlp_batch, ce, False)
    xc = torch.randn(512, 3, 16, 16, generator=gen)
    yc = (xc.mean((1, 2, 3)) > 0).long()

    def cnn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * 32) % (len(xc) - 32)
        return xc[start : start + 32], yc[start : start + 32]

    cnn = _cnn(True).make_model()
    both("cnn+bn adamw 1e-3", cnn, torch.optim.AdamW(cnn.parameters(), 1e-3), cnn_batch, ce, False)
    zipf = 1.0 / torch.arange(1, VOCAB + 1).float()

    def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.multinomial(zipf, 8 * 17, replacement=True, generator=gen).view(8, 17)
        return t[:, :16], t[:, 1:].reshape(-1)

    lm = _Transformer(32, 1, VOCAB)
    both(
        "transformer adamw 3e-4", lm, torch.optim.AdamW(lm.parameters(), 3e-4), lm_batch, ce, False
    )
    lstm = _LSTM()
    both("lstm adamw 3e-3", lstm, torch.optim.AdamW(lstm.parameters(), 3e-3), lm_batch, ce, False)
    tuned = pretrained()
    both(
        "fine-tune adam 1e-5",
        tuned,
        torch.optim.Adam(tuned.parameters(), 1e-5),
        _fine_tune_batch(2),
        mse,
        False,
    )
    tuned = pretrained()
    both(
        "fine-tune sgd 1e-3",
        tuned,
        torch.optim.SGD(tuned.parameters(), 1e-3),
        _fine_tune_batch(2),
        mse,
        False,
    )
    tuned = with_lora(pretrained(), "trunk.2")
    lora = [p for p in tuned.parameters() if p.requires_grad]
    both(
        "lora trunk adam 1e-4", tuned, torch.optim.Adam(lora, 1e-4), _fine_tune_batch(2), mse, False
    )
    model = mlp()
    both(
        "mlp adam lr 1e-12", model, torch.optim.Adam(model.parameters(), 1e-12), mlp_batch, ce, True
    )
    tuned = pretrained()
    both(
        "fine-tune adam 1e-12",
        tuned,
        torch.optim.Adam(tuned.parameters(), 1e-12),
        _fine_tune_batch(2),
        mse,
        True,
    )
    tuned = with_lora(pretrained(), "side.inner")
    lora = [p for p in tuned.parameters() if p.requires_grad]
    both("lora on 1e-6 branch", tuned, torch.optim.Adam(lora, 1e-3), _fine_tune_batch(2), mse, True)
    model = mlp()
    copy_opt = torch.optim.Adam(copy.deepcopy(model).parameters(), 1e-3)
    both("optimizer on a copy", model, copy_opt, mlp_batch, ce, True, watched=False)
    lowest_healthy, highest_stalled = min(healthy), max(stalled)
    default = Config().stalled_training.min_change
    print(
        f"\nhealthy runs move at least {lowest_healthy:.2e}; stalled runs at most "
        f"{highest_stalled:.2e}; min_change {default:g} sits "
        f"{lowest_healthy / default:.0f}x below the one and "
        f"{default / max(highest_stalled, 1e-300):.2g}x above the other"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
