"""What the model will train, and where: trainable and frozen parameters by location.

A fine-tune whose adapters wrap the wrong layers, or whose optimizer was built
before the model was frozen, runs without error. The counts and locations of
the trainable parameters show it at once; this builds them once per setup
(when a monitor attaches, and when parameter groups or ``requires_grad``
change), never on a training step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from trainwatch.compiled import user_name
from trainwatch.released import ReleasedOptimizer

# Rows of trainable locations and of adapters shown before the rest is summed up.
MAX_ROWS = 30
# Names that mark a low-rank adapter pair (PEFT's and loralib's layouts).
_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


@dataclass
class LocationRow:
    """Parameter elements under one location; ``modules`` > 1 for a repeated block."""

    module: str  # qualified name, or a pattern with ``*`` for numbered blocks
    trainable: int
    frozen: int
    optimizers: list[int]  # the watched optimizers holding its trainable parameters
    modules: int = 1
    # "top": a child of the model (or the model's own parameters, ""); "trainable":
    # a module holding trainable parameters, listed when part of the model is frozen.
    section: str = "top"
    # The watched optimizers holding its frozen parameters: a forgotten freeze (or
    # a momentum encoder moved by hand) shows where it sits.
    frozen_held: list[int] = field(default_factory=list)

    @property
    def share(self) -> float:
        total = self.trainable + self.frozen
        return self.trainable / total if total else 0.0


@dataclass
class AdapterRow:
    """A trainable low-rank pair (``lora_A``/``lora_B``) and the frozen module it wraps."""

    module: str  # the module holding the pair, a pattern for numbered blocks
    wraps: str  # the module whose frozen weight the pair adapts
    rank: int
    trainable: int  # elements in the pair(s)
    modules: int = 1


@dataclass
class OptimizerRow:
    index: int
    kind: str
    groups: int
    trainable: int  # elements of trainable parameters it holds
    frozen: int  # elements of requires_grad=False parameters it holds


@dataclass
class SetupAudit:
    """The setup table; plain data, JSON-serialisable through :meth:`to_dict`."""

    revision: int  # 0 for the first audit, one more for each change of the setup
    step: int
    trainable: int  # parameter elements, each shared parameter counted once
    frozen: int
    # Trainable elements no watched optimizer holds (0 when none is watched).
    unheld: int
    locations: list[LocationRow] = field(default_factory=list)
    adapters: list[AdapterRow] = field(default_factory=list)
    optimizers: list[OptimizerRow] = field(default_factory=list)
    # Rows left out beyond MAX_ROWS (trainable locations, adapters).
    more_locations: int = 0
    more_adapters: int = 0
    model: str | None = None  # which model, when one run watches several
    # Under `trainwatch run`: models set up the same way after this one, each
    # dropped after use (a copy per task), whose tables were not shown again.
    alike: int = 0

    @property
    def share(self) -> float:
        total = self.trainable + self.frozen
        return self.trainable / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["share"] = self.share
        for row, source in zip(values["locations"], self.locations):
            row["share"] = source.share
        return values

    def headline(self) -> str:
        """``print_trainable_parameters()``'s line."""
        total = self.trainable + self.frozen
        return (
            f"trainable params: {self.trainable:,} || all params: {total:,} || "
            f"trainable%: {100 * self.share:.4f}"
        )


def pattern(name: str) -> str:
    """``layers.3.attn.q`` as ``layers.*.attn.q``: numbered blocks share a row."""
    return _INDEX.sub("*", name)


