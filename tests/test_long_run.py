"""Long runs: 20,000 steps with every rule on, and runs that end by a signal.

Memory: trainwatch's own host memory and, on CUDA, the device memory it holds
stay flat; a finding that recurs every step is printed and written once and
counted. Kills: real child processes (``tests/scripts/train_until_killed.py``)
stopped with SIGTERM (files complete, the process still dies by SIGTERM) and
SIGKILL (files readable up to their last complete line).
"""

from __future__ import annotations

import gc
import io
import json
import signal
import subprocess
import sys
import threading
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, train
from trainwatch import termination
from trainwatch.cli import main as cli_main
from trainwatch.collect import batch_norm_batches
from trainwatch.report import build_report
from trainwatch.rules import RULE_CLASSES, RULE_IDS
from trainwatch.tensorboard_plugin import metadata

REPO = Path(__file__).resolve().parent.parent
CHILD = REPO / "tests" / "scripts" / "train_until_killed.py"
SIGTERM_SELF = REPO / "tests" / "scripts" / "sigterm_self.py"
ALERT_FIELDS = {"rule", "severity", "step", "module", "message", "hint", "data", "time"}

# -- 20,000 steps ------------------------------------------------------------

STEPS = 20_000
WARM_UP = 1_000  # every rule's per-module state exists, sampled checks have run
TRACED = 500  # the last steps, under tracemalloc (it triples a step's cost)
TRACE_SETTLE = 100

# Every rule is on by default; on top, what is off by default: every update's
# weights checked at once, and the norm histograms. Norm scalars every 10
# steps instead of every step: on a model this small, TensorBoard's writer
# costs about as much as all the checks together (the sinks can cost
# more than the checks); streak marks and alerts are still written at
# every step.
EVERYTHING_ON = {
    "nonfinite_parameter": {"check_every": 1},
    "tensorboard": {"every": 10, "histograms": True, "histogram_every": 100},
}

# Bounds. tracemalloc names the line that first allocated a block, and the
# interpreter's free lists hand such blocks on to other objects, so blocks
# first allocated at trainwatch's lines and now held elsewhere (or the other
# way round) come and go: measured, up to about 100 blocks at one line and
# about 8-16 KiB over the traced window, settling but never exactly flat. A
# leak of one object per step at one line adds a block per traced step there
# (400), which the per-line bound catches however small the object; the byte
# bound catches bigger leaks spread over several lines.
MAX_PYTHON_BLOCKS_GROWTH = 2_000
MAX_BLOCKS_GROWTH_AT_ONE_LINE = (TRACED - TRACE_SETTLE) // 2
MAX_TRAINWATCH_BYTES_GROWTH = 32 * 1024
MAX_DEVICE_BYTES_GROWTH = 64 * 1024


class LongRunNet(nn.Module):
    """TinyNet plus what the behaviour rules look at: a ReLU module, batch norm, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.act = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.detach_fc1 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act(self.norm(self.fc1(x))))
        if self.detach_fc1:
            h = h.detach()
        return self.head(torch.tanh(self.fc2(h)))


@dataclass
class LongRun:
    """One 20,000-step run and what was measured along it."""

    variant: str
    device: str
    monitor: tw.Monitor
    log_dir: Path
    console: str
    python_blocks_growth: int  # steps WARM_UP .. STEPS - TRACED, whole process
    trainwatch_growth: TracedGrowth  # the traced window, trainwatch's own files
    device_bytes_growth: int | None = None  # steps WARM_UP .. STEPS, CUDA only


def _python_blocks() -> int:
    gc.collect()
    return sys.getallocatedblocks()


def _trainwatch_snapshot() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*trainwatch/*")])


@dataclass
class TracedGrowth:
    """What trainwatch's own lines hold more of at the end of a traced window."""

    steps: int
    bytes: int
    most_blocks_at_one_line: int
    top_lines: list[str]

    @classmethod
    def between(
        cls, before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, steps: int
    ) -> TracedGrowth:
        diff = after.compare_to(before, "lineno")
        most = max((stat.count_diff for stat in diff), default=0)
        top = sorted(diff, key=lambda stat: stat.count_diff, reverse=True)[:5]
        return cls(steps, sum(stat.size_diff for stat in diff), most, [str(s) for s in top])

    def explained(self) -> str:
        return (
            f"trainwatch grew by {self.bytes} bytes in {self.steps} steps, at most "
            f"{self.most_blocks_at_one_line} blocks at one line; most blocks added:\n"
            + "\n".join(self.top_lines)
        )


