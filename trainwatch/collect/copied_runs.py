"""Target networks that copy only part of a trained model: BYOL's, less the predictor.

BYOL's target is a copy of the online network's backbone and projector, without
the predictor the online network trains on top of them; a mean teacher may copy
a student's encoder alone. Such a target matches no trained model shape for
shape in full, only a run of its parameters: by name, where the target's names
end those of the part it copies (``backbone.0.weight`` in both, or ``0.weight``
for a copy of ``backbone`` alone), or, where the copied parts were put in a
container of the target's own (``nn.Sequential(deepcopy(backbone),
deepcopy(projector))``), by their shapes in order.

Names and shapes alone agree by chance in small models (two MLPs with layers of
one width, a new head of an embedding's shape), so a run counts only where the
copy's weights lie within :data:`NEAR` of its norm: a copy made by
``copy.deepcopy`` or ``load_state_dict``, and an EMA of one, lie far nearer;
two tensors initialized on their own, about 1.4 times the norm apart (or as far
as the larger one's norm, where their scales differ). Only weights drawn at
random say so: a copy must hold one of two or more dimensions (a layer's
weight), or a loss module's class weights, all ones, would copy a LayerNorm's.

Looked for only once a finding is due (gradients in a model, or a part, that no
optimizer holds), never on the healthy step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from trainwatch.collect.model_copies import sample_weights, weight_distance
from trainwatch.compiled import user_name

Named = Sequence[tuple[str, torch.Tensor]]

# A copy of a run of parameters lies within this share of the run's weights' norm.
NEAR = 0.5


@dataclass(frozen=True)
class CopiedRun:
    """The parameters of the original that a copy matches (in the copy's order), and
    how far the copy's weights lie from them, as a share of their norm."""

    params: list[torch.Tensor]
    far: float


def copied_runs(own: Named, of: Named) -> list[CopiedRun]:
    """Each run of ``of``'s parameters (fewer than all of them: a whole copy is
    :func:`~trainwatch.collect.model_copies.is_copy`'s) that ``own`` copies by
    names and shapes, or by shapes in order, and lies near; none when the two
    share a parameter."""
    if len(own) >= len(of) or not any(param.dim() >= 2 for _, param in own):
        return []
    theirs = {id(param) for _, param in of}
    if any(id(param) in theirs for _, param in own):
        return []
    found = dict.fromkeys([*_by_names(own, of), *_by_shapes(own, of)])
    weights = sample_weights(param for _, param in own)
    runs = []
    for run in found:
        params = [of[index][1] for index in run]
        values = sample_weights(params)
        norm = float(torch.linalg.vector_norm(values))
        far = weight_distance(weights, values) / norm if norm > 0.0 else math.inf
        if far < NEAR:
            runs.append(CopiedRun(params, far))
    return runs


def nearest_run(runs: Sequence[CopiedRun]) -> CopiedRun | None:
    return min(runs, key=lambda run: run.far, default=None)


def covered_parts(modules: dict[str, nn.Module], params: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """The largest modules (by their names in ``modules``) whose every parameter is one
    of ``params``: what a copy of ``params`` copies (``backbone``, ``projector``)."""
    run = {id(param) for param in params}
    taken: list[str] = []
    for name, module in modules.items():
        if not name or any(name.startswith(f"{outer}.") for outer in taken):
            continue
        inside = list(module.parameters())
        if inside and all(id(param) in run for param in inside):
            taken.append(name)
    return tuple(taken)


def holder(parts: Sequence[str]) -> str:
    """The innermost module holding every one of ``parts`` (``""``: the model)."""
    split = [part.split(".") for part in parts]
    shared = []
    for pieces in zip(*split):
        if any(piece != pieces[0] for piece in pieces):
            break
        shared.append(pieces[0])
    return ".".join(shared)


def named_parameters(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters by the names the alerts use (a compiled part's
    ``_orig_mod`` dropped)."""
    return [(user_name(name), param) for name, param in module.named_parameters()]


def _by_names(own: Named, of: Named) -> Iterator[tuple[int, ...]]:
    """Runs where every name of ``own``, under one prefix, names a parameter of ``of``
    of the same shape."""
    where = {name: index for index, (name, _) in enumerate(of)}
    first = own[0][0]
    for name in where:
        if name != first and not name.endswith(f".{first}"):
            continue
        prefix = name[: len(name) - len(first)]
        run = []
        for own_name, param in own:
            index = where.get(prefix + own_name)
            if index is None or of[index][1].shape != param.shape:
                break
            run.append(index)
        else:
            yield tuple(run)


def _by_shapes(own: Named, of: Named) -> Iterator[tuple[int, ...]]:
    """Runs of consecutive parameters of ``of`` with ``own``'s shapes in order."""
    shapes = [param.shape for _, param in own]
    for start in range(len(of) - len(shapes) + 1):
        if all(of[start + k][1].shape == shape for k, shape in enumerate(shapes)):
            yield tuple(range(start, start + len(shapes)))
