"""A LoRA adapter whose A and B were both initialised to zero is told as such.

Each half's gradient passes through the other: with B all zeros A's gradient
is exactly zero, with A all zeros B's is. Neither ever moves, and there is no
dead ReLU to blame. zero_gradient names both halves as each other's all-zero
partner (``data.partner_stays_zero: both_zero``) and says to initialise A
randomly, in loralib's layout (both halves bare parameters of one layer) under
``tw.watch`` and in PEFT's (each half a Linear of its own) under ``trainwatch
run``. Beside each: the standard init (B zero, A random), LoRA-FA (A frozen,
random) and dead units upstream of a standard LoRA keep what they had.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.lora_models import LoraLinear
from trainwatch.runner import run_script

_DEAD_HINT = "dead (ReLU stuck at 0)"


class Adapted(nn.Module):
    """A frozen embedding-like input layer, a loralib LoRA layer, a frozen head.

    ``dead``: the input layer's units all dead, so the LoRA layer's input is zero."""

    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16).requires_grad_(False)
        self.fc = LoraLinear(16, 16)
        self.head = nn.Linear(16, 3).requires_grad_(False)
        if dead:
            with torch.no_grad():
                self.inp.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(torch.relu(self.inp(x))))


def _loralib_run(quiet_watch, setup: str) -> list:
    torch.manual_seed(0)
    model = Adapted(dead=setup == "dead_upstream")
    a = model.fc.lora_A
    if setup == "both_zero":  # A initialised like B, a copy-paste
        nn.init.zeros_(a)
    elif setup == "lora_fa":  # LoRA-FA: A random and frozen, only B learns
        a.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        x, y = torch.randn(32, 8, generator=gen), torch.randint(0, 3, (32,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


def test_both_halves_zero_in_one_layer_are_named_as_each_others_partner(quiet_watch):
    (alert,) = _loralib_run(quiet_watch, "both_zero")
    assert alert.module == "fc" and alert.step == 0
    assert alert.data["parameters"] == ["fc.lora_A", "fc.lora_B"]
    assert alert.data["cause"] == "all_zero_partner"
    assert alert.data["partner_stays_zero"] == "both_zero"
    assert alert.data["zero_partner"] == "fc.lora_B"
    assert alert.data["all_zero_weights"] == ["fc.lora_A", "fc.lora_B"]
    assert "fc.lora_A and fc.lora_B are both all zeros" in alert.message
    assert "gradient of each passes through the other" in alert.message
    assert "Initialise one of them randomly" in alert.hint and "kaiming" in alert.hint
    assert "dead" not in alert.hint  # no ReLU to blame: the old hint misled


@pytest.mark.parametrize("setup", ["standard", "lora_fa"])
def test_control_a_random_a_leaves_no_zero_gradient(quiet_watch, setup):
    assert _loralib_run(quiet_watch, setup) == []


def test_control_dead_units_before_a_standard_lora_keep_the_dead_relu_hint(quiet_watch):
    """B all zeros and silent, A random and silent: both silent through the dead
    input, and B is no cause (it would move if its input were alive)."""
    (alert,) = _loralib_run(quiet_watch, "dead_upstream")
    assert alert.module == "fc"
    assert "cause" not in alert.data
    assert _DEAD_HINT in alert.hint
    assert "all zeros" not in alert.message


PEFT_LAYOUT = """
import sys
import torch
from torch import nn

setup = sys.argv[1]
torch.manual_seed(0)


class PeftStyleLora(nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, base.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)
        if setup == "both_zero":
            nn.init.zeros_(self.lora_A["default"].weight)
        elif setup == "lora_fa":
            self.lora_A["default"].requires_grad_(False)

    def forward(self, x):
        return self.base_layer(x) + 2.0 * self.lora_B["default"](self.lora_A["default"](x))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16).requires_grad_(False)
        self.q = PeftStyleLora(nn.Linear(16, 16))
        self.v = PeftStyleLora(nn.Linear(16, 16))
        self.classifier = nn.Linear(16, 3)

    def forward(self, tokens):
        h = self.embed(tokens)
        scores = self.q(h) @ h.transpose(1, 2) / 4.0
        return self.classifier(scores.softmax(-1) @ self.v(h))


model = Encoder()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
gen = torch.Generator().manual_seed(0)
for step in range(8):
    tokens = torch.randint(0, 50, (8, 6), generator=gen)
    loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 3), (tokens % 3).reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _peft_run(tmp_path, setup: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(PEFT_LAYOUT)
    assert run_script(script, [setup], log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == "zero_gradient"]


def test_both_halves_zero_in_modules_of_their_own_name_each_other_under_run(tmp_path):
    found = _peft_run(tmp_path, "both_zero")
    told = {a["module"]: a for a in found}
    halves = [f"{layer}.lora_{half}.default" for layer in ("q", "v") for half in "AB"]
    assert sorted(told) == sorted(halves)
    for module, alert in told.items():
        layer, half = module.split(".")[0], module.split(".")[1][-1]
        other = "B" if half == "A" else "A"
        data = alert["data"]
        assert alert["severity"] == "warning" and alert["step"] == 0
        assert data["cause"] == "all_zero_partner"
        assert data["partner_stays_zero"] == "both_zero"
        assert data["zero_partner"] == f"{layer}.lora_{other}.default.weight"
        assert data["all_zero_weights"] == [
            f"{layer}.lora_A.default.weight",
            f"{layer}.lora_B.default.weight",
        ]
        assert "are both all zeros" in alert["message"]
        assert "Initialise one of them randomly" in alert["hint"]
        assert "dead" not in alert["hint"]


@pytest.mark.parametrize("setup", ["standard", "lora_fa"])
def test_control_peft_layout_with_a_random_a_is_silent_under_run(tmp_path, setup):
    assert _peft_run(tmp_path, setup) == []
