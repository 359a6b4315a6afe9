"""The setup audit as people read it: rich tables on the console, markdown for TensorBoard."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from trainwatch.setup_audit import LocationRow, SetupAudit


def _label(module: str) -> str:
    return module or "<model>"


def _held(row: LocationRow) -> str:
    """The optimizers holding the row's parameters; one holding only frozen ones
    is marked so (a freeze left inside the optimizer, a momentum encoder)."""
    held = [str(i) for i in row.optimizers]
    held += [f"{i} (frozen)" for i in row.frozen_held if i not in row.optimizers]
    return ", ".join(held) if held else "-"


def _title(audit: SetupAudit) -> str:
    model = f" of {audit.model}" if audit.model else ""
    change = " (changed)" if audit.revision else ""
    return f"trainwatch setup{model}{change}, step {audit.step}: {audit.headline()}"


def _location_name(module: str, modules: int) -> str:
    return _label(module) + (f" (x{modules})" if modules > 1 else "")


def rich_view(audit: SetupAudit) -> Group:
    """Where the trainable parameters sit, the adapters, and which optimizer holds what."""
    parts: list[Table | Text] = []
    table = Table(title=_title(audit), title_justify="left")
    for column in ("location", "trainable", "frozen", "trainable %", "optimizer"):
        table.add_column(column, justify="left" if column == "location" else "right")
    section = "top"
    for row in audit.locations:
        if row.section != section:
            section = row.section
            table.add_section()
            table.add_row(Text("where the trainable ones sit:", style="dim"), "", "", "", "")
        table.add_row(
            _location_name(row.module, row.modules),
            f"{row.trainable:,}",
            f"{row.frozen:,}",
            f"{100 * row.share:.2f}",
            _held(row),
        )
    if audit.more_locations:
        table.add_row(f"... {audit.more_locations} more", "", "", "", "")
    parts.append(table)
    if audit.adapters:
        adapters = Table(title="adapters (low-rank pairs)", title_justify="left")
        for column in ("module", "wraps", "rank", "trainable"):
            adapters.add_column(column)
        for adapter in audit.adapters:
            adapters.add_row(
                _location_name(adapter.module, adapter.modules),
                _label(adapter.wraps),
                str(adapter.rank),
                f"{adapter.trainable:,}",
            )
        if audit.more_adapters:
            adapters.add_row(f"... {audit.more_adapters} more", "", "", "")
        parts.append(adapters)
    lines = [
        f"optimizer {o.index} ({o.kind}, {o.groups} group{'s' if o.groups != 1 else ''}): "
        f"{o.trainable:,} trainable, {o.frozen:,} frozen"
        for o in audit.optimizers
    ]
    if audit.unheld:
        lines.append(f"{audit.unheld:,} trainable elements in no watched optimizer")
    if lines:
        parts.append(Text("\n".join(lines)))
    return Group(*parts)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(audit: SetupAudit) -> str:
    """The same view for TensorBoard's Text tab."""
    rows = [
        f"**{_cell(_title(audit))}**",
        "",
        "| location | trainable | frozen | trainable % | optimizer |",
        "|---|---|---|---|---|",
    ]
    section = "top"
    for row in audit.locations:
        if row.section != section:
            section = row.section
            rows.append("| *where the trainable ones sit:* | | | | |")
        rows.append(
            f"| {_cell(_location_name(row.module, row.modules))} | {row.trainable:,} | "
            f"{row.frozen:,} | {100 * row.share:.2f} | {_held(row)} |"
        )
    if audit.more_locations:
        rows.append(f"| ... {audit.more_locations} more | | | | |")
    if audit.adapters:
        rows += ["", "| adapter | wraps | rank | trainable |", "|---|---|---|---|"]
        for adapter in audit.adapters:
            rows.append(
                f"| {_cell(_location_name(adapter.module, adapter.modules))} | "
                f"{_cell(_label(adapter.wraps))} | {adapter.rank} | {adapter.trainable:,} |"
            )
    rows.append("")
    for o in audit.optimizers:
        rows.append(
            f"- optimizer {o.index} ({o.kind}, {o.groups} groups): "
            f"{o.trainable:,} trainable, {o.frozen:,} frozen"
        )
    if audit.unheld:
        rows.append(f"- {audit.unheld:,} trainable elements in no watched optimizer")
    return "\n".join(rows)
