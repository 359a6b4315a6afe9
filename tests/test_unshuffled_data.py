"""unshuffled_data: label-sorted data read in order warns; shuffled, validation and LM
streams stay silent.

Each planted bug (a dataset stored sorted by label, read without shuffling)
runs in several shapes of script: a plain loop with ``tw.watch(data=loader)``,
hand-made batches sliced off sorted tensors, a LightningModule and an
unmodified script under ``trainwatch run``; each beside a clean control.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.test_run import alerts as run_alerts
from tests.test_run import cli
from trainwatch.config import load_config
from trainwatch.errors import ConfigError
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

RULE = "unshuffled_data"
CLASSES = 10
PER_CLASS = 64
BATCH = 8


def sorted_by_label(features: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A classification set stored sorted by label, as image folders often are."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(CLASSES).repeat_interleave(PER_CLASS)
    x = torch.randn(len(y), features, generator=gen) + y[:, None].float() * 0.1
    return x, y


def mlp(features: int = 12) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, CLASSES))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))


def fit(monitor_args: dict, loader: DataLoader, model: nn.Module, epochs: int = 1) -> tw.Monitor:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = tw.watch(model, opt, console=io.StringIO(), data=loader, **monitor_args)
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    monitor.close()
    return monitor


def found(monitor_alerts: list, severity: str | None = None) -> list:
    return [
        a for a in monitor_alerts if a.rule == RULE and (severity is None or a.severity == severity)
    ]


# -- plain loop, tw.watch(data=loader) ------------------------------------------


def test_label_sorted_data_read_in_order_warns_with_the_sampler_named():
    loader = DataLoader(TensorDataset(*sorted_by_label()), batch_size=BATCH, shuffle=False)
    monitor = fit({}, loader, mlp())
    (alert,) = found(monitor.alerts)
    assert alert.severity == "warning" and alert.module is None
    # Sampled every 5 steps from step 5; the third class reaches the samples at step 20.
    assert alert.step == 20
    assert alert.data["classes_per_batch"] == 1.0
    assert alert.data["expected_classes_per_batch"] > 2.0
    assert "SequentialSampler" in alert.data["sampler"]


def test_the_same_data_shuffled_is_silent():
    loader = DataLoader(TensorDataset(*sorted_by_label()), batch_size=BATCH, shuffle=True)
    assert found(fit({}, loader, mlp()).alerts) == []


class IdentitySampler(torch.utils.data.Sampler):
    """P x K batches (re-identification, metric learning): P random classes a batch,
    K samples of each; a new draw of classes every batch."""

    def __init__(self, labels: torch.Tensor, classes: int = 2, per_class: int = 4) -> None:
        self.by_class = [torch.nonzero(labels == c).flatten() for c in range(CLASSES)]
        self.classes, self.per_class = classes, per_class
        self.batches = len(labels) // (classes * per_class)
        self.gen = torch.Generator().manual_seed(0)

    def __iter__(self):
        for _ in range(self.batches):
            chosen = torch.randperm(CLASSES, generator=self.gen)[: self.classes]
            yield [
                int(i)
                for c in chosen
                for i in self.by_class[c][torch.randperm(PER_CLASS, generator=self.gen)][
                    : self.per_class
                ]
            ]

    def __len__(self) -> int:
        return self.batches


def test_a_batch_sampler_of_few_classes_by_design_is_silent():
    """The P x K sampler's batches hold 2 classes where random ones would hold 6."""
    x, y = sorted_by_label()
    loader = DataLoader(TensorDataset(x, y), batch_sampler=IdentitySampler(y))
    assert found(fit({}, loader, mlp()).alerts) == []


def test_the_same_batches_of_few_classes_without_the_loader_seen_are_silent_too():
    """Handed no loader, the targets tell the design: each batch holds exactly 4 of
    each of its 2 classes, new classes every batch (more shapes in
    test_unshuffled_data_identity_batches.py)."""
    x, y = sorted_by_label()
    loader = DataLoader(TensorDataset(x, y), batch_sampler=IdentitySampler(y))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    assert monitor.step_count >= 40
    assert found(monitor.alerts) == []


def test_a_sequential_sampler_over_data_stored_shuffled_is_one_info_line():
    x, y = sorted_by_label()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(x[order], y[order]), batch_size=BATCH, shuffle=False)
    monitor = fit({}, loader, mlp(), epochs=2)  # judged after 16 sampled batches
    (alert,) = found(monitor.alerts)
    assert alert.severity == "info"
    assert "SequentialSampler" in alert.message


