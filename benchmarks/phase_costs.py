"""Where a watched step's extra time falls: zero_grad, forward, loss, backward, step.

``overhead.py`` gives the whole step's ratio and ``hook_costs.py`` the time
spent inside trainwatch's own hooks. This times each phase of the loop
itself, the watched copy beside an identical plain one in alternating
blocks of steps, so it also shows what the hooks cost the model's own work
around them (a model's kernels run slower after Python has pushed their
code and data out of the caches) and what happens only on sampled steps
(the mean moves, the median does not). Times are printed, never asserted.

    python benchmarks/phase_costs.py                       # the MLP of overhead.py
    python benchmarks/phase_costs.py --workloads mlp deep --steady-malloc
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import ALL_WORKLOADS, _loss, _steady_malloc

import trainwatch as tw

PHASES = ("zero_grad", "forward", "loss", "backward", "step")


def _timed_steps(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    into: dict[str, list[float]],
) -> None:
    """``steps`` training steps, each phase's wall time appended to ``into``."""
    clock = time.perf_counter
    x, y = batch
    for _ in range(steps):
        began = clock()
        opt.zero_grad()
        zeroed = clock()
        output = model(x)
        forward = clock()
        loss = _loss(output, y)
        lossed = clock()
        loss.backward()
        backward = clock()
        opt.step()
        stepped = clock()
        for phase, start, end in zip(
            PHASES,
            (began, zeroed, forward, lossed, backward),
            (zeroed, forward, lossed, backward, stepped),
        ):
            into[phase].append(end - start)


def time_phases(
    name: str, blocks: int, block: int, warm: int, quick: bool, config: str | None = None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per-phase times of the plain loop and of the watched one, over the same steps."""
    workload = ALL_WORKLOADS[name](quick)
    if workload.step is not None:
        raise SystemExit(f"{name}: a workload with its own step has no phases to time")
    torch.manual_seed(0)
    plain = workload.make_model()
    watched = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_watched = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    batch = workload.make_batch(torch.device("cpu"))
    times = {"plain": {p: [] for p in PHASES}, "watched": {p: [] for p in PHASES}}
    loops = [("plain", plain, opt_plain), ("watched", watched, opt_watched)]
    with tw.watch(watched, opt_watched, config=config, console=False):
        scratch: dict[str, list[float]] = {p: [] for p in PHASES}
        for _, model, opt in loops:
            _timed_steps(model, opt, batch, warm, scratch)
        for index in range(blocks):
            order = loops if index % 2 == 0 else loops[::-1]  # each leads in turn
            for label, model, opt in order:
                _timed_steps(model, opt, batch, block, times[label])
    return times["plain"], times["watched"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(ALL_WORKLOADS), default=["mlp"])
    parser.add_argument("--config", help="a trainwatch config (default: defaults)")
    parser.add_argument("--blocks", type=int, default=20, help="blocks of each loop, alternating")
    parser.add_argument("--block", type=int, default=25, help="steps in a block")
    parser.add_argument("--warm", type=int, default=60, help="untimed steps first (the audits)")
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--steady-malloc", action="store_true", help="as in overhead.py")
    args = parser.parse_args(argv)
    if args.steady_malloc and not _steady_malloc():
        print("--steady-malloc: not glibc, left as it is", file=sys.stderr)
    for name in args.workloads:
        plain, watched = time_phases(
            name, args.blocks, args.block, args.warm, args.quick, args.config
        )
        plain_step = sum(statistics.mean(plain[p]) for p in PHASES)
        print(f"{name}: plain step {1e3 * plain_step:.2f} ms (mean of {len(plain['step'])} steps)")
        print(f"  {'phase':<10} {'plain us':>9} {'added us (median)':>18} {'added us (mean)':>16}")
        added_total = 0.0
        for phase in PHASES:
            median = statistics.median(watched[phase]) - statistics.median(plain[phase])
            mean = statistics.mean(watched[phase]) - statistics.mean(plain[phase])
            added_total += mean
            print(
                f"  {phase:<10} {1e6 * statistics.median(plain[phase]):>9.1f} "
                f"{1e6 * median:>18.1f} {1e6 * mean:>16.1f}"
            )
        ratio = 1 + added_total / plain_step
        print(f"  whole step: {1e6 * added_total:.0f} us added, {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
