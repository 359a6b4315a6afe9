"""No-grad passes that iterate one computation: a solver's steps, one pass for the judge.

A deep-equilibrium model solves its fixed point ``z = cell(z, u)`` under
``no_grad`` at every training step, twenty or fifty calls of its cell (or of
the whole model, where the model is the cell) in training mode, and then
applies the cell once with gradients; the solver may sit in the training
loop, not in ``forward``. A greedy decoding loop feeds each step's output to
the next step the same way. Counted one by one, such calls look like a
validation loop's batches, too many in a row for a step, and a DEQ trained
this way was told as an evaluation in training mode at its first step.

A call that feeds on the pass before it is a step of the same computation:

- it takes that pass's output (``z = cell(z, u)``, ``h = decoder(h)``), or
- its first tensor has the shape of that pass's output (a new estimate,
  mixed from earlier ones by an Anderson or Broyden step) and another of its
  tensors is one that pass took, the same object (the solver's injection
  ``u``).

A validation loop hands every call a batch of its own, so none of its passes
feeds on another: it is still counted pass by pass, told at once when long.
The whole solve counts as one pass, held and judged like any short run:
recurring at every step, it is training; run once now and then (a forgotten
``model.eval()`` around a solve or a decoding), it is an evaluation.

The tensors are held weakly: a pass's output freed by the next step keeps
no memory alive here, and a new tensor at its address is no match.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainwatch.collect.tensors import tensor_leaves


def _tensors(value: Any) -> list[torch.Tensor]:
    return [tensor for _, tensor in tensor_leaves(value)]


class PassChain:
    """The tensors of the model's last no-grad pass, to tell whether the next feeds on them."""

    def __init__(self) -> None:
        self._outputs: dict[int, weakref.ref[torch.Tensor]] = {}
        self._inputs: dict[int, weakref.ref[torch.Tensor]] = {}
        self._output_shape: tuple[int, ...] | None = None

    def feeds_on_last(self, args: Any, kwargs: Any, output: Any) -> bool:
        """Whether this no-grad pass (its arguments and output) iterates the one
        before it; it becomes the pass the next one is compared with."""
        inputs = _tensors(args) + _tensors(kwargs)
        outputs = _tensors(output)
        fed = any(_held(self._outputs, t) for t in inputs) or (
            bool(inputs)
            and tuple(inputs[0].shape) == self._output_shape
            and any(_held(self._inputs, t) for t in inputs[1:])
        )
        self._inputs = {id(t): weakref.ref(t) for t in inputs}
        self._outputs = {id(t): weakref.ref(t) for t in outputs}
        self._output_shape = tuple(outputs[0].shape) if outputs else None
        return fed


def _held(refs: dict[int, weakref.ref[torch.Tensor]], tensor: torch.Tensor) -> bool:
    ref = refs.get(id(tensor))
    return ref is not None and ref() is tensor
