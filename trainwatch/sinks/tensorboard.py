"""TensorBoard: per-layer gradient norms as scalars, alerts as text and as the tab's data.

Writes through any ``SummaryWriter`` (its own in ``log_dir`` for plain loops,
the Lightning ``TensorBoardLogger``'s otherwise). A step's alerts are held
until the step is over and written together, because TensorBoard keeps one
value per run, tag and step: two writes for one step would hide the first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import summary_pb2

from trainwatch.alert import Alert
from trainwatch.config import TensorBoardConfig
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import Sink, StepNumbers, Summary
from trainwatch.strict_json import jsonable
from trainwatch.tensorboard_plugin import metadata
from trainwatch.termination import uninterrupted


@dataclass
class _StepGroup:
    """What one rank raised in one step, waiting to be written as one entry."""

    step: int
    alerts: dict[tuple[str, str | None], tuple[Alert, int]] = field(default_factory=dict)
    marks: dict[str, str] = field(default_factory=dict)
    layers: list[str] | None = None  # the model's layer order, when it is new
    written: bool = False


# Steps whose scalars are handed to the writer together (also at every flush,
# every ``flush_secs``, and at close): the writer's thread wakes once for them.
_SCALAR_BATCH = 16


def open_writer(log_dir: str | Path, flush_secs: float) -> Any:
    """Our own SummaryWriter (plain loops), imported late: ``import trainwatch`` stays light."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir), flush_secs=max(1, math.ceil(flush_secs)))


def _label(layer: str) -> str:
    """A layer's name as the tab shows it (the heatmap row of its norm tag)."""
    return metadata.layer_of_tag(metadata.norm_tag(layer)) or layer


def _kind(value: float) -> str | None:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf"
    if value == 0.0:
        return "zero"
    return None


def _entry(alert: Alert, count: int, rank: int) -> dict[str, Any]:
    """A finding in full the first time; a repeat as its key, step and count only.

    A finding that recurs every step would otherwise write its message, hint
    and data again each step (about 1 KB), for 20,000 steps.
    """
    if count == 1:
        return {**jsonable(alert.to_dict()), "count": count, "rank": rank}
    return {
        "rule": alert.rule,
        "severity": alert.severity,
        "step": alert.step,
        "module": alert.module,
        "count": count,
        "rank": rank,
    }


def _cell(text: Any) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def markdown_table(alerts: Iterable[tuple[Alert, int]]) -> str:
    """The Text tab's view of one step: a markdown table, one row per (rule, module)."""
    rows = [
        "| severity | rule | module | message | hint | count |",
        "|---|---|---|---|---|---|",
    ]
    for alert, count in alerts:
        module = "-" if alert.module is None else (alert.module or metadata.ROOT_LABEL)
        rows.append(
            f"| {_cell(alert.severity)} | {_cell(alert.rule)} | {_cell(module)} | "
            f"{_cell(alert.message)} | {_cell(alert.hint)} | {count} |"
        )
    return "\n".join(rows)


