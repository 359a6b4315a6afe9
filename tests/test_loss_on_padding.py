"""loss_on_padding: a token loss that counts label positions at padding.

The planted bug: ``labels = input_ids.clone()`` on a padded batch (no -100 where
``attention_mask`` is 0), through a tiny GPT-2 in a plain loop, through
``transformers.Trainer`` with trainwatch's callback, and through a hand-written
model taking ``labels=``/``attention_mask=``; in plain PyTorch, targets holding
the embedding's ``padding_idx`` with ``ignore_index`` left at -100. Each beside
its healthy twin, which stays silent.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import trainwatch as tw
from tests.hf_models import VOCAB, bert, gpt2, t5
from trainwatch.config import load_config
from trainwatch.errors import ConfigError
from trainwatch.rules import RULE_IDS

PAD = 0  # GPT-2's pad is its EOS (tests.hf_models sets eos to 0)
BATCH, SEQ = 4, 12
STEPS = 12


def padded_batch(
    step: int, *, masked: bool, side: str = "right", lengths=(12, 9, 6, 4), eos_inside=False
) -> dict[str, torch.Tensor]:
    """Token ids padded with PAD, the mask, and labels copied from the ids (padding
    set to -100 when ``masked``)."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    if eos_inside:
        ids[:, 2] = PAD  # an EOS inside the text (mask 1): a real label
    keep = torch.tensor(lengths)[:, None]
    positions = torch.arange(SEQ)[None]
    mask = (positions < keep) if side == "right" else (positions >= SEQ - keep)
    mask = mask.long()
    ids = ids.masked_fill(mask == 0, PAD)
    labels = ids.clone()
    if masked:
        labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def fit(model: nn.Module, batches, steps: int = STEPS, **overrides) -> tw.Monitor:
    """A plain loop: ``model(**batch)`` computes its own loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO(), **overrides) as monitor:
        for step in range(steps):
            opt.zero_grad()
            model(**batches(step)).loss.backward()
            opt.step()
    return monitor


def padding_alerts(monitor) -> list:
    return [a for a in monitor.alerts if a.rule == "loss_on_padding"]


def silent(monitor) -> bool:
    return not {"loss_on_padding", "internal_error"} & {a.rule for a in monitor.alerts}


# -- a tiny GPT-2 in a plain loop -------------------------------------------------------


def test_gpt2_trained_on_padding_labelled_with_eos_is_told_once_with_the_figures():
    torch.manual_seed(0)
    monitor = fit(gpt2(), lambda step: padded_batch(step, masked=False), steps=30)
    (alert,) = padding_alerts(monitor)
    assert alert.severity == "warning" and alert.module == ""
    assert alert.step == 0  # the first step, where it was seen
    # lengths 12, 9, 6, 4 of 12: GPT-2's loss shifts the labels for next-token
    # prediction, so it counts 4 x 11 = 44 positions, 17 of them padding.
    assert alert.data["kind"] == "attention_mask"
    assert alert.data["padded_labels"] == 17 and alert.data["labelled"] == 44
    assert alert.data["padding_fraction"] == pytest.approx(17 / 44, abs=1e-3)
    assert alert.data["pad_value"] == PAD and alert.data["pad_positions"] == 17
    assert "17 of the 44" in alert.message and "39%" in alert.message
    assert "labels[attention_mask == 0] = -100" in alert.hint
    assert "DataCollatorForLanguageModeling" in alert.hint
    assert "internal_error" not in {a.rule for a in monitor.alerts}


@pytest.mark.parametrize("side", ["right", "left"])
def test_gpt2_with_padding_labels_set_to_minus_100_is_silent(side):
    torch.manual_seed(0)
    monitor = fit(gpt2(), lambda step: padded_batch(step, masked=True, side=side))
    assert silent(monitor)
    # The verdict is in, and the look goes on: a collate may break later.
    padding = monitor._pipeline.class_targets.padding
    assert padding.judged and padding.open


def test_left_padded_batches_labelled_at_padding_are_told():
    torch.manual_seed(0)
    monitor = fit(gpt2(), lambda step: padded_batch(step, masked=False, side="left"))
    (alert,) = padding_alerts(monitor)
    # The first column, padding in 3 rows, is no label of GPT-2's shifted loss.
    assert alert.data["padded_labels"] == 14


def test_an_eos_inside_the_text_is_a_label_not_padding():
    """pad == eos: the EOS tokens the mask keeps are real labels; the padding is -100."""
    torch.manual_seed(0)
    monitor = fit(gpt2(), lambda step: padded_batch(step, masked=True, eos_inside=True))
    assert silent(monitor)


def test_batches_without_padding_are_silent_and_looked_at_less_and_less():
    torch.manual_seed(0)
    full = (SEQ,) * BATCH
    monitor = fit(gpt2(), lambda step: padded_batch(step, masked=False, lengths=full), steps=140)
    assert silent(monitor)
    look = monitor._pipeline.class_targets
    assert not look.finished and look.every > 5  # still open, no more every 5 steps


def test_a_padded_batch_after_unpadded_ones_is_still_told():
    torch.manual_seed(0)
    full = (SEQ,) * BATCH

    def batches(step):
        return padded_batch(step, masked=False, lengths=full if step < 30 else (12, 9, 6, 4))

    monitor = fit(gpt2(), batches, steps=60)
    (alert,) = padding_alerts(monitor)
    assert alert.step >= 30


# -- Hugging Face models whose labels are no per-token copy of the input -----------------


def test_seq2seq_labels_of_another_length_are_silent():
    torch.manual_seed(0)

    def batches(step):
        batch = padded_batch(step, masked=False)
        batch["labels"] = batch["labels"][
            :, : SEQ // 2
        ].contiguous()  # the decoder's, not the encoder's
        return batch

    assert silent(fit(t5(), batches))


def test_seq2seq_labels_as_long_as_the_source_are_not_read_against_its_mask():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    def batches(step):
        batch = padded_batch(step, masked=True)
        batch["labels"] = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
        return batch

    assert silent(fit(t5(), batches))


def test_sequence_classification_labels_are_silent():
    torch.manual_seed(0)

    def batches(step):
        batch = padded_batch(step, masked=False)
        batch["labels"] = torch.arange(BATCH) % 3
        return batch

    monitor = fit(bert(), batches)
    assert silent(monitor)


# -- a hand-written model: the call, not the library --------------------------------------


class Out:
    def __init__(self, logits: torch.Tensor, loss: torch.Tensor | None) -> None:
        self.logits, self.loss = logits, loss


class TinyLM(nn.Module):
    """No Hugging Face: ``model(input_ids=, attention_mask=, labels=)`` returns its loss,
    ignoring -100 as Hugging Face models do."""

    def __init__(self, vocab: int = VOCAB, classes: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.head = nn.Linear(32, classes or vocab)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden = self.embed(input_ids)
        if attention_mask is not None:
            hidden = hidden * attention_mask[..., None]
        logits = self.head(torch.tanh(hidden))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
            )
        return Out(logits, loss)


def test_a_hand_written_model_called_with_labels_at_padding_is_told():
    torch.manual_seed(0)
    monitor = fit(TinyLM(), lambda step: padded_batch(step, masked=False))
    (alert,) = padding_alerts(monitor)
    assert alert.data["kind"] == "attention_mask" and alert.data["padded_labels"] == 17


def test_a_hand_written_model_called_with_masked_labels_is_silent():
    torch.manual_seed(0)
    assert silent(fit(TinyLM(), lambda step: padded_batch(step, masked=True)))


def test_token_classification_with_minus_100_at_padding_is_silent():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    def batches(step):
        batch = padded_batch(step, masked=True)
        tags = torch.randint(0, 5, (BATCH, SEQ), generator=gen)
        batch["labels"] = tags.masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    assert silent(fit(TinyLM(classes=5), batches))


def test_token_classification_with_tags_at_padding_is_told():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)

    def batches(step):
        batch = padded_batch(step, masked=True)
        tags = torch.randint(1, 5, (BATCH, SEQ), generator=gen)
        batch["labels"] = tags.masked_fill(batch["attention_mask"] == 0, 0)  # "O" at padding
        return batch

    (alert,) = padding_alerts(fit(TinyLM(classes=5), batches))
    assert alert.data["pad_value"] == 0 and alert.data["padded_labels"] == 17


def test_figures_read_back_with_the_step_for_a_large_batch():
    """Over 4096 positions the figures are ops whose values join the step's readback."""
    torch.manual_seed(0)

    def batches(step):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(2, VOCAB, (16, 300), generator=gen)
        mask = torch.ones_like(ids)
        mask[::2, 200:] = 0  # 8 rows with 100 padding positions each
        ids = ids.masked_fill(mask == 0, 7)
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    (alert,) = padding_alerts(fit(TinyLM(), batches))
    assert alert.step == 0
    assert alert.data["padded_labels"] == 800 and alert.data["labelled"] == 4800
    assert alert.data["pad_value"] == 7 and alert.data["other_pad_value"] is None


