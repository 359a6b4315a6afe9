"""Alerts as they happen, on stderr, one line each; a summary when done.

Uses rich so a terminal gets colour, while a CI log gets the same text plain
and unwrapped (rich drops styling when stderr is not a terminal).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import IO, TypeVar

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainwatch.alert import Alert, undone_at, withdrawals
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import AlertTally, Sink, Summary

_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}
# One mistake (a .detach() above a stack of layers, a frozen encoder) can raise
# the same finding in many modules at once: this many or more are one group.
GROUP_AT = 4
# The other modules a grouped line names before it only counts them.
NAMES_SHOWN = 8

T = TypeVar("T")


def _module_label(module: str | None) -> str:
    if module is None:
        return ""
    return "<model>" if module == "" else module


def _fold(items: Sequence[T], key: Callable[[T], Hashable | None]) -> list[list[T]]:
    """Items in order, those sharing a key one list at the first one's place when
    there are ``GROUP_AT`` or more; a key of None never groups."""
    members: dict[Hashable, list[T]] = {}
    for item in items:
        shared = key(item)
        if shared is not None:
            members.setdefault(shared, []).append(item)
    folded = []
    for item in items:
        shared = key(item)
        group = members[shared] if shared is not None else [item]
        if len(group) < GROUP_AT:
            folded.append([item])
        elif group[0] is item:
            folded.append(group)
    return folded


def _row_module(alert: Alert) -> str:
    """The summary's module cell. A finding in an evaluation pass is counted apart
    from the same rule's training finding (its hint differs: training itself may
    be sound), and both often name no module (a loss written in the loop): the
    cell says which row is the evaluation's, or the two rows read the same."""
    module = _module_label(alert.module) or "-"
    return f"{module} (evaluation)" if alert.data.get("phase") == "evaluation" else module


def _same_finding(alert: Alert) -> Hashable | None:
    """Alerts of one publish that say the same thing of different modules: a rule's
    kinds and causes are different findings (a layer without a gradient is not
    one whose gradient is zero), and so are different optimizers, different
    models under ``trainwatch run``, and a module frozen whole against one frozen
    in part beside trainable parameters (a name filter too broad)."""
    if alert.module is None:
        return None
    data = alert.data
    return (
        alert.rule,
        alert.severity,
        alert.step,
        data.get("rank"),
        data.get("model"),
        data.get("optimizer"),
        data.get("finding"),
        data.get("kind"),
        data.get("cause"),
        bool(data.get("trainable")),
    )


def _same_row(tally: AlertTally) -> Hashable | None:
    """Summary rows that differ in their module only."""
    shared = _same_finding(tally.first)
    return None if shared is None else (shared, tally.count)


def severity_text(severity: str, undone: int | None = None) -> Text:
    """A finding its rule took back later stays in the table, marked as no longer standing."""
    if undone is None:
        return Text(severity, style=_STYLE.get(severity, ""))
    return Text(f"{severity} (undone {undone})", style="dim")


