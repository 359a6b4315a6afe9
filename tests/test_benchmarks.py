"""The benchmark scripts run (a smoke run: times are printed, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _overhead(tmp_path, *args: str) -> dict:
    """Run benchmarks/overhead.py --quick with ``args``; its JSON results."""
    out = tmp_path / "overhead.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/overhead.py", "--quick", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_overhead_benchmark_quick_run_prints_a_ratio_per_workload(tmp_path):
    results = _overhead(tmp_path)
    # gpt2 runs by default only on CUDA; the default device is the CPU.
    assert set(results) == {"mlp", "cnn", "transformer", "deep"}
    assert all(r["ratio"] > 0 for r in results.values())
    assert all(r["plain_ms_per_step"] > 0 for r in results.values())


@pytest.mark.slow
def test_overhead_benchmark_tiny_measures_the_fixed_cost_when_named(tmp_path):
    results = _overhead(tmp_path, "--workloads", "tiny")
    assert list(results) == ["tiny"] and results["tiny"]["ratio"] > 0


@pytest.mark.slow
def test_overhead_benchmark_with_sinks_writes_tensorboard_and_measures_it(tmp_path):
    results = _overhead(tmp_path, "--workloads", "deep", "--sinks")
    assert list(results) == ["deep"] and results["deep"]["ratio"] > 0


def test_overhead_benchmark_floor_times_the_plain_loop_with_only_the_gradient_norms(tmp_path):
    floored = _overhead(tmp_path, "--workloads", "mlp", "--floor")["mlp"]
    assert floored["floor_ratio_median"] > 0 and floored["ratio"] > 0
    # Without the flag no third loop runs.
    assert "floor_ratio_median" not in _overhead(tmp_path, "--workloads", "mlp")["mlp"]


def test_overhead_benchmark_ideal_times_a_hand_written_monitor_beside_trainwatch(tmp_path):
    results = _overhead(tmp_path, "--workloads", "mlp", "--ideal")["mlp"]
    assert results["ideal_ratio_median"] > 0 and "floor_ratio_median" not in results


def _hand_written_monitor():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from overhead import _HandWrittenMonitor
    finally:
        sys.path.pop(0)
    return _HandWrittenMonitor


def _steps_by_hand(poison_at: int | None) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = _hand_written_monitor()(model, opt)
    for step in range(6):
        x = torch.randn(16, 4)
        if step == poison_at:
            x[0, 0] = float("nan")
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    return monitor.alarms


def test_hand_written_reference_monitor_catches_a_nan_it_is_timed_against():
    assert _steps_by_hand(poison_at=3) > 0  # a real monitor, not an empty hook


def test_hand_written_reference_monitor_is_silent_on_healthy_steps():
    assert _steps_by_hand(poison_at=None) == 0


def test_overhead_benchmark_rl_times_batch_of_one_passes_when_named(tmp_path):
    results = _overhead(tmp_path, "--workloads", "rl")
    assert list(results) == ["rl"] and results["rl"]["ratio"] > 0


def test_overhead_benchmark_gpt2_runs_on_cpu_when_named(tmp_path):
    results = _overhead(tmp_path, "--device", "cpu", "--workloads", "gpt2")
    assert set(results) == {"gpt2"}
    assert results["gpt2"]["ratio"] > 0


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU, run benchmarks/gpu_check.py itself"
)
def test_gpu_check_runs_anywhere():
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_check" in done.stdout


@pytest.mark.slow
def test_relay_cost_benchmark_prints_each_cost(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "benchmarks/relay_cost.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 reads the store, nothing posted" in done.stdout
    assert "rank 1 posts one alert" in done.stdout


def test_hook_costs_benchmark_prints_each_hook_of_a_watched_step():
    done = subprocess.run(
        [sys.executable, "benchmarks/hook_costs.py", "--quick", "--steps", "5", "--warm", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "Monitor._before_optimizer_step" in done.stdout
    assert "ModelPasses.enter" in done.stdout


def test_phase_costs_prints_what_each_phase_of_the_loop_adds():
    done = subprocess.run(
        [sys.executable, "benchmarks/phase_costs.py", "--quick"]
        + ["--blocks", "2", "--block", "3", "--warm", "3", "--workloads", "mlp", "deep"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for phase in ("zero_grad", "forward", "loss", "backward", "step"):
        assert sum(line.split()[0] == phase for line in lines if line.strip()) == 2
    assert sum("whole step:" in line for line in lines) == 2


def test_step_writes_lists_the_state_a_healthy_step_moves():
    done = subprocess.run(
        [sys.executable, "benchmarks/step_writes.py", "--workload", "tiny", "--step", "41"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "_step " in done.stdout and "Monitor._advance" in done.stdout  # the step count moves
    assert "distinct writes" in done.stdout.splitlines()[-1]


def test_step_kinds_sorts_each_steps_gap_by_the_looks_made_at_it():
    done = subprocess.run(
        [sys.executable, "benchmarks/step_kinds.py", "--workload", "tiny"]
        + ["--steps", "30", "--from-step", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    kinds = {line.rsplit(None, 3)[0] for line in done.stdout.splitlines()[2:-1]}
    assert kinds == {"usual step", "class-target look", "activation sample"}  # steps 20-49
    assert done.stdout.splitlines()[-1].startswith("all steps: mean gap")
