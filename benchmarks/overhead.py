"""Overhead of trainwatch as a ratio to the same loop unmonitored, in one process.

Two identical copies of each model train side by side; blocks of steps
alternate between the plain copy and the watched one so that drift (thermal,
other load) hits both alike. The headline ratio is fastest watched block over
fastest plain block (the least disturbed of each); the median of per-round
ratios and its range are printed beside it. Times are never asserted anywhere.

    python benchmarks/overhead.py                 # MLP, CNN, transformer on CPU
    python benchmarks/overhead.py --quick         # seconds; a smoke run
    python benchmarks/overhead.py --device cuda --config configs/strict.yaml
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trainwatch as tw


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    steps_per_round: int
    rounds: int


def _mlp(quick: bool) -> Workload:
    width = 64 if quick else 512
    return Workload(
        "mlp",
        lambda: nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        ),
        lambda d: (torch.randn(128, 784, device=d), torch.randint(0, 10, (128,), device=d)),
        steps_per_round=5 if quick else 40,
        rounds=3 if quick else 15,
    )


def _cnn(quick: bool) -> Workload:
    ch = 8 if quick else 16
    size = 16 if quick else 32

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, ch, 3, padding=1),
            nn.BatchNorm2d(ch),
            nn.ReLU(),
            nn.Conv2d(ch, ch * 2, 3, padding=1),
            nn.BatchNorm2d(ch * 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(ch * 2, ch * 2, 3, padding=1),
            nn.BatchNorm2d(ch * 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(ch * 2, 10),
        )

    return Workload(
        "cnn",
        make,
        lambda d: (torch.randn(64, 3, size, size, device=d), torch.randint(0, 10, (64,), device=d)),
        steps_per_round=2 if quick else 6,
        rounds=3 if quick else 11,
    )


class _Transformer(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def _transformer(quick: bool) -> Workload:
    d, layers, seq = (32, 1, 16) if quick else (256, 4, 128)
    return Workload(
        "transformer",
        lambda: _Transformer(d, layers),
        lambda dev: (
            torch.randint(0, 1000, (8, seq), device=dev),
            torch.randint(0, 1000, (8 * seq,), device=dev),
        ),
        steps_per_round=2,
        rounds=3 if quick else 9,
    )


WORKLOADS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> float:
    # On CPU, this process's CPU time: other processes on a shared machine
    # then disturb the ratio far less than wall time would. On CUDA, wall time.
    return time.perf_counter() if device.type == "cuda" else time.process_time()


def _time_block(model, opt, batch, steps: int, device: torch.device) -> float:
    x, y = batch
    loss_fn = nn.functional.cross_entropy
    _sync(device)
    start = _clock(device)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    _sync(device)
    return _clock(device) - start


def measure(workload: Workload, device: torch.device, config: str | None) -> dict[str, float]:
    torch.manual_seed(0)
    plain = workload.make_model().to(device)
    watched = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_watched = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    batch = workload.make_batch(device)
    ratios, plain_times, watched_times = [], [], []
    with tw.watch(watched, opt_watched, config=config, console=False):
        for model, opt in ((plain, opt_plain), (watched, opt_watched)):
            _time_block(model, opt, batch, 2, device)  # warm-up
        for round_index in range(workload.rounds):
            pair = [(plain, opt_plain), (watched, opt_watched)]
            if round_index % 2:
                pair.reverse()
            times = {}
            for model, opt in pair:
                times[id(model)] = _time_block(model, opt, batch, workload.steps_per_round, device)
            ratios.append(times[id(watched)] / times[id(plain)])
            plain_times.append(times[id(plain)] / workload.steps_per_round)
            watched_times.append(times[id(watched)] / workload.steps_per_round)
    return {
        # The fastest block of each is the least disturbed by anything else
        # running on the machine: their ratio is the headline figure.
        "ratio": min(watched_times) / min(plain_times),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "plain_ms_per_step": 1000 * min(plain_times),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default=None, help="a trainwatch config (default: defaults)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps (smoke run)")
    parser.add_argument("--only", nargs="*", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (FACTS.md: 1)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--rounds", type=float, default=1.0, help="multiply every workload's rounds (steadier)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results = {}
    print(f"trainwatch overhead on {device} (config: {args.config or 'default'})")
    print(
        f"{'workload':<12} {'plain ms/step':>14} {'ratio':>7} {'median':>7} {'min':>6} {'max':>6}"
    )
    for name in args.only:
        workload = WORKLOADS[name](args.quick)
        workload.rounds = max(3, round(workload.rounds * args.rounds))
        result = measure(workload, device, args.config)
        results[name] = result
        print(
            f"{name:<12} {result['plain_ms_per_step']:>14.2f} {result['ratio']:>7.3f} "
            f"{result['ratio_median']:>7.3f} {result['ratio_min']:>6.3f} "
            f"{result['ratio_max']:>6.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
