"""An EMA copy handed to its model's optimizer is told as that, once, with advice that fits.

``SGD([*model.parameters(), *ema.parameters()])`` holds an EMA copy
(``torch.optim.swa_utils.AveragedModel``, or a ``copy.deepcopy`` moved by
``lerp_`` under ``no_grad``) beside the model it averages. The copy gets no
gradient by design and is evaluated in eval mode on purpose. Under
``trainwatch run``, which watches the copy as a model of its own from its first
evaluation, it was told as a layer cut off (zero_gradient's ".detach()" advice)
and as a training step run in eval mode ("call model.train()"), dated by the
copy's own step count (0, 1) while the training was at step 8; under
``tw.watch`` nothing was said. Now one ``info`` line, at the first step, says
an EMA or averaged copy sits in the optimizer (``data.kind: copy_in_optimizer``),
and the copy's own findings are dated at the training's step. With the copy
left out of the optimizer nothing is told.
"""

from __future__ import annotations

import json

import pytest

import trainwatch as tw
from trainwatch.runner import run_script

SCRIPT = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# averaged or lerp; the copy with the model in its optimizer or apart; evaluated in eval or train
shape, where, evaluated = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
if shape == "averaged":
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 10),
    )
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
    x, y = torch.randn(256, 3, 8, 8), torch.randint(0, 10, (256,))
else:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))
    ema = copy.deepcopy(model)
    x, y = torch.randn(256, 16), torch.randint(0, 10, (256,))
params = [*model.parameters(), *ema.parameters()] if where == "with" else model.parameters()
if shape == "averaged":
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
else:
    opt = torch.optim.AdamW(params, 1e-3, weight_decay=0.01)
for epoch in range(3):
    model.train()
    for i in range(8):
        loss = F.cross_entropy(model(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if shape == "averaged":
            ema.update_parameters(model)
        else:
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.01)
    if evaluated == "eval":
        ema.eval()
    with torch.no_grad():
        print("epoch", epoch, (ema(x[:64]).argmax(1) == y[:64]).float().mean().item())
"""


def _run(tmp_path, args: list[str]) -> list[dict]:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    run_script(path, args, log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("shape", ["averaged", "lerp"])
def test_under_trainwatch_run_an_ema_copy_in_the_optimizer_is_one_note(tmp_path, shape):
    """The repro's AveragedModel under SGD, and a deepcopy moved by lerp_ under AdamW:
    one note at step 0, naming the copy; no layer cut off, no model.train() advice."""
    alerts = _run(tmp_path, [shape, "with", "eval"])
    (note,) = [a for a in alerts if a["rule"] == "zero_gradient"]
    assert note["severity"] == "info" and note["step"] == 0
    assert note["data"]["kind"] == "copy_in_optimizer"
    assert "EMA or averaged copy" in note["message"]
    assert "model.parameters() alone" in note["hint"]
    assert ".detach()" not in note["hint"]
    assert [a for a in alerts if a["rule"] == "train_in_eval_mode"] == []
    assert [a for a in alerts if a["severity"] != "info"] == []


@pytest.mark.parametrize("shape", ["averaged", "lerp"])
def test_under_trainwatch_run_an_ema_copy_kept_apart_is_silent(tmp_path, shape):
    """Control: the optimizer over model.parameters() alone."""
    assert _run(tmp_path, [shape, "apart", "eval"]) == []


@pytest.mark.parametrize("shape", ["averaged", "lerp"])
def test_the_copys_own_findings_are_dated_at_the_trainings_step(tmp_path, shape):
    """The copy in the optimizer evaluated in training mode (ema.eval() forgotten):
    told as an evaluation in training mode at the end of the first epoch (8 steps
    in), not at the copy's own step 0, and not taken for a generator whose
    optimizer steps between its samples."""
    alerts = _run(tmp_path, [shape, "with", "train"])
    (told,) = [a for a in alerts if a["rule"] == "eval_in_train_mode"]
    assert told["step"] == 8
    assert told["data"]["model"] in ("AveragedModel", "Sequential#2")


def _watched_loop(with_copy: bool) -> list[tuple[str, str, int, str | None]]:
    import copy

    import torch
    from torch import nn
    from torch.nn import functional as F

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 10))
    ema = copy.deepcopy(model)
    params = [*model.parameters(), *ema.parameters()] if with_copy else model.parameters()
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(12):
            x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.01)
    return [(a.rule, a.severity, a.step, a.data.get("kind")) for a in monitor.alerts]


def test_under_tw_watch_an_ema_copy_in_the_optimizer_is_one_note():
    """The copy lies outside the watched model: told at step 0, once."""
    assert _watched_loop(True) == [("zero_gradient", "info", 0, "copy_in_optimizer")]


def test_under_tw_watch_an_ema_copy_kept_apart_is_silent():
    assert _watched_loop(False) == []


TWINS = """
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)


def critic():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


q1, q2 = critic(), critic()  # initialised apart: twins, not a copy
opt = torch.optim.Adam([*q1.parameters(), *q2.parameters()], 1e-3)
for step in range(12):
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with torch.no_grad():
        q2(x)  # its own loss term forgotten: no gradient ever reaches it
    loss = F.mse_loss(q1(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_twin_network_initialised_apart_is_no_copy(tmp_path):
    """Two critics of one architecture in one optimizer, the second's loss forgotten:
    it lies far from the first (no average of it), so its layers are still told as
    getting no gradient, a warning, and no copy note is made."""
    path = tmp_path / "twins.py"
    path.write_text(TWINS)
    run_script(path, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    told = [a for a in map(json.loads, lines) if a["rule"] == "zero_gradient"]
    assert told and all(a["severity"] == "warning" for a in told)
    assert all(a["data"].get("kind") != "copy_in_optimizer" for a in told)