def _traced_growth(loop: _Loop, settle: int, steps: int) -> TracedGrowth:
    """Run ``settle`` then ``steps`` steps under tracemalloc; what trainwatch's own
    lines gained over the last ``steps``."""
    tracemalloc.start()
    try:
        loop.run(settle)
        before = _trainwatch_snapshot()
        loop.run(steps)
        after = _trainwatch_snapshot()
    finally:
        tracemalloc.stop()
    return TracedGrowth.between(before, after, steps)


def _device_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


class _Loop:
    """The user's loop: fresh batches, an evaluation pass every 500 steps.

    ``recurring`` plants two bugs: fc1's block is cut out of the graph
    (zero_gradient for fc1 and norm, reported once) and zero_grad() is never
    called (accumulated_gradient at every step from step 1). Its learning
    rate is 0: the gradients pile up (that is the bug) but the weights stay
    put, so the numbers stay finite for all 20,000 steps (and the run changes
    nothing: stalled_training, reported once).
    """

    def __init__(self, model: LongRunNet, device: str, recurring: bool) -> None:
        self.model = model
        self.device = device
        self.recurring = recurring
        self.opt = torch.optim.SGD(model.parameters(), lr=0.0 if recurring else 0.01)
        self.gen = torch.Generator().manual_seed(0)
        self.step = 0

    def run(self, steps: int) -> None:
        model, opt = self.model, self.opt
        for _ in range(steps):
            x = torch.randn(8, 8, generator=self.gen).to(self.device)
            y = x[:, :1].sin()
            if not self.recurring:
                opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if self.step % 500 == 0:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            self.step += 1


def _run_20000_steps(variant: str, device: str, log_dir: Path) -> LongRun:
    torch.manual_seed(0)
    model = LongRunNet().to(device)
    model.detach_fc1 = variant == "recurring"
    loop = _Loop(model, device, recurring=variant == "recurring")
    console = io.StringIO()
    with tw.watch(model, loop.opt, log_dir=log_dir, config=EVERYTHING_ON, console=console) as mon:
        loop.run(WARM_UP)
        blocks_before, device_before = _python_blocks(), _device_bytes(device)
        loop.run(STEPS - WARM_UP - TRACED)
        blocks_after = _python_blocks()
        growth = _traced_growth(loop, TRACE_SETTLE, TRACED - TRACE_SETTLE)
        device_after = _device_bytes(device)
    assert mon.step_count == STEPS
    return LongRun(
        variant=variant,
        device=device,
        monitor=mon,
        log_dir=log_dir,
        console=console.getvalue(),
        python_blocks_growth=blocks_after - blocks_before,
        trainwatch_growth=growth,
        device_bytes_growth=(
            None if device_before is None or device_after is None else device_after - device_before
        ),
    )


_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
HEALTHY = [
    pytest.param(("healthy", "cpu"), id="healthy-cpu"),
    pytest.param(("healthy", "cuda"), id="healthy-cuda", marks=_CUDA),
]
RECURRING = [
    pytest.param(("recurring", "cpu"), id="recurring-cpu"),
    pytest.param(("recurring", "cuda"), id="recurring-cuda", marks=_CUDA),
]


@pytest.fixture(scope="module")
def long_run(request, tmp_path_factory) -> LongRun:
    """Each (variant, device) runs once; its tests share the measurements."""
    variant, device = request.param
    return _run_20000_steps(variant, device, tmp_path_factory.mktemp(f"{variant}-{device}"))


def test_the_long_runs_turn_every_rule_on():
    config = tw.load_config(EVERYTHING_ON)
    rules = [rule for rule in RULE_IDS if config.rule(rule) is not None]
    assert {cls.id for cls in RULE_CLASSES} <= set(rules)
    assert all(config.rule(rule).enabled for rule in rules)


