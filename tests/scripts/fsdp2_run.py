"""Two gloo ranks training a model sharded with FSDP2's ``fully_shard``, run by tests/test_fsdp2.py.

``python fsdp2_run.py OUT MODE``: MODE ``clean``, ``no_zero_grad`` (both ranks
drop ``zero_grad()`` from step 3) or ``frozen`` (layer ``2``'s weight left frozen
in the optimizer). Each rank writes ``OUT/rank<r>.json``: its
alerts and its per-layer norms.
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

BUG_AT = 3


def rank_main(rank: int, out: str, mode: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    if mode == "frozen":
        model[2].weight.requires_grad_(False)  # left frozen, still in the optimizer
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    with tw.watch(model, optimizer, console=False) as monitor:
        for step in range(12):
            x = torch.randn(16, 8, generator=gen)
            if not (mode == "no_zero_grad" and step >= BUG_AT):
                optimizer.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
            optimizer.step()
        norms = monitor.grad_norms()
    record = {"alerts": [a.to_dict() for a in monitor.alerts], "norms": norms}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, mode, init), nprocs=2, join=True)
