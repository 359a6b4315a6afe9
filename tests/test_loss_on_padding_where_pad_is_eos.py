"""loss_on_padding where the padding id is also the model's EOS (pad = EOS).

A tokenizer without a pad token is padded with EOS (``tokenizer.pad_token =
tokenizer.eos_token``), so a Llama built with ``pad_token_id = eos_token_id``
has ``embed_tokens.padding_idx`` equal to EOS. A loss computed in the loop
over targets holding that id is then mostly right: the EOS closing each
response (or each document of a packed row) is the label that teaches the
model to stop. Only the ids after a row's closing EOS are padding.

Healthy (silent): an SFT batch with prompt and padding set to -100 and one
closing EOS a row, flattened or ``(N, C, T)``, in a plain loop and in a
Lightning ``training_step``; packed rows with EOS between documents and no
padding at all. Planted (told, with the count of the tail after each closing
EOS): the same batches with the padded tail labelled. Beside them, a
hand-written GRU whose ``padding_idx`` 0 is no EOS (every pad target still
counts) and GPT-2 with pad = EOS called with ``labels=`` (told by its
``attention_mask``).
"""

from __future__ import annotations

import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.hf_models import gpt2
from trainwatch.collect.padded_labels import _device_figures, _host_figures

transformers = pytest.importorskip("transformers")

V, BOS, EOS = 100, 1, 2
ROWS = 8
STEPS = 6


def llama() -> nn.Module:
    """pad = EOS: ``embed_tokens.padding_idx`` is the model's ``eos_token_id``."""
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return transformers.LlamaForCausalLM(config)


def sft_batch(step: int, *, tail_labelled: bool, rows: int = ROWS):
    """Prompt + sorted response + EOS, right-padded with EOS; labels -100 on the
    prompt and, unless ``tail_labelled``, on the padding. Also the count of padded
    tail positions (after each row's closing EOS) among the shifted targets."""
    rng = random.Random(step)
    pairs = []
    for _ in range(rows):
        prompt = [rng.randint(5, V - 1) for _ in range(rng.randint(3, 12))]
        pairs.append(([BOS, *prompt], [*sorted(prompt), EOS]))
    width = max(len(a) + len(b) for a, b in pairs)
    ids = torch.full((rows, width), EOS)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    tail = 0
    for i, (prompt, response) in enumerate(pairs):
        text = prompt + response
        ids[i, : len(text)] = torch.tensor(text)
        mask[i, : len(text)] = 1
        labels[i, len(prompt) : len(text)] = torch.tensor(response)
        if tail_labelled:
            labels[i, len(text) :] = EOS
        tail += width - len(text)
    return ids, mask, labels, tail