@pytest.mark.slow
@pytest.mark.parametrize("long_run", HEALTHY + RECURRING, indirect=True)
def test_trainwatch_memory_stays_flat_over_20000_steps(long_run):
    run = long_run
    assert run.python_blocks_growth < MAX_PYTHON_BLOCKS_GROWTH, (
        f"{run.python_blocks_growth} more Python objects after {STEPS - WARM_UP - TRACED} steps"
    )
    growth = run.trainwatch_growth
    assert growth.most_blocks_at_one_line < MAX_BLOCKS_GROWTH_AT_ONE_LINE, growth.explained()
    assert growth.bytes < MAX_TRAINWATCH_BYTES_GROWTH, growth.explained()
    if run.device == "cuda":
        assert run.device_bytes_growth is not None
        assert run.device_bytes_growth < MAX_DEVICE_BYTES_GROWTH, (
            f"device memory grew by {run.device_bytes_growth} bytes"
        )


class _ShiftingBatchLoop(_Loop):
    """The user's loop with batches of 8 and 7 rows in turn: through batch norm in
    training mode, the batch size changes at every step."""

    def run(self, steps: int) -> None:
        model, opt = self.model, self.opt
        for _ in range(steps):
            x = torch.randn(8 - self.step % 2, 8, generator=self.gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
            opt.step()
            self.step += 1


@pytest.mark.parametrize("history", ["kept bounded", "PLANTED: grows without bound"])
def test_the_memory_bound_catches_a_history_that_gains_an_entry_every_step(
    history, monkeypatch, tmp_path
):
    planted = history.startswith("PLANTED")
    if planted:  # every batch-size change kept: one entry a step, at one line
        monkeypatch.setattr(batch_norm_batches, "KEPT", 10**9)
    torch.manual_seed(0)
    model = LongRunNet()
    loop = _ShiftingBatchLoop(model, "cpu", recurring=False)
    with tw.watch(model, loop.opt, log_dir=tmp_path, config=EVERYTHING_ON, console=False):
        loop.run(300)
        growth = _traced_growth(loop, settle=50, steps=TRACED - TRACE_SETTLE)
    caught = growth.most_blocks_at_one_line >= MAX_BLOCKS_GROWTH_AT_ONE_LINE
    assert caught == planted, growth.explained()


@pytest.mark.slow
@pytest.mark.parametrize("long_run", HEALTHY, indirect=True)
def test_a_healthy_20000_step_run_raises_no_alert(long_run):
    assert [(a.rule, a.module, a.step) for a in long_run.monitor.alerts] == []
    assert (long_run.log_dir / "alerts.jsonl").read_text() == ""


@pytest.mark.slow
@pytest.mark.parametrize("long_run", RECURRING, indirect=True)
def test_a_finding_that_recurs_every_step_is_printed_and_written_once_and_counted(long_run):
    run = long_run
    findings = {
        ("accumulated_gradient", None),
        ("zero_gradient", "fc1"),
        ("zero_gradient", "norm"),
        ("stalled_training", ""),
    }
    assert {a.key for a in run.monitor.alerts} == findings
    # The console: one line per finding, then the summary table.
    printed = [line for line in run.console.splitlines() if line.startswith("trainwatch step")]
    assert len(printed) == len(findings)
    assert len(run.console.splitlines()) < 25
    # alerts.jsonl: one line per finding.
    records = [json.loads(line) for line in (run.log_dir / "alerts.jsonl").open()]
    assert len(records) == len(findings)
    assert {(r["rule"], r["module"]) for r in records} == findings
    # ... and every repeat counted: steps 1 .. 19,999 re-applied stale gradients.
    assert run.monitor.alert_counts[("accumulated_gradient", None)] == STEPS - 1
    counts = json.loads((run.log_dir / "alert_counts.json").read_text())
    assert counts["steps"] == STEPS
    by_rule = {(c["rule"], c["module"]): c for c in counts["counts"]}
    assert by_rule["accumulated_gradient", None]["count"] == STEPS - 1
    assert by_rule["accumulated_gradient", None]["last_step"] == STEPS - 1
    row = next(r for r in build_report(run.log_dir).rows if r.rule == "accumulated_gradient")
    assert (row.first_step, row.last_step, row.count) == (1, STEPS - 1, STEPS - 1)


# -- the SIGTERM handler: taken only where the default is in place ------------


@pytest.fixture
def default_sigterm():
    """Every test here starts and ends with SIGTERM's default action."""
    gc.collect()  # monitors of earlier tests that were never closed let go
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    yield
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_plain_loop_monitor_takes_sigterm_while_open_and_gives_it_back(model, default_sigterm):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(model, opt, console=False)
    assert termination.installed()
    monitor.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_is_given_back_when_the_last_of_several_monitors_closes(default_sigterm):
    first, second = TinyNet(), TinyNet()
    a = tw.watch(first, torch.optim.SGD(first.parameters(), lr=0.01), console=False)
    b = tw.watch(second, torch.optim.SGD(second.parameters(), lr=0.01), console=False)
    a.close()
    assert termination.installed()
    b.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("users", ["handler", "ignore"])
def test_a_sigterm_disposition_of_the_users_is_never_replaced(model, default_sigterm, users):
    own = signal.SIG_IGN if users == "ignore" else (lambda signum, frame: None)
    signal.signal(signal.SIGTERM, own)
    monitor = tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.01), console=False)
    assert signal.getsignal(signal.SIGTERM) is own
    monitor.close()
    assert signal.getsignal(signal.SIGTERM) is own


