"""The Hugging Face support is an extra: ``import trainwatch`` never needs transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parent.parent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def test_importing_trainwatch_loads_no_hugging_face_package():
    code = (
        "import json, sys, trainwatch; "
        "print(json.dumps([m for m in ('transformers', 'peft', 'accelerate') if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=_REPO
    )
    assert json.loads(out.stdout) == []


def test_the_hf_extra_names_what_trainwatch_hf_imports():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((_REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {spec.split(">")[0].split("=")[0] for spec in extras["hf"]}
    assert {"transformers", "peft"} <= names
    assert names <= {spec.split(">")[0].split("=")[0] for spec in extras["dev"]}


def test_the_callback_is_a_transformers_trainer_callback():
    transformers = pytest.importorskip("transformers")
    from trainwatch.hf import TrainWatchCallback

    assert isinstance(TrainWatchCallback(console=False), transformers.TrainerCallback)
