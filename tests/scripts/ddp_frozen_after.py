"""Two gloo ranks with a layer frozen around the time DDP wraps the model: run by
tests/test_ddp_frozen_after.py.

``python ddp_frozen_after.py OUT``: each rank runs every case in turn, each
with its own model, optimizer, ``tw.watch`` and log directory, and writes
``OUT/rank<r>.json``: per case, DDP's error and the notes trainwatch added to
it, the steps the monitor counted, what the case's ``alerts.jsonl`` held when
the error was caught (rank zero) and the monitor's alerts after close.

- ``frozen_after``: the first layer frozen after DDP and the optimizer were
  built (``find_unused_parameters=False``): DDP's reducer still waits for its
  gradients, and the forward of step 1 fails on every rank (the bug).
- ``frozen_after_inner``: the same, watching the model inside the wrapper.
- ``frozen_after_attach``: the monitor attached first; the layer frozen at
  step ``FREEZE_AT``, so DDP fails at the forward after it.
- ``frozen_before``: frozen before DDP wraps the model, every parameter in
  the optimizer: DDP never took the layer and trains on.
- ``find_unused``: frozen after wrapping, DDP built with
  ``find_unused_parameters=True``: it copes, and trains on.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rank_exit import leave

import trainwatch as tw

STEPS = 5
FREEZE_AT = 2
CASES = (
    "frozen_before",
    "find_unused",
    "frozen_after",
    "frozen_after_inner",
    "frozen_after_attach",
)


def _case(rank: int, case: str, out: Path) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if case == "frozen_before":
        net[0].requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(net, find_unused_parameters=case == "find_unused")
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    if case in ("frozen_after", "frozen_after_inner", "find_unused"):
        net[0].requires_grad_(False)
    gen = torch.Generator().manual_seed(rank)
    console = io.StringIO()
    log_dir = out / case
    error, notes, on_disk, printed = None, [], None, None
    watched = net if case == "frozen_after_inner" else ddp
    try:
        with tw.watch(watched, opt, console=console, log_dir=log_dir) as monitor:
            try:
                for step in range(STEPS):
                    if case == "frozen_after_attach" and step == FREEZE_AT:
                        net[0].requires_grad_(False)
                    x = torch.randn(16, 8, generator=gen)
                    opt.zero_grad()
                    nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
                    opt.step()
            except RuntimeError:
                if rank == 0:
                    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
                    on_disk = [json.loads(line) for line in lines]
                    printed = console.getvalue()
                raise
    except RuntimeError as exc:
        error = str(exc)
        notes = list(getattr(exc, "__notes__", []))
    return {
        "error": error,
        "notes": notes,
        "steps": monitor.step_count,
        "on_disk_at_error": on_disk,
        "console_at_error": printed,
        "alerts": [a.to_dict() for a in monitor.alerts],
    }


def rank_main(rank: int, out: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    record = {case: _case(rank, case, Path(out)) for case in CASES}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    leave()  # past PyTorch's own collectives: see rank_exit.py


if __name__ == "__main__":
    out = sys.argv[1]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, init), nprocs=2, join=True)