def test_a_handler_installed_after_watch_is_left_in_place_on_close(model, default_sigterm):
    monitor = tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.01), console=False)

    def own(signum, frame):
        pass

    signal.signal(signal.SIGTERM, own)
    monitor.close()
    assert signal.getsignal(signal.SIGTERM) is own


def test_a_handler_that_chains_to_ours_keeps_the_process_and_the_monitor(model, default_sigterm):
    monitor = tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.01), console=False)
    ours = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # e.g. Lightning's
    ours(signal.SIGTERM, None)  # what a chaining handler does on SIGTERM
    assert not monitor.closed  # the process is alive too: we are running
    monitor.close()


def test_a_monitor_opened_off_the_main_thread_takes_no_signal(model, default_sigterm):
    opened: list[tw.Monitor] = []
    worker = threading.Thread(
        target=lambda: opened.append(
            tw.watch(model, torch.optim.SGD(model.parameters(), lr=0.01), console=False)
        )
    )
    worker.start()
    worker.join()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    opened[0].close()


# -- real kills ---------------------------------------------------------------


@dataclass
class Killed:
    """A child run that was signalled: its exit status and how far it got."""

    returncode: int
    last_step: int  # the last step the child reported done before it died
    first_alerts: int | None  # len(monitor.alerts) at that step (None: unwatched)
    stderr: str


