"""Overhead of trainwatch as a ratio to the same loop unmonitored, in one process.

Two identical copies of each model train side by side; blocks of steps
alternate between the plain copy and the watched one so that drift (thermal,
other load) hits both alike. The headline ratio is fastest watched block over
fastest plain block (the least disturbed of each); the median of per-round
ratios and its range are printed beside it, and the plain and watched
milliseconds per step beside that, since a ratio alone hides whether a step is
launch-bound or compute-bound. Times are never asserted anywhere.

The workloads span where a per-module or per-parameter cost shows: a small MLP,
CNN and transformer; "deep", a residual stack of 32 tiny blocks (the stack
``opcount.py`` counts ops on), where per-module costs dominate; and "gpt2", a
GPT-2-small-sized language model (124M parameters, bf16 autocast, batch 8 x
1024 tokens), where they should vanish beside the compute. gpt2 runs by default
only on CUDA; on CPU name it with ``--workloads gpt2`` (``--quick`` makes it tiny).

    python benchmarks/overhead.py                 # mlp, cnn, transformer, deep on CPU
    python benchmarks/overhead.py --quick         # seconds; a smoke run
    python benchmarks/overhead.py --workloads deep gpt2 --quick
    python benchmarks/overhead.py --workloads tiny  # trainwatch's fixed cost per step
    python benchmarks/overhead.py --workloads rl    # batch-of-one passes: the cost per pass
    python benchmarks/overhead.py --sinks         # with alerts.jsonl and TensorBoard written
    python benchmarks/overhead.py --steady-malloc # glibc's allocator pinned (_steady_malloc)
    python benchmarks/overhead.py --floor         # and the gradient norms alone (see measure)
    python benchmarks/overhead.py --ideal         # and the same triggers written by hand
    python benchmarks/overhead.py --device cuda --config configs/strict.yaml  # and gpt2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from opcount import BATCH, WIDTH, residual_stack

import trainwatch as tw


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    steps_per_round: int
    rounds: int
    autocast: torch.dtype | None = None  # e.g. bf16: forward and loss under autocast
    # One training step of its own (model, optimizer, batch); None: one forward of
    # the batch, its loss, backward and the optimizer's step.
    step: Callable[[nn.Module, torch.optim.Optimizer, tuple], None] | None = None


def _mlp(quick: bool) -> Workload:
    width = 64 if quick else 512
    return Workload(
        "mlp",
        lambda: nn.Sequential(
            nn.Flatten(),
            nn.Linear(784, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        ),
        lambda d: (torch.randn(128, 784, device=d), torch.randint(0, 10, (128,), device=d)),
        steps_per_round=5 if quick else 40,
        rounds=3 if quick else 15,
    )


def _cnn(quick: bool) -> Workload:
    ch = 8 if quick else 16
    size = 16 if quick else 32

    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, ch, 3, padding=1),
            nn.BatchNorm2d(ch),
            nn.ReLU(),
            nn.Conv2d(ch, ch * 2, 3, padding=1),
            nn.BatchNorm2d(ch * 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(ch * 2, ch * 2, 3, padding=1),
            nn.BatchNorm2d(ch * 2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(ch * 2, 10),
        )

    return Workload(
        "cnn",
        make,
        lambda d: (torch.randn(64, 3, size, size, device=d), torch.randint(0, 10, (64,), device=d)),
        steps_per_round=2 if quick else 6,
        rounds=3 if quick else 11,
    )


class _Transformer(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens))).flatten(0, 1)


def _transformer(quick: bool) -> Workload:
    d, layers, seq = (32, 1, 16) if quick else (256, 4, 128)
    return Workload(
        "transformer",
        lambda: _Transformer(d, layers),
        lambda dev: (
            torch.randint(0, 1000, (8, seq), device=dev),
            torch.randint(0, 1000, (8 * seq,), device=dev),
        ),
        steps_per_round=2,
        rounds=3 if quick else 9,
    )


def _deep(quick: bool) -> Workload:
    depth = 8 if quick else 32
    return Workload(
        "deep",
        lambda: residual_stack(depth),
        lambda d: (torch.randn(BATCH, WIDTH, device=d), torch.randn(BATCH, 1, device=d)),
        steps_per_round=3 if quick else 20,
        rounds=3 if quick else 11,
    )


def _tiny(quick: bool) -> Workload:
    """A 3-layer toy model whose step takes well under a millisecond: what is left of
    the ratio is trainwatch's fixed cost per step, whatever the model."""
    return Workload(
        "tiny",
        lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)),
        lambda d: (torch.randn(8, 4, device=d), torch.randn(8, 1, device=d)),
        steps_per_round=10 if quick else 200,
        rounds=3 if quick else 11,
    )


