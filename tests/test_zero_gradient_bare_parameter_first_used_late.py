"""A model's own nn.Parameter whose first use comes after the first steps.

Classifier-free guidance reads its learned null embedding (a bare parameter of
the model, beside its layers) on the batches whose condition is dropped only:
with the first such batch at step 5 or 30 it has no gradient (None) from step
0 until then, and was warned of at step 0 with the .detach() hint, a warning
that stood to the end. It now gets the 50 steps a bare parameter that trained
before gets, while the model's passes are watched for reads of it: one read
through a .detach() is still told at the usual patience, and one no pass reads
(a learned token defined and forgotten) after those 50 steps, as never read.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F


class Denoiser(nn.Module):
    """The repro's shape: the null embedding replaces the class embedding when the
    batch's labels are dropped."""

    def __init__(self, d: int = 16, classes: int = 4, cut: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 64), nn.SiLU(), nn.Linear(64, d))
        self.cond = nn.Embedding(classes, d)
        self.null = nn.Parameter(torch.zeros(d))
        self.cut = cut

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        null = self.null.detach() if self.cut else self.null
        c = null if y is None else self.cond(y)
        return self.body(x + c)


def _denoiser_run(quiet_watch, first: int, every: int = 7, steps: int = 70, cut: bool = False):
    torch.manual_seed(0)
    model = Denoiser(cut=cut)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        if step >= first and (step - first) % every == 0:
            y = None  # an unconditional batch
        loss = F.mse_loss(model(x, y), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


@pytest.mark.parametrize("first", [3, 5, 30])
def test_a_null_embedding_first_used_after_the_first_steps_is_silent(quiet_watch, first):
    assert _denoiser_run(quiet_watch, first) == []


def test_a_null_embedding_detached_is_still_told_at_the_usual_patience(quiet_watch):
    # Read (through its .detach()) on an unconditional batch at step 1: a cut.
    found = _denoiser_run(quiet_watch, first=1, every=3, cut=True)
    assert [(a.step, a.module, a.data["kind"]) for a in found] == [(0, "", "none")]
    assert found[0].data["steps"] == 3  # told at step 2, as before
    assert "never_read" not in found[0].data.values()


class Tokens(nn.Module):
    """A ViT-like encoder with a learned CLS token (read every step) and a
    register token that is read, forgotten or detached as planted."""

    def __init__(self, register: str) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
        self.register = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.use = register

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        parts = [self.cls.expand(len(x), -1, -1), h]
        if self.use == "read":
            parts.insert(1, self.register.expand(len(x), -1, -1))
        elif self.use == "detached":
            parts.insert(1, self.register.detach().expand(len(x), -1, -1))
        h = torch.cat(parts, dim=1)
        h = h + self.mix(h).mean(dim=1, keepdim=True)
        return self.head(h[:, 0])


def _tokens_run(quiet_watch, register: str, steps: int):
    torch.manual_seed(0)
    model = Tokens(register)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(steps):
        x = torch.randn(8, 5, 8)
        loss = F.cross_entropy(model(x), x[:, 0, :3].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


def test_control_a_cls_and_register_token_read_every_step_are_silent(quiet_watch):
    assert _tokens_run(quiet_watch, "read", 60) == []


def test_a_register_token_never_read_is_told_after_the_50_step_grace(quiet_watch):
    found = _tokens_run(quiet_watch, "forgotten", 60)
    assert [(a.step, a.module, a.severity) for a in found] == [(0, "", "warning")]
    alert = found[0]
    assert alert.data["parameters"] == ["register"]
    assert alert.data["steps"] == 50  # told at step 49
    assert alert.data["cause"] == "never_read"
    assert alert.data["passes_watched"] == 49  # every pass with gradients after step 0
    assert "left out of forward()" in alert.hint


def test_a_register_token_never_read_is_not_told_before_the_grace(quiet_watch):
    assert _tokens_run(quiet_watch, "forgotten", 49) == []


def test_a_register_token_detached_is_told_at_the_usual_patience(quiet_watch):
    found = _tokens_run(quiet_watch, "detached", 10)
    assert [(a.step, a.module, a.severity) for a in found] == [(0, "", "warning")]
    assert found[0].data["steps"] == 3
    assert found[0].data.get("cause") != "never_read"
    assert ".detach()" in found[0].hint


def test_the_reads_are_watched_within_the_passes_only(quiet_watch):
    """The look at reads lives inside the model's passes while a token has had no
    gradient yet: between them, and after the monitor closes, no mode is left."""
    torch.manual_seed(0)
    model = Tokens("forgotten")
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(5):
        x = torch.randn(8, 5, 8)
        loss = F.cross_entropy(model(x), x[:, 0, :3].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert torch._C._len_torch_function_stack() == 0
    model(torch.randn(8, 5, 8))  # a pass the monitor watches, then closed mid-streak
    monitor.close()
    assert torch._C._len_torch_function_stack() == 0


CFG_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)


    class Denoiser(nn.Module):
        def __init__(self, d=16, nc=4):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(d, 64), nn.SiLU(), nn.Linear(64, d))
            self.cond = nn.Embedding(nc, d)
            self.null = nn.Parameter(torch.zeros(d))

        def forward(self, x, y=None):
            c = self.null if y is None else self.cond(y)
            return self.body(x + c)


    model = Denoiser()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for step in range(60):
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        if step >= FIRST and (step - FIRST) % 9 == 0:
            y = None
        loss = F.mse_loss(model(x, y), x)
        opt.zero_grad(); loss.backward(); opt.step()
    """
)


@pytest.mark.parametrize("first", [5, 30])
def test_trainwatch_run_on_a_null_embedding_first_used_late_is_silent(tmp_path, first):
    from trainwatch.runner import run_script

    script = tmp_path / "cfg.py"
    script.write_text(CFG_SCRIPT.replace("FIRST", str(first)))
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = list(map(json.loads, lines))
    assert [a for a in alerts if a["severity"] != "info"] == []


def test_trainwatch_run_on_a_detached_null_embedding_is_told(tmp_path):
    from trainwatch.runner import run_script

    script = tmp_path / "cfg.py"
    text = CFG_SCRIPT.replace("FIRST", "1").replace("c = self.null if", "c = self.null.detach() if")
    script.write_text(text)
    run_script(script, log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    told = [a for a in map(json.loads, lines) if a["rule"] == "zero_gradient"]
    assert [(a["step"], a["module"], a["severity"]) for a in told] == [(0, "", "warning")]
