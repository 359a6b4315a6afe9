"""A VAE's learned prior while its KL term is annealed in from a weight of 0.

The prior's ``mu`` and ``logvar`` (both 0 at init: N(0, I)) get an exactly zero
gradient while the loss weighs the KL by ``beta = 0``, and learn once beta
rises. Two wrong findings came of it:

- returned by the model as they are (leaf parameters among its outputs), they
  were a warning that was never withdrawn, while the same outputs made by an op
  (``prior_mu.expand(n, -1)``) were the documented info line of an output the
  loss weighs by 0 for now. Both are that info line now (``data.kind:
  output_without_signal``), under ``tw.watch`` and ``trainwatch run``;
- held by a module of their own and read by the loop, both all zeros, they were
  told as each other's all-zero partner ("the gradient of each passes through
  the other, so neither ever leaves zero", LoRA's hint), which is false: neither
  multiplies the other. Only weights that chain as the factors of one product
  (LoRA's ``B (out, r)`` after ``A (r, in)``) are partners now.

Beside each: the prior cut off by a ``.detach()`` in the KL, a returned
parameter also read inside the model along a dead path, and a low-rank factor
pair both initialised to zero are still told; beta = 1 from the start is silent.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainwatch.runner import run_script

STEPS, WARM_UP = 16, 8


class ReturnsPrior(nn.Module):
    """A VAE returning its learned prior's parameters as they are, in a tuple.

    ``read_inside``: ``prior_mu`` is read inside the model too, along a path
    whose units are all dead (a zero gradient there of its own)."""

    def __init__(self, read_inside: bool = False, z: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2 * z))
        self.dec = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, 32))
        self.prior_mu = nn.Parameter(torch.zeros(z))
        self.prior_logvar = nn.Parameter(torch.zeros(z))
        self.read_inside = read_inside

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.enc(x).chunk(2, 1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        if self.read_inside:
            z = z + torch.relu(self.prior_mu - 100.0)  # dead: relu of values far below 0
        return self.dec(z), mu, logvar, self.prior_mu, self.prior_logvar


def _kl(mu, logvar, pm, plv) -> torch.Tensor:
    return 0.5 * (plv - logvar + (logvar.exp() + (mu - pm) ** 2) / plv.exp() - 1).sum(1).mean()


def _beta(setup: str, step: int) -> float:
    if setup == "no_warm_up":
        return 1.0
    return 0.0 if step < WARM_UP else (step - WARM_UP + 1) / WARM_UP


def _returns_prior_run(quiet_watch, setup: str) -> list:
    torch.manual_seed(0)
    model = ReturnsPrior(read_inside=setup == "read_inside")
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        x = (torch.rand(64, 32, generator=gen) > 0.5).float()
        logits, mu, logvar, pm, plv = model(x)
        if setup == "detached":
            pm = pm.detach()  # the bug: the prior's mean never learns
        rec = F.binary_cross_entropy_with_logits(logits, x, reduction="none").sum(1).mean()
        loss = rec + _beta(setup, step) * _kl(mu, logvar, pm, plv)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.prior_logvar.abs().max() > 0  # it learns once beta rises
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


def test_prior_parameters_returned_as_they_are_are_an_output_without_signal(quiet_watch):
    (alert,) = _returns_prior_run(quiet_watch, "kl_annealed")
    assert alert.severity == "info" and alert.module == "" and alert.step == 0
    assert alert.data["kind"] == "output_without_signal"
    assert alert.data["outputs"] == [3, 4]
    assert alert.data["parameters"] == ["prior_mu", "prior_logvar"]
    assert "the model returns them as they are (outputs 3, 4)" in alert.message
    assert "loss weight is 0 for now" in alert.hint


def test_control_no_warm_up_is_silent(quiet_watch):
    assert _returns_prior_run(quiet_watch, "no_warm_up") == []


def test_control_a_prior_detached_in_the_kl_is_still_told(quiet_watch):
    found = _returns_prior_run(quiet_watch, "detached")
    (told,) = [a for a in found if a.severity == "warning"]
    assert told.module == "" and "prior_mu" in told.data["parameters"]
    assert told.data["kind"] == "none" and told.step == 0


def test_control_a_returned_parameter_also_read_inside_along_a_dead_path_is_told(quiet_watch):
    """Its zero gradient may be the dead path's: no output without signal is claimed."""
    found = _returns_prior_run(quiet_watch, "read_inside")
    (alert,) = [a for a in found if "prior_mu" in a.data["parameters"]]
    assert alert.severity == "warning"
    assert alert.data.get("kind") != "output_without_signal"


DICT_OUTPUT = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

setup = sys.argv[1]
torch.manual_seed(0)


class VAE(nn.Module):
    def __init__(self, z=4):
        super().__init__()
        self.enc = nn.Linear(16, 2 * z)
        self.dec = nn.Sequential(nn.Linear(z, 32), nn.Tanh(), nn.Linear(32, 16))
        self.prior_mu = nn.Parameter(torch.zeros(z))
        self.prior_logvar = nn.Parameter(torch.zeros(z))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, 1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return {"recon": self.dec(z), "mu": mu, "logvar": logvar,
                "prior": (self.prior_mu, self.prior_logvar)}