# -- plain PyTorch: nn.Embedding(padding_idx=P) and a cross_entropy that counts P ---------


class PlainLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, pad: int = PAD) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32, padding_idx=pad)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, vocab)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def fit_plain(loss_of, steps: int = STEPS, shape: str = "flat") -> tw.Monitor:
    torch.manual_seed(0)
    model = PlainLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(steps):
            batch = padded_batch(step, masked=False)
            ids = batch["input_ids"]
            inputs, targets = ids[:, :-1], ids[:, 1:]
            opt.zero_grad()
            logits = model(inputs)
            if shape == "flat":
                loss = loss_of(logits.reshape(-1, VOCAB), targets.reshape(-1))
            else:  # (N, C, T) against (N, T)
                loss = loss_of(logits.transpose(1, 2), targets)
            loss.backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("shape", ["flat", "channels"])
def test_plain_cross_entropy_counting_the_padding_idx_is_told(shape):
    monitor = fit_plain(nn.functional.cross_entropy, shape=shape)
    (alert,) = padding_alerts(monitor)
    assert alert.data["kind"] == "padding_idx" and alert.data["pad_value"] == PAD
    assert alert.data["ignore_index"] == -100 and alert.module == ""
    # Next-token targets: lengths 12, 9, 6, 4 leave 0, 3, 6, 8 pads among 11 targets a row.
    assert alert.data["padded_labels"] == 17 and alert.data["labelled"] == 44
    assert "ignore_index=0" in alert.hint


