"""Two gloo ranks under DDP, each with ``tw.watch``: run by tests/test_distributed_relay.py.

``python ddp_watch_relay.py OUT MODE``, MODE one of:

* ``clean``: 12 healthy steps.
* ``nan``: rank 1's batch at step 5 holds a NaN (no ``halt_on``); alerts reach
  rank zero every 4 steps (``distributed.gather_every``).
* ``destroy``: the same NaN, but each rank destroys the process group before
  its monitor closes, and rank 1 closes a second later than rank 0, with
  nothing delivered before (``gather_every: 0``).
* ``own``: the same NaN with ``distributed.relay: false``: each rank writes
  its own sinks.

Each rank writes ``OUT/rank<r>.json``: what its monitor holds and, on rank
zero, what ``alerts.jsonl`` held after step 8. A rank that hangs is the
caller's timeout's business.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import trainwatch as tw

NAN_AT = 5
STEPS = 12


def rank_main(rank: int, out: str, mode: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    every = 0 if mode == "destroy" else 4
    console = io.StringIO()
    log_dir = Path(out, f"tw{rank}")
    monitor = tw.watch(
        model,
        optimizer,
        console=console,
        log_dir=log_dir,
        config={"distributed": {"gather_every": every, "relay": mode != "own"}},
    )
    gen = torch.Generator().manual_seed(rank)
    on_disk_after_8: list[dict] | None = None
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=gen)
        if mode != "clean" and rank == 1 and step == NAN_AT:
            x[3, 2] = float("nan")
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        optimizer.step()
        if rank == 0 and step == 8:
            lines = (log_dir / "alerts.jsonl").read_text().splitlines()
            on_disk_after_8 = [json.loads(line) for line in lines]
    if mode == "destroy":
        # Both ranks meet before the group is torn down: gloo torn down on one rank
        # right after the last all-reduce aborts the other now and then (SIGABRT,
        # 'terminate called without an active exception'), with or without trainwatch.
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(1.0 * rank)  # rank 1 closes a second after rank 0 began to
    monitor.close()
    record = {
        "alerts": [a.to_dict() for a in monitor.alerts],
        "on_disk_after_8": on_disk_after_8,
        "console": console.getvalue(),
        "wrote": sorted(p.name for p in log_dir.iterdir()) if log_dir.exists() else [],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    if mode != "destroy":
        # Both ranks meet before the group is torn down: gloo torn down on one rank
        # right after the last all-reduce aborts the other now and then (SIGABRT,
        # 'terminate called without an active exception'), with or without trainwatch.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, mode, init), nprocs=2, join=True)
