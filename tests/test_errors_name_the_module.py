"""An exception escaping a watched model's forward gets a note naming the module.

Shape mismatches planted deep in nested models (an MLP, a CNN, a small
transformer), each beside a clean control, in the three ways in: a plain loop
(with and without ``with``), a real Lightning ``Trainer`` and ``trainwatch
run``. The note is read from the traceback after the fact: a clean run never
walks it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from trainwatch import raised
from trainwatch.demo import run_demo
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

MLP_NOTE = (
    "trainwatch: raised in encoder.blocks.2.fc2 = Linear(in_features=512, out_features=256, "
    "bias=True), called with (32, 768) float32"
)
CNN_NOTE = (
    "trainwatch: raised in features.conv2 = Conv2d(4, 16, kernel_size=(3, 3), stride=(1, 1), "
    "padding=(1, 1)), called with (4, 8, 12, 12) float32"
)


class Block(nn.Module):
    def __init__(self, width: int, inner: int, fc2_in: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, inner)
        self.fc2 = nn.Linear(fc2_in or inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Encoder(nn.Module):
    def __init__(self, width: int, wrong: bool) -> None:
        super().__init__()
        # Block 2's fc2 was written for an inner width of 512: the planted bug.
        self.blocks = nn.ModuleList(
            Block(width, 768, fc2_in=512 if wrong and i == 2 else None) for i in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class DeepMLP(nn.Module):
    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 256)
        self.encoder = Encoder(256, wrong)
        self.head = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(torch.relu(self.embed(x))))


class SmallCNN(nn.Module):
    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv1", nn.Conv2d(3, 8, 3, padding=1))
        self.features.add_module("act", nn.ReLU())
        self.features.add_module("conv2", nn.Conv2d(4 if wrong else 8, 16, 3, padding=1))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x)).flatten(1))


def mlp_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def cnn_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 4, (4,), generator=g)


def train(model: nn.Module, opt: torch.optim.Optimizer, batch, steps: int = 3) -> None:
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def notes(exc: BaseException) -> list[str]:
    return [n for n in getattr(exc, "__notes__", []) if n.startswith(raised.NOTE_PREFIX)]


@pytest.fixture
def walks(monkeypatch) -> list[int]:
    """How many times trainwatch walked a traceback."""
    calls: list[int] = []
    walk = raised.innermost_call

    def counted(*args):
        calls.append(1)
        return walk(*args)

    monkeypatch.setattr(raised, "innermost_call", counted)
    return calls


# -- plain loops ---------------------------------------------------------------
def test_with_block_names_the_innermost_module_of_a_nested_mlp_and_its_input(walks):
    model = DeepMLP(wrong=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        with tw.watch(model, opt, console=False):
            train(model, opt, mlp_batch)
    assert notes(caught.value) == [MLP_NOTE]


def test_watch_without_with_names_the_conv_a_cnn_fed_the_wrong_channels():
    model = SmallCNN(wrong=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(model, opt, console=False)
    try:
        with pytest.raises(RuntimeError, match="channels") as caught:
            train(model, opt, cnn_batch)
    finally:
        monitor.close()
    assert notes(caught.value) == [CNN_NOTE]


def test_clean_mlp_and_cnn_loops_never_walk_a_traceback(walks):
    for model, batch in ((DeepMLP(), mlp_batch), (SmallCNN(), cnn_batch)):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with tw.watch(model, opt, console=False):
            train(model, opt, batch, steps=4)
    assert walks == []


def test_with_block_names_the_module_when_the_loop_calls_a_part_of_the_model():
    """Only the part runs (``model.encoder(x)``): the block's exit reads the traceback."""
    model = DeepMLP(wrong=True)
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        with tw.watch(model, console=False):
            model.encoder(torch.randn(32, 256))
    assert notes(caught.value) == [MLP_NOTE]


class PaddedTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens), src_key_padding_mask=padding))


def _lm_step(model: nn.Module, opt: torch.optim.Optimizer, pad_width: int) -> None:
    tokens = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    padding = torch.zeros(4, pad_width, dtype=torch.bool)
    opt.zero_grad()
    logits = model(tokens[:, :-1], padding)
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()


def test_transformer_padding_mask_of_the_wrong_length_names_the_attention_and_its_kwargs(walks):
    model = PaddedTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False):
        _lm_step(model, opt, pad_width=8)  # the clean control: the mask fits
        assert walks == []
        with pytest.raises(AssertionError, match="key_padded_mask") as caught:
            _lm_step(model, opt, pad_width=9)  # the tokens were cut, the mask was not
    (note,) = notes(caught.value)
    assert note.startswith(
        "trainwatch: raised in encoder.layers.0.self_attn = MultiheadAttention((out_proj): "
    )
    assert note.endswith(
        "called with (4, 8, 16) float32, (4, 8, 16) float32, (4, 8, 16) float32, "
        "attn_mask=None, key_padding_mask=(4, 9) float32, need_weights=False, is_causal=False"
    )


class DictBatchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch["x"]).view(-1, 7)  # the model's own code, after fc returned


def test_an_error_in_the_models_own_code_names_the_model_itself_and_its_dict_batch():
    model = DictBatchNet()
    batch = {"x": torch.randn(8, 8), "y": torch.zeros(8, dtype=torch.long)}
    with pytest.raises(RuntimeError, match="invalid for input of size 128") as caught:
        with tw.watch(model, console=False):
            model(batch)
    assert notes(caught.value) == [
        "trainwatch: raised in the model itself = DictBatchNet((fc): Linear(in_features=8, "
        "out_features=16, bias=True)), called with {x: (8, 8) float32, y: (8,) int64}"
    ]


def _user_frames(exc: BaseException) -> list[tuple[str, int]]:
    frames = traceback.extract_tb(exc.__traceback__)
    return [(f.name, f.lineno) for f in frames if f.filename == __file__]


def test_the_exception_keeps_its_type_message_and_frames():
    def fail(watched: bool) -> BaseException:
        torch.manual_seed(0)
        model = DeepMLP(wrong=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = tw.watch(model, opt, console=False) if watched else None
        try:
            train(model, opt, mlp_batch)
        except RuntimeError as exc:
            return exc
        finally:
            if monitor is not None:
                monitor.close()
        raise AssertionError("the planted shape mismatch did not raise")

    bare, watched = fail(False), fail(True)
    assert type(watched) is type(bare)
    assert str(watched) == str(bare)
    assert _user_frames(watched) == _user_frames(bare)
    assert not hasattr(bare, "__notes__")
    assert watched.__notes__ == [MLP_NOTE]  # noted once, not once per way in


def test_an_error_in_the_loss_outside_the_model_gets_no_note():
    model = DeepMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = mlp_batch(0)
    with pytest.raises((RuntimeError, ValueError)) as caught:
        with tw.watch(model, opt, console=False):
            nn.functional.cross_entropy(model(x), y[:8]).backward()
    assert notes(caught.value) == []


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward of a hand-written op failed")


class _NetFailingInBackward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_FailsInBackward.apply(self.fc1(x)))


def test_an_error_raised_inside_backward_names_no_module():
    model = _NetFailingInBackward()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="hand-written op") as caught:
        with tw.watch(model, opt, console=False):
            model(torch.randn(4, 8)).sum().backward()
    assert notes(caught.value) == []


class _ReturnsNothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> None:
        self.seen.append(self.fc(x))  # a forward that returns nothing, called while handling


def test_a_forward_returning_none_while_the_caller_handles_an_error_is_no_error(walks):
    model = _ReturnsNothing()
    with tw.watch(model, console=False):
        try:
            raise KeyError("the caller's own, handled")
        except KeyError as exc:
            model(torch.randn(2, 4))
            handled = exc
    assert notes(handled) == []
    assert walks == []


# -- Lightning -----------------------------------------------------------------
class TinyTransformer(nn.Module):
    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
            for _ in range(2)
        )
        if wrong:  # a feed-forward layer resized by hand, its partner not
            self.blocks[1].linear2 = nn.Linear(64, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LitTransformer(pl.LightningModule):
    """Calls its inner net directly from ``training_step`` (``self.net``), not ``self``."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.net = TinyTransformer(wrong)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LitMLP(pl.LightningModule):
    """Calls ``self(x)``: the module's own forward runs the nested MLP."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.model = DeepMLP(wrong)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(tmp_path: Path, module: pl.LightningModule, data: TensorDataset) -> TrainWatchCallback:
    callback = TrainWatchCallback(console=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=3,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=tmp_path,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[callback],
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return callback


def _tokens() -> TensorDataset:
    return TensorDataset(torch.randint(0, 32, (12, 9), generator=torch.Generator().manual_seed(0)))


def _features() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g))


def test_lightning_names_a_part_called_from_training_step(tmp_path):
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        _fit(tmp_path, LitTransformer(wrong=True), _tokens())
    assert notes(caught.value) == [
        "trainwatch: raised in net.blocks.1.linear2 = Linear(in_features=64, out_features=16, "
        "bias=True), called with (4, 8, 32) float32"
    ]


def test_lightning_names_the_module_under_its_own_forward(tmp_path):
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        _fit(tmp_path, LitMLP(wrong=True), _features())
    assert notes(caught.value) == [
        MLP_NOTE.replace("raised in encoder.", "raised in model.encoder.").replace("(32,", "(4,")
    ]