class ConsoleSink(Sink):
    name = "console"

    def __init__(
        self,
        file: IO[str] | None = None,
        *,
        summary: bool = True,
        top_layers: int = 5,
        force_terminal: bool | None = None,
        width: int | None = None,
    ) -> None:
        self.console = Console(
            file=file if file is not None else sys.stderr,
            force_terminal=force_terminal,
            width=width,
            highlight=False,
            soft_wrap=True,
        )
        # Whether close() prints the summary table.
        self.print_summary = summary
        self._top = top_layers
        # The watched model's name while it is worth printing (several models
        # watched at once print to one stderr: ``[main.1]`` alone does not say
        # whether it is the generator's or the discriminator's); None: not printed.
        self.model_label: Callable[[], str | None] | None = None

    def emit(self, alert: Alert) -> None:
        self.console.print(self.render(self._labelled([alert])[0]))

    def emit_many(self, alerts: Sequence[Alert]) -> None:
        """A same-step flood is one line and a list of the other modules, not a
        wall of near-identical lines; the files keep one record per alert."""
        for group in _fold(self._labelled(alerts), _same_finding):
            self.console.print(self.render_group(group))

    def _labelled(self, alerts: Sequence[Alert]) -> Sequence[Alert]:
        """The alerts as printed: each module prefixed with the model's name while
        ``model_label`` gives one (``Generator:main.1``, as ``trainwatch run`` prints)."""
        model = self.model_label() if self.model_label is not None else None
        if not model:
            return alerts
        return [
            dataclasses.replace(a, module=f"{model}:{a.module}" if a.module else model)
            for a in alerts
        ]

    @classmethod
    def render_group(cls, alerts: Sequence[Alert]) -> Text:
        """The first alert's line; with others, one indented line naming them."""
        line = cls.render(alerts[0])
        others = [_module_label(alert.module) for alert in alerts[1:]]
        if others:
            named = ", ".join(others[:NAMES_SHOWN])
            if len(others) > NAMES_SHOWN:
                named += f", ... (+{len(others) - NAMES_SHOWN} more)"
            line.append(f"\n  and {len(others)} more modules with the same finding: ")
            line.append(named, style="magenta")
        return line

    @staticmethod
    def render(alert: Alert) -> Text:
        line = Text("trainwatch ", style="dim")
        line.append(f"step {alert.step} ", style="bold")
        line.append(f"{alert.severity.upper()} ", style=_STYLE.get(alert.severity, ""))
        line.append(alert.rule, style=_STYLE.get(alert.severity, ""))
        module = _module_label(alert.module)
        if module:
            line.append(f" [{module}]", style="magenta")
        rank = alert.data.get("rank")
        if isinstance(rank, int) and rank != 0:
            line.append(f" (rank {rank})", style="magenta")  # gathered from another DDP rank
        line.append(f": {alert.message}")
        if alert.hint:
            line.append(f" | hint: {alert.hint}", style="dim")
        return line

    def note(self, text: str) -> None:
        """One line of trainwatch's own about what it watches (not an alert)."""
        self.console.print(Text(text, style="dim"))

    def setup(self, audit: SetupAudit) -> None:
        from trainwatch.sinks.setup_table import rich_view

        self.console.print(rich_view(audit))

    def close(self, summary: Summary) -> None:
        if not self.print_summary:
            return
        if summary.steps == 0:
            if summary.idle:
                self.note(summary.idle)
            return
        self.console.print(self.render_summary(summary, self._top))

    @staticmethod
    def render_summary(summary: Summary, top: int = 5) -> Table | Text:
        title = f"trainwatch: {summary.steps} steps watched"
        if not summary.tallies and not summary.latest_norms:
            return Text(f"{title}, no alerts", style="green")
        table = Table(title=title, title_justify="left", show_lines=False)
        table.add_column("rule")
        table.add_column("module")
        table.add_column("severity", no_wrap=True)
        table.add_column("first step", justify="right")
        table.add_column("count", justify="right")
        ordered = sorted(summary.tallies, key=lambda t: (t.first.step, t.first.rule))
        withdrawn = withdrawals((t.first, t.last_step) for t in summary.tallies)

        def undone(tally: AlertTally) -> int | None:
            return undone_at(tally.first, tally.last_step, withdrawn)

        def same_row(tally: AlertTally) -> Hashable | None:
            shared = _same_row(tally)
            return None if shared is None else (shared, undone(tally))

        for group in _fold(ordered, same_row):
            alert = group[0].first
            module = _row_module(alert)
            if len(group) > 1:
                module += f" +{len(group) - 1} more"
            table.add_row(
                alert.rule,
                module,
                severity_text(alert.severity, undone(group[0])),
                str(alert.step),
                str(group[0].count),
            )
        if not summary.tallies:
            table.add_row(Text("no alerts", style="green"), "", "", "", "")
        if top and summary.latest_norms:
            ranked = sorted(summary.latest_norms.items(), key=lambda kv: kv[1], reverse=True)

            def listed(items: list[tuple[str, float]]) -> str:
                return ", ".join(f"{_module_label(n) or '<model>'} {v:.3g}" for n, v in items)

            if len(ranked) <= 2 * top:
                table.caption = "grad norm by layer, latest step: " + listed(ranked)
            else:
                table.caption = (
                    f"grad norm, latest step - largest: {listed(ranked[:top])}"
                    f" | smallest: {listed(ranked[-top:][::-1])}"
                )
            table.caption_justify = "left"
        return table
