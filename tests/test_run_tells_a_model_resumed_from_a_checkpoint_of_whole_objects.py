"""A resume that takes the model object out of a checkpoint of whole objects.

The checkpoint holds the objects themselves (``torch.save({"model": model,
"optimizer": opt, "epoch": e})``, loaded with ``weights_only=False``) and the
resume runs ``model = ck["model"]`` after the optimizer was built over a fresh
model: the loop trains the loaded model, whose gradients no optimizer applies,
while the optimizer steps the fresh model's parameters. ``trainwatch run`` said
nothing, and closed with "no optimizer stepped and no backward pass reached a
model" though the optimizer stepped at every batch: the unpickled optimizer,
still alive in ``ck``, holds exactly the loaded model's parameters, so the
loaded model was paired with it, and it never steps. Now the model is told in
its first steps as ``not_optimized`` (``data.kind: replaced_model``), as the
same resume with ``ck`` dropped always was; and a run that watched no step,
while an optimizer did step, says that it stepped.

Clean beside them: the weights loaded into the model the optimizer holds, the
model and the optimizer both taken from the checkpoint, a checkpoint of state
dicts, and the best model object reloaded from an early-stopping checkpoint
once training is over.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

# A notebook's resume cell, at the top of the script: ``mode`` says how.
RESUME = """
import sys
import torch
import torch.nn.functional as F
from torch import nn

mode, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
x_all = torch.randn(512, 10)
y_all = (x_all[:, 0] > 0).long()


def net():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))


# An earlier run's checkpoint.
old = net()
old_opt = torch.optim.Adam(old.parameters(), lr=1e-2)
if mode == "state_dicts":
    torch.save({"model": old.state_dict(), "optimizer": old_opt.state_dict(), "epoch": 4}, path)
else:
    torch.save({"model": old, "optimizer": old_opt, "epoch": 4}, path)
del old, old_opt

model = net()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
ck = torch.load(path, weights_only=False)
if mode == "bug":
    model = ck["model"]  # the optimizer still holds the fresh model's parameters
elif mode == "load_state_dict":
    model.load_state_dict(ck["model"].state_dict())
elif mode == "both_objects":
    model, optimizer = ck["model"], ck["optimizer"]
else:
    model.load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])
for step in range(40):
    i = (step * 64) % 512
    optimizer.zero_grad()
    F.cross_entropy(model(x_all[i:i + 64]), y_all[i:i + 64]).backward()
    optimizer.step()
"""

# The same resume inside main(), behind a flag, with a scheduler and a checkpoint
# of whole objects written every epoch (the first run writes the one resumed from).
RESUME_IN_MAIN = """
import argparse
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt")
    ap.add_argument("--resume", choices=["bug", "fixed"])
    args = ap.parse_args()
    torch.manual_seed(0)
    x_all = torch.randn(512, 10)
    y_all = (x_all[:, 0] > 0).long()
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    start = 0
    if args.resume:
        ck = torch.load(args.ckpt, weights_only=False)
        if args.resume == "bug":
            model = ck["model"]  # a new object: the optimizer above steps the old one
        else:
            model.load_state_dict(ck["model"].state_dict())
            optimizer.load_state_dict(ck["optimizer"].state_dict())
        start = ck["epoch"] + 1
    for epoch in range(start, start + 3):
        model.train()
        for i in range(0, 512, 64):
            optimizer.zero_grad()
            F.cross_entropy(model(x_all[i:i + 64]), y_all[i:i + 64]).backward()
            optimizer.step()
        sched.step()
        torch.save(
            {"model": model, "optimizer": optimizer, "scheduler": sched, "epoch": epoch},
            args.ckpt,
        )


if __name__ == "__main__":
    main()
"""

# The best epoch's objects restored mid-training, the checkpoint dict kept.
RESTORE_MID_TRAINING = """
import sys
import torch
from torch import nn

mode, path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
x_all = torch.randn(512, 8)
y_all = (x_all[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(6):
    model.train()
    for i in range(0, 512, 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_all[i:i + 64]), y_all[i:i + 64]).backward()
        opt.step()
    if epoch == 1:
        torch.save({"model": model, "optimizer": opt, "epoch": epoch}, path)
    if epoch == 2:
        ck = torch.load(path, weights_only=False)
        if mode == "bug":
            model = ck["model"]  # the optimizer still holds the old model
        else:
            model.load_state_dict(ck["model"].state_dict())
"""

# Early stopping: the best epoch's objects saved, the best model reloaded for the
# test set once training is over (and a saliency backward through it).
EARLY_STOPPING = """
import sys
import torch
from torch import nn

path = sys.argv[1]
torch.manual_seed(0)
x_all = torch.randn(512, 8)
y_all = (x_all[:, 0] > 0).long()
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
best = None
for epoch in range(5):
    model.train()
    for i in range(0, 448, 64):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x_all[i:i + 64]), y_all[i:i + 64]).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        val = nn.functional.cross_entropy(model(x_all[448:]), y_all[448:]).item()
    if best is None or val < best:
        best = val
        torch.save({"model": model, "optimizer": opt, "epoch": epoch}, path)
ck = torch.load(path, weights_only=False)
model = ck["model"]
model.eval()
with torch.no_grad():
    model(x_all[448:])
