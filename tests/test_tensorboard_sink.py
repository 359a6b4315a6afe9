"""TensorBoard sink: event files written by real loops, read back with TensorBoard's reader."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

import trainwatch as tw
from tests.conftest import train
from trainwatch.tensorboard_plugin import metadata


def _read(log_dir) -> EventAccumulator:
    guidance = {"tensors": 0, "scalars": 0, "histograms": 0}  # 0: keep every event
    events = EventAccumulator(str(log_dir), size_guidance=guidance)
    events.Reload()
    return events


def _payloads(events: EventAccumulator) -> dict[int, dict]:
    return {
        e.step: metadata.decode(tensor_util.make_ndarray(e.tensor_proto))
        for e in events.Tensors(metadata.ALERTS_TAG)
    }


def _norm_steps(events: EventAccumulator, layer: str) -> dict[int, float]:
    return {e.step: e.value for e in events.Scalars(metadata.norm_tag(layer))}


def test_per_layer_norms_and_total_are_scalars_equal_to_the_monitors(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path)
    train(model, opt, 4)
    latest, total = monitor.grad_norms(), monitor.total_grad_norm
    monitor.close()
    events = _read(tmp_path)
    assert events.Tags()["histograms"] == []
    scalars = set(events.Tags()["scalars"])
    assert scalars == {
        "trainwatch/grad_norm/fc1",
        "trainwatch/grad_norm/fc2",
        "trainwatch/grad_norm/head",
        "trainwatch/grad_norm/total",
    }
    for layer in ("fc1", "fc2", "head"):
        by_step = _norm_steps(events, layer)
        assert sorted(by_step) == [0, 1, 2, 3]
        assert by_step[3] == pytest.approx(latest[layer], rel=1e-6)
    assert events.Scalars(metadata.TOTAL_TAG)[-1].value == pytest.approx(total, rel=1e-6)


def test_norms_follow_the_configured_cadence(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path, tensorboard={"every": 3})
    train(model, opt, 7)
    monitor.close()
    assert sorted(_norm_steps(_read(tmp_path), "fc1")) == [0, 3, 6]


def test_histograms_are_off_by_default_and_throttled_when_on(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(
        model, opt, log_dir=tmp_path, tensorboard={"histograms": True, "histogram_every": 2}
    )
    train(model, opt, 5)
    monitor.close()
    events = _read(tmp_path)
    assert [e.step for e in events.Histograms(metadata.HISTOGRAM_TAG)] == [0, 2, 4]
    assert events.Histograms(metadata.HISTOGRAM_TAG)[0].histogram_value.num == 3  # layers


def test_a_step_with_alerts_gets_one_tensor_and_one_markdown_table(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path)
    train(model, opt, 5, zero_grad_until=2)  # planted: zero_grad dropped from step 2
    monitor.close()
    events = _read(tmp_path)
    payloads = _payloads(events)
    alert_steps = sorted(s for s, p in payloads.items() if p["alerts"])
    assert alert_steps == [2, 3, 4]
    first = payloads[2]["alerts"]
    assert [(a["rule"], a["step"], a["count"]) for a in first] == [("accumulated_gradient", 2, 1)]
    assert payloads[4]["alerts"][0]["count"] == 3
    assert events.SummaryMetadata(metadata.ALERTS_TAG).plugin_data.plugin_name == "trainwatch"
    (table_tag,) = [t for t in events.Tags()["tensors"] if t.startswith(metadata.TABLE_TAG)]
    text = tensor_util.make_ndarray(events.Tensors(table_tag)[0].tensor_proto).item().decode()
    assert "| error | accumulated_gradient |" in text and "zero_grad" in text


def test_a_recurring_finding_is_written_in_full_once_then_as_counts(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path)
    train(model, opt, 30, zero_grad_until=2)  # accumulated_gradient every step from 2
    monitor.close()
    events = _read(tmp_path)
    payloads = _payloads(events)
    (first,) = payloads[2]["alerts"]
    assert "zero_grad" in first["message"] and first["hint"]
    repeat = payloads[29]["alerts"][0]
    assert (repeat["rule"], repeat["count"]) == ("accumulated_gradient", 28)
    assert "message" not in repeat and "data" not in repeat  # a few bytes, not a kilobyte
    tables = [t for t in events.Tags()["tensors"] if t.startswith(metadata.TABLE_TAG)]
    assert [e.step for t in tables for e in events.Tensors(t)] == [2]  # new findings only


def test_clean_loop_writes_no_alerts_only_the_layer_order(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path)
    train(model, opt, 5)
    monitor.close()
    payloads = _payloads(_read(tmp_path))
    assert list(payloads) == [0]
    assert payloads[0]["alerts"] == [] and payloads[0]["marks"] == {}
    assert payloads[0]["layers"] == ["fc1", "fc2", "head"]


def test_first_nan_step_of_a_layer_is_marked_whatever_the_cadence(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path, tensorboard={"every": 10})

    def plant(step: int) -> None:
        if step == 3:
            model.head.bias.grad.fill_(float("nan"))

    train(model, opt, 6, before_step=plant)
    monitor.close()
    payloads = _payloads(_read(tmp_path))
    marked = {step: p["marks"] for step, p in payloads.items() if p["marks"]}
    # head goes NaN at 3; the NaN bias then poisons every layer's gradient at 4.
    assert marked[3] == {"head": "nan"}
    assert set(marked[4]) == {"fc1", "fc2"}
    assert 5 not in marked  # a streak is marked once, where it starts


def test_nan_norms_are_written_as_nan_scalars(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path)
    train(model, opt, 2, before_step=lambda s: model.fc2.weight.grad.fill_(float("nan")))
    monitor.close()
    assert all(math.isnan(v) for v in _norm_steps(_read(tmp_path), "fc2").values())


def test_halting_alert_is_in_the_event_file_before_close(model, tmp_path):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(
        model, opt, log_dir=tmp_path, console=False, halt_on=["accumulated_gradient"]
    )
    try:
        with pytest.raises(tw.TrainingHealthError):
            train(model, opt, 5, zero_grad_until=2)
        payloads = _payloads(_read(tmp_path))  # read while the monitor is still open
        assert payloads[2]["alerts"][0]["rule"] == "accumulated_gradient"
    finally:
        monitor.close()


def test_a_failing_writer_is_switched_off_and_training_goes_on(model, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from trainwatch.sinks.tensorboard import TensorBoardSink

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    writer = SummaryWriter(str(tmp_path))
    writer.file_writer.add_event = disk_full  # every event's write fails, as on a full disk
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.Monitor(model, [opt], sinks=[TensorBoardSink(writer)])
    try:
        train(model, opt, 4, zero_grad_until=2)
    finally:
        monitor.close()
        writer.close()
    assert monitor.step_count == 4
    rules = [a.rule for a in monitor.alerts]
    assert rules == ["internal_error", "accumulated_gradient"]
    assert "tensorboard sink" in monitor.alerts[0].message


def test_tensorboard_can_be_switched_off(model, tmp_path, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, log_dir=tmp_path, tensorboard=False)
    train(model, opt, 2)
    monitor.close()
    assert not list(tmp_path.glob("events.out.tfevents*"))
    assert (tmp_path / "alerts.jsonl").exists()


@pytest.mark.slow
def test_events_are_flushed_at_interpreter_exit_without_close(tmp_path):
    script = f"""
import torch, trainwatch as tw
from tests.conftest import TinyNet, train
model = TinyNet(); opt = torch.optim.SGD(model.parameters(), lr=0.01)
monitor = tw.watch(model, opt, log_dir={str(tmp_path)!r}, console=False,
                   tensorboard={{"flush_secs": 3600}})
train(model, opt, 3, zero_grad_until=1)
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=_repo_root())
    payloads = _payloads(_read(tmp_path))
    assert [p["alerts"][0]["step"] for s, p in sorted(payloads.items()) if p["alerts"]] == [1, 2]


def test_importing_trainwatch_loads_neither_lightning_nor_tensorboard():
    code = (
        "import sys, trainwatch; "
        "print(json.dumps([m for m in ('lightning', 'torch.utils.tensorboard', 'tensorboard')"
        " if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code],
        check=True,
        capture_output=True,
        text=True,
        cwd=_repo_root(),
    )
    assert json.loads(out.stdout) == []


def test_tensorboard_config_is_validated():
    with pytest.raises(tw.ConfigError, match=r"tensorboard\.every"):
        tw.load_config({"tensorboard": {"every": 0}})


def _repo_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent)