def build_audit(
    root: nn.Module,
    optimizers: Sequence[Optimizer],
    *,
    revision: int = 0,
    step: int = 0,
) -> SetupAudit:
    """One walk over the model's parameters and the optimizers' groups."""
    owners: dict[int, str] = {}
    params: dict[int, torch.Tensor] = {}
    for raw, module in root.named_modules():
        name = user_name(raw)
        for param in module.parameters(recurse=False):
            if id(param) not in params:
                params[id(param)] = param
                owners[id(param)] = name
    held: dict[int, list[int]] = {}
    optimizer_rows = []
    for index, optimizer in enumerate(optimizers):
        if type(optimizer) is ReleasedOptimizer:
            continue  # let go by the script: no row (the others keep their numbers)
        trainable = frozen = 0
        for group in optimizer.param_groups:
            for param in group["params"]:
                held.setdefault(id(param), [])
                if index not in held[id(param)]:
                    held[id(param)].append(index)
                if param.requires_grad:
                    trainable += param.numel()
                else:
                    frozen += param.numel()
        optimizer_rows.append(
            OptimizerRow(
                index, type(optimizer).__name__, len(optimizer.param_groups), trainable, frozen
            )
        )
    total_trainable = total_frozen = unheld = 0
    for key, param in params.items():
        if param.requires_grad:
            total_trainable += param.numel()
            if optimizer_rows and key not in held:
                unheld += param.numel()
        else:
            total_frozen += param.numel()
    adapters, claimed = _adapters(root)
    audit = SetupAudit(
        revision=revision,
        step=step,
        trainable=total_trainable,
        frozen=total_frozen,
        unheld=unheld,
        adapters=adapters[:MAX_ROWS],
        more_adapters=max(0, len(adapters) - MAX_ROWS),
        optimizers=optimizer_rows,
    )
    audit.locations, audit.more_locations = _locations(params, owners, held, claimed, audit)
    return audit


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _locations(
    params: dict[int, torch.Tensor],
    owners: dict[int, str],
    held: dict[int, list[int]],
    claimed: dict[int, str],
    audit: SetupAudit,
) -> tuple[list[LocationRow], int]:
    """Top-level modules, then (when part of the model is frozen) where the trainable ones sit."""
    top: dict[str, LocationRow] = {}
    for key, param in params.items():
        _add(top, _top(owners[key]), param, held.get(key, []))
    rows = list(top.values())
    if len(rows) > MAX_ROWS:  # a long nn.Sequential: numbered children share a row
        rows = _collapsed(rows)
    if not audit.frozen or not audit.trainable:
        return rows, 0
    inner: dict[str, LocationRow] = {}
    members: dict[str, set[str]] = {}
    row_of: dict[str, LocationRow] = {}  # each member module's row
    for key, param in params.items():
        if not param.requires_grad:
            continue
        # An adapter's parameters are located at the module the pair sits in.
        location = claimed.get(key, owners[key])
        row_name = pattern(location)
        _add(inner, row_name, param, held.get(key, []))
        inner[row_name].section = "trainable"
        members.setdefault(row_name, set()).add(location)
        row_of[location] = inner[row_name]
    for row_name, row in inner.items():
        row.modules = len(members[row_name])
    for key, param in params.items():
        if param.requires_grad:
            continue
        # A frozen weight counts under the innermost listed module holding it
        # (an adapter's base layer under its adapter).
        name = owners[key]
        while True:
            row = row_of.get(name)
            if row is not None:
                row.frozen += param.numel()
                _hold(row.frozen_held, held.get(key, []))
                break
            if not name:
                break
            name = name.rsplit(".", 1)[0] if "." in name else ""
    extra = [row for name, row in inner.items() if name not in top]
    return rows + extra[:MAX_ROWS], max(0, len(extra) - MAX_ROWS)


def _collapsed(rows: list[LocationRow]) -> list[LocationRow]:
    merged: dict[str, LocationRow] = {}
    for row in rows:
        name = pattern(row.module)
        into = merged.get(name)
        if into is None:
            merged[name] = LocationRow(
                name,
                row.trainable,
                row.frozen,
                list(row.optimizers),
                frozen_held=list(row.frozen_held),
            )
            continue
        into.trainable += row.trainable
        into.frozen += row.frozen
        into.modules += 1
        _hold(into.optimizers, row.optimizers)
        _hold(into.frozen_held, row.frozen_held)
    return list(merged.values())


