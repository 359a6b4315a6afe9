"""Log dirs that several models write into: then each alert line names its model.

A script training two models one after the other, each under its own
``tw.watch(..., log_dir=same)`` (a baseline, then a bigger model), or one
Lightning callback with a fixed ``log_dir`` handed a new module for every fit,
shares one ``alerts.jsonl``, ``alert_counts.json`` and ``setup.json``. Written
as a single monitor writes them, the second model's counts would replace the
first's, and ``trainwatch report`` would merge both models' findings at the
same module into one row. So, once a second model of the process opens a dir,
the dir names its models as ``trainwatch run`` does (``data.model``: the
class name, ``Sequential#2`` for a second model of the same class): the lines
the first model wrote already get its name, later lines carry their model's,
and each model's counts and setup tables are kept beside the others'. A dir
whose earlier lines name their models (an earlier process's such run, or
``trainwatch run``'s) is named so from the start.

A dir only one model writes keeps the single-monitor format: a resumed run of
it (a new process appending) and ``trainer.test()`` after ``fit()`` (the same
LightningModule) are the same model, not a second one.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from trainwatch.compiled import unwrap
from trainwatch.model_names import class_name, unique_name
from trainwatch.strict_json import dumps

if TYPE_CHECKING:
    from trainwatch.sinks.jsonl import JsonlSink


class LogDir:
    """One log dir as this process writes it: the models named in it, and its open sinks."""

    def __init__(self, path: Path, alerts: Path, counts: Path, setup: Path) -> None:
        self.path = path
        self.alerts, self.counts, self.setup = alerts, counts, setup
        # Each model that opened a sink here, in order, by name: the first of a
        # class takes the class name, as under ``trainwatch run``.
        self._models: list[tuple[str, weakref.ref[nn.Module]]] = []
        self._taken: set[str] = set()
        self._sinks: weakref.WeakSet[JsonlSink] = weakref.WeakSet()
        # Where this process began writing alerts.jsonl: the lines past it, written
        # before a second model came, are the first model's.
        self._start = _size(alerts)
        # Whether this process wrote the counts and setup files there now.
        self.counts_ours = False
        self.setup_ours = False
        # Alerts are tagged with their model: a second model came, or the lines
        # already there name theirs.
        self.named = _names_models(alerts, counts)

    def join(self, sink: JsonlSink, model: nn.Module) -> str:
        """The name ``model`` goes by here; a second model makes the dir name them all."""
        model = unwrap(model)
        self._sinks.add(sink)
        for name, ref in self._models:
            if ref() is model:
                return name  # the same model again (an evaluation after its fit)
        name = unique_name(class_name(model), self._taken)
        self._models.append((name, weakref.ref(model)))
        if not self.named and len(self._models) > 1:
            self.named = True
            self._name_earlier(self._models[0][0])
        return name

    def _name_earlier(self, first: str) -> None:
        """What this process wrote before the dir was shared is the first model's: its
        lines, counts and setup tables get its name, and open sinks write on anew."""
        try:
            _tag_lines(self.alerts, self._start, first)
            if self.counts_ours:
                _tag_counts(self.counts, first)
            if self.setup_ours:
                _tag_setup(self.setup, first)
        except (OSError, ValueError):
            return  # a dir that cannot be rewritten keeps what it has
        finally:
            for sink in list(self._sinks):
                sink.reopen()


_DIRS: dict[str, LogDir] = {}


def log_dir_of(alerts: Path, counts: Path, setup: Path) -> LogDir:
    """The process's record of the log dir holding ``alerts``, made at its first sink."""
    path = alerts.parent.resolve()
    found = _DIRS.get(str(path))
    if found is None:
        found = _DIRS[str(path)] = LogDir(path, alerts, counts, setup)
    return found


def merged_counts(path: Path, model: str, counts: list[dict[str, Any]], steps: int) -> dict:
    """The counts file with ``model``'s counts in place of those it held for it; other
    models' stay. Steps: those of the model that trained most, as ``trainwatch run``."""
    kept: list[dict[str, Any]] = []
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
        kept = [c for c in earlier["counts"] if c.get("model") != model]
        steps = max(steps, int(earlier.get("steps", 0)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # none yet, or unreadable: this model's alone
    return {"steps": steps, "counts": kept + counts}


def merged_setup(path: Path, model: str, audits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The setup tables of the other models in ``path``, then ``model``'s own."""
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))["audits"]
        kept = [a for a in earlier if a.get("model") != model]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        kept = []
    return kept + audits


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _names_models(alerts: Path, counts: Path) -> bool:
    """Whether what the dir holds names its models (``data.model``)."""
    try:
        tallies = json.loads(counts.read_text(encoding="utf-8"))["counts"]
        if any(isinstance(t, dict) and t.get("model") is not None for t in tallies):
            return True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        text = alerts.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if '"model"' in line:
            try:
                data = json.loads(line).get("data")
            except (ValueError, AttributeError):
                continue
            if isinstance(data, dict) and data.get("model") is not None:
                return True
    return False


def _tag_lines(path: Path, start: int, model: str) -> None:
    """The alert lines from byte ``start`` on, each naming ``model`` where none does."""
    with path.open("rb") as file:
        head = file.read(start)
        tail = file.read()
    if not tail:
        return
    lines = []
    for line in tail.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            lines.append(line)  # a line cut short by a kill stays as it was
            continue
        if isinstance(record, dict):
            data = record.get("data")
            if isinstance(data, dict) and data.get("model") is None:
                record["data"] = {**data, "model": model}
            line = dumps(record)
        lines.append(line)
    _replace(path, head + ("\n".join(lines) + "\n").encode("utf-8"))


def _tag_counts(path: Path, model: str) -> None:
    written = json.loads(path.read_text(encoding="utf-8"))
    for tally in written.get("counts", []):
        if isinstance(tally, dict) and tally.get("model") is None:
            tally["model"] = model
    _replace(path, dumps(written, indent=1).encode("utf-8"))


def _tag_setup(path: Path, model: str) -> None:
    written = json.loads(path.read_text(encoding="utf-8"))
    for audit in written.get("audits", []):
        if isinstance(audit, dict) and audit.get("model") is None:
            audit["model"] = model
    _replace(path, dumps(written).encode("utf-8"))


def _replace(path: Path, content: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(content)
    partial.replace(path)
