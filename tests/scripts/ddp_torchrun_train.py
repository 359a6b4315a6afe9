"""A DDP training script as one writes it for ``torchrun``: run by tests/test_run_under_torchrun.py
under ``torchrun --nproc_per_node 2 -m trainwatch run``, with no trainwatch in it.

``python ddp_torchrun_train.py OUT MODE``: MODE ``clean`` (healthy), ``nan``
(rank 1's batch at step 5 holds a NaN), ``no_zero_grad`` (rank 1 never
calls ``zero_grad``), ``unfrozen`` (the first layer frozen in the optimizer,
unfrozen at step 4: a staged fine-tune), ``unfrozen_on_zero`` (rank 1
never unfreezes it) or ``unfrozen_unsynced`` (frozen already when DDP wraps
the model, so DDP never all-reduces it once unfrozen; each rank writes its
copy of the layer to ``OUT/weight<rank>.txt``) or ``frozen_after`` (the first layer
frozen after DDP and the optimizer were built: DDP's reducer waits for its
gradients, and the forward of step 1 fails). Before each optimizer step, each rank writes its
number (1 for the first) to ``OUT/steps<rank>.txt``, so a caller sees at
which step each rank stopped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

STEPS = 12
NAN_AT = 5
UNFREEZE_AT = 4


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    frozen = mode.startswith("unfrozen")
    if mode == "unfrozen_unsynced":
        net[0].requires_grad_(False)
    # A layer frozen for now is one DDP must still reduce once it trains:
    # registered while trainable, and found unused while frozen.
    model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=frozen)
    net[0].requires_grad_(not frozen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if mode == "frozen_after":
        net[0].requires_grad_(False)
    gen = torch.Generator().manual_seed(rank)
    progress = out / f"steps{rank}.txt"
    for step in range(STEPS):
        if frozen and step == UNFREEZE_AT and not (mode == "unfrozen_on_zero" and rank == 1):
            net[0].requires_grad_(True)
        x = torch.randn(16, 8, generator=gen)
        if mode == "nan" and rank == 1 and step == NAN_AT:
            x[3, 2] = float("nan")
        if not (mode == "no_zero_grad" and rank == 1):
            optimizer.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        progress.write_text(str(step + 1))
        optimizer.step()
    if mode == "unfrozen_unsynced":  # the ranks' copies of the layer, for the test
        (out / f"weight{rank}.txt").write_text(repr(net[0].weight.detach().flatten().tolist()))
    # Both ranks meet before the group is torn down: gloo torn down on one rank
    # right after the last all-reduce aborts the other now and then (SIGABRT,
    # 'terminate called without an active exception'), with or without trainwatch.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
