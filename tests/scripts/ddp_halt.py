"""Two gloo ranks under DDP, one of them meets a NaN: run by tests/test_distributed_halt.py.

``python ddp_halt.py OUT CHECK_EVERY``: rank 1's batch at step 5 holds a NaN,
``halt_on: [nonfinite_forward]``. Each rank writes ``OUT/rank<r>.json``: the
step it stopped at, the halting alert it raised, and the alerts its monitor
holds. A rank that hangs is the caller's timeout's business.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trainwatch as tw

NAN_AT = 5
STEPS = 12


def rank_main(rank: int, out: str, check_every: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stopped_at, raised = None, None
    config = {
        "halt_on": ["nonfinite_forward"],
        "distributed": {"halt_check_every": check_every},
    }
    monitor = tw.watch(model, optimizer, console=False, config=config, log_dir=f"{out}/tw{rank}")
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(STEPS):
            x = torch.randn(16, 8, generator=gen)
            if rank == 1 and step == NAN_AT:
                x[3, 2] = float("nan")
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            optimizer.step()
    except tw.TrainingHealthError as halt:
        stopped_at, raised = step, halt.alert.to_dict()
    finally:
        monitor.close()
    record = {
        "stopped_at": stopped_at,
        "raised": raised,
        "alerts": [a.to_dict() for a in monitor.alerts],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    # Both ranks meet before the group is torn down: gloo torn down on one rank
    # right after the last all-reduce aborts the other now and then (SIGABRT,
    # 'terminate called without an active exception'), with or without trainwatch.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out, check_every = sys.argv[1], int(sys.argv[2])
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, check_every, init), nprocs=2, join=True)
