"""``trainwatch report PATH``: what went wrong in a finished (or killed) run, at a glance.

Reads ``alerts.jsonl`` files only: they are flushed line by line, so a run
killed mid-way still has everything it raised. A log dir holding only
TensorBoard event files is recognised and refused with a pointer, since
reading alerts back from events is not implemented here.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from trainwatch.alert import SEVERITIES, severity_rank
from trainwatch.sinks import ALERTS_FILE, COUNTS_FILE

_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


class ReportError(Exception):
    """PATH holds nothing a report can be made from; the message says why."""


@dataclass
class Row:
    """One (run, model, rule, module): where and when it first fired and how often."""

    rule: str
    module: str | None
    severity: str
    first_step: int
    last_step: int
    count: int
    message: str
    hint: str
    model: str | None = None
    run: str | None = None


@dataclass
class Report:
    rows: list[Row]
    files: list[str]
    skipped_lines: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "skipped_lines": self.skipped_lines,
            "groups": [asdict(row) for row in self.rows],
        }


def find_alert_files(path: str | os.PathLike[str]) -> list[Path]:
    """``alerts.jsonl`` itself, the one in a log dir, or every one below a runs dir."""
    target = Path(path)
    if target.is_file():
        return [target]
    if not target.is_dir():
        raise ReportError(f"no such file or directory: {str(path)!r}")
    if (target / ALERTS_FILE).is_file():
        return [target / ALERTS_FILE]
    found = sorted(target.rglob(ALERTS_FILE))
    if found:
        return found
    if any(target.rglob("events.out.tfevents.*")):
        raise ReportError(
            f"{target} holds TensorBoard event files but no {ALERTS_FILE}; reading alerts "
            "from event files is not supported yet: open it with `tensorboard --logdir "
            f"{target}`, or report on the {ALERTS_FILE} the run wrote beside them"
        )
    raise ReportError(f"no {ALERTS_FILE} in {target} or below it")


def build_report(path: str | os.PathLike[str]) -> Report:
    files = find_alert_files(path)
    base = Path(path) if Path(path).is_dir() else None
    groups: dict[tuple[Any, ...], Row] = {}
    skipped = 0
    for file in files:
        run = None
        if len(files) > 1 and base is not None:
            run = str(file.parent.relative_to(base)) or "."
        for line in file.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rule, step = str(record["rule"]), int(record["step"])
            except (ValueError, KeyError, TypeError):
                skipped += 1  # a line cut short by a kill, or not an alert
                continue
            severity = str(record.get("severity", "warning"))
            module = record.get("module")
            data = record.get("data") if isinstance(record.get("data"), dict) else {}
            model = data.get("model")
            key = (run, model, rule, module)
            row = groups.get(key)
            if row is None:
                groups[key] = Row(
                    rule=rule,
                    module=module,
                    severity=severity,
                    first_step=step,
                    last_step=step,
                    count=1,
                    message=str(record.get("message", "")),
                    hint=str(record.get("hint", "")),
                    model=model,
                    run=run,
                )
                continue
            row.count += 1
            if step < row.first_step:
                row.first_step, row.message = step, str(record.get("message", ""))
            row.last_step = max(row.last_step, step)
            if _rank(severity) > _rank(row.severity):
                row.severity = severity
        _apply_counts(file.with_name(COUNTS_FILE), run, groups)
    rows = sorted(
        groups.values(),
        key=lambda r: (r.run or "", r.first_step, -_rank(r.severity), r.rule, r.module or ""),
    )
    return Report(rows, [str(f) for f in files], skipped)


def _apply_counts(path: Path, run: str | None, groups: dict[tuple[Any, ...], Row]) -> None:
    """Repeats are not lines in alerts.jsonl: take their counts from the monitor's tally."""
    try:
        tallies = json.loads(path.read_text(encoding="utf-8"))["counts"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no tally (a killed run): each line counts once
    for tally in tallies:
        try:
            row = groups.get((run, tally.get("model"), tally["rule"], tally.get("module")))
            if row is not None:
                row.count = max(row.count, int(tally["count"]))
                row.last_step = max(row.last_step, int(tally["last_step"]))
        except (KeyError, TypeError, ValueError):
            continue


def _rank(severity: str) -> int:
    return severity_rank(severity) if severity in SEVERITIES else 0


def render(report: Report) -> Group:
    """The table, then each finding's first message and hint (too long for a cell)."""
    parts: list[Any] = [_table(report)]
    for row in report.rows:
        where = f" [{row.module or '<model>'}]" if row.module is not None else ""
        model = f"{row.model}: " if row.model else ""
        line = Text(f"{model}{row.rule}{where} step {row.first_step}: ", style="bold")
        line.append(row.message, style="")
        if row.hint:
            line.append(f" | hint: {row.hint}", style="dim")
        parts.append(line)
    return Group(*parts)


def _table(report: Report) -> Table:
    several_runs = any(row.run for row in report.rows)
    several_models = len({row.model for row in report.rows}) > 1
    table = Table(
        title=f"trainwatch report: {len(report.rows)} finding(s) in {', '.join(report.files)}",
        title_justify="left",
    )
    if several_runs:
        table.add_column("run")
    if several_models:
        table.add_column("model")
    for name in ("rule", "module", "severity"):
        table.add_column(name, no_wrap=True)
    table.add_column("first step", justify="right")
    table.add_column("last step", justify="right")
    table.add_column("count", justify="right")
    for row in report.rows:
        cells: list[Any] = []
        if several_runs:
            cells.append(row.run or ".")
        if several_models:
            cells.append(row.model or "-")
        module = "-" if row.module is None else (row.module or "<model>")
        cells += [
            row.rule,
            module,
            Text(row.severity, style=_STYLE.get(row.severity, "")),
            str(row.first_step),
            str(row.last_step),
            str(row.count),
        ]
        table.add_row(*cells)
    if not report.rows:
        table.add_row(Text("no alerts", style="green"), *[""] * (len(table.columns) - 1))
    if report.skipped_lines:
        table.caption = f"{report.skipped_lines} unreadable line(s) skipped"
    return table


def report_main(path: str, *, as_json: bool = False) -> int:
    """The ``trainwatch report`` command; 0 on success, 1 when PATH holds no alerts file."""
    try:
        report = build_report(path)
    except ReportError as exc:
        print(f"trainwatch report: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        Console(highlight=False, soft_wrap=True).print(render(report))
    return 0