class _GPT(nn.Module):
    """GPT-2's shape from plain torch modules: pre-norm blocks, causal, tied head."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Embedding(context, d)
        self.drop = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.1, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied, as in GPT-2 (124M with it)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        x = self.drop(self.tokens(tokens) + self.positions(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        # is_causal with a causal mask lets attention take the fused causal kernel.
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.head(self.norm(x)).flatten(0, 1)


def _gpt2(quick: bool) -> Workload:
    # GPT-2 small: vocab 50257, context 1024, d 768, 12 layers, 12 heads.
    vocab, seq, d, layers, heads, batch = (
        (512, 64, 64, 2, 4, 4) if quick else (50257, 1024, 768, 12, 12, 8)
    )
    return Workload(
        "gpt2",
        lambda: _GPT(vocab, seq, d, layers, heads),
        lambda dev: (
            torch.randint(0, vocab, (batch, seq), device=dev),
            torch.randint(0, vocab, (batch * seq,), device=dev),
        ),
        steps_per_round=2 if quick else 4,
        rounds=3 if quick else 7,
        autocast=torch.bfloat16,
    )


# Small enough for any device (profile_step.py runs all of these by default).
WORKLOADS = {"mlp": _mlp, "cnn": _cnn, "transformer": _transformer, "deep": _deep}
# Run by default only on CUDA: on CPU a step takes seconds (name them to run them).
CUDA_WORKLOADS = {"gpt2": _gpt2}


# Run only when named: "tiny" isolates the fixed cost of a step (its plain step
# is a fraction of a millisecond, so its ratio is large by construction); "rl"
# the cost of each forward pass (32 batch-of-one passes to a step).
def _reinforce_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> None:
    """An episode of batch-of-one policy passes, then one update (REINFORCE's shape)."""
    observations, actions, returns = batch
    picked = [
        torch.log_softmax(model(observations[t : t + 1]), -1)[0, actions[t]]
        for t in range(len(observations))
    ]
    opt.zero_grad()
    (-(torch.stack(picked) * returns).sum()).backward()
    opt.step()


def _rl(quick: bool) -> Workload:
    """A policy network acting on one observation at a time, 32 passes to an update:
    what a watched model costs per forward pass, not per step."""
    return Workload(
        "rl",
        lambda: nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4)),
        lambda d: (
            torch.randn(32, 8, device=d),
            torch.randint(0, 4, (32,)).tolist(),
            torch.randn(32, device=d),
        ),
        steps_per_round=2 if quick else 20,
        rounds=3 if quick else 11,
        step=_reinforce_step,
    )


NAMED_WORKLOADS = {"tiny": _tiny, "rl": _rl}
ALL_WORKLOADS = {**WORKLOADS, **CUDA_WORKLOADS, **NAMED_WORKLOADS}


