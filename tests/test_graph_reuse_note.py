"""A backward through a graph an earlier backward freed gets a note saying what
carries a graph across steps (torch's own message suggests retain_graph=True,
which is not the fix); other errors keep their notes, or none."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.graph_reuse_note import NOTE_PREFIX


class _LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.out = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor, state=None):
        output, state = self.rnn(self.embed(tokens), state)
        return self.out(output), state


def _tbptt(detach: bool) -> None:
    torch.manual_seed(0)
    model = _LanguageModel()
    opt = torch.optim.Adam(model.parameters())
    stream = torch.randint(0, 20, (4, 61))
    state = None
    with tw.watch(model, opt, console=False):
        for start in range(0, 60, 10):
            x, y = stream[:, start : start + 10], stream[:, start + 1 : start + 11]
            if detach and state is not None:
                state = tuple(part.detach() for part in state)
            opt.zero_grad()
            logits, state = model(x, state)
            loss = nn.functional.cross_entropy(logits.reshape(-1, 20), y.reshape(-1))
            loss.backward()
            opt.step()


def _notes(exc: BaseException) -> list[str]:
    return [note for note in getattr(exc, "__notes__", ()) if note.startswith("trainwatch")]


def test_hidden_state_not_detached_gets_the_note_naming_the_recurrent_layer():
    with pytest.raises(RuntimeError, match="second time") as raised:
        _tbptt(detach=False)
    (note,) = _notes(raised.value)
    assert note.startswith(NOTE_PREFIX)
    assert "(1) a hidden state" in note and "recurrent layers: rnn" in note
    assert "retain_graph=True hides the error" in note


def test_hidden_state_detached_trains_without_error():
    _tbptt(detach=True)


def test_running_total_of_losses_gets_the_note_without_a_recurrent_lead():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = 0.0
    with pytest.raises(RuntimeError, match="second time") as raised:
        with tw.watch(model, opt, console=False):
            for _ in range(5):
                opt.zero_grad()
                loss = model(torch.randn(32, 8)).pow(2).mean()
                total = total + loss  # the bug: the tensor, not loss.item()
                total.backward()
                opt.step()
    (note,) = _notes(raised.value)
    assert "(1) a running total of losses" in note
    assert "recurrent layers" not in note


def test_other_backward_errors_get_no_graph_note():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(RuntimeError, match="inplace") as raised:
        with tw.watch(model, opt, console=False):
            opt.zero_grad()
            hidden = model[1](model[0](torch.randn(32, 8)))
            out = model[2](hidden)
            hidden.mul_(2)  # sigmoid saved its output for backward
            out.sum().backward()
    assert not any(note.startswith(NOTE_PREFIX) for note in _notes(raised.value))


@pytest.mark.slow
def test_trainwatch_run_prints_the_note_under_an_unmodified_tbptt_script(tmp_path: Path):
    script = tmp_path / "tbptt.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            torch.manual_seed(0)
            rnn = nn.GRU(8, 8, batch_first=True)
            head = nn.Linear(8, 1)
            model = nn.ModuleDict({"rnn": rnn, "head": head})
            opt = torch.optim.Adam(model.parameters())
            h = None
            for step in range(5):
                x = torch.randn(4, 6, 8)
                out, h = rnn(x, h)
                loss = head(out[:, -1]).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            """
        )
    )
    command = [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(
        [*command, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "second time" in done.stderr
    assert NOTE_PREFIX in done.stderr
    assert "recurrent layers" in done.stderr
