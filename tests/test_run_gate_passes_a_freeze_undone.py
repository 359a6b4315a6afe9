"""``--fail-on`` judges what still stands when the run ends.

A staged-unfreeze fine-tune (the encoder frozen for the first epoch while its
parameters sit in the optimizer, unfrozen later) is told as a warning at
step 0: at that point nobody can tell it from a freeze never undone. When the
encoder trains again, the same rule says so in a note that takes its warning
back. ``trainwatch run --fail-on warning`` used to exit 3 over the warning all
the same; now a withdrawn warning no longer fails the gate, while a freeze
never undone, or undone for part of the encoder only, still does. The encoder,
frozen whole, is told as one warning at ``encoder``, and its unfreeze as one note. The
closing summary and ``trainwatch report`` keep the warning, marked undone.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

from trainwatch.alert import Alert
from trainwatch.report import build_report
from trainwatch.runner import EXIT_ALERTS, run_script

# ``python finetune.py UNFREEZE OWN``: UNFREEZE is what is unfrozen at step 4
# (all: the encoder; part: its second layer only; never: nothing); OWN "own"
# watches the loop with the script's own ``tw.watch``.
FINETUNE = """
import contextlib
import sys
import torch
from torch import nn
import trainwatch as tw


class FineTuner(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
        self.classifier = nn.Linear(16, 3)

    def forward(self, x):
        return self.classifier(self.encoder(x))


torch.manual_seed(0)
model = FineTuner()
model.encoder.requires_grad_(False)  # 'pretrained': frozen for warm-up
opt = torch.optim.AdamW(
    [
        {"params": model.encoder.parameters(), "lr": 3e-4},
        {"params": model.classifier.parameters(), "lr": 3e-3},
    ]
)
unfreeze = {"all": model.encoder, "part": model.encoder[2], "never": None}[sys.argv[1]]
own = tw.watch(model, opt, console=False) if sys.argv[2] == "own" else contextlib.nullcontext()
with own:
    for step in range(8):
        if step == 4 and unfreeze is not None:
            unfreeze.requires_grad_(True)
        x = torch.randn(32, 8)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
"""


@pytest.fixture(autouse=True)
def _no_hook_left():
    yield
    assert not module_hooks._global_forward_pre_hooks
    assert not module_hooks._global_forward_hooks
    assert not optimizer_hooks._global_optimizer_pre_hooks
    assert not optimizer_hooks._global_optimizer_post_hooks


def _run(tmp_path: Path, unfreeze: str, own: str = "run") -> tuple[int, list[tuple]]:
    script = tmp_path / "finetune.py"
    script.write_text(textwrap.dedent(FINETUNE))
    code = run_script(
        script, [unfreeze, own], log_dir=tmp_path / "log", fail_on="warning", console=True
    )
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    told = [
        (a["severity"], a["module"], a["step"], bool(a["data"].get("withdraws")))
        for a in map(json.loads, lines)
        if a["rule"] == "frozen_in_optimizer"
    ]
    return code, told


@pytest.mark.parametrize("own", ["run", "own"])
def test_a_staged_unfreeze_passes_the_gate_and_is_marked_undone(tmp_path, capsys, own):
    code, told = _run(tmp_path, "all", own)
    assert code == 0
    # The encoder frozen whole is told once, at the encoder, and so is its unfreeze.
    assert told == [("warning", "encoder", 0, False), ("info", "encoder", 4, True)]
    err = capsys.readouterr().err
    assert "failing" not in err
    if own == "run":  # the script's own monitor keeps its summary to itself
        assert err.count("warning (undone 4)") == 1
    report = build_report(tmp_path / "log")
    assert [(r.module, r.severity, r.undone_step) for r in report.rows] == [
        ("encoder", "warning", 4),
    ]


@pytest.mark.parametrize("own", ["run", "own"])
def test_control_a_freeze_never_undone_fails_the_gate(tmp_path, capsys, own):
    code, told = _run(tmp_path, "never", own)
    assert told == [("warning", "encoder", 0, False)]
    assert code == EXIT_ALERTS
    err = capsys.readouterr().err
    assert "failing (exit 3): an alert of severity warning" in err
    assert "(undone" not in err
    assert [r.undone_step for r in build_report(tmp_path / "log").rows] == [None]


@pytest.mark.parametrize("own", ["run", "own"])
def test_control_a_freeze_undone_for_part_of_the_encoder_fails_the_gate(tmp_path, capsys, own):
    code, told = _run(tmp_path, "part", own)
    assert code == EXIT_ALERTS
    # The encoder's warning stands for encoder.0; the note on encoder.2 takes nothing back.
    assert told == [("warning", "encoder", 0, False), ("info", "encoder.2", 4, False)]
    if own == "run":
        assert "(undone" not in capsys.readouterr().err
    report = build_report(tmp_path / "log")
    assert [(r.module, r.severity, r.undone_step) for r in report.rows] == [
        ("encoder", "warning", None),
        ("encoder.2", "info", None),
    ]


def _alert(severity: str, step: int, module: str = "encoder.0", **data) -> tuple[Alert, int]:
    return Alert("frozen_in_optimizer", severity, step, module, "", "", data), step


def test_a_warning_told_again_after_its_withdrawal_stands():
    """Only what a rule told before taking it back is withdrawn; the withdrawal
    speaks for its own model and module only."""
    from trainwatch.alert import standing_worst  # the gate's own helper

    warned, undone = _alert("warning", 0), _alert("info", 4, withdraws=True)
    assert standing_worst([warned, undone]) == "info"
    again = (warned[0], 9)  # the tally's last step: told again at step 9
    assert standing_worst([again, undone]) == "warning"
    elsewhere = _alert("info", 4, "encoder.2", withdraws=True)
    assert standing_worst([warned, elsewhere]) == "warning"
    other_model = _alert("info", 4, withdraws=True, model="Teacher")
    assert standing_worst([warned, other_model]) == "warning"
