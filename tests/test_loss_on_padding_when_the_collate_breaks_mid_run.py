"""loss_on_padding when the collate breaks mid-run, after a healthy start.

The first padded batch says the padding is ignored; a later phase brings
batches of another make that count it: a curriculum's second loader (from
epoch 2) padding its batches dynamically with ``labels = input_ids.clone()``,
packed rows without a mask followed by padded ones, a fine-tuning phase whose
loss no longer ignores the padding index, ``DataCollatorWithPadding`` swapped
in for ``DataCollatorForLanguageModeling`` with a new optimizer, a tokenizer
whose pad token is set to its EOS while the collate still masks the old pad
id. Where the new pass over the data or the new phase is seen (a ``DataLoader``
pass under ``tw.watch``, Lightning, the Hugging Face ``Trainer``, ``trainwatch
run``, ``monitor.add_optimizer``, ``monitor.data_restarted()``) it is told at
the very step it begins, naming the module called with the labels; batches the
loop makes itself are told at the look's next sampled step. Beside each, the
same phase switch with a healthy collate stays silent.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import trainwatch as tw

V, PAD, EOS = 100, 0, 1
BATCH = 8
EPOCH = 87  # steps an epoch: the second phase begins at step 174, no multiple of 10
S = 2 * EPOCH


def documents(n: int, seed: int) -> list[list[int]]:
    """Token ids of ``n`` texts of 4 to 23 tokens, each closed by EOS."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (n,), generator=gen).tolist()
    return [torch.randint(2, V, (k - 1,), generator=gen).tolist() + [EOS] for k in lengths]


