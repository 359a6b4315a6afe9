"""Two gloo ranks running the step-end halt check alone, run by tests/test_distributed_halt.py.

``python halt_sync_let_go.py OUT``: 60 checks; rank 1 holds a halt at every
tenth. Every tensor the check hands to ``all_reduce`` / ``all_gather`` is
followed by weak reference, and after each check (returned or raised) the
rank counts how many the process group's worker threads still hold. Each
rank writes ``OUT/rank<r>.json``: those counts, and the halts it raised.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainwatch.alert import Alert
from trainwatch.errors import TrainingHealthError
from trainwatch.halt_sync import HaltSync

CHECKS = 60
HALT_EVERY = 10


def rank_main(rank: int, out: str, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    handed: list[weakref.ref] = []
    for name in ("all_reduce", "all_gather"):
        collective = getattr(dist, name)

        def followed(*args, _collective=collective, **kwargs):
            for arg in args:
                for tensor in arg if isinstance(arg, list) else [arg]:
                    if isinstance(tensor, torch.Tensor):
                        handed.append(weakref.ref(tensor))
            return _collective(*args, **kwargs)

        setattr(dist, name, followed)
    sync = HaltSync(every=1)
    still_held: list[int] = []
    halts: list[dict] = []
    for step in range(CHECKS):
        if rank == 1 and step % HALT_EVERY == HALT_EVERY - 1:
            alert = Alert.from_dict(
                {"rule": "nonfinite_forward", "severity": "error", "step": step}
            )
            sync.hold(TrainingHealthError(alert))
        try:
            sync.at_step(step)
        except TrainingHealthError as halt:
            halts.append({"step": step, "at": halt.alert.step, "rank": halt.alert.data["rank"]})
        still_held.append(sum(ref() is not None for ref in handed))
        handed.clear()
    record = {"still_held": still_held, "halts": halts}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    # Both ranks meet before the group is torn down: gloo torn down on one rank
    # right after the last all-reduce aborts the other now and then (SIGABRT,
    # 'terminate called without an active exception'), with or without trainwatch.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, init), nprocs=2, join=True)