def test_a_sequential_sampler_over_two_classes_sorted_is_not_said_to_look_shuffled():
    """Two classes seen are too few to judge the batches: no "look shuffled" after
    16 sampled batches (a run trained task by task in class order is still in its
    first task there); the sampler alone, as not judged, after 32."""
    x, y = sorted_by_label()
    two = y < 2
    loader = DataLoader(TensorDataset(x[two], y[two]), batch_size=BATCH, shuffle=False)
    monitor = fit({}, loader, mlp(), epochs=10)  # 160 steps: sampled at 0, 5, ... 155
    (alert,) = found(monitor.alerts)
    assert alert.severity == "info" and alert.step == 155
    assert "not judged" in alert.message and "look shuffled" not in alert.message
    assert alert.data["sampled_batches"] == 32


def test_a_sequential_sampler_without_class_targets_to_check_is_one_info_line():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 12, generator=gen)
    loader = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=BATCH, shuffle=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=io.StringIO(), data=loader) as monitor:
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    (alert,) = found(monitor.alerts)
    assert alert.severity == "info"
    assert "no class targets" in alert.message


def test_an_unshuffled_validation_loader_beside_a_shuffled_training_one_is_silent():
    x, y = sorted_by_label()
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    val = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=io.StringIO(), data=train) as monitor:
        for step, (xb, yb) in enumerate(train):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            if step % 20 == 19:
                model.eval()
                with torch.no_grad():
                    for vx, vy in val:
                        nn.functional.cross_entropy(model(vx), vy)
                model.train()
    assert found(monitor.alerts) == []


# -- hand-made batches, no loader -------------------------------------------------


def _hand_batches(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tw.Monitor:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for start in range(0, len(y), BATCH):
            xb, yb = x[start : start + BATCH], y[start : start + BATCH]
            opt.zero_grad()
            nn.NLLLoss()(torch.log_softmax(model(xb), dim=1), yb).backward()
            opt.step()
    return monitor


def test_hand_made_batches_sliced_off_label_sorted_images_warn_without_a_loader():
    x, y = sorted_by_label(features=36)
    monitor = _hand_batches(SmallCNN(), x.view(-1, 1, 6, 6), y)
    (alert,) = found(monitor.alerts)
    assert alert.severity == "warning" and alert.data["sampler"] is None
    assert alert.step == 20


def test_hand_made_batches_of_permuted_images_are_silent():
    x, y = sorted_by_label(features=36)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(2))
    monitor = _hand_batches(SmallCNN(), x[order].view(-1, 1, 6, 6), y[order])
    assert found(monitor.alerts) == []


# -- a language model's contiguous stream -------------------------------------------


class CharLM(nn.Module):
    def __init__(self, vocab: int, flat: bool) -> None:
        super().__init__()
        self.flat = flat
        self.embed = nn.Embedding(vocab, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.mix(self.embed(tokens))))
        return logits.reshape(-1, logits.shape[-1]) if self.flat else logits


@pytest.mark.parametrize("loss_shape", ["targets_BT", "flattened_in_loss", "flattened_in_model"])
def test_a_language_models_contiguous_stream_read_in_order_is_silent(loss_shape):
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    gen = torch.Generator().manual_seed(0)
    text = " ".join(words[i] for i in torch.randint(0, len(words), (2000,), generator=gen))
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    seq = 16
    chunks = ids[: (len(ids) - 1) // seq * seq + 1]
    inputs = chunks[:-1].view(-1, seq)
    targets = chunks[1:].view(-1, seq)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=False)
    torch.manual_seed(0)
    model = CharLM(len(vocab), flat=loss_shape == "flattened_in_model")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=io.StringIO(), data=loader) as monitor:
        for step, (xb, yb) in enumerate(loader):
            if step == 60:
                break
            opt.zero_grad()
            logits = model(xb)
            if loss_shape == "targets_BT":
                loss = nn.functional.cross_entropy(logits.transpose(1, 2), yb)
            else:
                loss = nn.functional.cross_entropy(logits.reshape(-1, len(vocab)), yb.reshape(-1))
            loss.backward()
            opt.step()
    assert found(monitor.alerts) == []


