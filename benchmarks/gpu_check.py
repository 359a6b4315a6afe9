"""One command for the GPU machine: the CUDA tests, the op counts, then the overhead on CUDA.

    python benchmarks/gpu_check.py    # was under 8 minutes on one H200 before deep, gpt2, opcount

The overhead run covers every workload, deep (per-module costs dominate) and
gpt2 (GPT-2 small, where they should vanish) included. ``opcount.py`` counts
what a watched step adds (ops and Python calls at depth 4 and 64), so the
counts and the times of the same torch build sit in one log. Without a CUDA
device it says so and exits 0 at once, so it can run anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# The CUDA tests in one process (-n 0): they share the one GPU.
STEPS: list[tuple[str, list[str]]] = [
    ("CUDA tests", ["-m", "pytest", "-q", "-n", "0", "-m", "cuda", "tests"]),
    ("op counts", ["benchmarks/opcount.py", "--depths", "4", "64"]),
    (
        "CUDA overhead",
        ["benchmarks/overhead.py", "--device", "cuda", "--workloads"]
        + ["mlp", "cnn", "transformer", "deep", "gpt2"],
    ),
]


def _run(label: str, args: list[str], start: float) -> int:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, check=False)
    print(f"gpu_check: {label} exit {done.returncode} at {time.time() - start:.0f}s", flush=True)
    return done.returncode


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; CUDA tests, op counts and benchmark skipped")
        return 0
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    start = time.time()
    codes = [_run(label, args, start) for label, args in STEPS]
    print(f"gpu_check: done in {time.time() - start:.0f}s", flush=True)
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main())
