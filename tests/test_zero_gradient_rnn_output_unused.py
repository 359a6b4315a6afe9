"""zero_gradient says which layer-direction of an nn.RNN/LSTM/GRU gets nothing when the
loss reads only part of the module's output: a bidirectional LSTM classifier reading
``h_n[-1]`` (the last layer's reverse direction only) leaves the last layer's forward
weights with an exactly zero gradient. The alert names that cause
(``data.cause: rnn_output_unused``, ``data.unused_directions``) and the fix
(``torch.cat([h_n[-2], h_n[-1]], dim=1)``), not dead ReLUs, and lists the parameters
in the module's own order. Each shape beside its healthy twin, which stays silent; an
RNN cut off whole by a ``.detach()`` keeps its own story."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.conftest import rules_of
from trainwatch.runner import run_script

HIDDEN = 12


class Classifier(nn.Module):
    """Embedding -> RNN -> linear head; ``shape`` picks the RNN and what the head reads."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape
        self.emb = nn.Embedding(50, 16)
        kind, layers, both_ways, features = {
            "bilstm_h_n_last": (nn.LSTM, 2, True, HIDDEN),
            "bilstm_h_n_both": (nn.LSTM, 2, True, 2 * HIDDEN),
            "bigru_forward_half": (nn.GRU, 1, True, HIDDEN),
            "bigru_all_features": (nn.GRU, 1, True, 2 * HIDDEN),
            "gru_h_n_first": (nn.GRU, 3, False, HIDDEN),
            "lstm_output_last": (nn.LSTM, 2, False, HIDDEN),
            "lstm_detached": (nn.LSTM, 2, False, HIDDEN),
        }[shape]
        self.rnn = kind(16, HIDDEN, num_layers=layers, bidirectional=both_ways, batch_first=True)
        self.fc = nn.Linear(features, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output, state = self.rnn(self.emb(x))
        h_n = state[0] if isinstance(state, tuple) else state
        read = {
            "bilstm_h_n_last": lambda: h_n[-1],  # the bug: the reverse direction only
            "bilstm_h_n_both": lambda: torch.cat([h_n[-2], h_n[-1]], dim=1),
            "bigru_forward_half": lambda: output[..., :HIDDEN].mean(1),  # forward only
            "bigru_all_features": lambda: output.mean(1),
            "gru_h_n_first": lambda: h_n[0],  # the first layer's, not the last's
            "lstm_output_last": lambda: output[:, -1],
            "lstm_detached": lambda: output[:, -1].detach(),
        }[self.shape]
        return self.fc(read())


def _train(quiet_watch, shape: str, steps: int = 6):
    torch.manual_seed(0)
    model = Classifier(shape)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        x = torch.randint(1, 50, (16, 10))
        y = (x[:, :5] < 10).any(1).long()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return monitor


def _told(monitor) -> dict[str, object]:
    return {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}


def _weights(*suffixes: str) -> list[str]:
    return [
        f"rnn.{w}_{s}" for s in suffixes for w in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    ]


def test_bidirectional_lstm_reading_h_n_last_names_the_forward_direction(quiet_watch):
    found = _told(_train(quiet_watch, "bilstm_h_n_last"))
    assert set(found) == {"rnn"}
    alert = found["rnn"]
    assert alert.step == 0 and alert.severity == "warning"
    assert alert.data["cause"] == "rnn_output_unused"
    assert alert.data["unused_directions"] == ["l1"]
    # The module's own order, not the order the step's gradients came in.
    assert alert.data["parameters"] == _weights("l1")
    assert "layer 1's forward direction (h_n[-2]) of this 2-layer bidirectional RNN" in (
        alert.message
    )
    assert "torch.cat([h_n[-2], h_n[-1]], dim=1)" in alert.hint
    assert "dead" not in alert.hint  # the old hint blamed dead ReLUs upstream


def test_bidirectional_gru_reading_the_forward_half_names_the_reverse_direction(quiet_watch):
    alert = _told(_train(quiet_watch, "bigru_forward_half"))["rnn"]
    assert alert.data["cause"] == "rnn_output_unused"
    assert alert.data["unused_directions"] == ["l0_reverse"]
    assert alert.data["parameters"] == _weights("l0_reverse")
    assert "layer 0's reverse direction (h_n[-1])" in alert.message
    assert "output's first hidden_size features" in alert.hint
    assert "dead" not in alert.hint


def test_stacked_gru_reading_the_first_layer_names_the_layers_above(quiet_watch):
    alert = _told(_train(quiet_watch, "gru_h_n_first"))["rnn"]
    assert alert.data["cause"] == "rnn_output_unused"
    assert alert.data["unused_directions"] == ["l1", "l2"]
    assert alert.data["parameters"] == _weights("l1", "l2")
    assert "layer 1 (h_n[1]) and layer 2 (h_n[-1]) of this 3-layer RNN" in alert.message
    assert "h_n[0] is the first layer's" in alert.hint


@pytest.mark.parametrize("shape", ["bilstm_h_n_both", "bigru_all_features", "lstm_output_last"])
def test_control_an_rnn_whose_whole_output_is_read_is_silent(quiet_watch, shape):
    assert rules_of(_train(quiet_watch, shape)) == []


def test_control_an_rnn_cut_off_whole_by_detach_keeps_its_story(quiet_watch):
    found = _told(_train(quiet_watch, "lstm_detached"))
    assert set(found) == {"emb", "rnn"}
    alert = found["rnn"]
    assert alert.data["kind"] == "none" and "cause" not in alert.data
    assert alert.data["parameters"] == _weights("l0", "l1")
    assert ".detach()" in alert.hint


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch.nn import functional as F
    from tests.test_zero_gradient_rnn_output_unused import Classifier

    torch.manual_seed(0)
    model = Classifier(sys.argv[1])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(6):
        x = torch.randint(1, 50, (16, 10))
        y = (x[:, :5] < 10).any(1).long()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    """
)

LIGHTNING_SCRIPT = textwrap.dedent(
    """
    import sys
    import lightning.pytorch as pl
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from tests.test_zero_gradient_rnn_output_unused import Classifier

    class Lit(pl.LightningModule):
        def __init__(self, shape):
            super().__init__()
            self.net = Classifier(shape)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    torch.manual_seed(0)
    x = torch.randint(1, 50, (96, 10))
    data = TensorDataset(x, (x[:, :5] < 10).any(1).long())
    pl.Trainer(
        max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    ).fit(Lit(sys.argv[1]), DataLoader(data, batch_size=16))
    """
)


def _run(tmp_path, script: str, shape: str) -> list[dict]:
    path = tmp_path / "train.py"
    path.write_text(script)
    run_script(path, [shape], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["severity"] in ("warning", "error")]


@pytest.mark.parametrize("script", [SCRIPT, LIGHTNING_SCRIPT], ids=["loop", "lightning"])
def test_under_trainwatch_run_the_cause_is_named(tmp_path, script):
    told = _run(tmp_path, script, "bilstm_h_n_last")
    assert [(a["rule"], a["module"].rpartition(".")[2]) for a in told] == [("zero_gradient", "rnn")]
    data = told[0]["data"]
    assert data["cause"] == "rnn_output_unused" and data["unused_directions"] == ["l1"]
    assert [name.rpartition(".")[2] for name in data["parameters"]] == [
        "weight_ih_l1",
        "weight_hh_l1",
        "bias_ih_l1",
        "bias_hh_l1",
    ]


@pytest.mark.parametrize("script", [SCRIPT, LIGHTNING_SCRIPT], ids=["loop", "lightning"])
def test_control_under_trainwatch_run_the_healthy_twin_is_silent(tmp_path, script):
    assert _run(tmp_path, script, "bilstm_h_n_both") == []