# -- Lightning ------------------------------------------------------------------------


class SortedClassifier(pl.LightningModule):
    def __init__(self, shuffle: bool) -> None:
        super().__init__()
        self.shuffle = shuffle
        self.fc = nn.Linear(12, 32)
        self.head = nn.Linear(32, CLASSES)
        self.data = TensorDataset(*sorted_by_label())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH, shuffle=self.shuffle)

    def val_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH, shuffle=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit_lightning(tmp_path: Path, shuffle: bool) -> TrainWatchCallback:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_steps=40,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
        limit_val_batches=5,
        val_check_interval=20,
        num_sanity_val_steps=0,
    )
    trainer.fit(SortedClassifier(shuffle))
    return callback


def test_lightning_train_dataloader_without_shuffle_over_sorted_labels_warns(tmp_path):
    (alert,) = found(_fit_lightning(tmp_path, shuffle=False).alerts)
    assert alert.severity == "warning" and alert.step == 20
    assert "SequentialSampler" in alert.data["sampler"]


def test_lightning_shuffled_training_with_an_unshuffled_val_dataloader_is_silent(tmp_path):
    assert found(_fit_lightning(tmp_path, shuffle=True).alerts) == []


# -- Lightning's overfit_batches: the sequential sampler is Lightning's --------------------


class Regressor(pl.LightningModule):
    """No class targets: the training loader's order alone is judged (a warning)."""

    def __init__(self, shuffle: bool) -> None:
        super().__init__()
        self.shuffle = shuffle
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x[:, :1].sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16, shuffle=self.shuffle)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit_regressor(tmp_path: Path, shuffle: bool, overfit_batches: int) -> TrainWatchCallback:
    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = pl.Trainer(
        callbacks=[callback],
        accelerator="cpu",
        max_steps=30,
        overfit_batches=overfit_batches,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Regressor(shuffle))
    return callback


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in_order"])
def test_lightning_overfit_batches_reading_in_order_is_silent(tmp_path, shuffle):
    """Trainer(overfit_batches=2) swaps a SequentialSampler in for the same two batches
    every epoch, whatever the loader asked: a debugging run, not an order to fix."""
    assert found(_fit_regressor(tmp_path, shuffle, overfit_batches=2).alerts) == []


def test_lightning_unshuffled_loader_without_overfit_batches_is_still_told(tmp_path):
    (alert,) = found(_fit_regressor(tmp_path, shuffle=False, overfit_batches=0).alerts)
    assert alert.severity == "info" and alert.step == 20
    assert "no class targets" in alert.message


LIGHTNING_SCRIPT = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning.pytorch as pl


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
overfit = sys.argv[1] == "overfit"
x = torch.randn(512, 8)
train = DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16, shuffle=overfit)
trainer = pl.Trainer(
    accelerator="cpu", max_steps=30, overfit_batches=2 if overfit else 0, logger=False,
    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
)
trainer.fit(Regressor(), train)
"""


@pytest.mark.parametrize("mode", ["overfit", "in-order"])
def test_trainwatch_run_on_lightning_judges_the_order_only_without_overfit_batches(tmp_path, mode):
    script = tmp_path / "fit_lightning.py"
    script.write_text(textwrap.dedent(LIGHTNING_SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, [mode], log_dir=log, console=False) == 0
    told = [a["severity"] for a in run_alerts(log) if a["rule"] == RULE]
    assert told == ([] if mode == "overfit" else ["info"])  # a regression: no classes


# -- trainwatch run on an unmodified script ----------------------------------------------

SCRIPT = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
shuffle = sys.argv[1] == "shuffle"
y = torch.arange(10).repeat_interleave(64)
x = torch.randn(len(y), 12) + y[:, None].float() * 0.1
train = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=shuffle)
val = DataLoader(TensorDataset(x, y), batch_size=8)
model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    model.train()
    for xb, yb in train:
        opt.zero_grad()
        criterion(model(xb), yb).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        correct = sum((model(vx).argmax(1) == vy).sum().item() for vx, vy in val)
    print(epoch, correct)
"""


def _run(tmp_path: Path, mode: str) -> list[dict]:
    script = tmp_path / "train_sorted.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    assert run_script(script, [mode], log_dir=log, console=False) == 0
    return [a for a in run_alerts(log) if a["rule"] == RULE]


