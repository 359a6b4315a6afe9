"""What the store relay costs (tw.watch / trainwatch run under torch.distributed).

Two gloo CPU processes. Times, per call: rank zero's read of the store when
nothing was posted (its cost every ``distributed.gather_every`` steps on a
healthy run), a post from rank one (paid only when an alert is raised), and,
for comparison, the one-number all-reduce the halt check makes and the
``gather_object`` the Lightning callback makes at its cadence. Then the time
of a small DDP step, watched with the relay at ``gather_every`` 1 and 50.

    python benchmarks/relay_cost.py [--init tcp|file]

Times only, never asserted: the machine's load moves them.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainwatch as tw
from trainwatch.store_relay import StoreLink

CALLS = 300


def _per_call_us(fn, calls: int = CALLS) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _step_ms(rank: int, every: int | None, steps: int = 200) -> float:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = None
    if every is not None:
        config = {"distributed": {"gather_every": every}, "tensorboard": {"enabled": False}}
        monitor = tw.watch(model, opt, console=False, config=config)
    x = torch.randn(32, 64)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
    elapsed = (time.perf_counter() - start) / steps * 1e3
    if monitor is not None:
        monitor.close()
    dist.barrier()
    return elapsed


def rank_main(rank: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    link = StoreLink("bench", rank=rank, world=2, wait_s=1.0)
    link.connect()
    dist.barrier()
    results = {}
    if rank == 0:
        results["rank 0 reads the store, nothing posted"] = _per_call_us(link.take)
    dist.barrier()
    if rank == 1:
        record = [
            {
                "alert": {
                    "rule": "x",
                    "severity": "info",
                    "step": 0,
                    "module": None,
                    "message": "m" * 200,
                    "hint": "",
                    "data": {},
                },
                "repeats": 0,
            }
        ]
        results["rank 1 posts one alert"] = _per_call_us(lambda: link.post(record))
    dist.barrier()
    flag = torch.zeros(1)
    results["one-number all-reduce (halt check)"] = _per_call_us(lambda: dist.all_reduce(flag), 200)

    def gather() -> None:
        dist.gather_object([], [None, None] if rank == 0 else None, dst=0)

    results["gather_object (Lightning's cadence)"] = _per_call_us(gather, 100)
    plain = _step_ms(rank, None)
    every_50 = _step_ms(rank, 50)
    every_1 = _step_ms(rank, 1)
    if rank == 0:
        for name, us in results.items():
            print(f"  {name:45s} {us:9.1f} us per call")
        print(f"  DDP step, unwatched                           {plain:9.3f} ms")
        print(f"  DDP step, watched, relay read every 50 steps  {every_50:9.3f} ms")
        print(f"  DDP step, watched, relay read every step      {every_1:9.3f} ms")
    if rank == 1:
        for name, us in results.items():
            if name.startswith("rank 1"):
                print(f"  {name:45s} {us:9.1f} us per call")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=["tcp", "file"], default="tcp")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.init == "file":
            init = "file://" + os.path.join(tmp, "rendezvous")
        else:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            init = f"tcp://127.0.0.1:{port}"
        print(f"store relay costs, 2 gloo processes, {args.init} store:")
        mp.spawn(rank_main, args=(init,), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