def test_plain_nll_loss_through_a_module_is_told():
    monitor = fit_plain(lambda logits, t: nn.NLLLoss()(logits.log_softmax(-1), t))
    assert len(padding_alerts(monitor)) == 1


@pytest.mark.parametrize(
    "loss_of",
    [
        lambda logits, t: nn.functional.cross_entropy(logits, t, ignore_index=PAD),
        nn.CrossEntropyLoss(ignore_index=PAD),
        # Positions weighted by hand after a per-position loss: not told.
        lambda logits, t: (
            nn.functional.cross_entropy(logits, t, reduction="none") * (t != PAD)
        ).mean(),
    ],
    ids=["functional", "module", "masked_by_hand"],
)
def test_plain_lm_ignoring_its_padding_is_silent(loss_of):
    monitor = fit_plain(loss_of)
    assert silent(monitor)
    # Still looked at (a later phase's loss may count the padding), never told.
    assert monitor._pipeline.class_targets.padding.open


def test_a_vocabulary_without_a_padding_idx_is_not_looked_at():
    torch.manual_seed(0)
    model = PlainLM()
    model.embed.padding_idx = None
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(STEPS):
            ids = padded_batch(step, masked=False)["input_ids"]
            opt.zero_grad()
            logits = model(ids[:, :-1])
            nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
            ).backward()
            opt.step()
    assert silent(monitor)
    assert monitor._pipeline.class_targets.targets_done


