"""Parameters and optimizers that disagree: frozen inside it, trained outside it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from trainwatch.alert import Alert
from trainwatch.config import RuleConfig
from trainwatch.halt_sync import process_group_up
from trainwatch.layers import EXTERNAL, ParamInfo
from trainwatch.record import LeftOutModel, ReplacedModel, SteppedTwice, StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names
from trainwatch.rules.target_copies import copied_model, copy_data
from trainwatch.rules.trainable_parameters import common_module
from trainwatch.setup_audit import pattern

_FROZEN_HINT_END = (
    "(A freeze undone later is told then, as a note.) A momentum or EMA copy kept "
    "frozen on purpose (MoCo's key encoder, a teacher) is moved by its own update, "
    "which then never ran: is that update called every step?"
)
_UNFROZEN_HINT = "nothing to do: a freeze for warm-up or fine-tuning, ended as planned"
# Under DDP the freeze itself is undone, but a wrapper built while it held does
# not all-reduce these gradients: trainable_parameters tells that on its own.
_UNFROZEN_HINT_DISTRIBUTED = (
    "nothing to do for the freeze; under DDP, a DistributedDataParallel built while "
    "these were frozen does not sync their gradients (see trainable_parameters)"
)


_PART_HINT = (
    "a fixed feature extractor (a frozen backbone, everything but the head) with the "
    "optimizer built over model.parameters()? Harmless with SGD, Adam or AdamW, which "
    "skip a parameter without a gradient (no momentum, no weight decay), unless the "
    "loop applies weight decay to them itself; if the freeze is meant for the whole "
    "run, build the optimizer from the parameters that train "
    "([p for p in model.parameters() if p.requires_grad]), which says so. If they "
    "should train again (a freeze for warm-up), the unfreeze is missing: set "
    "requires_grad=True where they should train. " + _FROZEN_HINT_END
)


_APART_HINT = (
    "frozen on purpose throughout the model (BatchNorm layers frozen for a fine-tune, "
    "one kind of layer frozen in every block)? Harmless with SGD, Adam or AdamW, which "
    "skip a parameter without a gradient, unless the loop applies weight decay to them "
    "itself; build the optimizer from the parameters that train "
    "([p for p in model.parameters() if p.requires_grad]), which says the freeze is "
    "meant. If they should train (a freeze for warm-up, a requires_grad_(False) loop "
    "that matched more than it should), set requires_grad=True where they should "
    "train. " + _FROZEN_HINT_END
)
_ADAPTER_HINT = (
    "nothing is wrong: SGD, Adam and AdamW skip a parameter without a gradient, so "
    "the frozen base stays as loaded (unless the loop applies weight decay to every "
    "parameter itself). Handing the optimizer only the parameters that train, "
    "AdamW(p for p in model.parameters() if p.requires_grad), spares it walking the "
    "frozen base at every step and says the freeze is meant. (An unfreeze later is "
    "told then, as a note.)"
)
# Frozen parts apart, told as one: one or two frozen layers among trainable ones
# may be a slip, each told alone; three or more apart are one decision made
# throughout the model (adapters beside every frozen base layer, BatchNorm frozen
# in every block), whose one fix covers them all.
_APART_PARTS = 3


@dataclass
class _Part:
    """A frozen part told as one alert: the modules holding its parameters, the
    largest frozen subtrees it is made of (``tops``, in the model's order), and the
    rest of the module holding them all (``rest``: what it holds besides, as the
    largest subtrees holding none of the part). ``apart``: its subtrees lie apart,
    trained parts between them; ``adapted``: the modules where small trainable
    additions sit beside a frozen base (adapters), where that is how it lies apart."""

    owners: list[str]
    tops: list[str] = field(default_factory=list)
    rest: list[str] = field(default_factory=list)
    apart: bool = False
    adapted: list[str] = field(default_factory=list)


def _prefixes(name: str) -> list[str]:
    """The modules holding ``name``, outermost first, itself last (``""``: the root)."""
    pieces = name.split(".") if name else []
    return [".".join(pieces[:i]) for i in range(len(pieces) + 1)]


def _holders(names: Iterable[str]) -> set[str]:
    """Every module holding one of ``names``, the root left out, they included."""
    return {holder for name in names for holder in _prefixes(name)[1:]}


def _one_stretch(order: list[str], owners: list[str], beside: set[str]) -> bool:
    """Whether the modules ``owners`` follow one another in the model's ``order`` with
    no module ``beside`` (held by an optimizer, or training) between any two of them:
    modules holding only parameters frozen and left out of every optimizer break
    nothing."""
    told = set(owners) - {EXTERNAL}
    if not told <= set(order):
        return False  # the model changed since its order was read
    seen, broken = 0, False
    for owner in order:
        if owner in told:
            if broken or owner in beside:  # frozen beside trainable ones of its own
                return False
            seen += 1
            if seen == len(told):
                return True
        elif seen and owner in beside:
            broken = True
    return True


def _rest(order: list[str], owners: list[str], module: str) -> list[str]:
    """What ``module`` holds besides the part ``owners`` make, in the model's order:
    the largest subtrees under it holding none of them (``fc`` for a torchvision
    network frozen all but its head)."""
    ends = {module, *_holders(owners)}
    rest: list[str] = []
    for owner in order:
        inside = not module or owner == module or owner.startswith(module + ".")
        if owner in owners or owner == EXTERNAL or not inside:
            continue
        below = _prefixes(owner)[len(_prefixes(module)) :]
        top = next((name for name in below if name not in ends), owner) or "<model>"
        if top not in rest:
            rest.append(top)
    return rest


def _adapted(sizes: dict[str, tuple[str, int, bool]], told: set[str]) -> list[str]:
    """The modules where a frozen model's trainable parameters sit as adapters, in
    the model's order; none where it is not fine-tuned through adapters.

    An adapter is a small trainable addition beside a frozen base, inside a block:
    for each module holding trainable parameters, the innermost module holding it
    and frozen parameters ``told`` too (LoRA's wrapper around its base layer,
    loralib's layer itself, the block around a bottleneck adapter) holds fewer
    trainable elements than frozen ones there. It is an adapter setup where such
    additions hold most of what trains, in two modules or more, and the model
    trains fewer elements than it keeps frozen: BatchNorm frozen beside trained
    convolutions is no adapter (the convolution outweighs it), nor is a prompt or a
    head beside the frozen model (the root holds them together)."""
    frozen: dict[str, int] = {}
    trainable: dict[str, int] = {}
    owners: dict[str, int] = {}
    for name, (owner, count, trains) in sizes.items():
        if name in told:
            for holder in _prefixes(owner):
                frozen[holder] = frozen.get(holder, 0) + count
        elif trains:
            owners[owner] = owners.get(owner, 0) + count
            for holder in _prefixes(owner):
                trainable[holder] = trainable.get(holder, 0) + count
    total = trainable.get("", 0)
    if not total or total >= frozen.get("", 0):
        return []
    adapted: list[str] = []
    held = 0
    for owner, count in owners.items():
        base = next((name for name in reversed(_prefixes(owner)) if name in frozen), "")
        if base and trainable[base] < frozen[base]:
            held += count
            if base not in adapted:
                adapted.append(base)
    return adapted if len(adapted) > 1 and 2 * held > total else []


def _compact(names: list[str]) -> list[str]:
    """``names`` with numbered blocks folded: ``blocks.*.q.base (x4)``. A name is
    folded only beside others of its pattern, and only where a named piece is left
    (``*.*.*`` would say nothing of a bare ``nn.Sequential``'s layers)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        folded = pattern(name)
        if not any(char.isalpha() for char in folded):
            folded = name
        groups.setdefault(folded, []).append(name)
    shown: list[str] = []
    for folded, members in groups.items():
        if len(members) == 1:
            shown.append(members[0] or "<model>")
        else:
            shown.append(f"{folded} (x{len(members)})")
    return shown


def _listed(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class _ReportOnce(Rule):
    """These conditions persist step after step: report each module once."""

    def __init__(self, config: RuleConfig) -> None:
        super().__init__(config)
        self._reported: set[tuple[int | None, str]] = set()

    def new_owners(self, scope: int | None, params: list[ParamInfo]) -> dict[str, list[ParamInfo]]:
        fresh = {}
        for owner, group in by_owner(params).items():
            if (scope, owner) not in self._reported:
                self._reported.add((scope, owner))
                fresh[owner] = group
        return fresh


class FrozenInOptimizerRule(_ReportOnce):
    id = "frozen_in_optimizer"
    reads = None  # the frozen parameters, and those unfrozen (a step without either: no work)

    def __init__(self, config: RuleConfig) -> None:
        super().__init__(config)
        self._undone: set[tuple[int | None, str]] = set()  # told as unfrozen since
        # Per (optimizer, module), the step its frozen parameters were first seen
        # while their verdict waited (a few boundaries: moved by hand, or forgotten).
        self._first_seen: dict[tuple[int | None, str], int] = {}
        # The names told for parameters outside the model, by their placeholder.
        self._shown: dict[str, str] = {}
        # Per (optimizer, module) told of, the modules its warning named, when more
        # than one (a whole backbone frozen): the freeze is told undone at that
        # module once they all train again.
        self._parts: dict[tuple[int | None, str], list[str]] = {}
        # Per (optimizer, module) told as a note, not a warning: a model fine-tuned
        # through adapters, its base frozen on purpose.
        self._noted: set[tuple[int | None, str]] = set()

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if not record.frozen:
            return self._unfrozen(record, []) if record.unfrozen else []
        if record.frozen_pending:
            for owner in {p.owner for p in record.frozen}:
                self._first_seen.setdefault((record.optimizer, owner), record.step)
            return self._unfrozen(record, record.frozen) if record.unfrozen else []
        frozen = record.frozen
        outside = record.frozen_outside
        if outside:
            # None: another monitor's model holds it, its verdict is not made twice.
            frozen = [p for p in frozen if outside.get(p.name, p.name) is not None]
        alerts = self._unfrozen(record, frozen) if record.unfrozen else []
        moved = record.frozen_moved
        # Moved by the training code every step (a momentum encoder): not forgotten.
        frozen = [p for p in frozen if p.name not in moved] if moved else frozen
        fresh = self.new_owners(record.optimizer, frozen)
        if not fresh:
            return alerts
        for part in self._frozen_parts(fresh):
            owners = part.owners
            if owners == [EXTERNAL]:
                alerts.append(self._outside(record, fresh[EXTERNAL]))
            elif len(owners) == 1:
                alerts.append(self._frozen_layer(record, owners[0], fresh[owners[0]]))
            elif part.adapted:
                alerts.append(self._adapters(record, part, {o: fresh[o] for o in owners}))
            else:
                alerts.append(self._frozen_part(record, part, {o: fresh[o] for o in owners}))
        return alerts

    def _frozen_parts(self, fresh: dict[str, list[ParamInfo]]) -> list[_Part]:
        """The modules told now, grouped into frozen parts, each told as one alert.

        A frozen subtree is the largest one holding nothing else the optimizers hold
        or that trains: a backbone frozen whole is one, told at the module holding it
        (``bert``). Where every module told makes one stretch of the model, its
        frozen subtrees one after the other in the model's order with nothing held
        or trained between them, the stretch is one part too, told at the module
        holding it all: a torchvision network's stem and stages frozen while its
        ``fc`` trains (the root), the embeddings and first encoder layers frozen for
        fine-tuning (``bert``); one decision froze them, one fix covers them. One or
        two frozen parts apart (embeddings and a head, the encoder trained between
        them) stay one alert per subtree, and a module frozen beside trainable
        parameters of its own is told alone.

        Three frozen parts apart or more, trained parts between them, are one part
        too, told at the module holding them all: a freeze made throughout the model
        (BatchNorm frozen in every block, a LoRA model's base layers between its
        adapters, ``_adapted``), not a layer frozen by slip; one or two stay apart."""
        owners = list(fresh)
        held = self.held
        if len(owners) < 2 or held is None:
            return [_Part([owner]) for owner in owners]
        told = {p.name for owner, group in fresh.items() if owner != EXTERNAL for p in group}
        beside = held.owners_beside(told)
        if beside is None:
            return [_Part([owner]) for owner in owners]
        # A module is in no frozen subtree where it or a module inside it is beside.
        ends = _holders(beside) | ({""} if beside else set())
        tops: dict[str, list[str]] = {}  # each frozen subtree's modules told
        for owner in owners:
            if owner == EXTERNAL:
                continue
            top = next((name for name in _prefixes(owner) if name not in ends), owner)
            tops.setdefault(top, []).append(owner)
        parts = [_Part(modules, [top]) for top, modules in tops.items()]
        order = held.layer_order() if len(parts) > 1 else None
        if order is not None and _one_stretch(order, owners, beside):
            modules = [m for part in parts for m in part.owners]
            subtrees = [top for part in parts for top in part.tops]
            parts = [_Part(modules, subtrees, _rest(order, modules, common_module(subtrees)))]
        elif len(parts) >= _APART_PARTS:
            modules = [m for part in parts for m in part.owners]
            subtrees = [top for part in parts for top in part.tops]
            sizes = held.sizes()
            adapted = _adapted(sizes, told) if sizes is not None else []
            rest = _rest(order, modules, common_module(subtrees)) if order is not None else []
            parts = [_Part(modules, subtrees, rest, apart=True, adapted=adapted)]
        if EXTERNAL in fresh:  # outside the model: a part of its own
            parts.append(_Part([EXTERNAL]))
        return parts

    def _frozen_layer(self, record: StepRecord, owner: str, params: list[ParamInfo]) -> Alert:
        """One module's frozen parameters, told alone: beside trainable ones of its
        own, or the only module of the model frozen there."""
        trainable = record.trainable_by_module.get(owner, 0)
        many = len(params) != 1
        return self.alert(
            self._first_seen.get((record.optimizer, owner), record.step),
            owner,
            f"{len(params)} parameter{'s' if many else ''} with "
            f"requires_grad=False ({short_names(params)}) "
            f"{'sit' if many else 'sits'} in optimizer "
            f"{record.optimizer}'s param groups, beside {trainable} trainable "
            f"one{'s' if trainable != 1 else ''} of this module",
            "this layer is not updated while it stays frozen: a freeze for "
            "warm-up or fine-tuning that is never undone? Set requires_grad=True, "
            "or build the optimizer from the parameters you mean to train. " + _FROZEN_HINT_END,
            {
                "frozen": len(params),
                "trainable": trainable,
                "parameters": [p.name for p in params],
                "optimizer": record.optimizer,
            },
        )

    def _frozen_part(
        self, record: StepRecord, found: _Part, part: dict[str, list[ParamInfo]]
    ) -> Alert:
        """A frozen part of many modules (a backbone frozen whole, everything but
        the head, or one kind of layer frozen throughout, while the optimizer was
        built over ``model.parameters()``): one alert, at the module holding them
        all, since one fix covers them all."""
        modules = list(part)
        module = common_module(modules)
        params = [p for group in part.values() for p in group]
        scope = record.optimizer
        # A later freeze told at the same module is withdrawn with this one.
        self._parts.setdefault((scope, module), []).extend(modules)
        since = min(self._first_seen.get((scope, m), record.step) for m in modules)
        where = module or "the model"
        # "<model>": the root's own parameters (a prompt tuned beside the model).
        rest = [name.replace("<model>", "its own parameters") for name in found.rest]
        if found.apart and (not rest or len(rest) > 3):
            what = "parts that train lie between them"
            if rest:
                what += f" ({_listed(_compact(found.rest), 6)})"
        elif rest:
            what = f"all of {where} but {_listed(rest)}"
        else:
            what = f"no parameter of {where} trains"
        subtrees = _compact(found.tops) if found.apart else found.tops
        if found.apart:
            tops = _listed(subtrees, 6)
            held = f"in {len(found.tops)} parts apart ({tops}; {len(modules)} modules)"
        elif len(found.tops) > 1:
            tops = _listed([top or "<model>" for top in found.tops], 6)
            held = f"in {len(found.tops)} parts ({tops}; {len(modules)} modules)"
        else:
            held = f"in {len(modules)} modules ({short_names(params)})"
        return self.alert(
            since,
            module,
            f"{len(params)} parameters of {where}, {held}, have requires_grad=False and "
            f"sit in optimizer {scope}'s param groups: {what}",
            _APART_HINT if found.apart else _PART_HINT,
            {
                "frozen": len(params),
                "trainable": 0,
                "parameters": [p.name for p in params],
                "modules": modules,
                "parts": subtrees,
                "rest": found.rest,
                "optimizer": scope,
            },
        )

    def _adapters(
        self, record: StepRecord, found: _Part, part: dict[str, list[ParamInfo]]
    ) -> Alert:
        """A model fine-tuned through adapters (LoRA written by hand, loralib, a
        bottleneck adapter in every block), its frozen base left in an optimizer
        built over ``model.parameters()``: one note, at the module holding it all.

        A note, not a warning: trainable additions inside every frozen block are
        made to train beside a base meant to stay frozen, which no forgotten
        unfreeze looks like (a warm-up freeze holds a stretch of the model, a
        backbone or its first layers, with nothing trained inside it); and the
        optimizer skips what gets no gradient."""
        modules = list(part)
        module = common_module(modules)
        params = [p for group in part.values() for p in group]
        scope = record.optimizer
        self._parts.setdefault((scope, module), []).extend(modules)
        self._noted.add((scope, module))
        since = min(self._first_seen.get((scope, m), record.step) for m in modules)
        subtrees = _compact(found.tops)
        adapted = _compact(found.adapted)
        held = f"{len(found.tops)} parts ({_listed(subtrees, 6)}; {len(modules)} modules)"
        if len(found.tops) == len(modules):
            held = f"{len(modules)} modules ({_listed(subtrees, 6)})"
        return self.alert(
            since,
            module,
            f"{len(params)} frozen parameters of {module or 'the model'}, in {held}, "
            f"sit in optimizer {scope}'s param groups beside the adapters that train "
            f"inside {len(found.adapted)} of its modules ({_listed(adapted, 6)}): a "
            "frozen base fine-tuned through adapters, whose frozen weights get no "
            "gradient and are skipped by the optimizer",
            _ADAPTER_HINT,
            {
                "kind": "adapters",
                "frozen": len(params),
                "trainable": 0,
                "parameters": [p.name for p in params],
                "modules": modules,
                "parts": subtrees,
                "adapted": adapted,
                "optimizer": scope,
            },
            severity="info",
        )

    def _outside(self, record: StepRecord, params: list[ParamInfo]) -> Alert:
        """Frozen parameters outside the model, beside the model's in its optimizer, that
        no other monitor judges: a loss module's (a temperature, loss weights) under
        ``tw.watch``, a bare tensor. Named as their module names them (``NTXent.log_t``),
        or by their place in the optimizer: a placeholder counter says nothing."""
        for p in params:
            self._shown.setdefault(p.name, record.frozen_outside.get(p.name) or p.name)
        count = len(params)
        return self.alert(
            self._first_seen.get((record.optimizer, EXTERNAL), record.step),
            EXTERNAL,
            f"{count} parameter{'s' if count != 1 else ''} outside the model "
            f"({self._names(params)}) with requires_grad=False "
            f"sit{'s' if count == 1 else ''} in optimizer {record.optimizer}'s param groups "
            "beside the model's: "
            f"{'it is' if count == 1 else 'they are'} not updated while frozen",
            "a learned parameter of the loss (a temperature, loss weights) frozen by "
            "mistake, or a freeze never undone? Set requires_grad=True to train it; if "
            "it is meant to stay fixed, leave it out of the optimizer.",
            {
                "frozen": count,
                "trainable": record.trainable_by_module.get(EXTERNAL, 0),
                "parameters": [self._shown[p.name] for p in params],
                "optimizer": record.optimizer,
                "finding": "outside the model",
            },
        )

    def _unfrozen(self, record: StepRecord, frozen: list[ParamInfo]) -> list[Alert]:
        """A module or frozen part told of, whose frozen parameters all train now: a
        warm-up freeze undone, told as a note beside the warning, at the module the
        warning named (``frozen``: those still frozen that this monitor judges). A
        part that trains again only in some of its modules (gradual unfreezing, top
        layers first) is told in a note of its own, its warning standing for the rest."""
        still = {p.owner for p in frozen}
        unfrozen = by_owner(record.unfrozen)
        scope = record.optimizer
        told: dict[str, list[str]] = {}  # the module each unfrozen module was told at
        for owner in unfrozen:
            if (scope, owner) in self._reported and owner not in still:
                module = self._part_of(scope, owner)
                if (scope, module) not in self._undone:
                    told.setdefault(module, []).append(owner)
        alerts = []
        for module, owners in told.items():
            params = [p for owner in owners for p in unfrozen[owner]]
            rest = [m for m in self._parts.get((scope, module), [module]) if m in still]
            if rest:
                alerts.append(self._part_unfrozen(record, module, owners, params, rest))
                continue
            self._undone.add((scope, module))
            data: dict[str, Any] = {
                "kind": "unfrozen",
                "finding": "unfrozen",
                "withdraws": True,  # the warning no longer stands (--fail-on)
                "parameters": [self._shown.get(p.name, p.name) for p in params],
                "optimizer": scope,
            }
            what, undone = self._names(params), "the freeze told of earlier was undone"
            part = self._parts.get((scope, module))
            if part is not None:
                data["modules"] = part
                if len(owners) < len(part):  # the others were told unfrozen before
                    undone = (
                        f"the rest of the freeze of {module or 'the model'} told of earlier "
                        "was undone, all of it trains"
                    )
            if len(owners) > 1:
                what = (
                    f"{len(params)} parameters of {module or 'the model'}, in {len(owners)} "
                    f"modules ({what}),"
                )
            alerts.append(
                self.alert(
                    record.step,
                    module,
                    f"{what} in optimizer {scope}'s param groups "
                    f"train again from step {record.step} (requires_grad=True): {undone}",
                    _UNFROZEN_HINT_DISTRIBUTED if process_group_up() else _UNFROZEN_HINT,
                    data,
                    severity="info",
                )
            )
        return alerts

    def _part_of(self, scope: int | None, owner: str) -> str:
        """The module whose warning named ``owner``: its own, or a frozen part's."""
        for (told_scope, module), modules in self._parts.items():
            if told_scope == scope and owner in modules:
                return module
        return owner

    def _part_unfrozen(
        self,
        record: StepRecord,
        module: str,
        owners: list[str],
        params: list[ParamInfo],
        rest: list[str],
    ) -> Alert:
        """Some modules of a frozen part train again, others stay frozen: said at the
        modules unfrozen, withdrawing nothing, since the part's warning still holds."""
        return self.alert(
            record.step,
            common_module(owners),
            f"{self._names(params)} in optimizer {record.optimizer}'s param groups "
            f"train again from step {record.step} (requires_grad=True): part of the freeze "
            f"of {module or 'the model'} told of earlier was undone; {len(rest)} of its "
            f"modules ({', '.join(rest[:4])}{' and more' if len(rest) > 4 else ''}) "
            f"{'stays' if len(rest) == 1 else 'stay'} frozen, and its "
            f"{'note' if (record.optimizer, module) in self._noted else 'warning'} stands "
            f"for {'it' if len(rest) == 1 else 'them'}",
            _UNFROZEN_HINT_DISTRIBUTED if process_group_up() else _UNFROZEN_HINT,
            {
                "kind": "unfrozen",
                "finding": "unfrozen",
                "withdraws": False,
                "parameters": [p.name for p in params],
                "modules": owners,
                "still_frozen": rest,
                "optimizer": record.optimizer,
            },
            severity="info",
        )

    def _names(self, params: list[ParamInfo]) -> str:
        return short_names([replace(p, name=self._shown.get(p.name, p.name)) for p in params])


class NotOptimizedRule(_ReportOnce):
    id = "not_optimized"
    reads = "not_optimized"

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.stepped_twice is not None:
            return self._stepped_twice(record, record.stepped_twice)
        if record.idle_steps:
            return self._idle(record)
        if record.replaced is not None:
            return self._replaced(record)
        params = record.not_optimized
        alerts = []
        unfrozen = record.unfrozen_unheld
        if unfrozen:
            alerts = self._unfrozen_after_optimizer(
                record, [p for p in params if p.name in unfrozen]
            )
            params = [p for p in params if p.name not in unfrozen]
        return alerts + [
            self.alert(
                record.step,
                owner,
                f"{short_names(params)} received gradients but no watched optimizer "
                "holds them, so they are never updated",
                "was the optimizer built over only part of the model "
                "(self.encoder.parameters()), this module or one of its weights replaced after "
                "the optimizer was built (a new head for fine-tuning, layer.weight = "
                "nn.Parameter(pretrained), remove_parametrizations()), or the model moved "
                "with .to()/.half() while "
                "torch.__future__.set_overwrite_module_params_on_conversion(True) "
                "replaces its parameters? Build the optimizer after the last change to "
                "the model, or add the parameters with optimizer.add_param_group().",
                {"parameters": [p.name for p in params]},
            )
            for owner, params in self.new_owners(None, params).items()
        ]

    def _stepped_twice(self, record: StepRecord, twice: SteppedTwice) -> list[Alert]:
        """Two optimizers hold the same parameters and both stepped them on one
        gradient: each backward updates them twice. One alert, at the module
        holding them all."""
        params = record.not_optimized
        if not params:
            return []
        modules = list(by_owner(params))
        module = common_module(modules)
        where = module or "the model"
        first = _optimizer_named(twice.first, twice.first_class, twice.first_name)
        second = _optimizer_named(twice.second, twice.second_class, twice.second_name)
        count = len(params)
        if twice.first_holds == twice.second_holds == count:
            held = "both hold exactly these parameters"
        else:
            held = (
                f"{twice.first} holds {twice.first_holds} parameters, "
                f"{twice.second} holds {twice.second_holds}"
            )
        return [
            self.alert(
                record.step,
                module,
                f"{first} and {second} both hold {count} parameters of {where} "
                f"({short_names(params)}; {held}) and both stepped them at step "
                f"{record.step} on the same gradient: every backward updates them twice, "
                "with two sets of optimizer state",
                f"{_built_over_the_wrong_one(twice, module)} Build each optimizer over the "
                f"parameters it is meant to train; if {where} should train with two "
                "learning rates, use one optimizer with two param groups.",
                {
                    "kind": "stepped_twice",
                    "parameters": [p.name for p in params],
                    "modules": modules,
                    "optimizers": [twice.first, twice.second],
                    "optimizer_classes": [twice.first_class, twice.second_class],
                    "optimizer_names": [twice.first_name, twice.second_name],
                },
            )
        ]

    def _unfrozen_after_optimizer(self, record: StepRecord, params: list[ParamInfo]) -> list[Alert]:
        """Parameters frozen while the optimizer was built, so left out of it, and
        unfrozen since (a linear probe, then the backbone trained; the HF Trainer's
        optimizer built at ``train()`` from the trainable parameters, a callback
        unfreezing later): one alert for the modules unfrozen together, at the
        module holding them all, since one fix adds them all."""
        fresh = self.new_owners(None, params)
        if not fresh:
            return []
        modules = list(fresh)
        params = [p for group in fresh.values() for p in group]
        module = common_module(modules)
        count = len(params)
        many = count != 1
        where = module or "the model"
        if len(modules) > 1:
            where += f", in {len(modules)} modules"
        return [
            self.alert(
                record.step,
                module,
                f"{count} parameter{'s' if many else ''} of {where} ({short_names(params)}) "
                f"{'were' if many else 'was'} frozen (requires_grad=False) when the optimizer "
                f"was built, and unfrozen since: {'they get' if many else 'it gets'} gradients "
                f"from step {record.step}, but the optimizer never got "
                f"{'them' if many else 'it'} and no watched optimizer holds "
                f"{'them' if many else 'it'}, so {'they are' if many else 'it is'} never updated",
                "an optimizer steps only the parameters it was built over: unfreezing "
                "does not add them. Where you unfreeze them, add them: "
                "optimizer.add_param_group({'params': "
                f"[p for p in {_module_in_code(module)}.parameters() if p.requires_grad], "
                "'lr': ...}) (under Lightning, BaseFinetuning's "
                "unfreeze_and_add_param_group), before any LR scheduler is built over the "
                "optimizer (a LambdaLR built earlier, as transformers' warm-up schedules "
                "are, fails at its next step); or, after unfreezing, build a new optimizer "
                "and scheduler over every parameter that trains"
                + (
                    ""
                    if self.loss_out_of_reach
                    else " and hand it to the monitor (monitor.add_optimizer)"
                )
                + ". Under the HF Trainer, whose optimizer and scheduler are built from the "
                "trainable parameters as train() starts, train the unfrozen phase with a "
                "new Trainer, or pass one optimizer over every parameter, frozen ones "
                "included (Trainer(optimizers=(optimizer, scheduler))): while frozen they "
                "get no gradient, so it updates them only once unfrozen.",
                {
                    "cause": "unfrozen_after_optimizer",
                    "parameters": [p.name for p in params],
                    "modules": modules,
                },
            )
        ]

    def _replaced(self, record: StepRecord) -> list[Alert]:
        """The model trained replaced another one after the optimizer was built: that
        optimizer steps the old model's parameters, and nothing updates these. One
        alert for the whole model."""
        replaced = record.replaced
        assert replaced is not None
        params = record.not_optimized
        owners = sorted({p.owner for p in params})
        for owner in owners:  # the per-module finding is this one
            self._reported.add((None, owner))
        if replaced.conversion is not None:
            return [self._converted(record, replaced, params, owners)]
        if replaced.part is not None:
            return [self._part_replaced(record, replaced, params, owners)]
        old = replaced.stale_class
        if old is None:
            old, when = "a model no module holds any more", "freed since"
        elif replaced.since is None:
            when = "a module never called while watched"
        else:
            when = f"a model no longer called since step {replaced.since}"
        if replaced.stale_model is not None and replaced.stale_model != old:
            old += f" (watched as {replaced.stale_model})"
        return [
            self.alert(
                record.step,
                owners[0] if len(owners) == 1 else "",
                f"{len(params)} parameters of this model ({short_names(params)}) receive "
                "gradients but no optimizer holds them, so they are never updated: the "
                f"{replaced.optimizer_class} optimizer steps the parameters of {old}, {when}, "
                "whose parameters match this model's: the model was replaced after the "
                "optimizer was built",
                "the model was replaced (copy.deepcopy, prepare_qat(inplace=False) or "
                "another transform returning a copy, a load of a new instance) after the "
                "optimizer was built: build the optimizer over the new model (after the "
                "last such change), or load the weights into the model the optimizer holds "
                "instead (model.load_state_dict(best.state_dict())).",
                {
                    "parameters": [p.name for p in params],
                    "kind": "replaced_model",
                    "optimizer_class": replaced.optimizer_class,
                    "stale_class": replaced.stale_class,
                    "stale_model": replaced.stale_model,
                    "stale_since": replaced.since,
                },
            )
        ]

    def _part_replaced(
        self,
        record: StepRecord,
        replaced: ReplacedModel,
        params: list[ParamInfo],
        owners: list[str],
    ) -> Alert:
        """A part of the model (a new head) replaced after the optimizer was built over
        the old one: the optimizer holds no parameter of the model."""
        part = replaced.part
        assert part is not None
        code = _module_in_code(part)
        count = len(params)
        many = count != 1
        if replaced.stale_class is None:
            old = "parameters that no module holds any more"
        else:
            old = f"the parameters of a {replaced.stale_class} never called while watched"
        return self.alert(
            record.step,
            owners[0] if len(owners) == 1 else "",
            f"{count} parameter{'s' if many else ''} of this model ({short_names(params)}) "
            f"{'receive' if many else 'receives'} gradients but no optimizer holds "
            f"{'them' if many else 'it'}, so {'they are' if many else 'it is'} never "
            f"updated: the {replaced.optimizer_class} optimizer steps {old}, shaped like "
            f"those of {part} but for their first dimension: {part} was replaced (a new "
            "head) after the optimizer was built over the old one, whose parameters no "
            "longer belong to the model, and nothing of the model trains",
            f"build the optimizer after replacing the head: first set {code} (the new head), "
            f"then the optimizer over {code}.parameters() (or over every parameter that "
            "trains); an optimizer steps only the tensors it was built over, and a module "
            "set in the old one's place brings new ones.",
            {
                "parameters": [p.name for p in params],
                "kind": "replaced_module",
                "replaced_module": part,
                "optimizer_class": replaced.optimizer_class,
                "stale_class": replaced.stale_class,
            },
        )

    def _converted(
        self,
        record: StepRecord,
        replaced: ReplacedModel,
        params: list[ParamInfo],
        owners: list[str],
    ) -> Alert:
        """The model was converted in overwrite mode after its optimizer was built: the
        optimizer holds the model's own parameters from before the conversion."""
        conversion = replaced.conversion
        assert conversion is not None
        return self.alert(
            record.step,
            owners[0] if len(owners) == 1 else "",
            f"{len(params)} parameters of this model ({short_names(params)}) receive "
            "gradients but no optimizer holds them, so they are never updated: the model "
            f"was converted (from {conversion.source} to {conversion.target}) while "
            "torch.__future__.set_overwrite_module_params_on_conversion(True) replaces its "
            f"parameters with new ones, and the {replaced.optimizer_class} optimizer, built "
            "before the conversion, holds the parameters from before it",
            "build the optimizer after the model's last .to()/.double()/.half()/.cuda(), "
            "from its parameters then, or turn overwrite mode off "
            "(torch.__future__.set_overwrite_module_params_on_conversion(False)): a "
            "conversion then keeps each Parameter object, and the optimizer's hold on it.",
            {
                "parameters": [p.name for p in params],
                "kind": "converted_in_overwrite_mode",
                "optimizer_class": replaced.optimizer_class,
                "converted_from": conversion.source,
                "converted_to": conversion.target,
            },
        )

    def _idle(self, record: StepRecord) -> list[Alert]:
        """Never updated while other models train: one alert, for the whole model."""
        params = record.not_optimized
        owners = sorted({p.owner for p in params})
        if record.source == "manual":
            return [self._never_updated(record, params, owners)]
        if record.source == "unwatched":
            return [self._unwatched(record, params, owners)]
        if record.idle_optimizer is not None:
            return [self._sibling_never_steps(record, params, owners)]
        if record.idle_lost:
            return [self._model_gradients_lost(record, params, owners)]
        return [
            self.alert(
                record.step,
                common_module(owners),
                f"this model's optimizer has not stepped once while other models took "
                f"{record.idle_steps} optimizer steps, yet {len(params)} of its parameters "
                f"({short_names(params)}) hold gradients: it is never updated, and its "
                "gradients pile up at every backward",
                "is its optimizer.step() missing (a second optimizer of a GAN or a "
                "domain-adversarial loop)? If the model is held fixed on purpose for "
                "now, freeze it (model.requires_grad_(False)) so no gradient is computed "
                "or kept for it.",
                {
                    "parameters": [p.name for p in params],
                    "steps_elsewhere": record.idle_steps,
                    "kind": "optimizer_never_steps",
                },
            )
        ]

    def _model_gradients_lost(
        self, record: StepRecord, params: list[ParamInfo], owners: list[str]
    ) -> Alert:
        """The model's only optimizers never stepped while other models did, and the
        loop threw its gradients away before any step applied them."""
        model = record.idle_model_name
        optimizer = record.idle_optimizer_name
        if optimizer and record.optimizer_class:
            named = f"{optimizer} ({record.optimizer_class})"
        else:
            named = optimizer or "this model's optimizer"
        whose = f"{model}'s" if model else "this model's"
        step_call = f"{optimizer}.step()" if optimizer else "its optimizer.step()"
        return self.alert(
            record.step,
            common_module(owners),
            f"{named} has not stepped once since step {record.step}, while other models "
            f"took {record.idle_steps} optimizer steps: {whose} gradients "
            f"({short_names(params)}) were reset and written anew {record.idle_lost} times "
            "with no step between, so every backward's gradient is thrown away "
            f"and {model or 'the model'} is never updated",
            f"is {step_call} missing after its backward (an actor-critic's critic_opt, a "
            "GAN's discriminator optimizer), or did a copy-paste slip step another "
            "optimizer in its place? If the model is held fixed on purpose, freeze it "
            "(requires_grad_(False)) so no gradient is computed for it.",
            {
                "parameters": [p.name for p in params],
                "steps_elsewhere": record.idle_steps,
                "kind": "optimizer_never_steps",
                "lost_gradients": record.idle_lost,
                "since_step": record.step,
                "optimizer_name": optimizer,
                "model_name": model,
            },
        )

    def _sibling_never_steps(
        self, record: StepRecord, params: list[ParamInfo], owners: list[str]
    ) -> Alert:
        """One of the model's optimizers never stepped while its others did."""
        index = record.idle_optimizer
        # Named by its class too: an index alone depends on the order the optimizers
        # were met in, which differs between tw.watch and trainwatch run.
        name = f"optimizer {index}"
        if record.optimizer_class:
            name += f" ({record.optimizer_class})"
            if record.idle_optimizer_name:  # critic_opt (optimizer 1, Adam)
                name = _optimizer_named(index, record.optimizer_class, record.idle_optimizer_name)
        if record.idle_lost:
            return self._sibling_gradients_lost(record, params, owners, name)
        if record.idle_since is not None:
            return self.alert(
                record.step,
                common_module(owners),
                f"{name} last stepped at step {record.idle_since}, "
                f"{record.idle_steps} steps ago, while this model's other optimizers "
                f"step, yet {len(params)} parameters only it holds "
                f"({short_names(params)}) still get gradients: they are no longer updated",
                "a new phase's optimizer built over part of the model (the head) while "
                "the rest still trains? Freeze what should stay fixed "
                "(requires_grad_(False)), or give the new optimizer every parameter "
                "that trains.",
                {
                    "parameters": [p.name for p in params],
                    "steps_elsewhere": record.idle_steps,
                    "optimizer": index,
                    "optimizer_class": record.optimizer_class,
                    "last_step": record.idle_since,
                    "kind": "optimizer_stopped",
                },
            )
        return self.alert(
            record.step,
            common_module(owners),
            f"{name} has not stepped once while this model's other optimizers "
            f"took {record.idle_steps} steps, yet {len(params)} of its parameters "
            f"({short_names(params)}) hold gradients: they are never updated",
            f"is {name}'s step() missing (a sparse embedding's SparseAdam "
            "beside the dense optimizer, one optimizer per part of the model)? If these "
            "parameters are held fixed on purpose for now, freeze them "
            "(requires_grad_(False)) so no gradient is computed or kept for them.",
            {
                "parameters": [p.name for p in params],
                "steps_elsewhere": record.idle_steps,
                "optimizer": index,
                "optimizer_class": record.optimizer_class,
                "kind": "optimizer_never_steps",
            },
        )

    def _sibling_gradients_lost(
        self, record: StepRecord, params: list[ParamInfo], owners: list[str], name: str
    ) -> Alert:
        """One of the model's optimizers never stepped while its others did, and the
        loop threw its parameters' gradients away before any step applied them."""
        module = common_module(owners)
        where = module or "the model"
        optimizer = record.idle_optimizer_name
        step_call = f"{optimizer}.step()" if optimizer else "its step()"
        return self.alert(
            record.step,
            module,
            f"{name} has not stepped once since step {record.step}, while this model's "
            f"other optimizers took {record.idle_steps} steps: the gradients of its "
            f"{len(params)} parameters ({short_names(params)}) were reset and written anew "
            f"{record.idle_lost} times with no step between, so every backward's "
            f"gradient is thrown away and {where} is never updated",
            f"is {step_call} missing after its backward (an actor-critic's critic_opt, "
            "one optimizer per part of the model), or did a copy-paste slip step another "
            "optimizer in its place? If these parameters are held fixed on purpose, freeze "
            "them (requires_grad_(False)) so no gradient is computed for them.",
            {
                "parameters": [p.name for p in params],
                "steps_elsewhere": record.idle_steps,
                "optimizer": record.idle_optimizer,
                "optimizer_class": record.optimizer_class,
                "optimizer_name": optimizer,
                "kind": "optimizer_never_steps",
                "lost_gradients": record.idle_lost,
                "since_step": record.step,
            },
        )

    def _unwatched(self, record: StepRecord, params: list[ParamInfo], owners: list[str]) -> Alert:
        """The weights move while no watched optimizer steps: an optimizer the monitor
        was not given trains the model (found and watched from now on, where
        ``record.optimizer_class`` names it), or something else writes them."""
        since = (
            f"since step {record.idle_since}"
            if record.idle_since is not None
            else "since watching began"
        )
        found = record.optimizer_class
        if found is not None:
            message = (
                f"the model's weights keep changing while no watched optimizer has stepped "
                f"{since} ({record.idle_steps} passes): {found}, an optimizer this monitor "
                "was not given, trains it; its steps went unchecked until now, and it is "
                "watched from this step on"
            )
            hint = (
                "a new optimizer built for a new phase (a new head, fine-tuning)? Hand it "
                "over where it is built, monitor.add_optimizer(optimizer), so every step of "
                "it is checked, or run the script under `trainwatch run`, which finds new "
                "optimizers by itself."
            )
            kind = "unwatched_optimizer"
        else:
            message = (
                f"the model's weights keep changing while no watched optimizer has stepped "
                f"{since} ({record.idle_steps} passes), and no optimizer step over its "
                "parameters was seen: something this monitor does not watch updates it, "
                "and those updates are not checked"
            )
            hint = (
                "an optimizer whose step() runs no hooks, or a hand-written update? Pass "
                "an optimizer that trains the model to monitor.add_optimizer(optimizer) "
                "(or run the script under `trainwatch run`); for hand-written updates, "
                "watch the model without an optimizer and call monitor.step() after each one."
            )
            kind = "unwatched_updates"
        return self.alert(
            record.step,
            owners[0] if len(owners) == 1 else "",
            message,
            hint,
            {
                "parameters": [p.name for p in params],
                "passes": record.idle_steps,
                "last_step": record.idle_since,
                "optimizer_class": found,
                "kind": kind,
            },
        )

    def _frozen_target(
        self, record: StepRecord, params: list[ParamInfo], owners: list[str]
    ) -> Alert:
        """A copy of a trained model that nothing updates gets gradients: a frozen
        target or reference whose output is used with gradients."""
        copied = record.copy_of
        assert copied is not None
        # Told from its second step on: not moved yet, which says nothing of a sync
        # to come (a DQN target's), only that no update uses these gradients.
        steps = record.idle_steps
        return self.alert(
            record.step,
            owners[0] if len(owners) == 1 else "",
            f"{short_names(params)} of this model, the copy of {copied_model(copied)} that no "
            "optimizer holds, hold gradients that are never reset while its weights have "
            f"not moved, and other models' optimizers took {steps} "
            f"step{'' if steps == 1 else 's'}: backward "
            "reaches it, most likely through a target or reference computed without "
            "torch.no_grad() or .detach(), which also sends gradients into whatever it "
            "was computed from",
            "compute the target under torch.no_grad() (or .detach() it) and freeze the "
            "copy (requires_grad_(False)); if it should train instead, hand its "
            "parameters to an optimizer.",
            {
                "parameters": [p.name for p in params],
                "steps_elsewhere": record.idle_steps,
                "kind": "target_receives_gradients",
                **copy_data(copied),
            },
        )

    def _model_left_out(
        self, record: StepRecord, left: LeftOutModel, params: list[ParamInfo]
    ) -> Alert:
        """A whole model with a forward of its own, called by the loop, in no
        optimizer: one alert at the model, naming it, with its own optimizer as
        the fix."""
        named = f"{left.model_name} ({left.model_class})" if left.model_name else left.model_class
        return self.alert(
            record.step,
            "",
            f"no optimizer holds the model {named}: its {len(params)} parameters "
            f"({short_names(params)}) get gradients at every step that are never reset, "
            "and its weights have not moved, while other models' optimizers took "
            f"{record.idle_steps} steps: it is never trained",
            _model_left_out_hint(left),
            {
                "parameters": [p.name for p in params],
                "steps_elsewhere": record.idle_steps,
                "kind": "model_in_no_optimizer",
                "model_class": left.model_class,
                "model_name": left.model_name,
                "optimizer_class": left.optimizer_class,
                "meant_optimizer": left.meant,
            },
        )

    def _never_updated(
        self, record: StepRecord, params: list[ParamInfo], owners: list[str]
    ) -> Alert:
        """No optimizer holds the model, and its weights never moved: left out of them."""
        if record.copy_of is not None:
            return self._frozen_target(record, params, owners)
        if record.left_out is not None:
            return self._model_left_out(record, record.left_out, params)
        return self.alert(
            record.step,
            owners[0] if len(owners) == 1 else "",
            f"{short_names(params)} of this model hold gradients that are never reset and "
            "its weights have not moved once, while other models' optimizers took "
            f"{record.idle_steps} steps: no optimizer holds them and nothing updates them",
            "parameters of a module outside the model (learned loss weights, a "
            "temperature, a criterion with parameters) must be handed to the optimizer "
            "too: torch.optim.Adam([*model.parameters(), *criterion.parameters()]).",
            {
                "parameters": [p.name for p in params],
                "steps_elsewhere": record.idle_steps,
                "kind": "never_updated",
            },
        )


def _model_left_out_hint(left: LeftOutModel) -> str:
    """Build the model's own optimizer, in the training code's names where found."""
    model = left.model_name or "model"
    build = f"torch.optim.{left.optimizer_class}({model}.parameters())"
    if left.meant is not None:
        instead = f" but {left.holds_instead}" if left.holds_instead else ""
        return (
            f"{left.meant} was most likely meant to be this model's optimizer, yet it "
            f"holds none of its parameters{instead} (a copy-paste slip?): build it over "
            f"this model's own, {left.meant} = {build}."
        )
    return (
        f"a model with a forward of its own that the loop calls, whose output feeds the "
        f"loss, is trained only by an optimizer over its parameters: build one, "
        f"{build}, and step it with the others, or add its parameters to the optimizer "
        f"of the model it trains with (torch.optim.{left.optimizer_class}"
        f"([*other.parameters(), *{model}.parameters()])). If it is meant to stay "
        f"fixed, freeze it ({model}.requires_grad_(False))."
    )


def _optimizer_named(index: int, kind: str, name: str | None) -> str:
    """``encoder_optimizer (optimizer 1, Adam)``, or ``optimizer 1 (Adam)`` unnamed."""
    return f"{name} (optimizer {index}, {kind})" if name else f"optimizer {index} ({kind})"


def _built_over_the_wrong_one(twice: SteppedTwice, module: str) -> str:
    """The usual slip, said with the training code's names where they were found."""
    if twice.second_name and twice.first_name:
        code = _module_in_code(module, twice.model_name or "model")
        return (
            f"was {twice.second_name} built over the wrong module's parameters, a "
            f"copy-paste of {twice.first_name}'s line ({twice.second_name} = "
            f"torch.optim.{twice.second_class}({code}.parameters()) where another "
            "module was meant, which that leaves in no optimizer)?"
        )
    return (
        "an optimizer built over the wrong module's parameters (a copy-paste slip: "
        "decoder_optimizer = torch.optim.Adam(encoder.parameters()), which also leaves "
        "the decoder in no optimizer)?"
    )


def _module_in_code(name: str, model: str = "model") -> str:
    """How the training code reaches the module ``name`` of its ``model``."""
    if not name:
        return model
    if all(piece.isidentifier() for piece in name.split(".")):
        return f"{model}.{name}"
    return f"{model}.get_submodule({name!r})"
