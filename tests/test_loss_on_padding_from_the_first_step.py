"""loss_on_padding is told at the first step, where the bug is first there.

The planted bug: a token loss over padded batches with ``ignore_index`` left at
-100 while the targets hold the embedding's ``padding_idx``. It is there from
step 0, so it is told at step 0, and a short smoke run
(``trainwatch run --max-steps 5 --fail-on warning``) fails on it. The first
steps are the broadcast audit's too: there the class target look rides the
audit's function mode (one mode sees the loss, not two), and the audit's own
findings stay at their step. Shapes: a token tagger and a causal LM in a plain
loop (``tw.watch``), an unmodified script under ``trainwatch run``, a Lightning
``Trainer`` with ``TrainWatchCallback``; each beside its twin with
``ignore_index`` set, which stays silent.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

import trainwatch as tw

V, PAD = 30, 0
BATCH, SEQ = 16, 12


def padded(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded with PAD after each row's length, and the next-token targets."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(1, V, (BATCH, SEQ), generator=gen)
    lengths = torch.randint(3, SEQ, (BATCH,), generator=gen)
    x[torch.arange(SEQ)[None] >= lengths[:, None]] = PAD
    y = x.roll(-1, 1)
    y[:, -1] = PAD
    return x, y


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32, padding_idx=PAD)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.out = nn.Linear(32, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0])


class CausalLM(nn.Module):
    """A one-layer causal transformer: next-token logits for every position."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32, padding_idx=PAD)
        self.block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.block(self.emb(x), src_mask=mask, is_causal=True))


def padding_alerts(alerts) -> list:
    return [a for a in alerts if a.rule == "loss_on_padding"]


def fit(model: nn.Module, ignore: int, steps: int = 8, **overrides):
    """A plain loop; the function modes on the stack as each step's loss is computed."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    crit = nn.CrossEntropyLoss(ignore_index=ignore)
    stacks = []
    with tw.watch(model, opt, console=io.StringIO(), **overrides) as monitor:
        for step in range(steps):
            x, y = padded(step)
            opt.zero_grad()
            logits = model(x)
            stacks.append([type(m).__name__ for m in _get_current_function_mode_stack()])
            crit(logits.reshape(-1, V), y.reshape(-1)).backward()
            opt.step()
    return monitor, stacks


# -- plain loops -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [Tagger, CausalLM], ids=["tagger", "causal_lm"])
def test_padding_counted_by_the_loss_is_told_at_step_0(make):
    monitor, stacks = fit(make(), ignore=-100)
    (alert,) = padding_alerts(monitor.alerts)
    assert alert.severity == "warning" and alert.step == 0
    assert alert.data["kind"] == "padding_idx" and alert.data["pad_value"] == PAD
    assert "internal_error" not in {a.rule for a in monitor.alerts}
    # Step 0 is the broadcast audit's: the look rode its mode, no second one was pushed
    # (after the verdict the look's own mode reads the loss's kind on its sampled steps).
    assert stacks[0] == ["_AuditMode"]
    assert all(stack in ([], ["_AuditMode"], ["_TargetMode"]) for stack in stacks)
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("make", [Tagger, CausalLM], ids=["tagger", "causal_lm"])
def test_padding_ignored_by_the_loss_is_silent_and_judged_at_step_0(make):
    monitor, _ = fit(make(), ignore=PAD)
    assert not {"loss_on_padding", "internal_error"} & {a.rule for a in monitor.alerts}
    padding = monitor._pipeline.class_targets.padding
    assert padding.judged and padding.open  # the verdict came with the first step; it goes on


def test_without_the_broadcast_audit_the_look_takes_step_0_with_its_own_mode():
    off = {"broadcast": False, "loss_input": False, "constant_output": False}
    monitor, stacks = fit(Tagger(), ignore=-100, **off)
    assert monitor._pipeline.behaviour is None or monitor._pipeline.behaviour.broadcast is None
    (alert,) = padding_alerts(monitor.alerts)
    assert alert.step == 0
    assert stacks[0] == ["_TargetMode"]
    assert torch._C._len_torch_function_stack() == 0


class TwoHeads(nn.Module):
    """A tagger with a length head: its (N, 1) output against (N,) lengths broadcasts."""

    def __init__(self) -> None:
        super().__init__()
        self.tagger = Tagger()
        self.length = nn.Linear(V, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.tagger(x)
        return logits, self.length(logits.mean(1))


@pytest.mark.parametrize("pad_bug", [True, False], ids=["padding_counted", "padding_ignored"])
def test_the_broadcast_audit_it_rides_tells_its_own_finding_at_its_step(pad_bug):
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    crit = nn.CrossEntropyLoss(ignore_index=-100 if pad_bug else PAD)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for step in range(6):
            x, y = padded(step)
            opt.zero_grad()
            logits, length = model(x)
            lengths = (x != PAD).sum(1).float()
            with pytest.warns(UserWarning):  # torch's own: a target size unlike the input's
                shape = nn.functional.mse_loss(length, lengths)
            (crit(logits.reshape(-1, V), y.reshape(-1)) + shape).backward()
            opt.step()
    broadcast = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert len(broadcast) == 1 and broadcast[0].step == 0
    found = padding_alerts(monitor.alerts)
    assert [a.step for a in found] == ([0] if pad_bug else [])
    assert "internal_error" not in {a.rule for a in monitor.alerts}


# -- trainwatch run on an unmodified script: a short smoke gate fails ----------------------

SCRIPT = """
import sys
import torch, torch.nn as nn
torch.manual_seed(0)
V, PAD = 30, 0
class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 32, padding_idx=PAD)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.out = nn.Linear(32, V)
    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])
