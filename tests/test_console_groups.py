"""One mistake that raises the same finding in many modules at one step is one
group on the console; the alerts themselves (monitor.alerts, alerts.jsonl)
stay one per (rule, module)."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
from rich.console import Console
from torch import nn

import trainwatch as tw
from trainwatch.alert import Alert
from trainwatch.dispatch import Dispatcher
from trainwatch.errors import TrainingHealthError
from trainwatch.runner import run_script
from trainwatch.sinks import AlertTally, ConsoleSink, MemorySink, Summary


class CutStack(nn.Module):
    """Six layers, the first ``cut`` of them above a ``.detach()``: no gradient reaches them."""

    def __init__(self, cut: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        self.head = nn.Linear(16, 4)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.encoder):
            x = torch.relu(layer(x))
            if i == self.cut - 1:
                x = x.detach()
        return self.head(x)


def _train(cut: int, steps: int = 12, **watch) -> tuple[tw.Monitor, str]:
    torch.manual_seed(0)
    model = CutStack(cut)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = io.StringIO()
    monitor = tw.watch(model, opt, console=out, **watch)
    try:
        for _ in range(steps):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        monitor.close()
    return monitor, out.getvalue()


def _alert_lines(console: str, rule: str) -> list[str]:
    return [
        line for line in console.splitlines() if line.startswith("trainwatch step") and rule in line
    ]


def _jsonl(log_dir) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]


def test_a_detach_above_six_layers_is_one_grouped_console_line(tmp_path):
    monitor, console = _train(cut=6, log_dir=tmp_path)
    lines = console.splitlines()
    (first,) = _alert_lines(console, "zero_gradient")
    assert "[encoder.0]" in first and "| hint:" in first
    continuation = lines[lines.index(first) + 1]
    assert continuation == (
        "  and 5 more modules with the same finding: "
        "encoder.1, encoder.2, encoder.3, encoder.4, encoder.5"
    )
    # The alerts themselves are untouched: one per (rule, module), in every other sink.
    cut = [f"encoder.{i}" for i in range(6)]
    assert [a.module for a in monitor.alerts if a.rule == "zero_gradient"] == cut
    assert [r["module"] for r in _jsonl(tmp_path) if r["rule"] == "zero_gradient"] == cut
    assert len([key for key in monitor.alert_counts if key[0] == "zero_gradient"]) == 6
    # The summary table: one row for the six.
    assert "encoder.0 +5 more" in console
    assert "encoder.3 " not in console.split("steps watched")[-1]


def test_two_layers_cut_are_two_ordinary_lines(tmp_path):
    monitor, console = _train(cut=2, log_dir=tmp_path)
    lines = _alert_lines(console, "zero_gradient")
    assert ["[encoder.0]" in lines[0], "[encoder.1]" in lines[1]] == [True, True]
    assert len(lines) == 2
    assert "more modules" not in console and "more " not in console.split("steps watched")[-1]
    assert len([a for a in monitor.alerts if a.rule == "zero_gradient"]) == 2
    assert len([r for r in _jsonl(tmp_path) if r["rule"] == "zero_gradient"]) == 2


def test_halt_on_still_raises_with_the_first_alert_after_the_group_is_printed(tmp_path):
    with pytest.raises(TrainingHealthError) as raised:
        _train(cut=6, log_dir=tmp_path, halt_on=["zero_gradient"])
    assert raised.value.alert.rule == "zero_gradient"
    assert raised.value.alert.module == "encoder.0"
    # Every sink held all six before the raise.
    assert [r["module"] for r in _jsonl(tmp_path) if r["rule"] == "zero_gradient"] == [
        f"encoder.{i}" for i in range(6)
    ]


def test_halt_on_with_a_grouped_console_prints_the_group_before_raising():
    out = io.StringIO()
    memory = MemorySink()
    dispatcher = Dispatcher([memory, ConsoleSink(out, width=400)], halt_on=["zero_gradient"])
    with pytest.raises(TrainingHealthError) as raised:
        dispatcher.publish(_flood("zero_gradient", 5))
    assert raised.value.alert.module == "layers.0"
    assert len(memory.alerts) == 5
    assert out.getvalue().count("\n") == 2
    assert "and 4 more modules with the same finding" in out.getvalue()


def _flood(rule: str, n: int, *, step: int = 3, severity: str = "warning", **data) -> list[Alert]:
    return [
        Alert(
            rule=rule,
            severity=severity,
            step=step,
            module=f"layers.{i}",
            message=f"layers.{i}.weight got no gradient",
            hint="look for a .detach()",
            data=dict(data),
        )
        for i in range(n)
    ]


def test_a_long_flood_names_eight_modules_and_counts_the_rest():
    out = io.StringIO()
    ConsoleSink(out, width=400).emit_many(_flood("zero_gradient", 14))
    first, more = out.getvalue().splitlines()
    assert first.startswith("trainwatch step 3 WARNING zero_gradient [layers.0]")
    names = ", ".join(f"layers.{i}" for i in range(1, 9))
    assert more == f"  and 13 more modules with the same finding: {names}, ... (+5 more)"


def test_three_of_a_finding_stay_three_lines_and_other_rules_are_not_merged():
    out = io.StringIO()
    frozen = _flood("frozen_in_optimizer", 3)
    cut = _flood("zero_gradient", 4)
    errors = _flood("zero_gradient", 4, severity="error")
    ConsoleSink(out, width=400).emit_many([*frozen, *cut, *errors])
    lines = out.getvalue().splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "trainwatch step 3 WARNING frozen_in_optimizer [layers.0]",
        "trainwatch step 3 WARNING frozen_in_optimizer [layers.1]",
        "trainwatch step 3 WARNING frozen_in_optimizer [layers.2]",
        "trainwatch step 3 WARNING zero_gradient [layers.0]",
        "  and 3 more modules with the same finding",
        "trainwatch step 3 ERROR zero_gradient [layers.0]",
        "  and 3 more modules with the same finding",
    ]


def test_different_kinds_of_one_rule_are_different_findings():
    out = io.StringIO()
    never_called = _flood("zero_gradient", 2, kind="never_called")
    cut = [
        dataclasses.replace(a, module=f"cut.{i}") for i, a in enumerate(_flood("zero_gradient", 2))
    ]
    ConsoleSink(out, width=400).emit_many([*never_called, *cut])
    lines = out.getvalue().splitlines()
    assert len(lines) == 4
    assert not any("more modules" in line for line in lines)


def test_repeats_in_the_same_publish_are_counted_not_printed_nor_grouped():
    out = io.StringIO()
    memory = MemorySink()
    dispatcher = Dispatcher([memory, ConsoleSink(out, width=400)], halt_on=())
    dispatcher.publish(_flood("unused_parameter", 2, step=0, severity="info"))
    # The next step: the two again (repeats) among four new experts.
    dispatcher.publish(_flood("unused_parameter", 6, step=1, severity="info"))
    lines = out.getvalue().splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "trainwatch step 0 INFO unused_parameter [layers.0]",
        "trainwatch step 0 INFO unused_parameter [layers.1]",
        "trainwatch step 1 INFO unused_parameter [layers.2]",
        "  and 3 more modules with the same finding",
    ]
    assert lines[-1].endswith("layers.3, layers.4, layers.5")
    assert [a.module for a in memory.alerts] == [f"layers.{i}" for i in range(6)]
    assert [t.count for t in dispatcher.tallies.values()] == [2, 2, 1, 1, 1, 1]


def _table(summary: Summary) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(ConsoleSink.render_summary(summary))
    return out.getvalue()


def test_summary_rows_of_one_flood_collapse_into_one():
    flood = [
        AlertTally(
            Alert(
                "zero_gradient", "warning", 7, f"encoder.layers.{i}.self_attn", "no gradient", ""
            ),
            count=20,
            last_step=26,
        )
        for i in range(14)
    ]
    other_count = AlertTally(Alert("zero_gradient", "warning", 7, "head", "no gradient", ""), 3, 9)
    few = [
        AlertTally(Alert("frozen_in_optimizer", "warning", 0, f"encoder.{i}", "frozen", ""), 1, 0)
        for i in range(3)
    ]
    table = _table(Summary(27, [*flood, other_count, *few], {}))
    assert "encoder.layers.0.self_attn +13 more" in table
    assert "encoder.layers.1.self_attn" not in table
    rows = [line for line in table.splitlines() if "zero_gradient" in line]
    assert len(rows) == 2 and " head " in rows[1]
    assert all(f"encoder.{i} " in table for i in range(3))
    assert "+2 more" not in table


_SCRIPT = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.encoder(x).detach())

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_trainwatch_run_groups_the_flood_on_its_console_and_writes_every_alert(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    assert run_script(script, log_dir=tmp_path / "log") == 0
    err = capsys.readouterr().err
    assert len(_alert_lines(err, "zero_gradient")) == 1
    assert "and 5 more modules with the same finding: encoder.1, encoder.2," in err
    assert len([r for r in _jsonl(tmp_path / "log") if r["rule"] == "zero_gradient"]) == 6


def test_a_partial_freeze_another_optimizer_or_another_model_is_a_finding_of_its_own():
    out = io.StringIO()
    whole = _flood("frozen_in_optimizer", 4, trainable=0, optimizer=0)
    partial = [
        dataclasses.replace(a, module=f"adapter.{i}")
        for i, a in enumerate(_flood("frozen_in_optimizer", 1, trainable=1, optimizer=0))
    ]
    other_optimizer = [
        dataclasses.replace(a, module=f"head.{i}")
        for i, a in enumerate(_flood("frozen_in_optimizer", 1, trainable=0, optimizer=1))
    ]
    ConsoleSink(out, width=400).emit_many([*whole, *partial, *other_optimizer])
    lines = out.getvalue().splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "trainwatch step 3 WARNING frozen_in_optimizer [layers.0]",
        "  and 3 more modules with the same finding",
        "trainwatch step 3 WARNING frozen_in_optimizer [adapter.0]",
        "trainwatch step 3 WARNING frozen_in_optimizer [head.0]",
    ]


def test_the_summary_keeps_two_models_rows_apart_under_run():
    generator = _flood("frozen_in_optimizer", 2, model="G")
    critic = [
        dataclasses.replace(a, module=f"D:{a.module}")
        for a in _flood("frozen_in_optimizer", 2, model="D")
    ]
    summary = Summary(4, [AlertTally(a, 1, 3) for a in [*generator, *critic]], {})
    out = io.StringIO()
    Console(file=out, width=200).print(ConsoleSink.render_summary(summary))
    assert "more" not in out.getvalue()
