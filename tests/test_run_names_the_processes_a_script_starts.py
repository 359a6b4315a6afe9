"""``trainwatch run`` around a script that trains in processes it starts itself: the
run watches no step, and its closing line names the processes, not the loop."""

from __future__ import annotations

import textwrap
from multiprocessing.process import BaseProcess

from trainwatch.runner import run_script

TRAIN = """
import torch
from torch import nn


def train(rank=0, *args):
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        x = torch.randn(32, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        opt.step()
"""

SPAWNED = (
    TRAIN
    + """
import torch.multiprocessing as mp

if __name__ == "__main__":
    mp.spawn(train, nprocs=2)
"""
)

# Forked: it inherits the run's hooks, which must leave its training alone (a
# TensorBoard flush there would wait forever on a writer thread not forked along).
PROCESS = (
    TRAIN
    + """
import multiprocessing
import sys

if __name__ == "__main__":
    worker = multiprocessing.get_context("fork").Process(target=train)
    worker.start()
    worker.join(60)
    if worker.exitcode is None:
        worker.kill()
        sys.exit("the forked process hung")
    assert worker.exitcode == 0
"""
)

# The control: training in the script's own process, its data read by worker processes.
WITH_DATA_WORKERS = (
    TRAIN
    + """
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    x = torch.randn(64, 8)
    loader = DataLoader(
        TensorDataset(x, x[:, :1].sin()), batch_size=16, num_workers=2,
        multiprocessing_context="fork",
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
"""
)


def _run(tmp_path, capsys, body: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(body))
    start = BaseProcess.start
    assert run_script(script, log_dir=tmp_path / "log") == 0
    assert BaseProcess.start is start  # put back when the run closed
    return capsys.readouterr().err


def test_ranks_started_with_mp_spawn_are_named_with_torchrun_as_the_way(tmp_path, capsys):
    err = _run(tmp_path, capsys, SPAWNED)
    assert "no training step watched in this process" in err
    assert "started 2 processes with torch.multiprocessing (mp.spawn" in err
    assert "torchrun --nproc-per-node=2 -m trainwatch run" in err and "train.py" in err
    assert "tw.watch(model, optimizer) inside the function the processes run" in err
    assert "no optimizer stepped" not in err


def test_a_forked_training_process_ends_and_is_named(tmp_path, capsys):
    err = _run(tmp_path, capsys, PROCESS)
    assert "no training step watched in this process" in err
    assert "started 1 process with multiprocessing" in err
    assert "tw.watch(model, optimizer) inside the function the process runs" in err
    assert "torchrun" not in err and "no optimizer stepped" not in err


def test_data_loader_workers_are_not_taken_for_training_processes(tmp_path, capsys):
    err = _run(tmp_path, capsys, WITH_DATA_WORKERS)
    assert "4 steps watched" in err
    assert "no training step watched" not in err and "process" not in err