def test_trainwatch_run_finds_the_unshuffled_training_loader_of_an_unmodified_script(tmp_path):
    (alert,) = _run(tmp_path, "in-order")
    assert alert["severity"] == "warning" and alert["step"] == 20
    assert "SequentialSampler" in alert["data"]["sampler"]


def test_trainwatch_run_is_silent_on_a_shuffled_script_with_an_unshuffled_val_loader(tmp_path):
    assert _run(tmp_path, "shuffle") == []


@pytest.mark.slow
def test_trainwatch_run_in_a_subprocess_fails_on_the_unshuffled_warning(tmp_path):
    script = tmp_path / "train_sorted.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log = tmp_path / "log"
    args = ("run", "--log-dir", str(log), "--fail-on", "warning", "--no-console")
    done = cli(*args, str(script), "in-order", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert [a["step"] for a in run_alerts(log) if a["rule"] == RULE] == [20]


def test_the_data_order_wrapper_comes_off_after_trainwatch_run(tmp_path):
    before = DataLoader.__iter__
    script = tmp_path / "noop.py"
    script.write_text("print('hi')\n")
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    assert DataLoader.__iter__ is before


# -- config --------------------------------------------------------------------------------


def test_a_bad_unshuffled_data_value_names_the_key():
    with pytest.raises(ConfigError, match=r"unshuffled_data\.ratio"):
        load_config({"unshuffled_data": {"ratio": 2.0}})
    with pytest.raises(ConfigError, match=r"unshuffled_data\.every"):
        load_config({"unshuffled_data": {"every": 0}})


def test_data_must_be_a_loader():
    model = mlp()
    with pytest.raises(tw.WatchError, match="data"):
        tw.watch(model, data=3, console=False)


# -- cost ------------------------------------------------------------------------------------


def test_only_sampled_steps_listen_for_class_targets_and_no_mode_is_left_behind():
    loader = DataLoader(TensorDataset(*sorted_by_label()), batch_size=BATCH, shuffle=True)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    listening = []
    with tw.watch(model, opt, console=io.StringIO(), data=loader) as monitor:
        for step, (x, y) in enumerate(loader):
            listening.append("class target look" in monitor._pipeline.passes.listener_names())
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            assert torch._C._len_torch_function_stack() == 0
            if step == 11:
                break
    assert listening == [step % 5 == 0 for step in range(12)]


# -- a model that computes its own loss from labels (Hugging Face style) -------------------------


class LabelledClassifier(nn.Module):
    """``model(inputs, labels=y)`` returns a dict with the loss, as Hugging Face models do."""

    def __init__(self, per_token: bool = False) -> None:
        super().__init__()
        self.per_token = per_token
        self.body = nn.Linear(12, 32)
        self.classifier = nn.Linear(32, CLASSES)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.classifier(torch.relu(self.body(inputs)))
        out = {"logits": logits}
        if labels is not None:
            flat = logits.reshape(-1, CLASSES)
            out["loss"] = nn.functional.cross_entropy(flat, labels.reshape(-1))
        return out


def _fit_labelled(model: nn.Module, loader: DataLoader) -> tw.Monitor:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO(), data=loader) as monitor:
        for inputs, labels in loader:
            opt.zero_grad()
            model(inputs, labels=labels)["loss"].backward()
            opt.step()
    return monitor


def test_labels_handed_to_a_model_that_computes_its_loss_are_checked():
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(*sorted_by_label()), batch_size=BATCH, shuffle=False)
    (alert,) = found(_fit_labelled(LabelledClassifier(), loader).alerts)
    assert alert.severity == "warning" and alert.step == 20


def test_per_token_labels_of_a_stream_read_in_order_are_silent():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(320, 6, 12, generator=gen)
    labels = torch.randint(0, CLASSES, (320, 6), generator=gen)
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=BATCH, shuffle=False)
    assert found(_fit_labelled(LabelledClassifier(per_token=True), loader).alerts) == []


