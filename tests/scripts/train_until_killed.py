"""A plain loop with planted bugs that trains until it is killed (tests/test_long_run.py).

    python tests/scripts/train_until_killed.py --log-dir DIR [--ready-after N]
    trainwatch run --log-dir DIR tests/scripts/train_until_killed.py --unwatched

fc1 is cut out of the graph (``zero_gradient``, once) and ``zero_grad()`` is
never called (``accumulated_gradient``, every step from step 1). After each
step it prints ``step S alerts K`` (K: first alerts so far; without its own
monitor, ``step S``), flushed, so the test knows how far the run got before
its signal, and ``READY`` once alerts are out and N steps have passed. Then it
trains on, forever.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir")
    parser.add_argument("--ready-after", type=int, default=30)
    parser.add_argument("--unwatched", action="store_true", help="no tw.watch (trainwatch run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyNet()
    model.detach_fc1 = True
    # lr 0: the gradients pile up (that is the bug) but the weights stay put,
    # so the numbers stay finite however long the test lets it run.
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = None if args.unwatched else tw.watch(model, opt, log_dir=args.log_dir, console=False)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    step = 0
    while True:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        alerts = "" if monitor is None else f" alerts {len(monitor.alerts)}"
        print(f"step {step}{alerts}", flush=True)
        if step == args.ready_after:
            print("READY", flush=True)
        step += 1


if __name__ == "__main__":
    main()