def fit_loop(make_batch, shape: str = "flat", steps: int = STEPS) -> tw.Monitor:
    """The loss in the loop, over the logits and labels shifted by hand."""
    torch.manual_seed(0)
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(steps):
            ids, mask, labels = make_batch(step)[:3]
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            target = labels[:, 1:]
            if shape == "flat":
                loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))
            else:  # (N, C, T) against (N, T)
                loss = F.cross_entropy(logits.transpose(1, 2), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor


def padding_alerts(alerts) -> list:
    return [a for a in alerts if a.rule == "loss_on_padding"]


def silent(alerts) -> bool:
    return not {"loss_on_padding", "internal_error"} & {a.rule for a in alerts}


# -- pad = EOS, the loss in the loop --------------------------------------------------------


@pytest.mark.parametrize("shape", ["flat", "channels"])
def test_sft_with_padding_set_to_minus_100_and_a_closing_eos_is_silent(shape):
    monitor = fit_loop(lambda step: sft_batch(step, tail_labelled=False), shape)
    assert silent(monitor.alerts)


@pytest.mark.parametrize("shape", ["flat", "channels"])
def test_sft_with_the_padded_tail_labelled_is_told_with_the_tail_count(shape):
    monitor = fit_loop(lambda step: sft_batch(step, tail_labelled=True), shape)
    (alert,) = padding_alerts(monitor.alerts)
    _, _, labels, tail = sft_batch(0, tail_labelled=True)
    assert alert.step == 0 and alert.data["kind"] == "padding_idx"
    # Every position after a row's closing EOS, and not the EOS itself.
    assert alert.data["padded_labels"] == tail > 0
    assert alert.data["labelled"] == int((labels[:, 1:] != -100).sum())
    assert alert.data["pad_value"] == EOS and alert.data["pad_is_eos"] is True
    assert "closing EOS" in alert.message and "eos_token_id" in alert.message
    assert "never learns to stop" in alert.hint and "-100" in alert.hint
    assert "internal_error" not in {a.rule for a in monitor.alerts}


def test_a_large_batch_counts_the_same_tail_on_the_device_path():
    """Over 4096 targets the figures are ops read back with the step."""

    def batch(step):
        return sft_batch(step, tail_labelled=True, rows=256)

    monitor = fit_loop(batch, steps=2)
    (alert,) = padding_alerts(monitor.alerts)
    _, _, labels, tail = batch(0)
    assert labels[:, 1:].numel() > 4096
    assert alert.data["padded_labels"] == tail


def packed_rows(step: int, width: int = 64) -> tuple[torch.Tensor, None, torch.Tensor]:
    """Documents ``BOS text EOS`` concatenated and cut into full rows: no padding."""
    rng = random.Random(step)
    stream: list[int] = []
    while len(stream) < ROWS * width:
        stream += [BOS, *(rng.randint(5, V - 1) for _ in range(rng.randint(3, 30))), EOS]
    ids = torch.tensor(stream[: ROWS * width]).view(ROWS, width)
    ids[0, -2:] = torch.tensor([7, EOS])  # a document ending exactly at a row's end
    ids[1, :3] = torch.tensor([7, EOS, BOS])  # one whose EOS begins a row's targets
    return ids, None, ids.clone()


@pytest.mark.parametrize("shape", ["flat", "channels"])
def test_packed_rows_with_eos_between_documents_are_silent_and_stay_looked_at(shape):
    monitor = fit_loop(packed_rows, shape, steps=12)
    assert silent(monitor.alerts)
    assert monitor._pipeline.class_targets.padding.open  # no padded batch seen yet


# -- Lightning: the loss in training_step -----------------------------------------------------


@pytest.mark.parametrize("tail_labelled", [False, True], ids=["healthy", "tail_labelled"])
def test_lightning_sft_with_pad_eos(tmp_path, tail_labelled):
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, Dataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    batches = [sft_batch(step, tail_labelled=tail_labelled)[:3] for step in range(4)]

    class Batches(Dataset):
        def __len__(self) -> int:
            return len(batches)

        def __getitem__(self, i: int):
            return batches[i]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llama()

        def training_step(self, batch, batch_idx):
            ids, mask, labels = batch
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(Batches(), batch_size=None)

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    quiet_trainer(tmp_path, [callback], max_steps=4, limit_val_batches=0).fit(Module())
    if not tail_labelled:
        assert silent(callback.alerts)
        return
    (alert,) = padding_alerts(callback.alerts)
    assert alert.step == 0 and alert.data["padded_labels"] == sft_batch(0, tail_labelled=True)[3]
    assert "internal_error" not in {a.rule for a in callback.alerts}


# -- a padding id that is no EOS: every target holding it is padding ----------------------------


class GruLM(nn.Module):
    """Hand-written, no config: ``padding_idx`` 0, texts closed by EOS 2."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32, padding_idx=0)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, V)

    def forward(self, ids):
        return self.head(self.rnn(self.embed(ids))[0])


def gru_batch(step: int) -> tuple[torch.Tensor, int]:
    """``BOS text EOS`` right-padded with 0, and the pad targets of ``ids[:, 1:]``."""
    ids, mask, _, _ = sft_batch(step, tail_labelled=False)
    ids = ids.masked_fill(mask == 0, 0)
    return ids, int((ids[:, 1:] == 0).sum())


@pytest.mark.parametrize("ignore_index", [-100, 0], ids=["padding_counted", "padding_ignored"])
def test_a_gru_whose_padding_idx_is_no_eos_counts_every_pad_target(ignore_index):
    torch.manual_seed(0)
    model = GruLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(STEPS):
            ids, _ = gru_batch(step)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(
                logits.reshape(-1, V), ids[:, 1:].reshape(-1), ignore_index=ignore_index
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    if ignore_index == 0:
        assert silent(monitor.alerts)
        return
    (alert,) = padding_alerts(monitor.alerts)
    assert alert.data["padded_labels"] == gru_batch(0)[1]  # the first pad of a tail too
    assert alert.data["pad_is_eos"] is False and "ignore_index=0" in alert.hint


# -- GPT-2, pad = EOS, called with labels= -------------------------------------------------------


@pytest.mark.parametrize("tail_labelled", [False, True], ids=["healthy", "tail_labelled"])
def test_gpt2_with_pad_eos_called_with_labels(tail_labelled):
    torch.manual_seed(0)
    model = gpt2()  # eos = 0, padded with it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    told = 0
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(STEPS):
            ids, mask, labels, _ = sft_batch(step, tail_labelled=True)
            ids = ids.masked_fill(ids == EOS, 0)
            labels = labels.masked_fill(labels == EOS, 0)
            if not tail_labelled:
                labels = labels.masked_fill(mask == 0, -100)
            elif step == 0:
                told = int(((labels[:, 1:] != -100) & (mask[:, 1:] == 0)).sum())
            opt.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
    if not tail_labelled:
        assert silent(monitor.alerts)
        return
    (alert,) = padding_alerts(monitor.alerts)
    assert alert.data["kind"] == "attention_mask" and alert.data["padded_labels"] == told > 0


# -- the rule itself: host and device figures agree ------------------------------------------------


def test_host_and_device_figures_agree_on_the_padding_past_each_end():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (64, 9), generator=gen)  # many runs of EOS (2) at either end
    rows[rows == 3] = -100
    rows[0] = EOS  # a row all EOS: all but its first
    host = _host_figures(rows, None, EOS, -100, None, True)
    device = _device_figures(rows, None, EOS, -100, None, True).tolist()
    assert host[:3] == device[:3]
    by_hand = 0
    for row in rows.tolist():
        head = next((i for i, v in enumerate(row) if v != EOS), len(row))
        tail = next((i for i, v in enumerate(row[::-1]) if v != EOS), len(row))
        if head == len(row):
            by_hand += len(row) - 1
        else:
            by_hand += max(head - 1, 0) + max(tail - 1, 0)
    assert host[2] == by_hand
