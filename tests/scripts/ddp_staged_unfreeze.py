"""Two gloo ranks fine-tuning with a layer frozen for the first steps: run by
tests/test_ddp_staged_unfreeze.py.

``python ddp_staged_unfreeze.py OUT``: each rank runs every case in turn, each
with its own model, optimizer and ``tw.watch``, and writes ``OUT/rank<r>.json``:
per case, the monitor's alerts and the first layer's weights at the end.

- ``frozen_at_wrap``: the first layer frozen when DDP wraps the model, unfrozen
  at step ``UNFREEZE_AT``. DDP's reducer was built without it: each rank trains
  its own copy from then on (the bug).
- ``frozen_at_wrap_inner``: the same, watching the model inside the wrapper.
- ``unfrozen_before_wrap``: frozen and unfrozen before DDP wraps the model.
- ``rebuilt``: frozen at wrap; at the unfreeze the model is wrapped anew.
- ``never_frozen``: nothing frozen.
- ``frozen_for_good``: frozen at wrap, never unfrozen.
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

from rank_exit import leave

import trainwatch as tw

STEPS = 6
UNFREEZE_AT = 3
CASES = (
    "frozen_at_wrap",
    "frozen_at_wrap_inner",
    "unfrozen_before_wrap",
    "rebuilt",
    "never_frozen",
    "frozen_for_good",
)


def _case(rank: int, case: str) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    frozen = case not in ("never_frozen", "unfrozen_before_wrap")
    net[0].requires_grad_(False)
    if not frozen:
        net[0].requires_grad_(True)
    ddp = nn.parallel.DistributedDataParallel(net)
    # The usual staged fine-tune: every parameter in the optimizer, the frozen
    # ones skipped while they have no gradient.
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    watched = net if case in ("frozen_at_wrap_inner", "rebuilt") else ddp
    with tw.watch(watched, opt, console=False) as monitor:
        for step in range(STEPS):
            if step == UNFREEZE_AT and case != "frozen_for_good" and frozen:
                net[0].requires_grad_(True)
                if case == "rebuilt":
                    ddp = nn.parallel.DistributedDataParallel(net)
            x = torch.randn(16, 8, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), x[:, :1]).backward()
            opt.step()
    return {
        "alerts": [a.to_dict() for a in monitor.alerts],
        "weight": net[0].weight.detach().flatten().tolist(),
    }


def rank_main(rank: int, out: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    record = {case: _case(rank, case) for case in CASES}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    leave()  # past PyTorch's own collectives: see rank_exit.py


if __name__ == "__main__":
    out = sys.argv[1]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, init), nprocs=2, join=True)
