"""``trainwatch report``: a known alerts.jsonl summarised by rule and module."""

from __future__ import annotations

import json

import pytest

from trainwatch.cli import main
from trainwatch.report import build_report

KNOWN = [
    {"rule": "zero_gradient", "severity": "warning", "step": 7, "module": "fc1"},
    {"rule": "accumulated_gradient", "severity": "error", "step": 3, "module": None},
    {"rule": "zero_gradient", "severity": "warning", "step": 2, "module": "fc1"},
    {"rule": "zero_gradient", "severity": "error", "step": 9, "module": "fc1"},
    {"rule": "zero_gradient", "severity": "warning", "step": 4, "module": "head"},
]


def write_alerts(directory, records, tail=""):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "alerts.jsonl"
    lines = [
        json.dumps({"message": f"m{r['step']}", "hint": "h", "data": {}, "time": 1.0, **r})
        for r in records
    ]
    path.write_text("\n".join(lines) + "\n" + tail)
    return path


def test_groups_by_rule_and_module_with_first_step_and_count(tmp_path):
    path = write_alerts(tmp_path, KNOWN, tail='{"rule": "cut sh')  # a kill mid-line
    report = build_report(path)
    got = [(r.rule, r.module, r.severity, r.first_step, r.last_step, r.count) for r in report.rows]
    assert got == [
        ("zero_gradient", "fc1", "error", 2, 9, 3),
        ("accumulated_gradient", None, "error", 3, 3, 1),
        ("zero_gradient", "head", "warning", 4, 4, 1),
    ]
    assert report.rows[0].message == "m2"  # the first occurrence's message
    assert report.skipped_lines == 1


def test_json_output_and_directory_argument(tmp_path, capsys):
    write_alerts(tmp_path / "run1", KNOWN)
    assert main(["report", str(tmp_path / "run1"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(g["rule"], g["module"], g["count"]) for g in out["groups"]] == [
        ("zero_gradient", "fc1", 3),
        ("accumulated_gradient", None, 1),
        ("zero_gradient", "head", 1),
    ]


def test_table_output(tmp_path, capsys):
    write_alerts(tmp_path, KNOWN)
    assert main(["report", str(tmp_path / "alerts.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "accumulated_gradient" in out and "first step" in out and "fc1" in out


def test_a_runs_dir_reports_every_run_below_it(tmp_path):
    write_alerts(tmp_path / "a", KNOWN[:1])
    write_alerts(tmp_path / "b", KNOWN[1:2])
    rows = build_report(tmp_path).rows
    assert [(r.run, r.rule) for r in rows] == [
        ("a", "zero_gradient"),
        ("b", "accumulated_gradient"),
    ]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "no alerts.jsonl"),
        (lambda d: (d / "events.out.tfevents.1.host").write_bytes(b""), "event files"),
    ],
)
def test_nothing_to_report_says_why(tmp_path, capsys, setup, message):
    setup(tmp_path)
    assert main(["report", str(tmp_path)]) == 1
    assert message in capsys.readouterr().err


def test_report_on_what_trainwatch_run_wrote(tmp_path):
    from trainwatch.demo import run_demo

    run_demo("missing_zero_grad", steps=12, delay=0, log_dir=tmp_path, monitor_console=False)
    (row,) = build_report(tmp_path).rows
    # one line in alerts.jsonl; the repeats come from the tally written at close
    assert (row.rule, row.first_step, row.last_step, row.count) == (
        "accumulated_gradient",
        4,
        11,
        8,
    )


def test_report_reads_alerts_back_from_event_files_alone(tmp_path):
    import torch

    import trainwatch as tw
    from tests.conftest import TinyNet, train

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, log_dir=tmp_path, console=False):
        train(model, opt, 8, zero_grad_until=2)
    for name in ("alerts.jsonl", "alert_counts.json"):
        (tmp_path / name).unlink(missing_ok=True)
    (row,) = build_report(tmp_path).rows
    assert (row.rule, row.first_step, row.last_step, row.count) == (
        "accumulated_gradient",
        2,
        7,
        6,
    )
