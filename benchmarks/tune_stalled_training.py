"""How stalled_training's thresholds were chosen: how far healthy and stalled runs move.

Trains healthy models of several families (an MLP, a CNN with batch norm, a
small transformer and an LSTM language model, a 'pretrained-like' model
fine-tuned at lr 1e-5 and 1e-6 with Adam and with SGD, learning-rate
schedules that end at or near 0: cosine to 0, warm-up then cosine, OneCycleLR,
ReduceLROnPlateau) and stalled ones (a learning rate of 1e-12, adapters on a
module whose output is scaled by 1e-6, an optimizer holding a copy of the
model, per-epoch schedulers stepped every batch: StepLR and ExponentialLR).
For each it prints the smallest move of the output on the first batch over
its spread (what stalled_training compares with ``min_change``) at or past
the warm-up; and, of two sampled steps in a row past the warm-up, the larger
of their largest-layer update-to-weight ratios, at its lowest over the run
(what it compares with ``min_update_ratio``). Each default sits between its
two groups with orders of magnitude to spare. Takes a minute or two on one
CPU thread.

    python benchmarks/tune_stalled_training.py
    python benchmarks/tune_stalled_training.py --steps 20 --every 5   # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
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
        self.largest: list[tuple[int, float]] = []  # each sampled step's largest layer ratio

    def emit(self, alert: tw.Alert) -> None:
        return None

    def on_step(self, numbers: StepNumbers) -> None:
        if numbers.output_change is not None:
            self.changes.append((numbers.step, numbers.output_change))
        if numbers.update_ratios:
            self.ratios.append(statistics.median(numbers.update_ratios.values()))
            self.largest.append((numbers.step, max(numbers.update_ratios.values())))


# Called after each optimizer step with the step and its loss: a learning-rate schedule.
Schedule = Callable[[int, float], None]


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
    schedule: Schedule | None = None,
) -> tuple[float, float, str]:
    """The smallest move past the warm-up, the lowest update ratio two sampled steps
    in a row past it stayed under, and how the rule fired ("" when it did not)."""
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
            if schedule is not None:
                schedule(step, loss.item())
    finally:
        monitor.close()
    late = [change for step, change in changes.changes if step + 1 >= warmup]
    smallest = min(late) if late else float("nan")
    ratio = statistics.median(changes.ratios) if changes.ratios else float("nan")
    largest = [value for step, value in changes.largest if step + 1 >= warmup]
    lowest = min(largest) if largest else float("nan")
    pairs = [max(a, b) for a, b in itertools.pairwise(largest)]
    quiet = min(pairs) if pairs else float("nan")
    fired = [a.data.get("criterion", "?") for a in monitor.alerts if a.rule == "stalled_training"]
    how = fired[0] if fired else ""
    print(
        f"{name:26s} smallest move past warm-up {smallest:9.2e}   "
        f"median ||dW||/||W|| {ratio:9.2e}   largest layer's: lowest {lowest:9.2e}, "
        f"two in a row {quiet:9.2e}   "
        f"fired: {how or 'no'}",
        flush=True,
    )
    return smallest, quiet, how


def per_batch(opt: torch.optim.Optimizer, make: Callable) -> Schedule:
    """A scheduler stepped after every batch."""
    scheduler = make(opt)
    return lambda step, loss: scheduler.step()


def on_plateau(opt: torch.optim.Optimizer, epoch: int) -> Schedule:
    """ReduceLROnPlateau stepped every ``epoch`` steps on their mean loss."""
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.3, patience=1)
    losses: list[float] = []

    def step(index: int, loss: float) -> None:
        losses.append(loss)
        if (index + 1) % epoch == 0:
            scheduler.step(statistics.fmean(losses))
            losses.clear()

    return step


def warmup_cosine(steps: int, warm: int) -> Callable[[int], float]:
    return lambda s: (
        s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm)))
    )


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
    # The output's smallest move of healthy and of stalled runs (min_change), and the
    # update ratio of runs whose updates move the weights and of those whose updates
    # stopped (min_update_ratio); what fired where nothing should have or should.
    healthy: list[float] = []
    stalled: list[float] = []
    moving: list[float] = []
    stopped: list[float] = []
    wrong: list[str] = []

    def both(
        name: str,
        model,
        opt,
        batch,
        loss_fn,
        sick: bool,
        watched: bool = True,
        schedule: Schedule | None = None,
        still: bool | None = None,
        updates: bool | None = None,
    ) -> None:
        """``sick``: stalled; ``still``: its output stays as it was (as ``sick``
        unless told); ``updates``: its updates move the weights (as a healthy run
        unless told)."""
        smallest, quiet, how = run(
            name, model, opt, batch, loss_fn, steps, every, warmup, watched, schedule
        )
        if not sick:
            healthy.append(smallest)
        elif still is None or still:
            stalled.append(smallest)
        if quiet == quiet:  # two sampled steps past the warm-up
            (moving if (not sick if updates is None else updates) else stopped).append(quiet)
        if bool(how) != sick:
            wrong.append(name)

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
    both(
        "lora on 1e-6 branch",
        tuned,
        torch.optim.Adam(lora, 1e-3),
        _fine_tune_batch(2),
        mse,
        True,
        updates=True,
    )
    model = mlp()
    copy_opt = torch.optim.Adam(copy.deepcopy(model).parameters(), 1e-3)
    both("optimizer on a copy", model, copy_opt, mlp_batch, ce, True, watched=False)
    tuned = pretrained()
    both(
        "fine-tune adam 1e-6",
        tuned,
        torch.optim.Adam(tuned.parameters(), 1e-6),
        _fine_tune_batch(2),
        mse,
        False,
    )
    # Schedules that end at (or close to) 0: the last sampled steps' updates are
    # tiny, never two of them in a row.
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    cosine = per_batch(opt, lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, steps))
    both("mlp adamw cosine to 0", model, opt, mlp_batch, ce, False, schedule=cosine)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    warm = per_batch(
        opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(steps, steps // 10))
    )
    both("mlp adamw warm-up+cosine", model, opt, mlp_batch, ce, False, schedule=warm)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    one = per_batch(opt, lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1e-2, total_steps=steps))
    both("mlp adamw onecycle", model, opt, mlp_batch, ce, False, schedule=one)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    plateau = on_plateau(opt, max(1, steps // 20))
    both("mlp adam reduce on plateau", model, opt, mlp_batch, ce, False, schedule=plateau)
    # Per-epoch schedules stepped every batch: the learning rate collapses within
    # the first sampled stretch, after real steps moved the output.
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    decay = per_batch(opt, lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.1))
    both("steplr per batch", model, opt, mlp_batch, ce, True, True, decay, False, False)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    decay = per_batch(opt, lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.8))
    both("exponentiallr per batch", model, opt, mlp_batch, ce, True, True, decay, False, False)
    default = Config().stalled_training
    lowest_healthy, highest_stalled = min(healthy), max(stalled)
    print(
        f"\nhealthy runs move at least {lowest_healthy:.2e}; stalled runs at most "
        f"{highest_stalled:.2e}; min_change {default.min_change:g} sits "
        f"{lowest_healthy / default.min_change:.0f}x below the one and "
        f"{default.min_change / max(highest_stalled, 1e-300):.2g}x above the other"
    )
    if moving and stopped:
        floor, lowest_moving, highest_stopped = default.min_update_ratio, min(moving), max(stopped)
        print(
            f"updates that move stay at or above {lowest_moving:.2e} of the weights two "
            f"sampled steps in a row; stopped ones at most {highest_stopped:.2e}; "
            f"min_update_ratio {floor:g} sits {lowest_moving / floor:.0f}x below the one "
            + (
                f"and {floor / highest_stopped:.2g}x above the other"
                if highest_stopped > 0.0
                else "and above the other (exactly 0: no weight moved)"
            )
        )
    if wrong:
        print("fired where it should not, or not where it should: " + ", ".join(wrong))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