def _add(rows: dict[str, LocationRow], name: str, param: torch.Tensor, held: list[int]) -> None:
    row = rows.get(name)
    if row is None:
        row = rows[name] = LocationRow(name, 0, 0, [])
    if param.requires_grad:
        row.trainable += param.numel()
        _hold(row.optimizers, held)
    else:
        row.frozen += param.numel()
        _hold(row.frozen_held, held)


def _hold(into: list[int], held: list[int]) -> None:
    into += [index for index in held if index not in into]


def _adapters(root: nn.Module) -> tuple[list[AdapterRow], dict[int, str]]:
    """Low-rank pairs, innermost first: a pair belongs to the module it sits in.

    A pair is two trainable 2-D weights ``A (r, n)`` and ``B (m, r)`` with
    ``r`` below both ``n`` and ``m``, beside a frozen ``(m, n)`` (or ``(n, m)``,
    an embedding) weight they adapt, within two levels of the module; or a
    pair named ``lora_A``/``lora_B`` without such a base.
    """
    found: list[tuple[str, str, int, int]] = []
    claimed: dict[int, str] = {}
    for raw, module in reversed(list(root.named_modules())):
        name = user_name(raw)
        near = [
            (short, param)
            for short, param in module.named_parameters()
            if short.count(".") <= 2 and id(param) not in claimed and param.dim() == 2
        ]
        trainable = [(s, p) for s, p in near if p.requires_grad]
        if len(trainable) < 2:
            continue
        frozen = [(s, p) for s, p in near if not p.requires_grad]
        for a_name, a in trainable:
            rank, n = a.shape
            for b_name, b in trainable:
                if b is a or id(b) in claimed or id(a) in claimed or b.shape[1] != rank:
                    continue
                m = b.shape[0]
                if not rank < min(n, m):
                    continue
                base = next(
                    (s for s, p in frozen if tuple(p.shape) in {(m, n), (n, m)}),
                    None,
                )
                named = any(tag in a_name + b_name for tag in _ADAPTER_NAMES)
                if base is None and not named:
                    continue
                wraps = name if base is None else _owner_of(name, base)
                claimed[id(a)] = claimed[id(b)] = name
                found.append((name, wraps, int(rank), a.numel() + b.numel()))
    rows: dict[tuple[str, str, int], AdapterRow] = {}
    members: dict[tuple[str, str, int], set[str]] = {}
    for name, wraps, rank, count in reversed(found):
        key = (pattern(name), pattern(wraps), rank)
        row = rows.get(key)
        if row is None:
            row = rows[key] = AdapterRow(key[0], key[1], rank, 0)
        row.trainable += count
        members.setdefault(key, set()).add(name)
    for key, row in rows.items():
        row.modules = len(members[key])
    return list(rows.values()), claimed


def _owner_of(module: str, param_name: str) -> str:
    """``q`` + ``base_layer.weight`` -> ``q.base_layer``; ``q`` + ``weight`` -> ``q``."""
    prefix = param_name.rsplit(".", 1)[0] if "." in param_name else ""
    if not prefix:
        return module
    return f"{module}.{prefix}" if module else prefix


def table_content(audit: SetupAudit) -> str:
    """What a setup table says, but for the model it is of, the step and revision it
    was made at and its optimizers' numbers (each counted by its place among the
    rows): two tables alike this way show the same."""
    values = audit.to_dict()
    for key in ("model", "step", "revision"):
        values.pop(key, None)
    place = {row.pop("index", None): n for n, row in enumerate(values["optimizers"])}
    for row in values["locations"]:
        for key in ("optimizers", "frozen_held"):
            if key in row:
                row[key] = [place.get(index, index) for index in row[key]]
    return json.dumps(values, sort_keys=True, default=str)
