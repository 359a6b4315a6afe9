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

A pass with gradients that takes the last no-grad pass's tensors was fed by
it (:meth:`PassChain.taken_by`): diffusion self-conditioning's first estimate,
made under ``no_grad`` on a random half of the steps, goes into the training
pass on the same noisy input; a solve's fixed point goes into the cell's one
pass with gradients beside the same injection. Such a pass is part of the
training step whether or not it recurs; a validation pass hands nothing on.

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

    def taken_by(self, args: Any, kwargs: Any) -> bool:
        """Whether a pass with gradients takes a tensor of the last no-grad pass: one
        it took (the same object), or its output, the same object or a view of it
        (``.detach()``: the same memory, while the output lives)."""
        for tensor in _tensors(args) + _tensors(kwargs):
            if _held(self._inputs, tensor) or _held(self._outputs, tensor):
                return True
            for ref in self._outputs.values():
                output = ref()
                if output is not None and _same_memory(output, tensor):
                    return True
        return False


def _held(refs: dict[int, weakref.ref[torch.Tensor]], tensor: torch.Tensor) -> bool:
    ref = refs.get(id(tensor))
    return ref is not None and ref() is tensor


def _same_memory(output: torch.Tensor, tensor: torch.Tensor) -> bool:
    """``tensor`` is ``output`` seen again (a ``.detach()``): the same memory and shape.
    Tensors with no plain memory (sparse, meta, fake) are never the same."""
    if output.shape != tensor.shape:
        return False
    try:
        start = output.data_ptr()
        return start != 0 and start == tensor.data_ptr()
    except RuntimeError:
        return False
