"""Two gloo ranks training a model sharded with FSDP2's ``fully_shard``, run by tests/test_fsdp2.py.

``python fsdp2_run.py OUT MODE``: MODE ``clean``, ``no_zero_grad`` (both ranks
drop ``zero_grad()`` from step 3), ``frozen`` (layer ``2``'s weight left frozen
in the optimizer), ``norms`` (whole-layer norms reduced every 4 steps, beside
each step's norms of the full gradients, gathered here with ``full_tensor()``),
``nan_input`` (a NaN in rank 1's batch at step 5), ``nan_layer`` (layer ``2``
multiplies its output by inf on rank 1 at step 5: born there from finite
inputs) or ``nan_backward`` (layer ``2``'s backward makes a NaN on rank 1 at
step 5, its forward staying finite) or ``embedding`` (an embedding first, and
every batch's tokens from its first half of rows: rank 1's shard of its
gradient is exactly zero at every step, the layer's is not). Suffixes: ``+deferred``
(``nonfinite_forward.check: deferred``), ``+step`` (``check: step``: no
module sums, so no layer can be named without a replay) and ``+halt`` (``halt_on:
[nonfinite_forward]``, whole-layer norms every step, riding in the halt
check). Each rank writes ``OUT/rank<r>.json``: its alerts, its per-layer
norms (per step in ``norms`` and ``+halt`` modes, beside the full gradients'
norms; TensorBoard files in ``OUT/tb<r>`` in ``norms`` mode) and the halt it
raised, if any.
"""

from __future__ import annotations

import json
import math
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

BUG_AT = 3
NAN_AT = 5
NORMS_EVERY = 4


class Fragile(nn.Linear):
    """A Linear that makes a NaN/Inf while ``poisoned``: in its forward (its output
    times inf) or, with ``in_backward``, in its backward only (sqrt's gradient at
    0 is inf, times 0: NaN; the forward adds 0)."""

    poisoned = False
    in_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if not self.poisoned:
            return out
        if self.in_backward:
            return out + (x * 0).sqrt().sum() * 0
        return out * math.inf


def full_layer_norms(model: nn.Module) -> dict[str, float]:
    """Each layer's gradient norm from the full (unsharded) gradients: a collective."""
    squares: dict[str, float] = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            layer = name.rsplit(".", 1)[0]
            full = param.grad.full_tensor()
            squares[layer] = squares.get(layer, 0.0) + float(full.double().pow(2).sum())
    return {layer: sq**0.5 for layer, sq in squares.items()}


def _config(mode: str, flags: list[str]) -> dict:
    config: dict = {}
    if mode == "norms":
        config["distributed"] = {"gather_every": NORMS_EVERY}
    if "deferred" in flags:
        config["nonfinite_forward"] = {"check": "deferred"}
    if "step" in flags:
        config["nonfinite_forward"] = {"check": "step"}
    if "halt" in flags:
        config["halt_on"] = ["nonfinite_forward"]
        config["distributed"] = {"gather_every": 1}
    return config


def rank_main(rank: int, out: str, mode: str, init: str) -> None:
    mode, *flags = mode.split("+")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    middle = Fragile(32, 32) if mode in ("nan_layer", "nan_backward") else nn.Linear(32, 32)
    middle.in_backward = mode == "nan_backward"
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), middle, nn.ReLU(), nn.Linear(32, 1))
    if mode == "embedding":
        model = nn.Sequential(nn.Embedding(64, 8), *model)
    if mode == "frozen":
        model[2].weight.requires_grad_(False)  # left frozen, still in the optimizer
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.Embedding)):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    per_step = mode == "norms" or "halt" in flags
    steps: list[dict] = []
    halted: dict | None = None
    log_dir = Path(out, f"tb{rank}") if mode == "norms" else None
    monitor = tw.watch(
        model, optimizer, console=False, config=_config(mode, flags), log_dir=log_dir
    )
    try:
        for step in range(12):
            x = torch.randn(16, 8, generator=gen)
            inputs = torch.randint(0, 32, (16,), generator=gen) if mode == "embedding" else x
            if mode == "nan_input" and rank == 1 and step == NAN_AT:
                x[3, 2] = float("nan")
            if isinstance(middle, Fragile):
                middle.poisoned = rank == 1 and step == NAN_AT
            if not (mode == "no_zero_grad" and step >= BUG_AT):
                optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), x[:, :1].sin()).backward()
            full = full_layer_norms(model) if per_step else {}
            optimizer.step()
            if per_step:
                reported, total = monitor.grad_norms(), monitor.total_grad_norm
                steps.append({"full": full, "reported": reported, "total": total})
    except tw.TrainingHealthError as halt:
        halted = {"step": step, "rule": halt.alert.rule, "rank": halt.alert.data.get("rank")}
    finally:
        monitor.close()
    record = {
        "alerts": [a.to_dict() for a in monitor.alerts],
        "norms": monitor.grad_norms(),
        "steps": steps,
        "halted": halted,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    # Both ranks meet before the group is torn down: gloo torn down on one rank
    # right after the last all-reduce aborts the other now and then (SIGABRT,
    # 'terminate called without an active exception'), with or without trainwatch.
    dist.barrier()
    dist.destroy_process_group()
    leave()  # past PyTorch's own collectives: see rank_exit.py


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    init = "file://" + os.path.join(out, "rendezvous")
    mp.spawn(rank_main, args=(out, mode, init), nprocs=2, join=True)
