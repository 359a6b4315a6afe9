"""Console, JSONL and memory sinks: what a person and a machine read back."""

from __future__ import annotations

import io
import json

import torch
from torch import nn

import trainwatch as tw
from tests.conftest import train
from trainwatch.alert import Alert
from trainwatch.config import Config, load_config
from trainwatch.sinks import AlertTally, ConsoleSink, JsonlSink, Summary, default_sinks
from trainwatch.sinks.tensorboard import TensorBoardSink


def _alert(**kw) -> Alert:
    base = dict(
        rule="zero_gradient",
        severity="warning",
        step=3,
        module="fc1",
        message="fc1.weight got no gradient",
        hint="look for a .detach()",
        data={"kind": "none"},
    )
    base.update(kw)
    return Alert(**base)


def test_console_line_has_step_severity_rule_module_message_and_hint():
    out = io.StringIO()
    ConsoleSink(out, width=400).emit(_alert())
    line = out.getvalue()
    assert line.count("\n") == 1
    assert line.strip() == (
        "trainwatch step 3 WARNING zero_gradient [fc1]: fc1.weight got no gradient"
        " | hint: look for a .detach()"
    )


def test_console_is_plain_text_when_not_a_terminal_and_coloured_on_one():
    plain, coloured = io.StringIO(), io.StringIO()
    ConsoleSink(plain).emit(_alert(severity="error"))
    ConsoleSink(coloured, force_terminal=True).emit(_alert(severity="error"))
    assert "\x1b[" not in plain.getvalue()
    assert "\x1b[" in coloured.getvalue()


def test_long_lines_are_not_hard_wrapped_in_logs():
    out = io.StringIO()
    ConsoleSink(out, width=40).emit(_alert(message="x" * 200))
    assert out.getvalue().count("\n") == 1


def test_root_module_is_named_model():
    out = io.StringIO()
    ConsoleSink(out).emit(_alert(module=""))
    assert "[<model>]" in out.getvalue()


def test_repeats_are_counted_not_reprinted(model):
    out = io.StringIO()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=out) as monitor:
        train(model, opt, 8, zero_grad_until=2)
    text = out.getvalue()
    assert text.count("ERROR accumulated_gradient") == 1
    assert monitor.alert_counts[("accumulated_gradient", None)] == 6
    assert len(monitor.alerts) == 1
    # The closing summary: the rule, its first step and count, and norms.
    summary = text.split("steps watched", 1)[1]
    assert "accumulated_gradient" in summary and " 2 " in summary and " 6 " in summary
    assert "grad norm" in summary and "fc2" in summary


def test_summary_lists_largest_and_smallest_layers():
    norms = {f"layer{i}": float(i) for i in range(12)}
    out = io.StringIO()
    sink = ConsoleSink(out, width=300)
    sink.close(Summary(steps=5, tallies=[AlertTally(_alert(), 4, 9)], latest_norms=norms))
    text = out.getvalue()
    assert "largest: layer11 11, layer10 10" in text
    assert "smallest: layer0 0, layer1 1" in text
    assert "5 steps watched" in text


def test_summary_can_be_turned_off(model):
    out = io.StringIO()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=out, console__summary=False):
        train(model, opt, 2)
    # Only the setup table, printed when the monitor attached, is left.
    assert "steps watched" not in out.getvalue()
    assert out.getvalue().startswith("trainwatch setup")


def test_jsonl_line_is_written_and_flushed_as_the_alert_is_raised(model, tmp_path):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "alerts.jsonl"
    with tw.watch(model, opt, log_dir=tmp_path, console=False):
        train(model, opt, 3, zero_grad_until=1)
        lines = path.read_text().splitlines()  # read while the monitor is open
        assert len(lines) == 1
        record = json.loads(lines[0])
        assert set(record) == {
            "rule",
            "severity",
            "step",
            "module",
            "message",
            "hint",
            "data",
            "time",
        }
        assert record["rule"] == "accumulated_gradient" and record["step"] == 1
        assert isinstance(record["time"], float)
        assert tw.Alert.from_dict(record).to_dict() == record


