"""Two gloo ranks under DDP without ``find_unused_parameters``, a branch cut out of the
graph: run by tests/test_ddp_unused_before_failure.py.

``python ddp_unused_two_ranks.py OUT MODE``: MODE ``cut`` detaches the branch
on every rank from the first step (DDP's reducer then fails the next forward
on each rank), ``cut_on_one`` on rank 1 only (rank 1 fails so; rank 0, left
waiting for the branch's gradients in its backward, gets gloo's error when
rank 1's process goes), ``clean`` keeps it in the graph. Each rank writes
``OUT/rank<r>.json``: DDP's error, the steps its monitor counted, what rank
zero's alerts.jsonl and console held when the error was caught, and its
monitor's alerts after close.
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

STEPS = 4


class Branchy(nn.Module):
    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        extra = self.branch(h)
        if self.cut:
            extra = extra.detach()  # called, but cut out of the graph
        return self.head(h + extra)


def rank_main(rank: int, out: str, mode: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    cut = mode == "cut" or (mode == "cut_on_one" and rank == 1)
    ddp = nn.parallel.DistributedDataParallel(Branchy(cut))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    console = io.StringIO()
    log_dir = Path(out, "tw")
    error, on_disk, printed = None, None, None
    with tw.watch(ddp, opt, console=console, log_dir=log_dir) as monitor:
        try:
            for _ in range(STEPS):
                x = torch.randn(16, 8, generator=gen)
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
                opt.step()
        except RuntimeError as exc:
            error = str(exc)
            if rank == 0:
                lines = (log_dir / "alerts.jsonl").read_text().splitlines()
                on_disk = [json.loads(line) for line in lines]
                printed = console.getvalue()
        steps = monitor.step_count
    record = {
        "error": error,
        "steps": steps,
        "on_disk_at_error": on_disk,
        "console_at_error": printed,
        "alerts": [a.to_dict() for a in monitor.alerts],
        "console": console.getvalue(),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    leave()  # past PyTorch's own collectives: see rank_exit.py


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, mode, init), nprocs=2, join=True)