def default_workloads(device: torch.device) -> list[str]:
    return [*WORKLOADS, *CUDA_WORKLOADS] if device.type == "cuda" else list(WORKLOADS)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> float:
    # On CPU, this process's CPU time: other processes on a shared machine
    # then disturb the ratio far less than wall time would. On CUDA, wall time.
    return time.perf_counter() if device.type == "cuda" else time.process_time()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Class labels (integer targets) take cross-entropy; float targets take MSE."""
    if target.is_floating_point():
        return nn.functional.mse_loss(output, target)
    return nn.functional.cross_entropy(output, target)


def _time_block(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple,
    steps: int,
    device: torch.device,
    autocast: torch.dtype | None = None,
    step: Callable[[nn.Module, torch.optim.Optimizer, tuple], None] | None = None,
) -> float:
    _sync(device)
    start = _clock(device)
    if step is not None:
        for _ in range(steps):
            step(model, opt, batch)
        _sync(device)
        return _clock(device) - start
    x, y = batch
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(device.type, dtype=autocast) if autocast else nullcontext():
            loss = _loss(model(x), y)
        loss.backward()
        opt.step()
    _sync(device)
    return _clock(device) - start


def _gradient_norms_before_update(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
    if grads:
        torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))


class _HandWrittenMonitor:
    """What a hand-written monitor of trainwatch's healthy-step triggers pays: the
    output's sum read at each forward pass, the gradient norms before each update,
    read back after it and checked against a running average in a Python loop.

    Nothing else: no record, no rules, no localisation. Its ratio is how close
    a monitor of these numbers can come to the plain loop in this same run.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.norms: torch.Tensor | None = None
        self.averages: list[float] | None = None
        self.alarms = 0
        model.register_forward_hook(self._output)
        opt.register_step_pre_hook(self._before_update)
        opt.register_step_post_hook(self._after_update)

    def _output(self, module: nn.Module, args: object, output: object) -> None:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            with torch.no_grad():
                self.alarms += not math.isfinite(output.sum().item())

    def _before_update(self, opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        grads = [
            p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None
        ]
        self.norms = (
            torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)) if grads else None
        )

    def _after_update(self, opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if self.norms is None:
            return
        values = self.norms.tolist()
        averages = self.averages
        if averages is None or len(averages) != len(values):
            self.averages = values
            return
        for i, (value, average) in enumerate(zip(values, averages)):
            if not math.isfinite(value) or value > 50.0 * average + 1e-12:
                self.alarms += 1
            averages[i] = 0.9 * average + 0.1 * value


def measure(
    workload: Workload,
    device: torch.device,
    config: str | None,
    from_step: int = 0,
    sinks: bool = False,
    floor: bool = False,
    ideal: bool = False,
) -> dict[str, float]:
    """Interleaved rounds; ``from_step`` untimed steps first (past the first-steps audits).

    ``sinks``: the watched loop writes alerts.jsonl and TensorBoard into a
    temporary folder (as ``trainwatch run`` and ``tw.watch(log_dir=...)`` do),
    so the ratio includes what the sinks cost; without, no sink but memory.

    ``floor``: a third copy runs the plain loop plus the one thing a healthy
    watched step cannot leave out: the gradients' norms, taken once before
    each update (one foreach kernel, as trainwatch takes them). Its ratio
    to the plain loop is what any monitor of per-layer gradient norms pays,
    however little else it does. Read right after backward, the gradients
    are no longer in cache: on one CPU thread that read costs more than the
    same kernel run on warm tensors.

    ``ideal``: one more copy runs under :class:`_HandWrittenMonitor`, the
    same triggers written by hand with nothing behind them.
    """
    torch.manual_seed(0)
    plain = workload.make_model().to(device)
    watched = copy.deepcopy(plain)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_watched = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    loops = [(plain, opt_plain), (watched, opt_watched)]
    if floor:
        normed = copy.deepcopy(plain)
        opt_normed = torch.optim.AdamW(normed.parameters(), lr=1e-4)
        opt_normed.register_step_pre_hook(_gradient_norms_before_update)
        loops.append((normed, opt_normed))
    if ideal:
        by_hand = copy.deepcopy(plain)
        opt_by_hand = torch.optim.AdamW(by_hand.parameters(), lr=1e-4)
        _HandWrittenMonitor(by_hand, opt_by_hand)
        loops.append((by_hand, opt_by_hand))
    batch = workload.make_batch(device)
    ratios, plain_times, watched_times, floor_ratios, ideal_ratios = [], [], [], [], []
    log_dir = tempfile.TemporaryDirectory() if sinks else None
    with (
        log_dir or nullcontext(),
        tw.watch(
            watched,
            opt_watched,
            config=config,
            console=False,
            log_dir=log_dir.name if log_dir is not None else None,
        ),
    ):
        for model, opt in loops:
            _time_block(
                model, opt, batch, max(2, from_step), device, workload.autocast, workload.step
            )
        for round_index in range(workload.rounds):
            # Each loop leads in turn (two loops: they alternate).
            shift = round_index % len(loops)
            times = {}
            for model, opt in loops[shift:] + loops[:shift]:
                times[id(model)] = _time_block(
                    model,
                    opt,
                    batch,
                    workload.steps_per_round,
                    device,
                    workload.autocast,
                    workload.step,
                )
            ratios.append(times[id(watched)] / times[id(plain)])
            if floor:
                floor_ratios.append(times[id(normed)] / times[id(plain)])
            if ideal:
                ideal_ratios.append(times[id(by_hand)] / times[id(plain)])
            plain_times.append(times[id(plain)] / workload.steps_per_round)
            watched_times.append(times[id(watched)] / workload.steps_per_round)
    result = {
        # The fastest block of each is the least disturbed by anything else
        # running on the machine: their ratio is the headline figure.
        "ratio": min(watched_times) / min(plain_times),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "plain_ms_per_step": 1000 * min(plain_times),
        "watched_ms_per_step": 1000 * min(watched_times),
    }
    if floor:
        result["floor_ratio_median"] = statistics.median(floor_ratios)
    if ideal:
        result["ideal_ratio_median"] = statistics.median(ideal_ratios)
    return result


def _steady_malloc() -> bool:
    """Pin glibc's allocator: every block under 256 MiB from the heap, none given back.

    By default glibc serves a large block (above a threshold it moves as
    blocks are freed) with a fresh mmap, whose pages fault in when first
    written, and trims freed memory. Which of two identical loops then pays
    hundreds of page faults a step depends on the order of their past
    allocations: on the MLP this alone moved a ratio by several percent, the
    same way run after run (so it looks like a cost). Pinned, both loops reuse
    their memory and the ratio is what the watched loop adds.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mmap_threshold, trim_threshold = -3, -1  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        return bool(
            libc.mallopt(mmap_threshold, 256 << 20) and libc.mallopt(trim_threshold, 1 << 30)
        )
    except (OSError, AttributeError):
        return False


def _header(floor: bool, ideal: bool = False) -> str:
    return (
        f"{'workload':<12} {'plain ms/step':>14} {'watched ms/step':>16} {'ratio':>7} "
        f"{'median':>7} {'min':>6} {'max':>6}"
        + (f" {'floor':>6}" if floor else "")
        + (f" {'ideal':>6}" if ideal else "")
    )


def _row(name: str, result: dict[str, float]) -> str:
    floor = result.get("floor_ratio_median")
    ideal = result.get("ideal_ratio_median")
    return (
        f"{name:<12} {result['plain_ms_per_step']:>14.2f} {result['watched_ms_per_step']:>16.2f} "
        f"{result['ratio']:>7.3f} {result['ratio_median']:>7.3f} {result['ratio_min']:>6.3f} "
        f"{result['ratio_max']:>6.3f}"
        + (f" {floor:>6.3f}" if floor is not None else "")
        + (f" {ideal:>6.3f}" if ideal is not None else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default=None, help="a trainwatch config (default: defaults)")
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps (smoke run)")
    parser.add_argument(
        "--workloads",
        "--only",
        nargs="+",
        choices=list(ALL_WORKLOADS),
        default=None,
        help=f"default: {' '.join(WORKLOADS)}; on CUDA also {' '.join(CUDA_WORKLOADS)}",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: no thread-pool noise)"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--rounds", type=float, default=1.0, help="multiply every workload's rounds (steadier)"
    )
    parser.add_argument(
        "--from-step",
        type=int,
        default=0,
        help="untimed steps before the rounds (e.g. 50: past the first-steps audits)",
    )
    parser.add_argument(
        "--sinks",
        action="store_true",
        help="also write alerts.jsonl and TensorBoard (to a temp folder), as trainwatch run does",
    )
    parser.add_argument(
        "--steady-malloc",
        action="store_true",
        help="glibc: no mmap for blocks under 256 MiB and no trimming (see _steady_malloc)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the plain loop plus only the gradient norms (median ratio: 'floor')",
    )
    parser.add_argument(
        "--ideal",
        action="store_true",
        help="also time a hand-written monitor of the same triggers (median ratio: 'ideal')",
    )
    args = parser.parse_args(argv)
    if args.steady_malloc and not _steady_malloc():
        print("--steady-malloc: not glibc, left as it is", file=sys.stderr)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = args.workloads or default_workloads(device)
    results = {}
    written = ", alerts.jsonl and TensorBoard written" if args.sinks else ""
    print(f"trainwatch overhead on {device} (config: {args.config or 'default'}{written})")
    skipped = [name for name in ALL_WORKLOADS if name not in names]
    if skipped and args.workloads is None:
        print(f"(not run on {device.type} by default: {', '.join(skipped)}; see --workloads)")
    print(_header(args.floor, args.ideal))
    for name in names:
        workload = ALL_WORKLOADS[name](args.quick)
        workload.rounds = max(3, round(workload.rounds * args.rounds))
        results[name] = measure(
            workload, device, args.config, args.from_step, args.sinks, args.floor, args.ideal
        )
        print(_row(name, results[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