# -- transformers.Trainer with trainwatch's callback ----------------------------------------


class PaddedRows(Dataset):
    def __init__(self, masked: bool, n: int = 48) -> None:
        self.rows = []
        for step in range(n // BATCH):
            batch = padded_batch(step, masked=masked)
            self.rows += [{k: v[i] for k, v in batch.items()} for i in range(BATCH)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


@pytest.mark.parametrize("masked", [False, True])
def test_trainer_with_the_callback(tmp_path, masked):
    transformers = pytest.importorskip("transformers")
    from trainwatch.hf import TrainWatchCallback

    torch.manual_seed(0)
    watch = TrainWatchCallback(console=io.StringIO())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(
        model=gpt2(), args=args, train_dataset=PaddedRows(masked), callbacks=[watch]
    )
    trainer.train()
    found = [a for a in watch.alerts if a.rule == "loss_on_padding"]
    assert "internal_error" not in {a.rule for a in watch.alerts}
    if masked:
        assert found == []
    else:
        (alert,) = found
        assert alert.step == 0 and alert.data["kind"] == "attention_mask"
        assert 0 < alert.data["padding_fraction"] < 1
        # GPT-2's loss (divided by the batch's token count) gets 4 rows of 11 shifted labels.
        assert alert.data["labelled"] == BATCH * (SEQ - 1)


# -- switched off, and the config ---------------------------------------------------------


def test_switched_off_it_attaches_nothing():
    torch.manual_seed(0)
    monitor = fit(gpt2(), lambda step: padded_batch(step, masked=False), loss_on_padding=False)
    assert silent(monitor)
    assert monitor._pipeline.class_targets.padding is None
    off = {"loss_on_padding": False, "unshuffled_data": False}
    kinds_only = fit(gpt2(), lambda step: padded_batch(step, masked=False), **off)
    look = kinds_only._pipeline.class_targets  # there to read the loss's kind only
    assert look.padding is None and look.targets_done
    # A model that computes its own loss leaves it no kind to read: it stops.
    assert look.finished and not look.listening
    none = fit(
        gpt2(),
        lambda step: padded_batch(step, masked=False),
        broadcast={"loss_kind_every": 0},
        **off,
    )
    assert none._pipeline.class_targets is None


def test_on_alone_it_keeps_its_own_cadence():
    torch.manual_seed(0)
    full = (SEQ,) * BATCH

    def batches(step):  # no padding before step 4: looked at on 0, 3, then 6
        return padded_batch(step, masked=False, lengths=full if step < 4 else (12, 9, 6, 4))

    monitor = fit(gpt2(), batches, unshuffled_data=False, loss_on_padding={"every": 3})
    (alert,) = padding_alerts(monitor)
    assert alert.step == 6


def test_rule_id_and_config():
    assert "loss_on_padding" in RULE_IDS
    assert load_config().loss_on_padding.every == 5
    with pytest.raises(ConfigError, match=r"loss_on_padding\.every"):
        load_config({"loss_on_padding": {"every": 0}})


# -- Lightning: the module called with the labels is named -----------------------------------


def test_a_lightning_module_around_gpt2_names_the_part_called_with_the_labels(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(PaddedRows(masked=False), batch_size=BATCH)

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    quiet_trainer(tmp_path, [callback], max_steps=8, limit_val_batches=0).fit(Module())
    (alert,) = [a for a in callback.alerts if a.rule == "loss_on_padding"]
    assert alert.module == "model" and alert.step == 0
