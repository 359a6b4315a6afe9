"""Label positions at padding that a token loss still counts, measured on sampled steps.

A language model's labels made as ``labels = input_ids.clone()`` on a padded
batch keep the pad token where ``attention_mask`` is 0: the model is trained
to predict padding (GPT-2's pad is its EOS: it learns to end every text
with endless EOS) and the loss is diluted by positions that carry nothing.
``DataCollatorForLanguageModeling`` sets those labels to -100, the index
every Hugging Face loss ignores. The same slip in plain PyTorch: an
``nn.Embedding(..., padding_idx=P)`` model whose ``cross_entropy`` over the
same vocabulary gets targets holding ``P`` with an ``ignore_index`` other
than ``P``.

Two places show it, both seen by the class target look on its sampled steps
only (other steps pay nothing):

- a model called with ``labels=`` and ``attention_mask=`` of the same shape
  (it computes its own loss, ignoring -100): the labels at mask 0 that are
  not -100, among the positions its loss received: a causal language
  model's loss (read in its autograd graph,
  :mod:`trainwatch.collect.model_loss_target`) sees the labels shifted for
  next-token prediction, ``labels[..., 1:]`` against ``attention_mask[..., 1:]``,
  one position a row fewer than it was handed;
- a ``cross_entropy``/``nll_loss`` over tokens after the pass, whose class
  count is the ``num_embeddings`` of the model's one embedding with a
  ``padding_idx``: its targets equal to that index, unless ``ignore_index``
  is it. Where that index is also the model's end of text (its config's
  ``eos_token_id``: a tokenizer without a pad token padded with EOS), a target
  holding it is mostly the EOS that ends a text, the label that teaches the
  model to stop (one per row, or one per document of a packed row): only the
  ids past the first of a run at either end of a row are padding (a right-padded
  tail after its closing EOS, a left-padded head), each row being the target's
  last axis or, for targets flattened to one axis, the model's batch rows.

A batch of up to 4096 CPU positions is counted on the host, with no op;
others in a handful of ops whose figures join the step's one readback.
The look closes for good at a finding (one a run) or where the model has
nothing of the kind to look at (a classifier's labels, a seq2seq model's
target sequence without its decoder mask, a vocabulary without a padding
embedding). A verdict that the padding is ignored (labels -100 at mask 0,
``ignore_index`` set to the padding index) does not close it: a collate that
breaks mid-run (a curriculum's second loader padding its batches, a
fine-tuning phase's ``DataCollatorWithPadding``, a pad token set to EOS) gives
batches of another make, so the look goes on at its sampled steps, less and
less often, as it does while batches hold no padding at all (packed
sequences), and at the first step after the batches may have changed (see
:meth:`trainwatch.collect.class_targets.ClassTargetLook.look_soon`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainwatch.collect.model_loss_target import loss_target
from trainwatch.compiled import unwrap
from trainwatch.record import PaddedLabels

# The label every Hugging Face loss (and torch's cross_entropy by default) ignores.
IGNORED = -100
# Positions of a CPU batch up to this many are counted on the host, with no op.
_COUNTED_ON_HOST = 4096
# The look's figures, in order (also the device vector's).
_FIGURES = ("pad_positions", "labelled", "padded", "pad_value_max", "pad_value_min")
# Kinds of evidence.
MASK = "attention_mask"
PADDING_IDX = "padding_idx"
# How a model's own loss shifted the labels it was handed (next-token targets):
# ``labels[..., 1:]``, one position a row fewer, or the same with ``ignore_index``
# appended to each row (transformers' causal LM loss: to be checked against the labels).
_DROPPED = "dropped"
_APPENDED = "appended"


def _integer(tensor: Any) -> bool:
    return (
        isinstance(tensor, torch.Tensor)
        and not tensor.is_floating_point()
        and not tensor.is_complex()
        and tensor.dtype != torch.bool
    )


def _seq2seq(module: Any, output: Any) -> bool:
    """An encoder-decoder: its labels are the decoder's, not aligned with the encoder's mask."""
    config = getattr(module, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return True
    return getattr(output, "encoder_last_hidden_state", None) is not None


def _next_token_target(labels: torch.Tensor, output: Any) -> tuple[str, Any, int] | None:
    """How the loss the model returned lined ``labels`` up: shifted for next-token
    prediction (``_DROPPED``, or ``_APPENDED`` with the target it received and its
    ``ignore_index``, to check against the labels), or None: as handed in, or unseen."""
    width = labels.shape[-1]
    if width < 2:
        return None
    found = loss_target(output, (labels.numel() // width * (width - 1), labels.numel()))
    if found is None:
        return None
    target, ignored = found
    if target.numel() != labels.numel():
        return _DROPPED, None, ignored
    if target.data_ptr() == labels.data_ptr():
        return None  # the labels themselves (``labels.view(-1)``): as handed in
    return _APPENDED, target.detach().reshape(-1, width).to(labels.device), ignored


def _appended(rows: list[list[int]], target: list[list[int]], ignored: int) -> bool:
    """Each row of ``target`` is its row of the labels shifted, ``ignored`` appended."""
    return all(
        got[:-1] == row[1:] and got[-1] == ignored for got, row in zip(target, rows, strict=True)
    )


def _past_the_end(row: list[int], pad: int) -> list[bool]:
    """Which of ``row``'s ids are padding where ``pad`` also ends a text: those past the
    first of the run of ``pad`` at either end of the row (an EOS then the padding after
    it; a row all ``pad``: all but its first)."""
    width = len(row)
    head = next((at for at, value in enumerate(row) if value != pad), width)
    tail = next((at for at, value in enumerate(reversed(row)) if value != pad), width)
    return [0 < at < head or at > width - tail for at in range(width)]


def _past_the_end_on_device(rows: torch.Tensor, pad: int) -> torch.Tensor:
    """:func:`_past_the_end` of each row of ``rows`` (its last axis), as device ops."""
    at_pad = (rows == pad).long()
    head = at_pad.cumprod(-1).bool()  # in the run at the row's start
    tail = at_pad.flip(-1).cumprod(-1).flip(-1).bool()  # in the run at its end
    padding = torch.zeros_like(head)
    padding[..., 1:] = head[..., 1:] | tail[..., :-1]
    return padding


def _host_figures(
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    pad: int | None,
    ignored: int,
    shift: tuple[str, Any, int] | None = None,
    pad_ends_text: bool = False,
) -> list[float]:
    """The figures of the labels at padding (``mask`` 0, or equal to ``pad``; past each
    row's end of text where ``pad_ends_text``), read on the host: no op. ``shift``: the
    model's loss received them shifted for next-token prediction; only the positions
    it saw are counted."""
    rows = labels.reshape(-1, labels.shape[-1]).tolist()
    first = 0
    if shift is not None:
        how, target, loss_ignores = shift
        first = int(how == _DROPPED or _appended(rows, target.tolist(), loss_ignores))
    values = [value for row in rows for value in row[first:]]
    if mask is not None:
        kept = mask.reshape(-1, mask.shape[-1]).tolist()
        pads = [not at for row in kept for at in row[first:]]
    elif pad_ends_text:
        pads = [at for row in rows for at in _past_the_end(row, pad)]  # type: ignore[arg-type]
    else:
        pads = [value == pad for value in values]
    labelled = len(values) - values.count(ignored)
    found = [v for v, at_pad in zip(values, pads, strict=True) if at_pad and v != ignored]
    top = Counter(found).most_common(1)
    value = float(top[0][0]) if top else 0.0
    return [float(sum(pads)), float(labelled), float(len(found)), value, value]


def _figures_on_device(
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    pad: int | None,
    ignored: int,
    pad_ends_text: bool = False,
) -> torch.Tensor:
    """The figures of ``labels`` against their ``mask`` (or ``pad``; past each row's end
    of text where ``pad_ends_text``), as device ops."""
    labels = labels.detach()
    if mask is not None:
        padding = mask == 0
    elif pad_ends_text:
        padding = _past_the_end_on_device(labels, pad)  # type: ignore[arg-type]
    else:
        padding = labels == pad
    labelled = labels != ignored
    padded = padding & labelled
    low = torch.iinfo(labels.dtype).min
    high = torch.iinfo(labels.dtype).max
    return torch.stack(
        [
            padding.sum(),
            labelled.sum(),
            padded.sum(),
            torch.where(padded, labels, low).amax(),
            torch.where(padded, labels, high).amin(),
        ]
    ).float()


def _device_figures(
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    pad: int | None,
    ignored: int,
    shift: tuple[str, Any, int] | None = None,
    pad_ends_text: bool = False,
) -> torch.Tensor:
    """The same figures on the device: a few small ops, read back with the step (the
    choice between the labels as handed in and shifted made there too: no sync)."""
    if shift is None or mask is None:
        return _figures_on_device(labels, mask, pad, ignored, pad_ends_text)
    later = labels[..., 1:]
    shifted = _figures_on_device(later, mask[..., 1:], pad, ignored)
    how, target, loss_ignores = shift
    if how == _DROPPED:
        return shifted
    later = later.reshape(target.shape[0], -1)
    same = (target[:, :-1] == later).all() & (target[:, -1] == loss_ignores).all()
    return torch.where(same, shifted, _figures_on_device(labels, mask, pad, ignored))


def name_in(root: nn.Module | None, module: Any) -> str:
    """``module``'s qualified name in ``root`` (``""``: the root itself, or not found)."""
    module = unwrap(module) if isinstance(module, nn.Module) else module
    if root is None or module is unwrap(root):
        return ""
    return next((name for name, part in unwrap(root).named_modules() if part is module), "")


def _ids(value: Any) -> set[int]:
    """A config's token id field as a set: one id, a list of them, or none."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def end_of_text_ids(root: nn.Module | None) -> frozenset[int]:
    """The ``eos_token_id`` of the configs (and generation configs) the model's modules
    carry: a Hugging Face model's, or a wrapped one's. None known: empty."""
    found: set[int] = set()
    if root is None:
        return frozenset()
    for module in root.modules():
        for holder in ("config", "generation_config"):
            config = module.__dict__.get(holder)
            if config is not None:
                found |= _ids(getattr(config, "eos_token_id", None))
    return frozenset(found)


def rows_of(target: torch.Tensor, batch: int | None) -> torch.Tensor:
    """``target`` as rows of one sequence each: its last axis, or, flattened to one axis,
    the model's ``batch`` rows (one row where the batch does not divide it)."""
    if target.dim() >= 2:
        return target.reshape(-1, target.shape[-1])
    if batch and target.numel() % batch == 0:
        return target.reshape(batch, -1)
    return target.reshape(1, -1)


def padding_indices(root: nn.Module | None) -> dict[int, int | None]:
    """``num_embeddings -> padding_idx`` of the model's embeddings that have one
    (None where two of the same size disagree)."""
    found: dict[int, int | None] = {}
    if root is None:
        return found
    for module in root.modules():
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            size, index = module.num_embeddings, int(module.padding_idx)
            found[size] = index if found.get(size, index) == index else None
    return found


class PaddingLook:
    """The padding job of the class target look: open until a finding, or nothing to
    look at; a healthy verdict leaves it open for the batches that come later."""

    def __init__(self, root_of: Callable[[], nn.Module | None]) -> None:
        # Measures on the look's sampled steps: until a finding, or nothing to look at.
        self.open = True
        # A padded batch was seen with every label there ignored (or the loss ignores
        # the padding index): healthy so far, looked at again all the same.
        self.judged = False
        # Labels reached it (a token loss's, while it stays open): a run of such batches.
        self.reached = False
        self._root_of = root_of
        self._pads: dict[int, int | None] | None = None  # the model's padding embeddings
        self._ends: frozenset[int] = frozenset()  # its end-of-text ids (config eos_token_id)
        # This sampled step's measurement: figures read on the host, or on the device.
        self._kind: str | None = None
        self._module = ""  # the module called with the labels (the root for a loss after it)
        self._ignored = IGNORED
        self._pad_ends_text = False  # the padding id measured is also the end of text
        self._host: list[float] | None = None
        self._device: torch.Tensor | None = None

    # -- what a sampled step shows ------------------------------------------
    def from_labels(self, module: Any, kwargs: dict[str, Any], labels: Any, output: Any) -> bool:
        """``model(..., labels=, attention_mask=)``: measured (True) or not."""
        self.reached = True
        seq2seq = _seq2seq(module, output)
        mask = kwargs.get("decoder_attention_mask" if seq2seq else "attention_mask")
        if not _integer(labels) or labels.dim() < 2 or (seq2seq and mask is None):
            # A classifier's labels, a seq2seq model's targets without their own mask:
            # nothing to look at, now or later.
            self.open = False
            return False
        if not isinstance(mask, torch.Tensor) or mask.shape != labels.shape:
            return False  # a stream without a mask of its own (packed rows): not yet
        self._measure(MASK, labels, mask, None, IGNORED, _next_token_target(labels, output))
        self._module = name_in(self._root_of(), module)
        return True

    def from_loss(
        self, logits: Any, target: Any, kwargs: dict[str, Any], batch: int | None = None
    ) -> bool:
        """A class loss over tokens after the pass: measured (True) or nothing to look at.
        ``batch``: the model's batch, the rows of targets flattened to one axis."""
        self.reached = True
        if self._pads is None:
            root = self._root_of()
            self._pads = padding_indices(root)
            self._ends = end_of_text_ids(root)
        pad = self._pads.get(logits.shape[1]) if logits.dim() >= 2 else None
        ignore_index = kwargs.get("ignore_index", IGNORED)
        if pad is None or not _integer(target) or not isinstance(ignore_index, int):
            self.open = False  # no padding embedding of this vocabulary: nothing to look at
            return False
        if kwargs.get("reduction", "mean") == "none" or kwargs.get("weight") is not None:
            # Per-position losses weighted after (a mask), or class weights that may
            # give the padding none: the loss may well leave the padding out (a later
            # phase's loss is looked at again).
            return False
        if ignore_index == pad:
            self.judged = True  # the padding is ignored: the fix is in, for this loss
            return False
        if pad in self._ends:
            # The padding id also ends a text: only what follows an end is padding.
            self._measure(PADDING_IDX, rows_of(target, batch), None, pad, ignore_index, None, True)
        else:
            self._measure(PADDING_IDX, target, None, pad, ignore_index)
        self._module = ""
        return True

    def _measure(
        self,
        kind: str,
        labels: torch.Tensor,
        mask: torch.Tensor | None,
        pad: int | None,
        ignored: int,
        shift: tuple[str, Any, int] | None = None,
        pad_ends_text: bool = False,
    ) -> None:
        self._kind, self._ignored, self._pad_ends_text = kind, ignored, pad_ends_text
        if labels.device.type == "cpu" and labels.numel() <= _COUNTED_ON_HOST:
            self._host = _host_figures(labels, mask, pad, ignored, shift, pad_ends_text)
        else:
            self._device = _device_figures(labels, mask, pad, ignored, shift, pad_ends_text)

    # -- at the step boundary -------------------------------------------------
    def take(self) -> tuple[PaddedLabels | None, torch.Tensor | None]:
        """The step's measurement: judged now (read on the host) or a tensor to read back."""
        host, device = self._host, self._device
        self._host = self._device = None
        if host is not None:
            return self.land(host), None
        return None, device

    def land(self, values: list[float]) -> PaddedLabels | None:
        """The figures read: the finding (padding labelled), or None. A finding closes
        the look; padding whose labels are all ignored is judged healthy, and a batch
        without padding says nothing either way: the look goes on."""
        figures = dict(zip(_FIGURES, (int(v) for v in values), strict=True))
        kind = self._kind or MASK
        if figures["padded"]:
            self.open = False
            return PaddedLabels(
                kind=kind,
                padded=figures["padded"],
                labelled=figures["labelled"],
                pad_positions=figures["pad_positions"],
                pad_value=figures["pad_value_max"],
                other_pad_value=(
                    figures["pad_value_min"]
                    if figures["pad_value_min"] != figures["pad_value_max"]
                    else None
                ),
                ignore_index=self._ignored,
                module=self._module,
                pad_ends_text=self._pad_ends_text,
            )
        if figures["pad_positions"] and kind == MASK:
            self.judged = True  # padding there, every label of it ignored
        return None
