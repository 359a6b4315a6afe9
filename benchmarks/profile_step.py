"""Where a watched step's extra time goes: per-part ratios and a Python profile.

    python benchmarks/profile_step.py --device cuda --only transformer

For each workload of ``overhead.py``: the ratio with every rule on, then with
one family of checks switched off at a time (the difference is that family's
cost), then the functions trainwatch spends its own time in (cProfile over
watched steps). A development tool: nothing asserts on it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead

import trainwatch as tw

FAMILIES: dict[str, dict] = {
    "all on": {},
    # Every non-finite rule off: only then is the per-module probe not attached.
    "without NaN checks": {
        "nonfinite_forward": False,
        "nonfinite_backward": False,
        "nonfinite_loss": False,
        "nonfinite_parameter": False,
        "amp_skipped_steps": False,
    },
    "without behaviour checks": {
        "constant_output": False,
        "dead_units": False,
        "eval_in_train_mode": False,
        "train_in_eval_mode": False,
        "broadcast": False,
    },
    "without accumulation check": {"accumulated_gradient": False},
}


def _profile(workload: overhead.Workload, device: torch.device, steps: int) -> str:
    torch.manual_seed(0)
    model = workload.make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = workload.make_batch(device)
    with tw.watch(model, opt, console=False):
        overhead._time_block(model, opt, batch, 3, device)
        profiler = cProfile.Profile()
        profiler.enable()
        overhead._time_block(model, opt, batch, steps, device)
        profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", choices=sorted(overhead.WORKLOADS))
    parser.add_argument("--steps", type=int, default=20, help="profiled steps")
    parser.add_argument("--quick", action="store_true", help="tiny models (smoke run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for name in args.only or sorted(overhead.WORKLOADS):
        print(f"== {name} on {device}", flush=True)
        for family, config in FAMILIES.items():
            workload = overhead.WORKLOADS[name](args.quick)
            result = overhead.measure(workload, device, config or None)
            print(
                f"{family:30s} ratio {result['ratio']:.3f}  median {result['ratio_median']:.3f}  "
                f"plain {result['plain_ms_per_step']:.2f} ms",
                flush=True,
            )
        print(_profile(overhead.WORKLOADS[name](args.quick), device, args.steps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
