"""Unmodified training scripts of real Hugging Face models (tiny, offline) under ``trainwatch run``.

Names are relative to the outermost module the script calls: the Hugging
Face model itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from trainwatch.runner import run_script

_REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
import torch
from tests.hf_models import ATTENTION, batch_for, freeze, model_of, plant_nan, unplant

family, steps, bug = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = model_of(family)
if bug == "frozen":
    freeze(model, "transformer.h.1.attn.c_attn")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(steps):
    if bug != "missing_zero_grad" or step < 3:
        optimizer.zero_grad()
    if bug == "nan" and step == 3:
        plant_nan(model, ATTENTION[family])
    loss = model(**batch_for(family, step)).loss
    unplant(model, ATTENTION[family])
    loss.backward()
    optimizer.step()
print("finished", steps)
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train_hf.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
    """The script imports the shared tiny models, as a user's script imports its own."""
    monkeypatch.syspath_prepend(str(_REPO))


def _found(log: Path) -> list[tuple[str, int, str | None]]:
    lines = (log / "alerts.jsonl").read_text().splitlines()
    found = [json.loads(line) for line in lines]
    return [(a["rule"], a["step"], a["module"]) for a in found if a["severity"] != "info"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_clean_script_is_silent(tmp_path, script, family):
    code = run_script(script, [family, "8", "none"], log_dir=tmp_path / "log", console=False)
    assert code == 0
    assert _found(tmp_path / "log") == []


def test_missing_zero_grad_is_caught(tmp_path, script):
    run_script(script, ["gpt2", "6", "missing_zero_grad"], log_dir=tmp_path / "log", console=False)
    assert _found(tmp_path / "log") == [("accumulated_gradient", 3, None)]


def test_frozen_layer_in_the_optimizer_is_named(tmp_path, script):
    run_script(script, ["gpt2", "2", "frozen"], log_dir=tmp_path / "log", console=False)
    assert _found(tmp_path / "log") == [("frozen_in_optimizer", 0, "transformer.h.1.attn.c_attn")]


def test_a_nan_in_one_attention_block_is_named(tmp_path, script):
    run_script(script, ["bert", "5", "nan"], log_dir=tmp_path / "log", console=False)
    assert _found(tmp_path / "log")[:1] == [
        ("nonfinite_forward", 3, "bert.encoder.layer.1.attention.self.query")
    ]


@pytest.mark.slow
def test_the_console_script_gates_a_planted_bug_in_a_subprocess(tmp_path, script):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(tmp_path / "log"),
         "--fail-on", "warning", "--no-console", str(script), "t5", "5", "nan"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "finished 5" in done.stdout
    assert _found(tmp_path / "log")[:1] == [
        ("nonfinite_forward", 3, "decoder.block.1.layer.0.SelfAttention.q")
    ]
