"""``trainwatch report PATH``: what went wrong in a finished (or killed) run, at a glance.

Reads ``alerts.jsonl`` files (flushed line by line, so a run killed mid-way
still has everything it raised), and, for a log dir that has only TensorBoard
event files (a Lightning run's logger dir, say), the alerts trainwatch's own
summaries hold, read back with TensorBoard's reader.
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
from trainwatch.sinks.console import severity_text
from trainwatch.strict_json import dumps


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
    # The step the rule took back what it had told (a freeze undone): no longer standing.
    undone_step: int | None = None


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
    event_dirs = sorted({p.parent for p in target.rglob("events.out.tfevents.*")})
    if event_dirs:
        return event_dirs
    raise ReportError(f"no {ALERTS_FILE} or TensorBoard event files in {target} or below it")


def _records(source: Path) -> tuple[list[dict[str, Any] | None], bool]:
    """Alert records of one source, and whether they carry their own counts.

    None stands for a line that could not be read (cut short by a kill).
    """
    if source.is_file():
        records: list[dict[str, Any] | None] = []
        # errors="replace": bytes cut mid-character by a kill spoil only their own line.
        for line in source.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                records.append(None)
        return records, False
    return _records_from_events(source), True


def _records_from_events(directory: Path) -> list[dict[str, Any] | None]:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    from trainwatch.tensorboard_plugin import metadata

    accumulator = event_accumulator.EventAccumulator(
        str(directory), size_guidance={event_accumulator.TENSORS: 0}
    )
    accumulator.Reload()
    records: list[dict[str, Any] | None] = []
    for tag in accumulator.Tags().get("tensors", []):
        if not tag.startswith(metadata.ALERTS_TAG):
            continue
        for event in accumulator.Tensors(tag):
            try:
                payload = metadata.decode(tensor_util.make_ndarray(event.tensor_proto))
            except (ValueError, TypeError):
                records.append(None)
                continue
            records.extend(payload.get("alerts", []))
    if not records:
        raise ReportError(f"the event files in {directory} hold no trainwatch alerts")
    return records


def build_report(path: str | os.PathLike[str]) -> Report:
    files = find_alert_files(path)
    base = Path(path) if Path(path).is_dir() else None
    groups: dict[tuple[Any, ...], Row] = {}
    told: dict[tuple[Any, ...], int] = {}  # each row's last step told, withdrawals aside
    withdrawn: dict[tuple[Any, ...], int] = {}  # each row's last withdrawal's step
    skipped = 0
    for file in files:
        run = None
        if len(files) > 1 and base is not None:
            run = str(file.parent.relative_to(base)) or "."
        records, counted = _records(file)
        for record in records:
            try:
                rule, step = str(record["rule"]), int(record["step"])  # type: ignore[index]
            except (ValueError, KeyError, TypeError):
                skipped += 1  # a line cut short by a kill, or not an alert
                continue
            assert record is not None
            severity = str(record.get("severity", "warning"))
            module = record.get("module")
            data = record.get("data") if isinstance(record.get("data"), dict) else {}
            model = data.get("model")
            key = (run, model, rule, module)
            marks = withdrawn if data.get("withdraws") else told
            marks[key] = max(marks.get(key, step), step)
            row = groups.get(key)
            if row is None:
                groups[key] = Row(
                    rule=rule,
                    module=module,
                    severity=severity,
                    first_step=step,
                    last_step=step,
                    count=int(record.get("count", 1)) if counted else 1,
                    message=str(record.get("message", "")),
                    hint=str(record.get("hint", "")),
                    model=model,
                    run=run,
                )
                continue
            row.count = max(row.count, int(record.get("count", 1))) if counted else row.count + 1
            if step < row.first_step:
                row.first_step, row.message = step, str(record.get("message", ""))
            row.last_step = max(row.last_step, step)
            if _rank(severity) > _rank(row.severity):
                row.severity = severity
        if file.is_file():
            _apply_counts(file.with_name(COUNTS_FILE), run, groups)
    for key, step in withdrawn.items():
        if key in told and told[key] <= step:
            groups[key].undone_step = step
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
        table.add_column("model", no_wrap=True)
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
            severity_text(row.severity, row.undone_step),
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
        print(dumps(report.to_dict(), indent=2))
    else:
        Console(highlight=False, soft_wrap=True).print(render(report))
    return 0
