"""``<log_dir>/alerts.jsonl``: one line per alert, flushed as it is raised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from trainwatch.alert import Alert
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import Sink, Summary
from trainwatch.sinks.shared_log_dir import LogDir, log_dir_of, merged_counts, merged_setup
from trainwatch.strict_json import dumps

ALERTS_FILE = "alerts.jsonl"
# Repeats of a (rule, module) are counted, not written as lines; the counts
# land here when the monitor closes, for ``trainwatch report``.
COUNTS_FILE = "alert_counts.json"
# Every setup audit of the run (the table, not alerts), rewritten at each one.
SETUP_FILE = "setup.json"


class JsonlSink(Sink):
    name = "jsonl"

    def __init__(self, log_dir: str | Path, model: nn.Module | None = None) -> None:
        """``model``: the one model whose alerts this sink writes (``tw.watch``, the
        Lightning and Hugging Face callbacks); its name goes on them once another
        model of the process writes into the same dir (see ``shared_log_dir``).
        None where the alerts name their models already (``trainwatch run``)."""
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
        self._dir: LogDir | None = None
        self.model_name: str | None = None
        if model is not None:
            self._dir = log_dir_of(
                self.path, self.path.with_name(COUNTS_FILE), self.path.with_name(SETUP_FILE)
            )
            self.model_name = self._dir.join(self, model)

    @property
    def names_models(self) -> bool:
        """Whether this sink's alerts carry their model's name: other models write here."""
        return self._dir is not None and self._dir.named

    def reopen(self) -> None:
        """The file was rewritten (its earlier lines given their model): append anew."""
        if not self._file.closed:
            self._file.close()
            self._file = self.path.open("a", encoding="utf-8")

    def emit(self, alert: Alert) -> None:
        if self._file.closed:
            return
        record = alert.to_dict()
        if self.names_models and record["data"].get("model") is None:
            record["data"] = {**record["data"], "model": self.model_name}
        self._file.write(dumps(record) + "\n")
        self._file.flush()  # readable up to the last line even after a kill

    def setup(self, audit: SetupAudit) -> None:
        written = audit.to_dict()
        earlier = _written_before(self._audits, audit)
        if earlier is not None:
            self._audits[earlier] = written
        else:
            self._audits.append(written)
        path = self.path.with_name(SETUP_FILE)
        audits = self._audits
        if self.names_models and self.model_name is not None:
            for own in audits:
                own["model"] = own.get("model") or self.model_name
            audits = merged_setup(path, self.model_name, audits)
        if self._dir is not None:
            self._dir.setup_ours = True
        partial = path.with_name(SETUP_FILE + ".partial")
        partial.write_text(dumps({"audits": audits}, indent=1))
        partial.replace(path)

    def close(self, summary: Summary) -> None:
        if not self._file.closed:
            self._file.close()
        named = self.model_name if self.names_models else None
        # Written at every close, a clean run's too (no counts): its presence says
        # the run closed, and how many steps it watched.
        counts = [
            {
                "rule": t.first.rule,
                "module": t.first.module,
                "model": t.first.data.get("model") or named,
                "first_step": t.first.step,
                "last_step": t.last_step,
                "count": t.count,
            }
            for t in summary.tallies
        ]
        path = self.path.with_name(COUNTS_FILE)
        written: dict[str, Any] = {"steps": summary.steps, "counts": counts}
        if named is not None:
            # Other models' counts stay beside this one's.
            written = merged_counts(path, named, counts, summary.steps)
        if self._dir is not None:
            self._dir.counts_ours = True
        partial = path.with_name(COUNTS_FILE + ".partial")
        partial.write_text(dumps(written, indent=1))
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