model = VAE()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(0)
for step in range(16):
    x = torch.randn(32, 16, generator=gen)
    out = model(x)
    pm, plv = out["prior"]
    if setup == "detached":
        pm = pm.detach()
    mu, logvar = out["mu"], out["logvar"]
    kl = 0.5 * (plv - logvar + (logvar.exp() + (mu - pm) ** 2) / plv.exp() - 1).sum(1).mean()
    beta = 1.0 if setup == "no_warm_up" else max(0.0, (step - 7) / 8)
    loss = F.mse_loss(out["recon"], x) + beta * kl
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _run(tmp_path, script_text: str, setup: str) -> list[dict]:
    script = tmp_path / "train.py"
    script.write_text(script_text)
    assert run_script(script, [setup], log_dir=tmp_path / "log", console=False) == 0
    alerts = tmp_path / "log" / "alerts.jsonl"
    lines = alerts.read_text().splitlines() if alerts.exists() else []
    return [a for a in map(json.loads, lines) if a["rule"] == "zero_gradient"]


def test_prior_returned_in_a_dict_is_an_output_without_signal_under_run(tmp_path):
    (alert,) = _run(tmp_path, DICT_OUTPUT, "kl_annealed")
    assert alert["severity"] == "info" and alert["module"] == ""
    assert alert["data"]["kind"] == "output_without_signal"
    assert alert["data"]["parameters"] == ["prior_mu", "prior_logvar"]
    assert alert["data"]["outputs"] == [3, 4]  # after recon, mu, logvar


def test_control_dict_output_without_warm_up_is_silent_under_run(tmp_path):
    assert _run(tmp_path, DICT_OUTPUT, "no_warm_up") == []


def test_control_dict_output_detached_in_the_kl_is_still_told_under_run(tmp_path):
    (alert,) = _run(tmp_path, DICT_OUTPUT, "detached")
    assert alert["severity"] == "warning" and "prior_mu" in alert["data"]["parameters"]
    assert alert["data"]["kind"] == "none"


# -- all-zero weights of one module that multiply nothing of each other's -----------


class GaussianPrior(nn.Module):
    def __init__(self, z: int, learn_logvar: bool = True) -> None:
        super().__init__()
        self.mu = nn.Parameter(torch.zeros(z))
        self.logvar = nn.Parameter(torch.zeros(z), requires_grad=learn_logvar)


class PriorVAE(nn.Module):
    def __init__(self, learn_logvar: bool = True, z: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2 * z))
        self.dec = nn.Sequential(nn.Linear(z, 64), nn.ReLU(), nn.Linear(64, 32))
        self.prior = GaussianPrior(z, learn_logvar)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, logvar = self.enc(x).chunk(2, 1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(z), mu, logvar


def _prior_module_run(quiet_watch, learn_logvar: bool) -> list:
    torch.manual_seed(0)
    model = PriorVAE(learn_logvar)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        x = (torch.rand(64, 32, generator=gen) > 0.5).float()
        logits, mu, logvar = model(x)
        pm, plv = model.prior.mu, model.prior.logvar
        rec = F.binary_cross_entropy_with_logits(logits, x, reduction="none").sum(1).mean()
        loss = rec + _beta("kl_annealed", step) * _kl(mu, logvar, pm, plv)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model.prior.mu.abs().max() > 0  # it left zero: nothing held it there
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


@pytest.mark.parametrize("learn_logvar", [True, False], ids=["both_learned", "logvar_frozen"])
def test_a_prior_s_zero_mu_and_logvar_are_not_each_other_s_partner(quiet_watch, learn_logvar):
    """Both learned: both silent and all zeros (the old "both_zero"); logvar frozen
    at 0 (a unit variance): all zeros and frozen (the old "it is frozen")."""
    found = _prior_module_run(quiet_watch, learn_logvar)
    (alert,) = found
    assert alert.module == "prior"
    assert "cause" not in alert.data and "zero_partner" not in alert.data
    assert "all zeros" not in alert.message and "LoRA" not in alert.hint


LOW_RANK = """
import sys
import torch
from torch import nn

setup = sys.argv[1]
torch.manual_seed(0)


class LowRank(nn.Module):
    # A factorised linear layer: W = U @ V, rank 3.
    def __init__(self, inputs, outputs, rank=3):
        super().__init__()
        self.U = nn.Parameter(torch.zeros(outputs, rank))
        self.V = nn.Parameter(torch.zeros(rank, inputs))
        if setup == "healthy":
            nn.init.normal_(self.V, std=0.1)

    def forward(self, x):
        return x @ self.V.t() @ self.U.t()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(10, 12)
        self.low = LowRank(12, 12)
        self.out = nn.Linear(12, 1)

    def forward(self, x):
        return self.out(self.inp(x) + self.low(torch.tanh(self.inp(x))))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(0)
for _ in range(8):
    x = torch.randn(16, 10, generator=gen)
    loss = (model(x) - x[:, :1]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_control_low_rank_factors_both_zero_are_still_each_other_s_partner_under_run(tmp_path):
    (alert,) = _run(tmp_path, LOW_RANK, "both_zero")
    assert alert["module"] == "low" and alert["severity"] == "warning"
    assert alert["data"]["cause"] == "all_zero_partner"
    assert alert["data"]["partner_stays_zero"] == "both_zero"
    assert alert["data"]["all_zero_weights"] == ["low.U", "low.V"]


def test_control_low_rank_factors_with_one_random_are_silent_under_run(tmp_path):
    assert _run(tmp_path, LOW_RANK, "healthy") == []