class TensorBoardSink(Sink):
    name = "tensorboard"

    def __init__(
        self,
        writer: Any,
        config: TensorBoardConfig | None = None,
        *,
        halt_on: Iterable[str] = (),
        owns_writer: bool = False,
    ) -> None:
        self.writer = writer
        self.config = config if config is not None else TensorBoardConfig()
        self._halt_on = frozenset(halt_on)
        self._owns = owns_writer
        self._groups: dict[int, _StepGroup] = {}  # rank -> the step being gathered
        # Layer -> the kind of its current NaN, Inf or zero streak (healthy layers: absent).
        self._streaking: dict[str, str] = {}
        self._tags: dict[str, str] = {}  # layer -> its norm's scalar tag
        self._scalars: list[tuple[Any, int]] = []  # steps' scalar events not yet handed over
        self._layers: list[str] = []  # layer names in model order, as the tab shows them
        self._last_flush = time.monotonic()
        self._closed = False

    @classmethod
    def in_dir(
        cls, log_dir: str | Path, config: TensorBoardConfig | None = None, **kwargs: Any
    ) -> TensorBoardSink:
        config = config if config is not None else TensorBoardConfig()
        return cls(open_writer(log_dir, config.flush_secs), config, owns_writer=True, **kwargs)

    # -- Sink interface ------------------------------------------------------
    # Each call that reaches the writer is @uninterrupted: the writer's lock
    # must not be held by a main thread that SIGTERM's handler interrupted.
    @uninterrupted
    def emit(self, alert: Alert) -> None:
        self._add(alert, 1)
        if alert.rule in self._halt_on:
            # Training is about to stop on this alert: make it visible now.
            self._write_group(self._rank(alert))

    @uninterrupted
    def repeat(self, alert: Alert, count: int) -> None:
        self._add(alert, count)

    @uninterrupted
    def on_step(self, numbers: StepNumbers) -> None:
        """A step's numbers as one event (one ``add_scalar`` per layer costs a
        protobuf, an event and a hand-off to the writer's thread each: 5 ms a step
        on a 65-layer model, measured on CPU), and the tab's streak marks when a
        layer's kind changes.
        """
        if self._closed:
            return
        step = numbers.step
        self._roll(0, step)
        group = self._groups[0]
        norms = numbers.layer_norms
        tags = self._tags
        if not tags.keys() >= norms.keys():
            new = [layer for layer in norms if layer not in tags]
            for layer in new:
                tags[layer] = metadata.norm_tag(layer)
            # Written once (and when layers appear), so the tab lists every run
            # that trainwatch watched, alerts or not, with rows in model order.
            self._layers.extend(_label(layer) for layer in new)
            group.layers = list(self._layers)
            group.written = False
        values = norms.values()
        if self._streaking or 0.0 in values or not all(map(math.isfinite, values)):
            self._mark_streaks(group, norms)
        scalars = summary_pb2.Summary()
        add = scalars.value.add
        if step % self.config.every == 0:
            for tag, value in zip(map(tags.__getitem__, norms), values):
                add(tag=tag, simple_value=value)
            if numbers.total_norm is not None:
                add(tag=metadata.TOTAL_TAG, simple_value=numbers.total_norm)
        for layer, ratio in numbers.update_ratios.items():
            label = layer if layer else metadata.ROOT_LABEL
            add(tag=metadata.UPDATE_RATIO_PREFIX + label, simple_value=ratio)
        if numbers.output_change is not None:
            add(tag=metadata.OUTPUT_CHANGE_TAG, simple_value=numbers.output_change)
        if scalars.value:
            # One event for the step's scalars, handed to the writer a few steps'
            # worth at a time: each hand-off wakes the writer's thread.
            self._scalars.append((scalars, step))
            if len(self._scalars) >= _SCALAR_BATCH:
                self._write_scalars()
        if self.config.histograms and step % self.config.histogram_every == 0:
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                import numpy as np

                self.writer.add_histogram(metadata.HISTOGRAM_TAG, np.asarray(finite), step)
        self._maybe_flush()

    def _mark_streaks(self, group: _StepGroup, norms: dict[str, float]) -> None:
        """The first step of a layer's NaN, Inf or all-zero streak gets a mark."""
        streaking = self._streaking
        for layer, value in norms.items():
            kind = _kind(value)
            if kind is not None and streaking.get(layer) != kind:
                group.marks[_label(layer)] = kind
                group.written = False
            if kind is None:
                streaking.pop(layer, None)
            else:
                streaking[layer] = kind

    @uninterrupted
    def setup(self, audit: SetupAudit) -> None:
        if self._closed:
            return
        from trainwatch.sinks.setup_table import markdown

        # One tag per model: TensorBoard keeps one text per tag and step.
        tag = metadata.SETUP_TAG + (f"/{audit.model}" if audit.model else "")
        self.writer.add_text(tag, markdown(audit), max(audit.step, 0))
        self.flush()

    @uninterrupted
    def close(self, summary: Summary) -> None:
        if self._closed:
            return
        for rank in list(self._groups):
            self._write_group(rank)
        self.flush()
        self._closed = True
        if self._owns:
            self.writer.close()

    # -- writing -------------------------------------------------------------
    @uninterrupted
    def flush(self) -> None:
        self._write_scalars()
        self._last_flush = time.monotonic()
        self.writer.flush()

    def _write_scalars(self) -> None:
        held, self._scalars = self._scalars, []
        for scalars, step in held:
            _add_summary(self.writer, scalars, step)

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= self.config.flush_secs:
            self.flush()

    @staticmethod
    def _rank(alert: Alert) -> int:
        rank = alert.data.get("rank", 0)
        return rank if isinstance(rank, int) else 0

    def _roll(self, rank: int, step: int) -> None:
        """Start gathering ``step`` for ``rank``; the step gathered before is complete."""
        group = self._groups.get(rank)
        if group is not None and group.step == step:
            return
        if group is not None:
            self._write_group(rank)
        self._groups[rank] = _StepGroup(step)

    def _add(self, alert: Alert, count: int) -> None:
        if self._closed:
            return
        rank = self._rank(alert)
        self._roll(rank, max(alert.step, 0))
        group = self._groups[rank]
        group.alerts[alert.key] = (alert, count)
        group.written = False
        self._maybe_flush()

    def _write_group(self, rank: int) -> None:
        group = self._groups.get(rank)
        if group is None or group.written or not (group.alerts or group.marks or group.layers):
            return
        group.written = True
        suffix = metadata.rank_suffix(rank)
        alerts = list(group.alerts.values())
        new = [(alert, count) for alert, count in alerts if count == 1]
        if new:
            self.writer.add_text(metadata.TABLE_TAG + suffix, markdown_table(new), group.step)
        payload: dict[str, Any] = {
            "version": metadata.VERSION,
            "step": group.step,
            "rank": rank,
            "alerts": [_entry(alert, count, rank) for alert, count in alerts],
            "marks": group.marks,
        }
        if group.layers:
            payload["layers"] = group.layers
        summary = metadata.step_summary(metadata.ALERTS_TAG + suffix, payload)
        _add_summary(self.writer, summary, group.step)
        if any(count == 1 for _, count in alerts):
            # A new finding reaches the disk now, as its alerts.jsonl line
            # did, not flush_secs later: a SIGKILL'd run still shows it.
            # Repeats wait for the next flush, so a finding that recurs
            # every step does not flush every step.
            self.flush()


def _add_summary(writer: Any, summary: Any, step: int) -> None:
    """A summary of our own plugin: SummaryWriter has no public call for that."""
    file_writer = getattr(writer, "file_writer", None) or writer._get_file_writer()
    try:
        file_writer.add_summary(summary, step)
    except TypeError:  # tensorboardX's writer: the same proto, its own classes
        from tensorboardX.proto.summary_pb2 import Summary as XSummary

        file_writer.add_summary(XSummary.FromString(summary.SerializeToString()), step)
