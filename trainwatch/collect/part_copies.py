"""Parts of the watched model that copy another part: a target network held inside it.

A LightningModule (or any model) may hold a DQN's Q-network and its target
side by side (``self.q_target = copy.deepcopy(self.q)``), the optimizer built
over ``self.q`` alone and the target moved by hand (a Polyak update, a sync
every few hundred steps). A TD target computed without ``torch.no_grad()``
writes gradients into the target part: parameters that no optimizer holds got
gradients, which taken for a part left out of the optimizer would have
``add_param_group()`` train the target.

A part is a copy of another when it is of that part's class with its
parameter shapes in order, shares none of them, holds no parameter an
optimizer holds while the other does, is not another layer of the same stack,
and lies near it: within ``WITHIN_NORM`` of its weights' norm (a deepcopy, a
recent sync), or moved towards it by the next boundary while no optimizer holds
it (a Polyak target started from an initialization of its own). A head added
after the optimizer was built copies nothing: a fresh initialization lies as
far from any other part as weights go, and nothing moves it. Nor does a
parameter in no part wholly out of the optimizers: a layer's weight swapped
for a new one (``fc.weight = nn.Parameter(pretrained)`` after the optimizer was
built, ``remove_parametrizations()`` mid-run) beside a bias an optimizer still
holds, or a parameter of the model itself.

A part that copies only some of the trained parts (BYOL's target: a copy of
the online backbone and projector, less the predictor, in a module of its own
or in an ``nn.Sequential`` of the copies) matches no part in full: where no part
matches so, a run of the parameters an optimizer holds that it matches by names
or by shapes in order (see :mod:`trainwatch.collect.copied_runs`) is judged as
such a part, where it lies near the run at once (decided then: no part far from
a run of another's shapes, a new head of an embedding's, waits a boundary),
unless the run is another layer of the same stack.

Looked at only at a boundary where parameters no optimizer holds got gradients
(never on the healthy step); each part is decided once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from trainwatch.collect.copied_runs import copied_runs, covered_parts, holder, named_parameters
from trainwatch.collect.model_copies import WITHIN_NORM, is_copy, sample_weights, weight_distance
from trainwatch.compiled import user_name
from trainwatch.record import CopiedFrom

# A part's verdict: (its name, what it copies), or None where it copies nothing;
# ``_UNKNOWN`` (told apart by identity) where not decided yet.
Verdict = tuple[str, CopiedFrom] | None
_UNKNOWN: Verdict = ("", CopiedFrom(""))


@dataclass(frozen=True)
class PartCopy:
    """A part of the model (``name``) that copies another (``of``), with its
    parameters that got gradients, first seen with them at step ``since``."""

    name: str
    of: CopiedFrom
    params: list[torch.Tensor]
    since: int


@dataclass
class _Doubt:
    """A part of another's class and shapes that lay far from every such part at step
    ``since``: its weights then, and how far each candidate lay."""

    since: int
    weights: torch.Tensor
    far: dict[CopiedFrom, float]


class PartCopies:
    """The verdicts on the parts whose parameters no optimizer holds, per parameter."""

    def __init__(self) -> None:
        # By parameter id: the parameter (weakly: an id is reused once it is freed)
        # and the copy its part is (None: a part that copies nothing).
        self._verdicts: dict[int, tuple[weakref.ref[torch.Tensor], Verdict]] = {}
        # By copy: the step its gradients were first seen.
        self._since: dict[tuple[str, CopiedFrom], int] = {}
        # Parts in doubt until the next boundary, by name.
        self._doubts: dict[str, _Doubt] = {}

    def split(
        self,
        step: int,
        root: nn.Module,
        trained: list[torch.Tensor],
        unheld: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[PartCopy]]:
        """``trained`` (parameters no optimizer holds, of ``unheld``, that got
        gradients at ``step``) parted into those left to not_optimized and the
        copies of other parts. A part in doubt is in neither until the next
        boundary decides it; a parameter in no unheld part is left to not_optimized
        at once."""
        if any(self._verdict(p) is _UNKNOWN for p in trained):
            self._decide(step, root, {id(p) for p in unheld}, trained)
        left: list[torch.Tensor] = []
        copies: dict[tuple[str, CopiedFrom], list[torch.Tensor]] = {}
        for param in trained:
            verdict = self._verdict(param)
            if verdict is None:
                left.append(param)
            elif verdict is not _UNKNOWN:
                copies.setdefault(verdict, []).append(param)
        return left, [
            PartCopy(name, of, params, self._since[name, of])
            for (name, of), params in copies.items()
        ]

    def _verdict(self, param: torch.Tensor) -> Verdict:
        held = self._verdicts.get(id(param))
        if held is None or held[0]() is not param:
            return _UNKNOWN
        return held[1]

    def _decide(
        self, step: int, root: nn.Module, unheld: set[int], trained: list[torch.Tensor]
    ) -> None:
        """Every part that got gradients and is not yet decided: decided, or in doubt.
        A parameter in no part wholly out of the optimizers (a weight swapped for a
        new one beside a bias an optimizer still holds, one on the model itself)
        copies nothing: left to not_optimized."""
        # By the names the alerts use: a compiled part is its inner module.
        modules = {user_name(raw): module for raw, module in root.named_modules()}
        got = {id(p) for p in trained}
        in_parts: set[int] = set()
        for name, part in _unheld_parts(modules, unheld):
            params = list(part.parameters())
            in_parts.update(map(id, params))
            if not any(id(p) in got for p in params):
                continue
            if all(self._verdict(p) is not _UNKNOWN for p in params):
                continue
            since = self._doubts[name].since if name in self._doubts else step
            verdict = self._judge(step, name, part, params, modules, unheld)
            if verdict is not None and verdict is not _UNKNOWN:
                self._since[verdict] = since
            if verdict is not _UNKNOWN:
                for param in params:
                    self._verdicts[id(param)] = (weakref.ref(param), verdict)
        for param in trained:
            if id(param) not in in_parts:
                self._verdicts[id(param)] = (weakref.ref(param), None)

    def _judge(
        self,
        step: int,
        name: str,
        part: nn.Module,
        params: list[torch.Tensor],
        modules: dict[str, nn.Module],
        unheld: set[int],
    ) -> Verdict:
        """The part this one copies, None, or not known yet (in doubt)."""
        place = _place_in_stack(name)
        originals = {
            CopiedFrom(other): list(module.parameters())
            for other, module in modules.items()
            if type(module) is type(part)
            and module is not part
            and _place_in_stack(other) != place
            and any(id(p) not in unheld for p in module.parameters())
            and is_copy(params, list(module.parameters()))
        }
        if not originals:
            return _copied_run(name, part, place, modules, unheld)
        weights = sample_weights(params)
        far = {
            other: weight_distance(weights, sample_weights(run)) for other, run in originals.items()
        }
        doubt = self._doubts.pop(name, None)
        if doubt is not None:
            return _moved_towards(name, doubt, weights, far)
        nearest = min(far, key=far.__getitem__)
        norm = float(torch.linalg.vector_norm(sample_weights(originals[nearest])))
        if far[nearest] <= WITHIN_NORM * norm:
            return (name, nearest)
        self._doubts[name] = _Doubt(step, weights, far)
        return _UNKNOWN


def _unheld_parts(
    modules: dict[str, nn.Module], unheld: set[int]
) -> Iterable[tuple[str, nn.Module]]:
    """The largest parts (not the model itself) whose parameters no optimizer holds."""
    taken: list[str] = []
    for name, module in modules.items():
        if not name or any(name.startswith(f"{outer}.") for outer in taken):
            continue
        params = list(module.parameters())
        if params and all(id(p) in unheld for p in params):
            taken.append(name)
            yield name, module


def _copied_run(
    name: str, part: nn.Module, place: str, modules: dict[str, nn.Module], unheld: set[int]
) -> Verdict:
    """What ``part`` copies of the parameters an optimizer holds, by the parts it
    covers (``online.backbone`` and ``online.projector``), the nearest run where
    several lie near; none that is another layer of ``part``'s stack. Decided at
    once: a run far from the part is none it copies (a new head of an
    embedding's shape)."""
    held = [(key, p) for key, p in named_parameters(modules[""]) if id(p) not in unheld]
    found = []
    for run in copied_runs(named_parameters(part), held):
        parts = covered_parts(modules, run.params)
        if parts and all(_place_in_stack(covered) != place for covered in parts):
            found.append((run.far, parts))
    if not found:
        return None
    parts = min(found)[1]
    return (name, CopiedFrom(holder(parts), parts))


def _place_in_stack(name: str) -> str:
    """A part's name with its indices dropped: the same for each layer of a stack
    (``layers.3.attn``, ``layers.7.attn``). nn.TransformerEncoder builds its layers
    as deepcopies of one, so an optimizer over only some of them leaves the others
    near copies of them: layers left out of it, not targets."""
    return ".".join("#" if part.isdigit() else part for part in name.split("."))


def _moved_towards(
    name: str, doubt: _Doubt, weights: torch.Tensor, far: dict[str, float]
) -> Verdict:
    """A part in doubt, looked at again: moved while no optimizer holds it, nearer a
    part it may copy than it was (a Polyak update), it copies that part."""
    if torch.equal(weights, doubt.weights):
        return None  # nothing moves it: a part left out of the optimizer
    nearer = [other for other, now in far.items() if now < doubt.far.get(other, now)]
    if not nearer:
        return None
    return (name, min(nearer, key=far.__getitem__))