def _kill_mid_run(command: list[str], sig: signal.Signals) -> Killed:
    """Start the child, wait for READY (alerts raised, steps passed), send ``sig``."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    watchdog = threading.Timer(120, proc.kill)  # a child that never dies fails, not hangs
    watchdog.start()
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == "READY":
                break
        proc.send_signal(sig)
        out, err = proc.stdout.read(), proc.stderr.read()  # to EOF: the child is gone
        proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    lines = [*seen, *out.splitlines()]
    progress = [line.split() for line in lines if line.startswith("step ")]
    progress = [words for words in progress if len(words) in (2, 4)]  # not a line cut short
    assert progress, err
    last = progress[-1]
    return Killed(proc.returncode, int(last[1]), int(last[3]) if len(last) == 4 else None, err)


def _alert_lines(log_dir: Path) -> tuple[list[dict], str]:
    """The complete lines of alerts.jsonl, and what follows the last newline."""
    text = (log_dir / "alerts.jsonl").read_text()
    complete, _, tail = text.rpartition("\n")
    return [json.loads(line) for line in complete.splitlines()], tail


def _events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    return events


def _alert_steps_in_events(events: EventAccumulator) -> dict[str, set[int]]:
    steps: dict[str, set[int]] = {}
    for event in events.Tensors(metadata.ALERTS_TAG):
        payload = metadata.decode(tensor_util.make_ndarray(event.tensor_proto))
        for alert in payload["alerts"]:
            steps.setdefault(alert["rule"], set()).add(alert["step"])
    return steps


@pytest.mark.slow
def test_sigterm_mid_run_leaves_every_alert_and_event_on_disk(tmp_path):
    log_dir = tmp_path / "log"
    killed = _kill_mid_run([sys.executable, str(CHILD), "--log-dir", str(log_dir)], signal.SIGTERM)
    assert killed.returncode == -signal.SIGTERM, killed.stderr  # still died by SIGTERM
    last = killed.last_step
    # alerts.jsonl: every alert raised before the kill, each a complete line.
    lines, tail = _alert_lines(log_dir)
    assert tail == ""
    assert len(lines) == killed.first_alerts
    assert {(r["rule"], r["module"]) for r in lines} == {
        ("zero_gradient", "fc1"),
        ("accumulated_gradient", None),
    }
    assert all(set(r) == ALERT_FIELDS for r in lines)
    # The monitor closed: repeats were counted up to the kill.
    counts = json.loads((log_dir / "alert_counts.json").read_text())
    assert counts["steps"] > last
    (accumulated,) = [c for c in counts["counts"] if c["rule"] == "accumulated_gradient"]
    assert accumulated["count"] >= last  # steps 1 .. last at least
    # TensorBoard: every step's norms and alerts up to the kill.
    events = _events(log_dir)
    scalar_steps = {e.step for e in events.Scalars(metadata.TOTAL_TAG)}
    assert set(range(last + 1)) <= scalar_steps
    alert_steps = _alert_steps_in_events(events)
    assert alert_steps["zero_gradient"] == {0}
    assert set(range(1, last + 1)) <= alert_steps["accumulated_gradient"]


@pytest.mark.slow
def test_sigkill_mid_run_leaves_files_readable_up_to_the_last_complete_line(tmp_path, capsys):
    log_dir = tmp_path / "log"
    killed = _kill_mid_run([sys.executable, str(CHILD), "--log-dir", str(log_dir)], signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    lines, _ = _alert_lines(log_dir)
    assert {r["rule"] for r in lines} == {"zero_gradient", "accumulated_gradient"}
    # New findings reach the event files as they are written, not flush_secs later.
    events = _events(log_dir)
    assert set(_alert_steps_in_events(events)) >= {"zero_gradient", "accumulated_gradient"}
    assert {0, 1} <= {e.step for e in events.Scalars(metadata.TOTAL_TAG)}
    # A kill in the middle of a line: the report reads every line before it.
    path = log_dir / "alerts.jsonl"
    text = path.read_text()
    path.write_text(text + text.splitlines()[-1][:40])
    capsys.readouterr()
    assert cli_main(["report", str(log_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["skipped_lines"] == 1
    assert {g["rule"] for g in report["groups"]} == {"zero_gradient", "accumulated_gradient"}


def test_a_run_resumed_after_a_kill_mid_line_keeps_its_first_alert(tmp_path, model):
    cut = '{"rule": "zero_gradient", "step": 3, "mod'
    (tmp_path / "alerts.jsonl").write_text(cut)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, log_dir=tmp_path, console=False):
        train(model, opt, 3, zero_grad_until=1)
    first, *rest = (tmp_path / "alerts.jsonl").read_text().splitlines()
    assert first == cut
    assert [json.loads(line)["rule"] for line in rest] == ["accumulated_gradient"]


def test_report_reads_an_alerts_file_cut_inside_a_character(tmp_path):
    line = json.dumps({"rule": "zero_gradient", "severity": "warning", "step": 3, "module": "fc1"})
    cut = '{"rule": "zero_gradient", "message": "caf\u00e9'.encode()[:-1]  # half of the é
    (tmp_path / "alerts.jsonl").write_bytes(line.encode() + b"\n" + cut)
    report = build_report(tmp_path)
    assert [(r.rule, r.module, r.count) for r in report.rows] == [("zero_gradient", "fc1", 1)]
    assert report.skipped_lines == 1


@pytest.mark.slow
def test_trainwatch_run_closes_its_files_when_the_script_gets_sigterm(tmp_path):
    log_dir = tmp_path / "log"
    command = [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(log_dir)]
    killed = _kill_mid_run([*command, str(CHILD), "--unwatched"], signal.SIGTERM)
    assert killed.returncode == -signal.SIGTERM, killed.stderr
    assert "steps watched" in killed.stderr  # the summary printed on the way out
    lines, tail = _alert_lines(log_dir)
    assert tail == ""
    assert {r["rule"] for r in lines} == {"zero_gradient", "accumulated_gradient"}
    counts = json.loads((log_dir / "alert_counts.json").read_text())
    assert counts["steps"] > killed.last_step


@pytest.mark.slow
def test_a_sigterm_during_trainwatchs_own_write_is_acted_on_when_the_write_ends(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SIGTERM_SELF), "during-write", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout.splitlines() == ["write finished"]
    assert json.loads((tmp_path / "alert_counts.json").read_text())["steps"] == 3


@pytest.mark.slow
def test_sigterm_ends_the_process_even_when_closing_hangs():
    done = subprocess.run(
        [sys.executable, str(SIGTERM_SELF), "close-hangs"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "still alive" not in done.stdout
