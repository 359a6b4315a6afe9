"""``<log_dir>/alerts.jsonl``: one line per alert, flushed as it is raised."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainwatch.alert import Alert
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import Sink, Summary

ALERTS_FILE = "alerts.jsonl"
# Repeats of a (rule, module) are counted, not written as lines; the counts
# land here when the monitor closes, for ``trainwatch report``.
COUNTS_FILE = "alert_counts.json"
# Every setup audit of the run (the table, not alerts), rewritten at each one.
SETUP_FILE = "setup.json"


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / ALERTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a resumed run keeps what the earlier part of it wrote.
        self._file = self.path.open("a", encoding="utf-8")
        self._audits: list[dict[str, Any]] = []
        if _ends_mid_line(self.path):
            # The earlier part was killed mid-line: end that line, or this
            # run's first alert would be glued onto it and lost with it.
            self._file.write("\n")
            self._file.flush()

    def emit(self, alert: Alert) -> None:
        if self._file.closed:
            return
        self._file.write(json.dumps(alert.to_dict(), default=str) + "\n")
        self._file.flush()  # readable up to the last line even after a kill

    def setup(self, audit: SetupAudit) -> None:
        written = audit.to_dict()
        earlier = _written_before(self._audits, audit)
        if earlier is not None:
            self._audits[earlier] = written
        else:
            self._audits.append(written)
        path = self.path.with_name(SETUP_FILE)
        partial = path.with_name(SETUP_FILE + ".partial")
        partial.write_text(json.dumps({"audits": self._audits}, indent=1))
        partial.replace(path)

    def close(self, summary: Summary) -> None:
        if not self._file.closed:
            self._file.close()
        # Written at every close, a clean run's too (no counts): its presence says
        # the run closed, and how many steps it watched.
        counts = [
            {
                "rule": t.first.rule,
                "module": t.first.module,
                "model": t.first.data.get("model"),
                "first_step": t.first.step,
                "last_step": t.last_step,
                "count": t.count,
            }
            for t in summary.tallies
        ]
        path = self.path.with_name(COUNTS_FILE)
        partial = path.with_name(COUNTS_FILE + ".partial")
        partial.write_text(json.dumps({"steps": summary.steps, "counts": counts}, indent=1))
        partial.replace(path)


def _written_before(audits: list[dict[str, Any]], audit: SetupAudit) -> int | None:
    """Where a table `trainwatch run` sends again at its end sits: it comes back with
    the count of models set up like it since (``alike``) and takes its own place."""
    if not audit.alike:
        return None
    same = (audit.model, audit.revision)
    return next((i for i, a in enumerate(audits) if (a["model"], a["revision"]) == same), None)


def _ends_mid_line(path: Path) -> bool:
    with path.open("rb") as file:
        if file.seek(0, 2) == 0:
            return False
        file.seek(-1, 2)
        return file.read(1) != b"\n"