def padded(rows: list[list[int]], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows padded on the right to the longest one, and their attention mask."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def masked_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """What DataCollatorForLanguageModeling(mlm=False) gives: padding labelled -100."""
    ids, mask = padded(rows)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def cloned_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """The bug: labels copied from the padded ids."""
    ids, mask = padded(rows)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def packed_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Texts packed end to end into rows of 16 ids: no padding, no mask."""
    stream = [token for row in rows for token in row]
    ids = torch.tensor(stream[: len(stream) // 16 * 16]).view(-1, 16)
    return {"input_ids": ids, "labels": ids.clone()}


class CausalLM(nn.Module):
    """A GRU language model that computes its own loss from ``labels`` (shifted for
    next-token prediction, -100 ignored), as a Hugging Face model does."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, V)

    def forward(self, input_ids, attention_mask=None, labels=None) -> dict[str, torch.Tensor]:
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(
                logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return out


def loaders(first, second, first_batch: int = BATCH) -> tuple[DataLoader, DataLoader]:
    """The first phase's loader (two epochs of EPOCH steps), and the second's."""
    one = DataLoader(documents(EPOCH * first_batch, 1), first_batch, shuffle=True, collate_fn=first)
    two = DataLoader(documents(EPOCH * BATCH, 2), BATCH, shuffle=True, collate_fn=second)
    return one, two


def curriculum(first, second, first_batch: int = BATCH) -> tw.Monitor:
    """A plain loop: two epochs of the first loader, then one of the second."""
    torch.manual_seed(0)
    model = CausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one, two = loaders(first, second, first_batch)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for epoch in range(3):
            for batch in one if epoch < 2 else two:
                opt.zero_grad()
                model(**batch)["loss"].backward()
                opt.step()
    return monitor


def padding_alerts(alerts) -> list:
    assert "internal_error" not in {a.rule for a in alerts}
    return [a for a in alerts if a.rule == "loss_on_padding"]


def told_at(alerts, step: int, module: str = "") -> None:
    (alert,) = padding_alerts(alerts)
    assert alert.step == step and alert.module == module and alert.severity == "warning"
    assert alert.data["kind"] == "attention_mask" and alert.data["pad_value"] == PAD


# -- a plain loop: a curriculum's second loader, seen as its pass begins --------------------


def test_a_second_loader_copying_the_labels_from_padded_ids_is_told_at_its_first_step():
    told_at(curriculum(masked_collate, cloned_collate).alerts, S)


def test_a_second_loader_with_its_padding_labelled_minus_100_is_silent():
    monitor = curriculum(masked_collate, masked_collate)
    assert padding_alerts(monitor.alerts) == []
    padding = monitor._pipeline.class_targets.padding
    assert padding.judged and padding.open  # healthy, and still looked at


def test_padded_batches_after_packed_rows_without_a_mask_are_told_at_their_first_step():
    """The packed rows carry no attention mask: nothing to judge until the padded ones."""
    told_at(curriculum(packed_collate, cloned_collate, first_batch=4).alerts, S)


def test_padded_batches_after_packed_rows_labelled_minus_100_at_padding_are_silent():
    monitor = curriculum(packed_collate, masked_collate, first_batch=4)
    assert padding_alerts(monitor.alerts) == []


def test_the_dataloader_wrapper_is_there_while_a_monitor_is_open_only():
    before = DataLoader.__iter__
    curriculum(masked_collate, masked_collate)
    assert DataLoader.__iter__ is before


# -- a plain loop without a DataLoader: the sampled cadence -----------------------------------


def make_batches(second, seed: int = 0):
    """Batches made on the spot by the loop: the first collate before step S, then
    ``second``; no DataLoader pass to see."""
    gen = torch.Generator().manual_seed(seed)

    def batch(step: int) -> dict[str, torch.Tensor]:
        rows = documents(BATCH, int(torch.randint(0, 10**6, (1,), generator=gen)))
        return (masked_collate if step < S else second)(rows)

    return batch


def loop_without_a_loader(second, *, restarted: bool = False, steps: int = 3 * EPOCH):
    torch.manual_seed(0)
    model = CausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_batches(second)
    looked = []
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        look = monitor._pipeline.class_targets
        for step in range(steps):
            if restarted and step == S:
                monitor.data_restarted()  # the loop says its second phase begins
            looked.append(look.listening)
            opt.zero_grad()
            model(**batch(step))["loss"].backward()
            opt.step()
    return monitor, [step for step, on in enumerate(looked) if on]


def test_without_a_loader_the_break_is_told_at_the_next_sampled_look():
    """A healthy verdict at step 0; the look slows down (every 5, 10, 20, 40, then 80
    steps for a loss computed inside the model) and comes at the first look after S."""
    monitor, looked = loop_without_a_loader(cloned_collate)
    (alert,) = padding_alerts(monitor.alerts)
    assert alert.step == min(step for step in looked if step >= S) < S + 16 * 5


def test_without_a_loader_the_loop_can_say_its_data_restarted():
    monitor, _ = loop_without_a_loader(cloned_collate, restarted=True)
    told_at(monitor.alerts, S)


def test_a_healthy_run_without_a_loader_is_looked_at_less_and_less():
    """The usual step pays nothing: the look comes on its sampled steps only, slowing
    down to every 80 steps; the healthy phase switch says nothing."""
    monitor, looked = loop_without_a_loader(masked_collate, restarted=True, steps=500)
    assert padding_alerts(monitor.alerts) == []
    assert S in looked  # the look asked for at the phase switch
    late = [step for step in looked if step >= 300]
    assert late == list(range(320, 500, 80))


def hugging_face_collators():
    """Hugging Face's own collators over a word-level tokenizer built on the spot (ids
    as words: no download): for language modelling, and with padding alone."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel

    vocab = {"<pad>": PAD, "<eos>": EOS, **{str(i): i for i in range(2, V)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(WordLevel(vocab, unk_token="<eos>")),
        pad_token="<pad>",
        eos_token="<eos>",
    )
    language_modelling = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    with_padding = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")

    def for_lm(rows: list[list[int]]) -> dict[str, torch.Tensor]:
        return language_modelling([{"input_ids": row} for row in rows])

    def padded_then_cloned(rows: list[list[int]]) -> dict[str, torch.Tensor]:
        batch = with_padding([{"input_ids": row} for row in rows])
        batch["labels"] = batch["input_ids"].clone()  # padding labelled with the pad id
        return dict(batch)

    return for_lm, padded_then_cloned


@pytest.mark.parametrize("swapped", [True, False], ids=["with_padding", "for_lm"])
def test_a_fine_tuning_phase_with_its_own_optimizer_is_looked_at_from_its_first_step(swapped):
    """The head alone trained by an optimizer handed over at the phase's start: a new
    phase, whose collate (``DataCollatorWithPadding`` swapped in for
    ``DataCollatorForLanguageModeling``, the labels copied from the padded ids) is
    told at its first step; the same phase keeping the LM collator is silent."""
    for_lm, padded_then_cloned = hugging_face_collators()
    torch.manual_seed(0)
    model = CausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    one, two = loaders(for_lm, padded_then_cloned if swapped else for_lm)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for epoch in range(3):
            if epoch == 2:
                model.requires_grad_(False)
                model.head.requires_grad_(True)
                opt = torch.optim.AdamW(model.head.parameters(), lr=1e-4)
                monitor.add_optimizer(opt)
            for batch in one if epoch < 2 else two:
                opt.zero_grad()
                model(**batch)["loss"].backward()
                opt.step()
    if not swapped:
        assert [a for a in monitor.alerts if a.severity != "info"] == []
        return
    (alert,) = padding_alerts(monitor.alerts)
    assert alert.step == S and alert.module == ""
    assert alert.data["kind"] == "attention_mask" and alert.data["pad_value"] == PAD


# -- a plain loop: the loss after the pass, a fine-tuning phase with a new criterion --------


class PaddedLM(nn.Module):
    """A GRU language model over a vocabulary whose padding id is ``PAD``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, 32, padding_idx=PAD)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


@pytest.mark.parametrize("fine_tune_masks", [False, True], ids=["counts_padding", "masks_it"])
def test_a_fine_tuning_criterion_counting_the_padding_idx_is_told_within_ten_steps(
    fine_tune_masks,
):
    """Pre-training ignores the padding index; the fine-tuning phase's criterion (the
    default ignore_index=-100) gets targets holding it, unless its collate masks them.
    No loader to see: a loss computed after the pass has its look every 10 steps at
    the slowest (it reads the loss's kind there too)."""
    torch.manual_seed(0)
    model = PaddedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pretrain = nn.CrossEntropyLoss(ignore_index=PAD)
    fine_tune = nn.CrossEntropyLoss()
    batch_at = make_batches(masked_collate)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(S + 40):
            batch = batch_at(step)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            targets = ids[:, 1:]
            if step >= S and fine_tune_masks:
                targets = targets.masked_fill(mask[:, 1:] == 0, -100)
            loss_of = pretrain if step < S else fine_tune
            opt.zero_grad()
            loss_of(model(ids[:, :-1]).reshape(-1, V), targets.reshape(-1)).backward()
            opt.step()
    found = padding_alerts(monitor.alerts)
    if fine_tune_masks:
        assert found == []
        return
    (alert,) = found
    assert alert.step == 180 and alert.module == ""  # S = 174: the next tenth step
    assert alert.data["kind"] == "padding_idx" and alert.data["ignore_index"] == -100


# -- Lightning: the second phase's loader, reloaded at its epoch ---------------------------


@pytest.mark.parametrize("second", [cloned_collate, masked_collate], ids=["cloned", "masked"])
def test_lightning_second_phase_loader_is_told_at_its_first_step(tmp_path, second):
    pl = pytest.importorskip("lightning.pytorch")
    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Curriculum(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CausalLM()
            self.phases = loaders(masked_collate, second)

        def training_step(self, batch, batch_idx):
            return self.model(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return self.phases[0 if self.current_epoch < 2 else 1]

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=3, reload_dataloaders_every_n_epochs=1)
    trainer.fit(Curriculum())
    found = padding_alerts(callback.alerts)
    if second is masked_collate:
        assert found == []
        return
    (alert,) = found
    assert alert.step == S and alert.module == "model"


# -- transformers.Trainer: the tokenizer's pad token set to EOS at epoch 2 -----------------


@pytest.mark.parametrize("masks_by_id", [True, False], ids=["stale_pad_id", "attention_mask"])
def test_hugging_face_trainer_pad_token_set_to_eos_mid_run(tmp_path, masks_by_id):
    """Its collate pads with the tokenizer's pad id and masks the id it read at the
    start: once the pad token is the EOS, the padding keeps its labels. Told at the
    first step of the epoch the change came in (the callback sees the epoch begin);
    a collate masking by the attention mask stays silent through the same change."""
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import gpt2
    from trainwatch.hf import TrainWatchCallback

    alerts = _trainer_run(transformers, gpt2, TrainWatchCallback, tmp_path, masks_by_id)
    found = padding_alerts(alerts)
    if not masks_by_id:
        assert found == []
        return
    (alert,) = found
    assert alert.step == S and alert.module == ""
    assert alert.data["pad_value"] == 0  # tests.hf_models' GPT-2: its EOS is 0


class _Tokenizer:
    """The part of a tokenizer a collate reads: its pad id, which a script may change."""

    def __init__(self, pad: int) -> None:
        self.pad_token_id = pad  # a pad token of its own, first
        self.eos_token_id = 0


def _trainer_run(transformers, gpt2, callback_class, tmp_path: Path, masks_by_id: bool):
    from tests.hf_models import VOCAB

    tokenizer = _Tokenizer(VOCAB - 1)
    pad_at_start = tokenizer.pad_token_id

    def collate(features):
        rows = [f["input_ids"] for f in features]
        ids, mask = padded(rows, pad=tokenizer.pad_token_id)
        labels = ids.clone()
        if masks_by_id:
            labels[labels == pad_at_start] = -100  # the id read once, at the start
        else:
            labels[mask == 0] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    class PadIsEos(transformers.TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            if state.epoch >= 2:
                tokenizer.pad_token_id = tokenizer.eos_token_id

    torch.manual_seed(0)
    rows = [{"input_ids": [t + 1 for t in row]} for row in documents(EPOCH * BATCH, 1)]
    watch = callback_class(console=io.StringIO())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        num_train_epochs=3,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    trainer = transformers.Trainer(
        model=gpt2(),
        args=args,
        train_dataset=rows,
        data_collator=collate,
        callbacks=[watch, PadIsEos()],
    )
    trainer.train()
    return watch.alerts


# -- trainwatch run on an unmodified script ---------------------------------------------------

SCRIPT = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader
torch.set_num_threads(1)
torch.manual_seed(0)
V, PAD, EOS, BATCH, EPOCH = 100, 0, 1, 8, 87

def documents(n, seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 24, (n,), generator=gen).tolist()
    return [torch.randint(2, V, (k - 1,), generator=gen).tolist() + [EOS] for k in lengths]

def collate(mask_padding):
    def make(rows):
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), PAD)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        labels = ids.clone()
        if mask_padding:
            labels[mask == 0] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return make

class CausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.head = nn.Linear(32, V)
    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.rnn(self.embed(input_ids))[0])
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return {"logits": logits, "loss": loss}

model = CausalLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
first = DataLoader(documents(EPOCH * BATCH, 1), BATCH, shuffle=True, collate_fn=collate(True))
second = DataLoader(
    documents(EPOCH * BATCH, 2), BATCH, shuffle=True, collate_fn=collate(sys.argv[1] == "masked")
)
for epoch in range(3):
    for batch in first if epoch < 2 else second:
        opt.zero_grad()
        model(**batch)["loss"].backward()
        opt.step()
"""


def _run(tmp_path: Path, mode: str) -> str:
    script = tmp_path / "curriculum.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=str(Path(tw.__file__).resolve().parents[1]))
    log = tmp_path / f"log_{mode}"
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--no-console", "--log-dir", str(log)]
        + [str(script), mode],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    path = log / "alerts.jsonl"
    return path.read_text() if path.exists() else ""


def test_trainwatch_run_tells_the_second_loader_at_its_first_step(tmp_path):
    alerts = _run(tmp_path, "cloned")
    (line,) = [row for row in alerts.splitlines() if '"rule": "loss_on_padding"' in row]
    assert f'"step": {S},' in line and '"module": ""' in line
    assert "internal_error" not in alerts


def test_trainwatch_run_with_a_healthy_second_loader_is_silent(tmp_path):
    alerts = _run(tmp_path, "masked")
    assert "loss_on_padding" not in alerts and "internal_error" not in alerts