nn.functional.cross_entropy(model(x_all[448:]), y_all[448:]).backward()
"""


def _run(tmp_path, source: str, args: list[str], console: bool = False):
    script = tmp_path / "train.py"
    script.write_text(source)
    log = tmp_path / "log"
    code = run_script(script, args, log_dir=log, console=console)
    assert code == 0
    lines = (log / "alerts.jsonl").read_text().splitlines()
    counts = json.loads((log / "alert_counts.json").read_text())
    return [json.loads(line) for line in lines], counts["steps"]


def _replaced(alerts: list[dict]) -> list[dict]:
    return [
        a
        for a in alerts
        if a["rule"] == "not_optimized" and a["data"].get("kind") == "replaced_model"
    ]


def test_the_model_taken_from_a_checkpoint_of_objects_is_told_as_the_replacement(tmp_path, capsys):
    alerts, steps = _run(tmp_path, RESUME, ["bug", str(tmp_path / "ck.pt")], console=True)
    (told,) = _replaced(alerts)
    assert told["step"] <= 2
    assert told["data"]["optimizer_class"] == "Adam"
    assert sorted(told["data"]["parameters"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert "the model was replaced after the optimizer was built" in told["message"]
    assert [a["rule"] for a in alerts] == ["not_optimized"]
    assert steps == 40  # every backward through the loaded model is a step
    err = capsys.readouterr().err
    assert "no training step watched" not in err and "40 steps watched" in err


@pytest.mark.parametrize("mode", ["load_state_dict", "both_objects", "state_dicts"])
def test_a_resume_the_optimizer_trains_is_silent(tmp_path, mode):
    alerts, steps = _run(tmp_path, RESUME, [mode, str(tmp_path / "ck.pt")])
    assert alerts == []
    assert steps == 40


def test_the_resume_inside_main_is_told_and_its_fixed_twin_is_silent(tmp_path):
    ckpt = str(tmp_path / "objects.pt")
    alerts, steps = _run(tmp_path, RESUME_IN_MAIN, ["--ckpt", ckpt])
    assert (alerts, steps) == ([], 24)  # the first run, which writes the checkpoint
    alerts, steps = _run(tmp_path, RESUME_IN_MAIN, ["--ckpt", ckpt, "--resume", "fixed"])
    assert (alerts, steps) == ([], 24)
    alerts, steps = _run(tmp_path, RESUME_IN_MAIN, ["--ckpt", ckpt, "--resume", "bug"])
    (told,) = _replaced(alerts)
    assert told["step"] <= 2 and told["data"]["optimizer_class"] == "Adam"
    assert [a["rule"] for a in alerts] == ["not_optimized"]
    assert steps == 24


def test_the_best_objects_restored_mid_training_are_told_as_the_replacement(tmp_path):
    alerts, steps = _run(tmp_path, RESTORE_MID_TRAINING, ["bug", str(tmp_path / "ck.pt")])
    (told,) = _replaced(alerts)
    # 8 steps an epoch: the loaded model is first trained at step 24.
    assert 24 <= told["step"] <= 28
    assert told["data"]["stale_model"] == "Sequential" and told["data"]["stale_since"] == 24
    assert told["data"]["optimizer_class"] == "SGD"
    # Nothing else is told of the loaded model: no optimizer that "never stepped".
    assert [a["rule"] for a in alerts if a["data"]["model"] == told["data"]["model"]] == [
        "not_optimized"
    ]
    # The old model, no longer called, is told as such if anything.
    assert {a["data"].get("kind") for a in alerts if a["rule"] == "zero_gradient"} <= {
        "model_not_called"
    }
    assert steps == 48


def test_the_best_weights_loaded_mid_training_are_silent(tmp_path):
    alerts, steps = _run(tmp_path, RESTORE_MID_TRAINING, ["fixed", str(tmp_path / "ck.pt")])
    assert (alerts, steps) == ([], 48)


def test_the_best_model_object_reloaded_after_training_is_silent(tmp_path):
    alerts, steps = _run(tmp_path, EARLY_STOPPING, [str(tmp_path / "best.pt")])
    assert (alerts, steps) == ([], 35)


def test_a_run_whose_optimizer_stepped_unwatched_does_not_say_none_stepped(tmp_path, capsys):
    """The loaded model is of another size than the fresh one the optimizer holds:
    not taken for its replacement, nothing is watched; the closing line says the
    optimizer stepped, and which model ran without an optimizer stepping it."""
    source = RESUME.replace(
        "old = net()", "old = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 2))"
    )
    alerts, steps = _run(tmp_path, source, ["bug", str(tmp_path / "ck.pt")], console=True)
    assert (alerts, steps) == ([], 0)
    err = capsys.readouterr().err
    assert "no optimizer stepped" not in err
    assert "the Adam optimizer stepped 40 times" in err
    assert "Sequential ran, but no optimizer holding its parameters stepped" in err


def test_under_watch_the_loaded_model_with_the_fresh_optimizer_is_refused(tmp_path):
    """``tw.watch`` is given both: the optimizer holds none of the model's parameters."""
    path = tmp_path / "ck.pt"
    old = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    torch.save({"model": old, "optimizer": torch.optim.Adam(old.parameters())}, path)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.Adam(model.parameters())
    ck = torch.load(path, weights_only=False)
    model = ck["model"]
    with pytest.raises(tw.WatchError, match="none of them belongs to the watched model"):
        tw.watch(model, optimizer, console=False)
    monitor = tw.watch(model, ck["optimizer"], console=False)  # the checkpoint's pair
    monitor.close()
