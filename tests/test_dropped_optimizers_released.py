"""An optimizer built anew every epoch or round, the old one dropped, is let go by the
monitor too: its state (Adam's moments) is freed, the setup table is not shown again
for each new one, and the checks go on with the optimizer that now steps."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

_SCRIPT = """
import sys, weakref, torch
from torch import nn

keep = sys.argv[1] == "keep"        # the control: the script keeps every optimizer
bug_epoch = int(sys.argv[2])        # from this epoch on, zero_grad() is forgotten
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
x, y = torch.randn(128, 16), torch.randn(128, 1)
kept, refs = [], []
for epoch in range(12):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * 0.9 ** epoch)  # lr set per epoch
    refs.append(weakref.ref(opt))
    if keep:
        kept.append(opt)
    for _ in range(4):
        if epoch < bug_epoch:
            opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
del opt
import gc
gc.collect()
print("LIVE", sum(r() is not None for r in refs))
"""


def _run(tmp_path: Path, keep: str, bug_epoch: int, capsys) -> tuple[int, list[dict], str]:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    run_script(script, [keep, str(bug_epoch)], log_dir=tmp_path / "log", console=True)
    out = capsys.readouterr()
    text = out.out + out.err
    live = int(text.split("LIVE ")[1].split()[0])
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return live, [json.loads(line) for line in lines], text


def test_under_run_an_optimizer_built_every_epoch_is_let_go_and_its_table_shown_once(
    tmp_path, capsys
):
    live, alerts, text = _run(tmp_path, "drop", 99, capsys)
    assert live == 1  # the last one, still watched: the eleven before it are let go
    assert [a for a in alerts if a["severity"] != "info"] == []
    assert text.count("trainwatch setup of") == 1


def test_under_run_a_bug_in_a_later_epochs_optimizer_is_still_told(tmp_path, capsys):
    live, alerts, _ = _run(tmp_path, "drop", 6, capsys)
    assert live == 1
    told = [(a["rule"], a["step"]) for a in alerts if a["severity"] != "info"]
    assert told[0] == ("accumulated_gradient", 24)  # epoch 6's first step, onto step 23's


def test_control_optimizers_the_script_keeps_are_kept(tmp_path, capsys):
    live, alerts, _ = _run(tmp_path, "keep", 99, capsys)
    assert live == 12
    assert [a for a in alerts if a["severity"] != "info"] == []


def test_add_optimizer_lets_go_of_the_one_the_loop_replaced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    x, y = torch.randn(128, 16), torch.randn(128, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    first = weakref.ref(opt)
    with tw.watch(model, opt, console=False) as monitor:
        for epoch in range(3):
            if epoch:
                opt = torch.optim.Adam(model.parameters(), lr=1e-3 / (epoch + 1))
                monitor.add_optimizer(opt)
            for _ in range(4):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        gc.collect()
        assert first() is None
        assert monitor.optimizers == [opt]
    assert [a for a in monitor.alerts if a.severity != "info"] == []


def test_control_add_optimizer_keeps_a_gans_first_optimizer():
    """Two optimizers the loop keeps (a GAN's): the second's arrival lets go of neither."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Linear(8, 8), "d": nn.Linear(8, 1)})
    opt_g = torch.optim.Adam(model["g"].parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(model["d"].parameters(), lr=1e-3)
    with tw.watch(model, opt_g, console=False) as monitor:
        monitor.add_optimizer(opt_d)
        assert monitor.optimizers == [opt_g, opt_d]


def test_a_let_go_optimizers_norms_leave_the_latest_ones():
    """Pre-training over the whole model, then a head trained alone on a frozen body:
    the body's last norms, from the dropped optimizer, are no longer reported as
    the latest step's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    x, y = torch.randn(128, 16), torch.randn(128, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for phase in range(2):
            if phase:
                model[0].requires_grad_(False)
                opt = torch.optim.Adam(model[2].parameters(), lr=1e-3)
                monitor.add_optimizer(opt)
            for _ in range(4):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
        assert set(monitor.grad_norms()) == {"2"}


def test_control_a_kept_optimizers_norms_stay_among_the_latest():
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Linear(8, 8), "d": nn.Linear(8, 1)})
    opt_g = torch.optim.SGD(model["g"].parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(model["d"].parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    with tw.watch(model, [opt_g, opt_d], console=False) as monitor:
        for _ in range(3):
            for opt in (opt_g, opt_d):
                opt.zero_grad()
                model["d"](model["g"](x)).mean().backward()
                opt.step()
        assert set(monitor.grad_norms()) == {"g", "d"}
