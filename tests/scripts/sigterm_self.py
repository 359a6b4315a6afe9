"""Sends itself SIGTERM at a chosen moment (tests/test_long_run.py).

python tests/scripts/sigterm_self.py during-write LOG_DIR
    while trainwatch is inside one of its own TensorBoard writes: the write
    must finish (it prints "write finished") before the monitor closes and
    the process dies, and nothing after it runs ("after write").
python tests/scripts/sigterm_self.py close-hangs
    while something trainwatch must close never finishes closing: the
    process must still die by SIGTERM (the watchdog), not hang.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import trainwatch as tw
from tests.conftest import TinyNet, train
from trainwatch import termination


class HangsOnClose:
    def close(self) -> None:
        threading.Event().wait()


def during_write(log_dir: str) -> None:
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(model, opt, log_dir=log_dir, console=False)
    train(model, opt, 3, zero_grad_until=1)

    @termination.uninterrupted
    def write() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        print("write finished", flush=True)

    write()
    print("after write", monitor, flush=True)


def close_hangs() -> None:
    model = TinyNet()
    monitor = tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.01), console=False)
    hanging = HangsOnClose()
    termination.hold(hanging)  # newest: closed first, and never done
    os.kill(os.getpid(), signal.SIGTERM)
    print("still alive", monitor, flush=True)  # the handler never returns; the watchdog ends it


if __name__ == "__main__":
    if sys.argv[1] == "during-write":
        during_write(sys.argv[2])
    else:
        close_hangs()
