"""Loss on padding: a token loss counts label positions that are padding.

``labels = input_ids.clone()`` on a padded batch (a tokenizer's
``padding=True``, ``DataCollatorWithPadding``) keeps the pad token as a label
where ``attention_mask`` is 0: the model is trained to predict padding (with
GPT-2's pad = EOS, it learns to emit EOS without end) and the loss is diluted
by positions that carry nothing. In plain PyTorch the same comes from a
``cross_entropy`` whose ``ignore_index`` is not the embedding's
``padding_idx`` (where that index is also the model's EOS, only the ids after
a row's closing EOS: that EOS is the label that teaches the model to stop).
Seen on the class target look's sampled steps; one finding per run, dated at
the step it was seen.
"""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.collect.padded_labels import MASK
from trainwatch.record import PaddedLabels, StepRecord
from trainwatch.rules.base import Rule

_MASK_HINT = (
    "set the labels of padding to -100, which the loss ignores: "
    "labels[attention_mask == 0] = -100 after labels = input_ids.clone() "
    "(or let DataCollatorForLanguageModeling(tokenizer, mlm=False) build the labels; "
    "DataCollatorForTokenClassification pads token labels with -100)"
)


def _end_of_text_hint(pad: int) -> str:
    return (
        f"set the targets after each row's closing EOS to -100, which the loss ignores "
        f"(labels[attention_mask == 0] = -100, the EOS that ends the text kept as a label); "
        f"not ignore_index={pad}: {pad} is also the EOS, and ignoring it the model "
        f"never learns to stop"
    )


def _padding_idx_hint(pad: int) -> str:
    return (
        f"ignore the padding in the loss: F.cross_entropy(..., ignore_index={pad}) "
        f"(nn.CrossEntropyLoss(ignore_index={pad})), or set the targets at padding to -100"
    )


class LossOnPaddingRule(Rule):
    """Padding positions whose labels the loss counts, once a run."""

    id = "loss_on_padding"
    needs = frozenset({"padded_labels"})
    reads = "padded_labels"  # set only on the sampled step where they are found

    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.done = False  # one finding per run

    def evaluate(self, record: StepRecord) -> list[Alert]:
        found = record.padded_labels
        if self.done or found is None or not found.padded:
            return []
        self.done = True
        return [self._alert(record.step, found)]

    def _alert(self, step: int, found: PaddedLabels) -> Alert:
        share = found.padded / found.labelled if found.labelled else 1.0
        value = str(found.pad_value)
        if found.other_pad_value is not None:
            value = f"{found.other_pad_value} to {found.pad_value}"
        if found.kind == MASK:
            where = (
                f"{found.padded} of the {found.labelled} label positions the loss counts "
                f"({share:.0%}) are padding (attention_mask 0), labelled {value} "
                f"instead of -100"
            )
            effect = "the model is trained to predict padding and the loss is diluted"
            hint = _MASK_HINT
        elif found.pad_ends_text:
            where = (
                f"{found.padded} of the {found.labelled} targets the loss counts ({share:.0%}) "
                f"are padding after a row's closing EOS: the embedding's padding_idx "
                f"{found.pad_value}, which is also the model's eos_token_id, and the loss's "
                f"ignore_index is {found.ignore_index}"
            )
            effect = (
                "the model is trained to emit EOS without end after the text, "
                "and the loss is diluted"
            )
            hint = _end_of_text_hint(found.pad_value)
        else:
            where = (
                f"{found.padded} of the {found.labelled} targets the loss counts ({share:.0%}) "
                f"are the embedding's padding_idx {found.pad_value}, and the loss's "
                f"ignore_index is {found.ignore_index}"
            )
            effect = "the model is trained to predict padding and the loss is diluted"
            hint = _padding_idx_hint(found.pad_value)
        return self.alert(
            step,
            found.module,
            f"{where}: {effect}",
            hint,
            {
                "kind": found.kind,
                "padded_labels": found.padded,
                "labelled": found.labelled,
                "padding_fraction": round(share, 4),
                "pad_positions": found.pad_positions,
                "pad_value": found.pad_value,
                "other_pad_value": found.other_pad_value,
                "ignore_index": found.ignore_index,
                "pad_is_eos": found.pad_ends_text,
            },
        )
