"""loss_on_padding counts the label positions the model's own loss received.

A causal language model called with ``labels=`` shifts them for next-token
prediction before its loss: ``labels[:, 1:]`` against ``logits[:, :-1]`` (a
hand-written model), or the shifted labels with -100 appended to each row
(transformers' causal LM loss). The finding's figures are those of the
positions the loss saw: 16 rows of 12 labels give it 16 x 11 = 176, not 192,
and a left-padded batch's first column (padding the loss never sees as a
label) is not counted. A token tagger's loss takes the labels as they are:
its figures stay those of all 192. The planted bug is ``labels =
input_ids.clone()`` on a padded batch; each shape beside its healthy twin
(padding labelled -100), which stays silent. Figures read on the host (a
small CPU batch) and with the step's readback (over 4096 positions) alike.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw

VOCAB = 50
ROWS, WIDTH = 16, 12
# 0 to 8 padding positions a row: 57 in all.
LENGTHS = tuple(WIDTH - i % 9 for i in range(ROWS))
# Over 4096 positions: the figures are ops read back with the step.
BIG_ROWS, BIG_WIDTH = 80, 60


def padded_batch(
    step: int,
    *,
    masked: bool,
    side: str = "right",
    rows: int = ROWS,
    width: int = WIDTH,
    tags: int | None = None,
) -> dict[str, torch.Tensor]:
    """Token ids padded with 0, their mask and labels: the ids (a language model) or
    tags (a tagger), 0 at padding, or -100 there when ``masked``."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (rows, width), generator=gen)
    lengths = torch.tensor([width - i % (width * 3 // 4) for i in range(rows)])
    if (rows, width) == (ROWS, WIDTH):
        lengths = torch.tensor(LENGTHS)
    positions = torch.arange(width)[None]
    keep = lengths[:, None]
    mask = ((positions < keep) if side == "right" else (positions >= width - keep)).long()
    ids = ids * mask
    labels = (
        ids.clone() if tags is None else torch.randint(1, tags, ids.shape, generator=gen) * mask
    )
    if masked:
        labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def seen(batch: dict[str, torch.Tensor], shifted: bool) -> tuple[int, int]:
    """(label positions at padding, label positions) among those a loss over the
    labels as handed in, or shifted for next-token prediction, counts."""
    labels, mask = batch["labels"], batch["attention_mask"]
    if shifted:
        labels, mask = labels[:, 1:], mask[:, 1:]
    counted = labels != -100
    return int((counted & (mask == 0)).sum()), int(counted.sum())


class GruLM(nn.Module):
    """A hand-written model computing its own loss, returned in a dict: next-token
    (``labels[:, 1:]``), or per token as handed in (``labels.view(-1)``, a tagger)."""

    def __init__(self, *, next_token: bool, classes: int = VOCAB) -> None:
        super().__init__()
        self.next_token = next_token
        self.emb = nn.Embedding(VOCAB, 32, padding_idx=0)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.lm_head = nn.Linear(32, classes)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.lm_head(self.rnn(self.emb(input_ids))[0])
        classes = logits.shape[-1]
        if labels is None:  # the loss is the caller's
            return {"logits": logits}
        if self.next_token:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, classes), labels[:, 1:].reshape(-1))
        else:
            loss = F.cross_entropy(logits.view(-1, classes), labels.view(-1))
        return {"loss": loss, "logits": logits}


def tiny_gpt2() -> nn.Module:
    """transformers' GPT-2, built from its config (nothing downloaded): its causal LM
    loss shifts the labels and appends -100 to each row."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64
    )
    return transformers.GPT2LMHeadModel(config)


def fit(model: nn.Module, batches, steps: int = 6) -> tw.Monitor:
    """A plain loop: ``model(**batch)`` computes its own loss."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(steps):
            out = model(**batches(step))
            loss = out["loss"] if isinstance(out, dict) else out.loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    return monitor


def padding_alerts(monitor: tw.Monitor) -> list:
    assert "internal_error" not in {a.rule for a in monitor.alerts}
    return [a for a in monitor.alerts if a.rule == "loss_on_padding"]


# -- the labels a language model's own loss shifts ----------------------------------------


def test_a_gru_lm_shifting_its_labels_is_told_the_176_positions_its_loss_counts():
    monitor = fit(GruLM(next_token=True), lambda step: padded_batch(step, masked=False))
    (alert,) = padding_alerts(monitor)
    assert alert.step == 0
    assert alert.data["padded_labels"] == 57 and alert.data["labelled"] == 176
    assert alert.data["pad_positions"] == 57
    assert alert.data["padding_fraction"] == pytest.approx(57 / 176, abs=1e-4)
    assert "57 of the 176 label positions the loss counts (32%)" in alert.message


def test_a_gru_lm_shifting_labels_set_to_minus_100_at_padding_is_silent():
    monitor = fit(GruLM(next_token=True), lambda step: padded_batch(step, masked=True))
    assert padding_alerts(monitor) == []
    assert monitor._pipeline.class_targets.padding.judged  # its verdict is in


def test_left_padding_the_shifted_loss_never_sees_as_a_label_is_not_counted():
    """The first column is padding in 14 rows: no label of the shifted loss."""
    monitor = fit(
        GruLM(next_token=True), lambda step: padded_batch(step, masked=False, side="left")
    )
    (alert,) = padding_alerts(monitor)
    assert alert.data["padded_labels"] == 57 - 14 and alert.data["labelled"] == 176


@pytest.mark.parametrize("side", ["right", "left"])
def test_gpt2_shifting_the_labels_it_is_handed_is_told_what_its_loss_counts(side):
    model = tiny_gpt2()
    monitor = fit(model, lambda step: padded_batch(step, masked=False, side=side))
    (alert,) = padding_alerts(monitor)
    padded, labelled = seen(padded_batch(0, masked=False, side=side), shifted=True)
    assert labelled == 176 and padded == (57 if side == "right" else 43)
    assert alert.step == 0 and alert.data["kind"] == "attention_mask"
    assert (alert.data["padded_labels"], alert.data["labelled"]) == (padded, labelled)
    assert f"{padded} of the 176 label positions" in alert.message


def test_gpt2_with_padding_labelled_minus_100_is_silent():
    monitor = fit(tiny_gpt2(), lambda step: padded_batch(step, masked=True, side="left"))
    assert padding_alerts(monitor) == []
    assert monitor._pipeline.class_targets.padding.judged


@pytest.mark.parametrize("model_of", [lambda: GruLM(next_token=True), tiny_gpt2])
def test_shifted_figures_read_back_with_the_step_for_a_large_batch(model_of):
    def batches(step):
        return padded_batch(step, masked=False, rows=BIG_ROWS, width=BIG_WIDTH)

    (alert,) = padding_alerts(fit(model_of(), batches))
    padded, labelled = seen(batches(0), shifted=True)
    assert labelled == BIG_ROWS * (BIG_WIDTH - 1)
    assert alert.step == 0
    assert (alert.data["padded_labels"], alert.data["labelled"]) == (padded, labelled)


def test_a_large_gpt2_batch_labelled_minus_100_at_padding_is_silent():
    def batches(step):
        return padded_batch(step, masked=True, rows=BIG_ROWS, width=BIG_WIDTH)

    assert padding_alerts(fit(tiny_gpt2(), batches)) == []


# -- a loss over the labels as handed in: every position counts ----------------------------


@pytest.mark.parametrize("rows,width", [(ROWS, WIDTH), (BIG_ROWS, BIG_WIDTH)])
def test_a_token_tagger_flattening_its_labels_keeps_all_192_positions(rows, width):
    def batches(step):
        return padded_batch(step, masked=False, side="left", rows=rows, width=width, tags=5)

    (alert,) = padding_alerts(fit(GruLM(next_token=False, classes=5), batches))
    padded, labelled = seen(batches(0), shifted=False)
    assert labelled == rows * width
    assert (alert.data["padded_labels"], alert.data["labelled"]) == (padded, labelled)


def test_a_token_tagger_with_tags_minus_100_at_padding_is_silent():
    def batches(step):
        return padded_batch(step, masked=True, side="left", tags=5)

    assert padding_alerts(fit(GruLM(next_token=False, classes=5), batches)) == []


@pytest.mark.parametrize("next_token", [False, True])
def test_a_hand_written_loss_after_the_pass_counts_the_targets_it_is_given(next_token):
    """``cross_entropy`` after the pass over the embedding's padding_idx: its own
    targets, ``labels.view(-1)`` (192) or ``labels[:, 1:]`` (176)."""
    torch.manual_seed(0)
    model = GruLM(next_token=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(6):
            batch = padded_batch(step, masked=False)
            ids, labels = batch["input_ids"], batch["labels"]
            logits = model(input_ids=ids)["logits"]
            if next_token:
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
            else:
                loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    (alert,) = padding_alerts(monitor)
    assert alert.data["kind"] == "padding_idx"
    assert (alert.data["padded_labels"], alert.data["labelled"]) == (
        (57, 176) if next_token else (57, 192)
    )