def test_clean_lightning_fits_never_walk_a_traceback(tmp_path, walks):
    _fit(tmp_path, LitTransformer(), _tokens())
    _fit(tmp_path, LitMLP(), _features())
    assert walks == []


class LitFailingInBackward(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _NetFailingInBackward()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_lightning_backward_error_is_not_pinned_on_the_module(tmp_path):
    """LightningModule.backward is on the traceback, but it is no call of the model."""
    data = TensorDataset(torch.randn(8, 8), torch.randn(8, 1))
    with pytest.raises(RuntimeError, match="hand-written op") as caught:
        _fit(tmp_path, LitFailingInBackward(), data)
    assert notes(caught.value) == []


# -- trainwatch run ------------------------------------------------------------
MLP_SCRIPT = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, wrong):
        super().__init__()
        self.fc1 = nn.Linear(256, 768)
        self.fc2 = nn.Linear(512 if wrong else 768, 256)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, wrong):
        super().__init__()
        self.embed = nn.Linear(16, 256)
        self.encoder = nn.Sequential(Block(False), Block(wrong))
        self.head = nn.Linear(256, 4)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)))


model = Net(wrong=WRONG)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(3):
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print("finished")
"""

CNN_SCRIPT = """
import torch
from torch import nn

model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1),
    nn.ReLU(),
    nn.Sequential(nn.Conv2d(4 if WRONG else 8, 16, 3, padding=1), nn.ReLU()),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(16, 4),
)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(3):
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 4, (4,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
print("finished")
"""

RUN_CASES = {
    "mlp": (
        MLP_SCRIPT,
        "trainwatch: raised in encoder.1.fc2 = Linear(in_features=512, out_features=256, "
        "bias=True), called with (32, 768) float32",
    ),
    "cnn": (
        CNN_SCRIPT,
        "trainwatch: raised in 2.0 = Conv2d(4, 16, kernel_size=(3, 3), stride=(1, 1), "
        "padding=(1, 1)), called with (4, 8, 12, 12) float32",
    ),
}


def _script(tmp_path: Path, body: str, wrong: bool) -> Path:
    path = tmp_path / ("wrong.py" if wrong else "clean.py")
    path.write_text(textwrap.dedent(body).replace("WRONG", str(wrong)))
    return path


@pytest.fixture
def no_hook_left():
    yield
    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks


@pytest.mark.parametrize("family", sorted(RUN_CASES))
def test_trainwatch_run_prints_the_note_under_the_traceback(family, tmp_path, capsys, no_hook_left):
    body, note = RUN_CASES[family]
    code = run_script(_script(tmp_path, body, True), log_dir=tmp_path / "runs", console=False)
    err = capsys.readouterr().err
    assert code == 1
    message = next(line for line in err.splitlines() if line.startswith("RuntimeError:"))
    assert err.rstrip().splitlines()[-1] == note
    assert err.index(message) < err.index(note)
    assert err.count(raised.NOTE_PREFIX) == 1


@pytest.mark.parametrize("family", sorted(RUN_CASES))
def test_trainwatch_run_of_a_clean_script_walks_no_traceback(
    family, tmp_path, capsys, walks, no_hook_left
):
    body, _ = RUN_CASES[family]
    code = run_script(_script(tmp_path, body, False), log_dir=tmp_path / "runs", console=False)
    captured = capsys.readouterr()
    assert code == 0
    assert "finished" in captured.out
    assert raised.NOTE_PREFIX not in captured.err
    assert walks == []


@pytest.mark.slow
def test_trainwatch_run_command_shows_the_note_and_the_scripts_exit_status(tmp_path):
    script = _script(tmp_path, MLP_SCRIPT, True)
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--no-console", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    assert done.stderr.rstrip().splitlines()[-1] == RUN_CASES["mlp"][1]


# -- the demo ------------------------------------------------------------------
DEMO_NOTE = (
    "trainwatch: raised in fc2 = UnsafeLinear(in_features=64, out_features=64, bias=True), "
    "called with (64, 128) float32"
)


def test_demo_shape_error_stops_with_the_note_naming_fc2():
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        run_demo("shape_error", steps=5, delay=0, monitor_console=False)
    assert notes(caught.value) == [DEMO_NOTE]


@pytest.mark.slow
def test_demo_shape_error_exits_non_zero_with_the_note_on_screen(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "demo", "--bug", "shape_error", "--delay", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1
    lines = done.stderr.rstrip().splitlines()
    assert lines[-2].startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied")
    assert lines[-1] == DEMO_NOTE
