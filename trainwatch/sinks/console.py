"""Alerts as they happen, on stderr, one line each; a summary when done.

Uses rich so a terminal gets colour, while a CI log gets the same text plain
and unwrapped (rich drops styling when stderr is not a terminal).
"""

from __future__ import annotations

import sys
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trainwatch.alert import Alert
from trainwatch.setup_audit import SetupAudit
from trainwatch.sinks.base import Sink, Summary

_STYLE = {"info": "cyan", "warning": "yellow", "error": "bold red"}


def _module_label(module: str | None) -> str:
    if module is None:
        return ""
    return "<model>" if module == "" else module


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
        self._summary = summary
        self._top = top_layers

    def emit(self, alert: Alert) -> None:
        self.console.print(self.render(alert))

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

    def setup(self, audit: SetupAudit) -> None:
        from trainwatch.sinks.setup_table import rich_view

        self.console.print(rich_view(audit))

    def close(self, summary: Summary) -> None:
        if not self._summary or summary.steps == 0:
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
        table.add_column("severity")
        table.add_column("first step", justify="right")
        table.add_column("count", justify="right")
        for tally in sorted(summary.tallies, key=lambda t: (t.first.step, t.first.rule)):
            alert = tally.first
            table.add_row(
                alert.rule,
                _module_label(alert.module) or "-",
                Text(alert.severity, style=_STYLE.get(alert.severity, "")),
                str(alert.step),
                str(tally.count),
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
