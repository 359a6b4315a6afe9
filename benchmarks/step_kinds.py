"""What trainwatch adds to each kind of step: the usual one, and its sampled looks.

    python benchmarks/step_kinds.py [--workload mlp] [--steps 600] [--from-step 100]

Times the plain loop and the watched one a step at a time, alternated, past
``--from-step`` untimed steps, and sorts each step's gap (watched minus
plain) by the looks the default config makes at it: stalled_training's re-run
of its first batch (every ``stalled_training.every`` steps), the activation
sample (every ``constant_output.every``), the class-target look at the loss
(every ``unshuffled_data.every``), or none (the usual step). The mean of all
gaps over the mean plain step is ``overhead.py``'s ratio; the rows say how
much of it the usual step pays and how much the sampled looks add on
average. Single steps are noisy on a shared machine: read medians.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead

import trainwatch as tw


def _kind(step: int, config: tw.Config) -> str:
    if step % config.stalled_training.every == 0:
        return "stalled_training re-run"
    if step % config.constant_output.every == 0:
        return "activation sample"
    if step % config.unshuffled_data.every == 0:
        return "class-target look"
    return "usual step"


def step_gaps(workload: str, steps: int, from_step: int) -> tuple[list[float], dict[str, list]]:
    """The plain loop's step times, and each kind's watched-minus-plain gaps (seconds)."""
    torch.set_num_threads(1)
    overhead._steady_malloc()
    torch.manual_seed(0)
    chosen = overhead.ALL_WORKLOADS[workload](False)
    plain = chosen.make_model()
    watched = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_watched = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    device = torch.device("cpu")
    batch = chosen.make_batch(device)

    def one(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        return overhead._time_block(model, opt, batch, 1, device, step=chosen.step)

    plain_times: list[float] = []
    gaps: dict[str, list[float]] = {}
    with tw.watch(watched, opt_watched, console=False) as monitor:
        for _ in range(from_step):
            one(plain, opt_plain)
            one(watched, opt_watched)
        for step in range(from_step, from_step + steps):
            took = one(plain, opt_plain)
            gap = one(watched, opt_watched) - took
            plain_times.append(took)
            gaps.setdefault(_kind(step, monitor.config), []).append(gap)
    return plain_times, gaps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(overhead.ALL_WORKLOADS))
    parser.add_argument("--steps", type=int, default=600, help="steps timed")
    parser.add_argument("--from-step", type=int, default=100, help="untimed steps first")
    args = parser.parse_args(argv)
    plain_times, gaps = step_gaps(args.workload, args.steps, args.from_step)
    step = statistics.mean(plain_times)
    print(f"{args.workload}: plain step {statistics.median(plain_times) * 1e6:.0f} us (median)")
    print(f"{'kind of step':26s} {'steps':>6s} {'median gap us':>14s} {'mean gap us':>12s}")
    every = [gap for kind in gaps.values() for gap in kind]
    for kind, found in sorted(gaps.items(), key=lambda kv: -len(kv[1])):
        median, mean = statistics.median(found) * 1e6, statistics.mean(found) * 1e6
        print(f"{kind:26s} {len(found):6d} {median:14.0f} {mean:12.0f}")
    mean_gap = statistics.mean(every)
    print(f"all steps: mean gap {mean_gap * 1e6:.0f} us, ratio {1 + mean_gap / step:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
