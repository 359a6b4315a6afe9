"""What one healthy step writes, attribute by attribute: the state a faster path must keep.

    python benchmarks/step_writes.py [--workload mlp] [--step 301]

Traces trainwatch's bytecode on one step of an ``overhead.py`` workload (past
the first-steps audits) and lists every ``STORE_ATTR``, ``STORE_SUBSCR`` and
``DELETE_SUBSCR`` it runs, by attribute and function. Most land on the
step's own new objects (its record, its pending readback, its frame); the
rest is what the step moves of the monitor's lasting state. A path for the
usual step that skips the general one must leave that state exactly as the
general path would: this is its inventory. A development tool: nothing
asserts on it.
"""

from __future__ import annotations

import argparse
import collections
import dis
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead
from opcount import _counted

import trainwatch as tw

_WRITES = ("STORE_ATTR", "STORE_SUBSCR", "DELETE_SUBSCR")


def step_writes(workload: str, step: int) -> collections.Counter:
    """(opcode, attribute, function) -> how many times step ``step`` ran it."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    chosen = overhead.ALL_WORKLOADS[workload](False)
    model = chosen.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = chosen.make_batch(torch.device("cpu"))
    writes: collections.Counter = collections.Counter()
    offsets: dict[Any, dict[int, dis.Instruction]] = {}

    def one_step() -> None:
        if chosen.step is not None:
            chosen.step(model, opt, batch)
        else:
            overhead._time_block(model, opt, batch, 1, torch.device("cpu"))

    def each(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            found = offsets.get(code)
            if found is None:
                found = offsets[code] = {i.offset: i for i in dis.get_instructions(code)}
            ins = found.get(frame.f_lasti)
            if ins is not None and ins.opname in _WRITES:
                where = f"{code.co_filename.split('trainwatch/')[-1]}:{code.co_qualname}"
                name = ins.argval if ins.opname == "STORE_ATTR" else "[]"
                writes[(ins.opname, name, where)] += 1
        return each

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and _counted(frame):
            frame.f_trace_opcodes = True
            return each
        return None

    with tw.watch(model, opt, console=False):
        for _ in range(step):
            one_step()
        sys.settrace(on_call)
        try:
            one_step()
        finally:
            sys.settrace(None)
    return writes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="mlp", choices=sorted(overhead.ALL_WORKLOADS))
    parser.add_argument("--step", type=int, default=301, help="the step traced (0-based)")
    args = parser.parse_args(argv)
    writes = step_writes(args.workload, args.step)
    for (op, name, where), n in sorted(writes.items(), key=lambda kv: kv[0][2]):
        print(f"{n:4d} {op:13s} {name:28s} {where}")
    print(f"{len(writes)} distinct writes, {sum(writes.values())} in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
