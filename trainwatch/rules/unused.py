"""A trainable parameter that backward reaches on some steps and not on others.

One device forgives it: the optimizer just skips a ``None`` gradient. Under
DistributedDataParallel the reducer waits for every parameter's gradient, so
the step hangs or fails unless ``find_unused_parameters=True``. The evidence
is free: the step record already lists which parameters had a gradient.
"""

from __future__ import annotations

import weakref
from typing import Any

from trainwatch.alert import Alert, severity_rank
from trainwatch.config import UnusedParameterConfig
from trainwatch.halt_sync import process_group_up
from trainwatch.layers import ParamInfo
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names

_HINT = (
    "a branch that only runs on some steps (an if on the data, a mixture-of-experts "
    "router, an auxiliary head used every k steps). On one device this works; under "
    "DistributedDataParallel it fails or hangs unless find_unused_parameters=True "
    "(which costs a graph walk per step). Better: make every branch reach the loss "
    "each step (add 0 * branch_output), or run the branch unconditionally."
)
# Not distributed: a mixture of experts or stochastic depth is right as it is.
_HINT_ONE_PROCESS = (
    "a branch that only runs on some steps (an if on the data, a mixture-of-experts "
    "router, an auxiliary head used every k steps). On one process nothing needs "
    "doing: the optimizer skips a parameter whose gradient is None. Only under "
    "DistributedDataParallel does it matter: build the model there with "
    "find_unused_parameters=True (a graph walk per step), or have every branch reach "
    "the loss each step (add 0 * branch_output)."
)
# DDP built with find_unused_parameters=True: it copes as it is.
_HINT_FIND_UNUSED = (
    "a branch that only runs on some steps (an if on the data, a mixture-of-experts "
    "router, an auxiliary head used every k steps). Nothing needs doing: DDP was built "
    "with find_unused_parameters=True, which marks the parameters a step leaves out, "
    "at the cost of a graph walk per step."
)
_ONE_DEVICE = "Fine on one device; under DDP this hangs or fails unless find_unused_parameters=True"
_COPES = "DDP copes, since it was built with find_unused_parameters=True"


class UnusedParameterRule(Rule):
    id = "unused_parameter"

    def __init__(self, config: UnusedParameterConfig) -> None:
        super().__init__(config)
        # Per parameter name: True once it had a gradient, False once it had
        # none; a name in both is the finding. Bounded by the model's size.
        self._used: set[str] = set()
        self._unused: dict[str, int] = {}
        self._reported: set[str] = set()
        # How the model trains under DDP, as the last record that asked said it.
        self._distributed = ""
        # Layouts of gradients whose parameters are all in ``_used`` already: a
        # step with one of them and nothing missing has nothing new (no loop).
        self._known_layouts: weakref.WeakSet[Any] = weakref.WeakSet()

    _NOT_STATE = Rule._NOT_STATE | {"_known_layouts"}

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.source not in ("optimizer", "manual"):
            return []
        if record.distributed:  # said on steps with parameters missing
            self._distributed = record.distributed
        if not record.present:
            return []  # no backward reached anything: not a partial step
        layout = record.layout
        if not record.missing and layout is not None and layout in self._known_layouts:
            return []
        found: list[tuple[ParamInfo, int, str]] = []
        for info in record.missing:
            if not info.in_model:
                continue
            self._unused.setdefault(info.name, record.step)
            if info.name in self._used and info.name not in self._reported:
                found.append((info, self._unused[info.name], "missing now"))
        for info in record.present:
            if info.name in self._used:
                continue
            self._used.add(info.name)
            if info.name in self._unused and info.name not in self._reported:
                found.append((info, self._unused[info.name], "missing before"))
        if layout is not None:
            self._known_layouts.add(layout)
        if not found:
            return []
        for info, _, _ in found:
            self._reported.add(info.name)
        # Harmless on one device; under DDP the reducer waits for every gradient,
        # unless it was built with find_unused_parameters=True (then it copes).
        distributed = bool(self._distributed) or process_group_up()
        ddp = self._distributed == "ddp" or (not self._distributed and distributed)
        copes = self._distributed == "find_unused"
        hint = _HINT_FIND_UNUSED if copes else _HINT if distributed else _HINT_ONE_PROCESS
        severity = None
        if ddp and severity_rank(self.config.severity) < severity_rank("warning"):
            severity = "warning"
        alerts = []
        groups = _whole_parents(by_owner(info for info, _, _ in found), record)
        for owner, params in groups.items():
            members = {info.name for info in params}
            rows = [row for row in found if row[0].name in members]
            unused_since = min(row[1] for row in rows)
            now_missing = any(row[2] == "missing now" for row in rows)
            how = (
                f"had gradients in earlier steps but none in step {record.step}"
                if now_missing
                else f"had no gradient from step {unused_since} but got one in step {record.step}"
            )
            alerts.append(
                self.alert(
                    record.step,
                    owner,
                    f"{short_names(params)} {how}: used on some steps only. "
                    + (_COPES if copes else _ONE_DEVICE),
                    hint,
                    {
                        "parameters": [p.name for p in params],
                        "unused_step": unused_since,
                        "missing_now": now_missing,
                        "distributed": distributed,
                        "find_unused_parameters": copes,
                    },
                    severity=severity,
                )
            )
        return alerts


def _whole_parents(
    groups: dict[str, list[ParamInfo]], record: StepRecord
) -> dict[str, list[ParamInfo]]:
    """Layers told together under the module holding them, where every parameter of
    that module the step knows is among them: an expert whose two linears the
    router skipped is one finding (``moe.experts.2``), not one per linear. A
    module with some parameter outside the finding keeps its layers apart; a
    lone layer keeps its own name; the model itself never takes them."""
    known = [*record.present, *record.missing]
    while _fold_one_parent(groups, known):
        pass
    return groups


def _fold_one_parent(groups: dict[str, list[ParamInfo]], known: list[ParamInfo]) -> bool:
    """Fold the first module all of whose known parameters the groups hold; whether one was."""
    by_parent: dict[str, list[str]] = {}
    for owner in groups:
        if owner:
            by_parent.setdefault(owner.rpartition(".")[0], []).append(owner)
    for parent, owners in by_parent.items():
        if not parent or len(owners) + (parent in groups) < 2:
            continue
        told = {info.name for owner in (*owners, parent) for info in groups.get(owner, ())}
        prefix = parent + "."
        if any(
            info.name not in told
            for info in known
            if info.owner == parent or info.owner.startswith(prefix)
        ):
            continue
        params = groups.pop(parent, [])
        for owner in owners:
            params.extend(groups.pop(owner))
        groups[parent] = params
        return True
    return False
