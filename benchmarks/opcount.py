"""What trainwatch adds to one healthy training step, counted instead of timed.

Counts are deterministic, so they are a gate a test can assert (times are
not): the aten ops a step dispatches (a ``TorchDispatchMode``, forward,
backward and the optimizer alike) and the Python function calls that
``sys.setprofile`` sees in the ``trainwatch`` package. Both are taken on the
same step of two identical copies of a model, one plain and one watched,
past the first-steps audits and off the sampled steps, at two depths of a
residual stack of ``Linear(64, 64) + LayerNorm + GELU`` blocks (batch 32).
A healthy step should cost the same at any depth. A third figure counts
every function call the profiler sees added to the step, in any code
(torch's own Python, builtins called from Python; calls made inside a C
loop, such as ``map`` over an attribute getter, are not seen). A fourth
counts the bytecode instructions trainwatch's own code runs (``sys.settrace``
opcode events; the ``__init__`` its dataclasses are given counts as its own):
the closest of these to the Python time a step adds (cold,
after a large model's kernels, each costs about 0.2 us), and where a Python
loop over layers or modules shows even when it calls nothing. The tests hold
the last two the same at every depth.

One step leaves out the sampled and audit steps (the activation sampler,
``stalled_training``'s re-run, the broadcast recheck). ``--window START STOP``
(``window_bytecodes``) counts trainwatch's bytecodes at every step of a window
as well, each kind of sampled step at the rate a run meets it, and prints the
average a step per depth: a test holds depth 64's near depth 4's.

    python benchmarks/opcount.py                    # depth 4 and 64, default config
    python benchmarks/opcount.py --depths 4 16 64 --json counts.json
    python benchmarks/opcount.py --config configs/strict.yaml
    python benchmarks/opcount.py --depths 4 16 64 --window 50 200

It also prints what each more forward pass adds to a step (``per_pass``): a
loop acting on one observation at a time runs tens of passes to an update.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trainwatch as tw

_PACKAGE = str(Path(tw.__file__).resolve().parent)
WIDTH, BATCH = 64, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.norm(self.fc(x)))


def residual_stack(depth: int) -> nn.Module:
    """``depth`` blocks and a head: per-module costs dominate such a step."""
    return nn.Sequential(*(Block() for _ in range(depth)), nn.Linear(WIDTH, 1))


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


@dataclass
class Counts:
    depth: int
    plain_ops: int
    added_ops: int
    python_calls: int
    interpreter_calls: int = 0  # added calls of any code the profiler sees (not gated)
    bytecodes: int = 0  # bytecode instructions run in trainwatch's own code


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()


def _count_ops(step: Callable[[], None]) -> int:
    counter = _OpCounter()
    with counter:
        step()
    return counter.count


def _count_calls(step: Callable[[], None]) -> tuple[int, int]:
    """(Python calls into trainwatch, calls of any code the profiler sees)."""
    calls = every = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, every
        if event == "call" or event == "c_call":
            every += 1
            if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
                calls += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls, every


def _counted(frame: Any) -> bool:
    """A frame of the package, or of code generated for it that the package calls
    (a dataclass's ``__init__``, a named tuple's ``__new__``: their file is ``<string>``)."""
    filename = frame.f_code.co_filename
    if filename.startswith(_PACKAGE):
        return True
    caller = frame.f_back
    return filename == "<string>" and caller is not None and _in_package(caller)


def _in_package(frame: Any) -> bool:
    return frame.f_code.co_filename.startswith(_PACKAGE)


def _count_bytecodes(step: Callable[[], None]) -> int:
    """Bytecode instructions run in the ``trainwatch`` package and in the generated
    code it calls: a Python loop over layers or modules shows here even when it
    calls nothing the profiler sees."""
    ran = 0

    def each_opcode(frame: Any, event: str, arg: Any) -> Any:
        nonlocal ran
        if event == "opcode":
            ran += 1
        return each_opcode

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and _counted(frame):
            frame.f_trace_opcodes = True
            return each_opcode
        return None

    sys.settrace(on_call)
    try:
        step()
    finally:
        sys.settrace(None)
    return ran


def count(
    depth: int,
    config: Any = None,
    warm_steps: int = 41,
    model: Callable[[int], nn.Module] = residual_stack,
) -> Counts:
    """Counts for one healthy step at ``depth``, taken at step ``warm_steps``.

    The default (41) is past the broadcast audit and the first sampled
    steps, and not a multiple of the sampling interval. ``model``: what is
    built at ``depth`` (the residual stack; a test adds dropout to it).
    """
    torch.manual_seed(0)
    plain = model(depth)
    watched = copy.deepcopy(plain)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    watched_opt = torch.optim.Adam(watched.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
    with tw.watch(watched, watched_opt, config=config, console=False):
        for _ in range(warm_steps):
            _train_step(plain, plain_opt, x, y)
            _train_step(watched, watched_opt, x, y)
        plain_ops = _count_ops(lambda: _train_step(plain, plain_opt, x, y))
        watched_ops = _count_ops(lambda: _train_step(watched, watched_opt, x, y))
        calls, every = _count_calls(lambda: _train_step(watched, watched_opt, x, y))
        _, every_plain = _count_calls(lambda: _train_step(plain, plain_opt, x, y))
        bytecodes = _count_bytecodes(lambda: _train_step(watched, watched_opt, x, y))
    return Counts(depth, plain_ops, watched_ops - plain_ops, calls, every - every_plain, bytecodes)


def window_bytecodes(
    depth: int,
    start: int = 50,
    stop: int = 200,
    config: Any = None,
    model: Callable[[int], nn.Module] = residual_stack,
) -> list[int]:
    """The bytecodes trainwatch runs at each step ``start`` to ``stop`` (both counted).

    A single healthy step leaves out the sampled and audit steps (the
    activation sampler, the broadcast recheck, stalled_training's re-run);
    over a window they are counted at the rate a run pays them. Step ``n``
    is the ``n``-th call of the training step.
    """
    torch.manual_seed(0)
    watched = model(depth)
    opt = torch.optim.Adam(watched.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, 1)
    counts = []
    with tw.watch(watched, opt, config=config, console=False):
        for _ in range(1, start):
            _train_step(watched, opt, x, y)
        for _ in range(start, stop + 1):
            counts.append(_count_bytecodes(lambda: _train_step(watched, opt, x, y)))
    return counts


def _passes_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, passes: int
) -> None:
    """One update after ``passes`` batch-of-one passes summed into one loss (a policy
    acting on one observation at a time, as REINFORCE does)."""
    opt.zero_grad()
    loss = sum(nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1]) for i in range(passes))
    loss.backward()  # type: ignore[union-attr]
    opt.step()


def per_pass(depth: int = 4, passes: int = 17, config: Any = None) -> tuple[float, float]:
    """(aten ops, trainwatch bytecodes) each forward pass adds to a healthy step: a
    step of ``passes`` batch-of-one passes against a step of one, on the residual
    stack, past the first-steps audits (step 41)."""
    torch.manual_seed(0)
    plain = residual_stack(depth)
    watched = copy.deepcopy(plain)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    watched_opt = torch.optim.Adam(watched.parameters(), lr=1e-3)
    x, y = torch.randn(passes, WIDTH), torch.randn(passes, 1)
    found = {}
    with tw.watch(watched, watched_opt, config=config, console=False):
        for _ in range(40):
            _passes_step(plain, plain_opt, x, y, 1)
            _passes_step(watched, watched_opt, x, y, 1)
        for n in (1, passes):  # steps 41 to 44: none a sampled step
            plain_step = partial(_passes_step, plain, plain_opt, x, y, n)
            watched_step = partial(_passes_step, watched, watched_opt, x, y, n)
            added = _count_ops(watched_step) - _count_ops(plain_step)
            found[n] = (added, _count_bytecodes(watched_step))
    more = passes - 1
    return (
        (found[passes][0] - found[1][0]) / more,
        (found[passes][1] - found[1][1]) / more,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--config", default=None, help="a YAML preset (default: the defaults)")
    parser.add_argument(
        "--json",
        default=None,
        help="also write the counts to this file (with --window: the step counts under "
        "'steps', each depth's count at every step of the window under 'window')",
    )
    parser.add_argument(
        "--window",
        type=int,
        nargs=2,
        metavar=("START", "STOP"),
        default=None,
        help="also count trainwatch's bytecodes over steps START to STOP, sampled steps included",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [count(depth, args.config) for depth in args.depths]
    print(
        f"{'depth':>6} {'plain ops':>10} {'ops added':>10} {'python calls':>13} "
        f"{'all calls added':>16} {'bytecodes':>10}"
    )
    for c in results:
        print(
            f"{c.depth:>6} {c.plain_ops:>10} {c.added_ops:>+10} {c.python_calls:>13} "
            f"{c.interpreter_calls:>+16} {c.bytecodes:>10}"
        )
    ops_a_pass, bytecodes_a_pass = per_pass(config=args.config)
    print(
        f"\neach more forward pass in a step (batch-of-one passes): "
        f"{ops_a_pass:+.0f} ops, {bytecodes_a_pass:.0f} bytecodes"
    )
    windows = {}
    if args.window:
        start, stop = args.window
        print(f"\nsteps {start}-{stop}: trainwatch bytecodes per step, sampled steps included")
        print(f"{'depth':>6} {'average':>10} {'total':>12} {'largest':>10}")
        for depth in args.depths:
            steps = window_bytecodes(depth, start, stop, args.config)
            windows[depth] = steps
            print(f"{depth:>6} {sum(steps) / len(steps):>10.0f} {sum(steps):>12} {max(steps):>10}")
    if args.json:
        payload: Any = [asdict(c) for c in results]
        if windows:
            payload = {"steps": payload, "window": {str(d): w for d, w in windows.items()}}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