model = Tagger()
opt = torch.optim.Adam(model.parameters(), 1e-3)
crit = nn.CrossEntropyLoss(ignore_index=PAD if sys.argv[1] == "ignored" else -100)
for step in range(20):
    x = torch.randint(1, V, (16, 12)); lens = torch.randint(3, 12, (16,))
    x[torch.arange(12)[None] >= lens[:, None]] = PAD
    y = x.roll(-1, 1); y[:, -1] = PAD
    opt.zero_grad()
    crit(model(x).reshape(-1, V), y.reshape(-1)).backward()
    opt.step()
"""


def _smoke_run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "tagger.py"
    script.write_text(textwrap.dedent(SCRIPT))
    args = ["run", "--no-console", "--log-dir", str(tmp_path / "log"), "--max-steps", "5"]
    return subprocess.run(
        [sys.executable, "-m", "trainwatch", *args, "--fail-on", "warning", str(script), mode],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_a_five_step_smoke_run_fails_on_padding_counted_by_the_loss(tmp_path):
    done = _smoke_run(tmp_path, "counted")
    assert done.returncode == 3, done.stderr
    alerts = (tmp_path / "log" / "alerts.jsonl").read_text()
    assert '"rule": "loss_on_padding"' in alerts and '"step": 0' in alerts


def test_a_five_step_smoke_run_with_padding_ignored_passes(tmp_path):
    done = _smoke_run(tmp_path, "ignored")
    assert done.returncode == 0, done.stderr
    log = tmp_path / "log" / "alerts.jsonl"
    assert not log.exists() or "loss_on_padding" not in log.read_text()


# -- Lightning ---------------------------------------------------------------------------


@pytest.mark.parametrize("ignore", [-100, PAD], ids=["padding_counted", "padding_ignored"])
def test_lightning_causal_lm_is_told_at_step_0_within_five_steps(tmp_path, ignore):
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, Dataset

    from tests.lightning_models import quiet_trainer
    from trainwatch.lightning import TrainWatchCallback

    class Rows(Dataset):
        def __len__(self) -> int:
            return 8 * BATCH

        def __getitem__(self, i: int):
            x, y = padded(i // BATCH)
            return x[i % BATCH], y[i % BATCH]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CausalLM()
            self.loss = nn.CrossEntropyLoss(ignore_index=ignore)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss(self.model(x).reshape(-1, V), y.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(Rows(), batch_size=BATCH)

    torch.manual_seed(0)
    callback = TrainWatchCallback(console=io.StringIO())
    quiet_trainer(tmp_path, [callback], max_steps=5, limit_val_batches=0).fit(Module())
    found = padding_alerts(callback.alerts)
    assert [a.step for a in found] == ([0] if ignore == -100 else [])
    assert "internal_error" not in {a.rule for a in callback.alerts}