def test_imbalanced_shuffled_classes_are_silent():
    gen = torch.Generator().manual_seed(3)
    y = torch.where(
        torch.rand(640, generator=gen) < 0.8, 0, torch.randint(1, 10, (640,), generator=gen)
    )
    x = torch.randn(640, 12, generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    assert found(fit({}, loader, mlp()).alerts) == []


def test_targets_all_ignored_are_skipped_without_an_internal_error():
    x, y = sorted_by_label()
    y = torch.full_like(y, -100)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    monitor = fit({}, loader, mlp())
    assert not {"unshuffled_data", "internal_error"} & {a.rule for a in monitor.alerts}


# -- the look's cadence: a run without a class loss is looked at less and less --


def _count_spans(monitor: tw.Monitor) -> list[int]:
    """The steps whose loss span the class target look opened."""
    look = monitor._pipeline.class_targets
    opened: list[int] = []
    enter = look._mode.__enter__

    def counted_enter():
        opened.append(monitor.step_count)
        return enter()

    look._mode.__enter__ = counted_enter
    return opened


def _train(model, opt, steps, loss_of):
    x = torch.randn(BATCH, 12)
    y = torch.arange(BATCH) % CLASSES
    for _ in range(steps):
        opt.zero_grad()
        loss_of(model(x), y).backward()
        opt.step()


def _regression_loss(out, y):
    return nn.functional.mse_loss(out, torch.zeros_like(out))


def test_a_regression_loop_opens_the_loss_span_less_and_less_often():
    """Down to a sixteenth of the cadence where the loss's kind is not read."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False, broadcast={"loss_kind_every": 0}) as monitor:
        opened = _count_spans(monitor)
        _train(model, opt, 400, _regression_loss)
        look = monitor._pipeline.class_targets
        assert look.every > 5
    late = [step for step in opened if step >= 200]
    assert len(opened) < 400 // 5 // 2 and len(late) <= 200 // 5 // 4


def test_a_regression_loop_reading_the_loss_kind_slows_down_to_its_cadence():
    """The loss's kind (read for the broadcast audit) keeps the look every 10 steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        opened = _count_spans(monitor)
        _train(model, opt, 400, _regression_loss)
        assert monitor._pipeline.class_targets.every == 10
    # (Step 200 is the broadcast audit's recheck: the look rides the audit's mode.)
    assert [step for step in opened if step >= 200] == list(range(210, 400, 10))


def test_a_classification_loop_keeps_the_configured_cadence():
    """Control: every fifth step's loss is looked at, all run long."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        opened = _count_spans(monitor)
        _train(model, opt, 200, nn.functional.cross_entropy)
        assert monitor._pipeline.class_targets.every == 5
    assert len(opened) >= 200 // 5 - 2


def test_a_class_loss_after_a_regression_phase_brings_the_cadence_back():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        _train(model, opt, 300, _regression_loss)
        look = monitor._pipeline.class_targets
        assert look.every > 5
        _train(model, opt, 200, nn.functional.cross_entropy)
        assert look.every == 5


def test_sorted_data_after_a_regression_warm_up_phase_is_still_found():
    """A pretext regression phase, then the classifier trained on label-sorted data."""
    x, y = sorted_by_label()
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False, data=loader) as monitor:
        _train(model, opt, 200, _regression_loss)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    assert found(monitor.alerts)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
@pytest.mark.parametrize("where", ["host", "bincount"])
def test_class_counts_count_each_class_and_leave_out_targets_outside_the_classes(
    dtype, where, monkeypatch
):
    """A small CPU batch is counted on the host, any other by one bincount: the same counts."""
    from trainwatch.collect import class_targets

    if where == "bincount":
        monkeypatch.setattr(class_targets, "_COUNTED_ON_HOST", 0)
    logits = torch.zeros(8, 5)
    targets = torch.tensor([0, 4, 4, 2, 200, 2, 2, 1])  # 200: no class of these logits
    if dtype is not torch.uint8:
        targets[4] = -100  # cross_entropy's ignore_index
    counts = class_targets.class_counts(logits, targets.to(dtype), max_classes=1000)
    if where == "bincount":
        assert counts.dtype == torch.float32
        counts = counts.tolist()
    assert counts == [1.0, 1.0, 3.0, 0.0, 2.0]


def test_class_counts_leave_per_token_and_soft_targets_alone():
    from trainwatch.collect.class_targets import class_counts

    assert class_counts(torch.zeros(4, 5), torch.rand(4, 5), 1000) is None  # soft labels
    assert class_counts(torch.zeros(4, 5, 7), torch.zeros(4, 7).long(), 1000) is None
    assert class_counts(torch.zeros(4, 5), torch.zeros(4).long(), 3) is None  # too many classes
