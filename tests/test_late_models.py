"""``trainwatch run`` finds a model first called late, in a no_grad or inference_mode block.

The global forward hooks that find models come off after the first steps; an
EMA copy first validated at step 30 was never watched, so validating it in
training mode (dropout on, batch norm statistics moved by validation data)
went unreported. Entering a ``no_grad`` or ``inference_mode`` block now turns
the hooks on for that block, at the 1st, 2nd, 4th... entry from the same line.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script

EMA_FIRST_VALIDATED_LATE = """
import copy
import sys
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

forgot_eval, block = sys.argv[1] == "forgot_eval", sys.argv[2]
looks = 0
register = module_hooks.register_module_forward_pre_hook


def counted(hook):
    global looks
    looks += 1
    return register(hook)


module_hooks.register_module_forward_pre_hook = counted
torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4)
)
ema = copy.deepcopy(model)
ema.requires_grad_(False)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x_val, y_val = torch.randn(512, 16), torch.randint(0, 4, (512,))


@torch.no_grad()
def evaluate(net):
    return (net(x_val).argmax(1) == y_val).float().mean().item()


def validate(net):
    if block == "decorated":
        return evaluate(net)
    with torch.inference_mode() if block == "inference_mode" else torch.no_grad():
        return (net(x_val).argmax(1) == y_val).float().mean().item()


for step in range(200):
    if step in (30, 45, 120):  # the EMA copy's first validation comes late
        if not forgot_eval:
            ema.eval()
        validate(ema)
        ema.train()
    if step % 20 == 10:  # the model's own validation, in eval mode
        model.eval()
        validate(model)
        model.train()
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a no_grad of its own
    opt.step()
    with torch.no_grad():  # the EMA update: a block entered at every step
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.99).add_(p, alpha=0.01)
print("global forward hooks left:", len(module_hooks._global_forward_pre_hooks))
print("forward hooks turned on:", looks)
"""


def _run(tmp_path, how: str, block: str) -> list[tuple[str, int, str | None]]:
    script = tmp_path / "ema_late.py"
    script.write_text(EMA_FIRST_VALIDATED_LATE)
    run_script(script, [how, block], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    return alerts


@pytest.mark.parametrize("block", ["no_grad", "inference_mode", "decorated"])
def test_an_ema_copy_first_validated_late_in_training_mode_warns(tmp_path, capsys, block):
    alerts = _run(tmp_path, "forgot_eval", block)
    rules = {(rule, module) for rule, _, module in alerts}
    assert ("eval_in_train_mode", "1") in rules
    # Told at its second validation (one pass cannot show an evaluation), dated
    # by the first: the step the training was in, not the copy's own count (0).
    assert min(step for rule, step, _ in alerts if rule == "eval_in_train_mode") == 30
    out = capsys.readouterr().out
    assert "global forward hooks left: 0" in out


@pytest.mark.parametrize("block", ["no_grad", "inference_mode", "decorated"])
def test_an_ema_copy_first_validated_late_in_eval_mode_is_silent(tmp_path, capsys, block):
    alerts = _run(tmp_path, "eval", block)
    assert alerts == []
    assert "global forward hooks left: 0" in capsys.readouterr().out


def test_blocks_entered_every_step_turn_the_hooks_on_a_logarithmic_number_of_times(
    tmp_path, capsys
):
    # 200 EMA updates and 200 clips (each a no_grad block), 10 validations of
    # the model and 3 of the copy: the first steps' hooks, then about log2(n)
    # looks per line of the script, not one per block.
    _run(tmp_path, "eval", "no_grad")
    out = capsys.readouterr().out
    looks = int(out.split("forward hooks turned on:")[1].split()[0])
    assert looks <= 1 + 4 * 9


def test_a_block_that_finds_nothing_new_turns_the_hooks_off_again(tmp_path, capsys):
    script = tmp_path / "validated.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "from torch.nn.modules import module as module_hooks\n"
        "model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(12):\n"
        "    loss = model(torch.randn(4, 8)).pow(2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()\n"
        "    if step == 8:\n"
        "        model.eval()\n"
        "        with torch.no_grad():\n"
        "            model(torch.randn(4, 8))\n"
        "            print('inside:', len(module_hooks._global_forward_pre_hooks))\n"
        "        print('after:', len(module_hooks._global_forward_pre_hooks))\n"
        "        model.train()\n"
    )
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    out = capsys.readouterr().out
    assert "inside: 1" in out and "after: 0" in out
    assert (tmp_path / "log" / "alerts.jsonl").read_text() == ""


@pytest.mark.parametrize("forgot_eval", [True, False])
def test_a_watched_copy_without_steps_dates_its_findings_by_the_training_step(forgot_eval):
    """Under tw.watch too: an EMA copy watched on its own takes no steps; its
    evaluation in training mode is dated by the step the trained model is in."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False), tw.watch(ema, console=False) as ema_monitor:
        for step in range(60):
            if step in (30, 45):
                if not forgot_eval:
                    ema.eval()
                with torch.no_grad():
                    ema(torch.randn(64, 8))
                ema.train()
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.05)
    found = [(a.rule, a.step) for a in ema_monitor.alerts]
    if forgot_eval:
        assert ("eval_in_train_mode", 30) in found
    else:
        assert found == []
    assert ema_monitor.step_count == 0