def test_a_clean_run_closes_with_its_counts_file_too(model, tmp_path):
    """Its presence says the run closed (a killed run has none), with the steps watched."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, log_dir=tmp_path, console=False):
        train(model, opt, 3)
    counts = json.loads((tmp_path / "alert_counts.json").read_text())
    assert counts == {"steps": 3, "counts": []}
    assert (tmp_path / "alerts.jsonl").read_text() == ""


def test_unwritable_log_dir_is_a_clear_error_and_attaches_nothing(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    try:
        tw.watch(model, log_dir=blocker / "sub", console=False)
    except tw.WatchError as exc:
        assert "log_dir" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected WatchError")
    with tw.watch(model, console=False):
        pass


def test_default_sinks_put_the_files_before_the_console(tmp_path):
    sinks = default_sinks(tmp_path, Config(), console=io.StringIO())
    assert [type(s) for s in sinks] == [JsonlSink, TensorBoardSink, ConsoleSink]
    for sink in sinks:
        sink.close(Summary(steps=0, tallies=[], latest_norms={}))


def test_default_sinks_write_through_a_writer_they_are_handed_and_leave_it_open(tmp_path):
    class Writer:
        closed = False

        def flush(self):
            pass

        def close(self):
            self.closed = True

    writer = Writer()
    sinks = default_sinks(None, Config(), console=False, writer=writer)
    assert [type(s) for s in sinks] == [TensorBoardSink] and sinks[0].writer is writer
    sinks[0].close(Summary(steps=0, tallies=[], latest_norms={}))
    assert not writer.closed  # its owner (the Lightning logger) closes it


def test_default_sinks_without_a_log_dir_or_tensorboard(tmp_path):
    assert [type(s) for s in default_sinks(None, Config())] == [ConsoleSink]
    assert default_sinks(None, Config(), console=False) == []
    no_tensorboard = load_config({"tensorboard": {"enabled": False}})
    sinks = default_sinks(tmp_path, no_tensorboard, console=False)
    assert [type(s) for s in sinks] == [JsonlSink]
    assert not list(tmp_path.glob("events.out.tfevents*"))
    sinks[0].close(Summary(steps=0, tallies=[], latest_norms={}))


def test_a_model_run_without_any_step_says_why_nothing_was_judged(model):
    """Weights updated by hand (gradients from torch.autograd.grad) with no
    monitor.step(): one line says the model ran but no step came, not silence."""
    out = io.StringIO()
    with tw.watch(model, console=out):
        for _ in range(3):
            x = torch.randn(16, 8)
            loss = model(x).pow(2).mean()
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p.sub_(0.01 * g)
    text = out.getvalue()
    assert "no training step watched: the model ran 3 forward passes" in text
    assert "monitor.step()" in text


def test_a_watched_step_prints_the_summary_and_no_idle_line(model):
    out = io.StringIO()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=out):
        train(model, opt, 2)
    text = out.getvalue()
    assert "2 steps watched" in text and "no training step watched" not in text


class _Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc1(x).detach())  # fc1 cut off: a zero_gradient finding


class _Critic(_Generator):
    pass


def _train_cut_off(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()


def test_two_models_watched_at_once_name_their_model_in_console_lines():
    """A GAN's two models watched apart print to one stderr: each line says whose."""
    g, d = _Generator(), _Critic()
    g_opt, d_opt = torch.optim.SGD(g.parameters(), 0.1), torch.optim.SGD(d.parameters(), 0.1)
    g_out, d_out = io.StringIO(), io.StringIO()
    with tw.watch(g, g_opt, console=g_out), tw.watch(d, d_opt, console=d_out):
        _train_cut_off(g, g_opt)
        _train_cut_off(d, d_opt)
    assert "zero_gradient [_Generator:fc1]" in g_out.getvalue()
    assert "zero_gradient [_Critic:fc1]" in d_out.getvalue()


def test_one_model_watched_alone_prints_bare_module_names():
    model = _Generator()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    out = io.StringIO()
    with tw.watch(model, opt, console=out):
        _train_cut_off(model, opt)
    assert "zero_gradient [fc1]" in out.getvalue()
