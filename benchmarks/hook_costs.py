"""Where a watched step's time goes: each of trainwatch's hooks, timed inside the loop.

``overhead.py`` gives the ratio; this says which hook it is spent in. Every
hook trainwatch installs calls through one adapter (``WeakHook``), so timing
that adapter per (collector, method) covers the forward, backward and
optimizer hooks alike. A hook costs several times more here than the same
code run in a tight loop: between two hooks the model's own work has
evicted trainwatch's code and data from the caches, which is what a real
loop pays. Times are printed, never asserted.

    python benchmarks/hook_costs.py                     # the MLP of overhead.py
    python benchmarks/hook_costs.py --workloads mlp deep --steady-malloc
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import ALL_WORKLOADS, _loss, _steady_malloc

import trainwatch as tw
from trainwatch import hooks


def time_hooks(name: str, steps: int, warm: int, quick: bool) -> tuple[float, dict]:
    """(plain ms a step, {(collector, method): (calls a step, us a step, median us a call)})."""
    workload = ALL_WORKLOADS[name](quick)
    torch.manual_seed(0)
    model = workload.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = workload.make_batch(torch.device("cpu"))

    def step() -> None:
        if workload.step is not None:
            workload.step(model, opt, batch)
            return
        x, y = batch
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()

    for _ in range(warm):
        step()
    start = time.process_time()
    for _ in range(steps):
        step()
    plain_ms = 1000 * (time.process_time() - start) / steps

    spent: dict[tuple[str, str], list[float]] = defaultdict(list)
    call = hooks.WeakHook.__call__
    clock = time.perf_counter

    def timed(self: hooks.WeakHook, *args: Any) -> Any:
        began = clock()
        try:
            return call(self, *args)
        finally:
            spent[(type(self.ref()).__name__, self.method)].append(clock() - began)

    hooks.WeakHook.__call__ = timed  # type: ignore[method-assign]
    try:
        with tw.watch(model, opt, console=False):
            for _ in range(warm):
                step()
            spent.clear()
            for _ in range(steps):
                step()
    finally:
        hooks.WeakHook.__call__ = call  # type: ignore[method-assign]
    return plain_ms, {
        key: (len(times) / steps, 1e6 * sum(times) / steps, 1e6 * statistics.median(times))
        for key, times in sorted(spent.items(), key=lambda item: -sum(item[1]))
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(ALL_WORKLOADS), default=["mlp"])
    parser.add_argument("--steps", type=int, default=400, help="timed steps")
    parser.add_argument("--warm", type=int, default=100, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--steady-malloc", action="store_true", help="as in overhead.py")
    args = parser.parse_args(argv)
    if args.steady_malloc and not _steady_malloc():
        print("--steady-malloc: not glibc, left as it is", file=sys.stderr)
    torch.set_num_threads(1)
    for name in args.workloads:
        plain_ms, costs = time_hooks(name, args.steps, args.warm, args.quick)
        total = sum(us for _, us, _ in costs.values())
        print(f"{name}: plain step {plain_ms:.2f} ms; trainwatch's hooks {total:.0f} us a step")
        print(f"  {'hook':<50} {'calls/step':>10} {'us/step':>8} {'median us':>10}")
        for (owner, method), (calls, us, median) in costs.items():
            print(f"  {owner + '.' + method:<50} {calls:>10.2f} {us:>8.1f} {median:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
