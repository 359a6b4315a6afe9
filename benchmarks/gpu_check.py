"""One command for the GPU machine: the CUDA tests, then the overhead on CUDA.

    python benchmarks/gpu_check.py            # under 8 minutes on one GPU

Without a CUDA device it says so and exits 0, so it can run anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; CUDA tests and the CUDA benchmark skipped")
        return 0
    print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    start = time.time()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests"], cwd=ROOT, check=False
    )
    print(
        f"gpu_check: CUDA tests exit {tests.returncode} in {time.time() - start:.0f}s", flush=True
    )
    bench = subprocess.run(
        [sys.executable, "benchmarks/overhead.py", "--device", "cuda"], cwd=ROOT, check=False
    )
    print(f"gpu_check: done in {time.time() - start:.0f}s", flush=True)
    return tests.returncode or bench.returncode


if __name__ == "__main__":
    sys.exit(main())
