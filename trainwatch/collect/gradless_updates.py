"""Whether a model trained without ``.grad`` moved its weights between two step boundaries.

A loop without an optimizer may compute its gradients outside ``.grad``:
per-sample gradients with ``torch.func`` (``vmap(grad(loss))`` over
``functional_call``: DP-SGD written out) or ``torch.autograd.grad(loss,
params)``, applied by hand (``p.sub_(lr * g)`` under ``no_grad``). Each
``monitor.step()`` then finds no parameter holding a gradient, as a graph cut
off before the model would leave it; the difference is that the weights move.
Those that moved are trained; one left where it was while the others moved is
left out of the loop's own update, not cut off by a ``.detach()``.

Looked at only at boundaries where no parameter holds a gradient and backward
reached none, so the usual step pays nothing. A parameter written in place
(``p.sub_``) or given a new storage (``p.data = ...``) shows it in its version
counter or storage, read in Python; one written in place through ``.data``
(``p.data.sub_``) shows it in its values only, so the float64 sums
(:func:`~trainwatch.collect.frozen_moves.weight_sums`) are taken of those whose
version and storage did not move, for the next boundary to compare.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainwatch.collect.frozen_moves import weight_sums
from trainwatch.collect.tensors import local_part


class GradlessUpdates:
    def __init__(self) -> None:
        self._at: int | None = None  # the boundary the prints are from
        # By name: storage, version counter, and the float64 sum where it was taken.
        self._prints: dict[str, tuple[int, int, float | None]] = {}
        # Some weight was seen moving so: the model trains outside .grad, and a
        # boundary where none moved is one without an update (gradients gathered
        # over several boundaries before one update), not a model cut off.
        self.moving = False

    def look(self, step: int, pairs: Sequence[tuple[str, torch.Tensor]]) -> frozenset[str] | None:
        """The names of ``pairs`` whose weights moved since the previous boundary
        (``step - 1``); None where that one was not looked at (nothing to compare)."""
        before = self._prints if self._at == step - 1 else {}
        keys = [(local_part(p).data_ptr(), p._version) for _, p in pairs]
        moved = set()
        summed = []  # indices of those whose storage and version stayed
        for i, ((name, param), key) in enumerate(zip(pairs, keys)):
            seen = before.get(name)
            if seen is not None and seen[:2] != key:
                moved.add(name)
            elif param.layout == torch.strided and param.numel():
                summed.append(i)
        sums = dict(zip(summed, weight_sums([pairs[i][1] for i in summed])))
        prints = {}
        for i, ((name, _), key) in enumerate(zip(pairs, keys)):
            total = sums.get(i)
            prints[name] = (*key, total)
            seen = before.get(name)
            if seen is not None and total is not None and seen[2] is not None and seen[2] != total:
                moved.add(name)  # written in place through .data
        self._prints, self._at = prints, step
        if not before:
            return None
        self.moving = self.moving or bool(moved)
        return frozenset(moved)
