"""Shared and reused modules: tied weights, loops over one cell, parametrisations, LoRA."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import trainwatch as tw

VOCAB, WIDTH, LENGTH = 40, 16, 10


class TiedTransformer(nn.Module):
    """Embedding tied to the LM head, a positional table, a causal mask, a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.02)
        self.enc = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm.weight = self.emb.weight
        self.cut_encoder = False

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        length = ids.shape[1]
        mask = torch.full((length, length), float("-inf")).triu(1)
        h = self.enc(self.emb(ids) + self.pos[:length], src_mask=mask)
        if self.cut_encoder:
            h = h.detach()
        h = self.norm(h)
        return {"logits": self.lm(h), "hidden": h}


def _train_lm(model: nn.Module, steps: int = 12) -> tw.Monitor:
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tw.watch(model, opt, console=False) as monitor:
            for _ in range(steps):
                ids = torch.randint(0, VOCAB, (4, LENGTH))
                opt.zero_grad()
                logits = model(ids)["logits"]
                nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1)).backward()
                opt.step()
    return monitor


def test_tied_embedding_is_reported_once_under_its_first_owner():
    torch.manual_seed(0)
    monitor = _train_lm(TiedTransformer())
    assert monitor.alerts == []
    norms = monitor.grad_norms()
    assert "emb" in norms and "lm" not in norms  # one parameter, one name
    assert "" in norms  # the positional table belongs to the root


def test_layer_cut_from_the_graph_in_a_tied_model_is_named():
    torch.manual_seed(0)
    model = TiedTransformer()
    model.cut_encoder = True
    monitor = _train_lm(model)
    silent = {a.module for a in monitor.alerts if a.rule == "zero_gradient"}
    # The encoder and what feeds only it go silent; the tied table still learns through lm.
    assert "enc.linear1" in silent and "" in silent
    assert "emb" not in silent and "norm" not in silent


class LoopedCell(nn.Module):
    """An RNN cell called once per time step from Python; a NaN can be planted at one."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(4, 12)
        self.head = nn.Linear(12, 1)
        self.poison_at: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[1], 12)
        for t in range(x.shape[0]):
            h = self.cell(x[t] if t != self.poison_at else x[t] / 0.0 * 0.0, h)
        return self.head(h)


def _train_rnn(model: LoopedCell, poison_step: int | None = None, **overrides) -> tw.Monitor:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False, **overrides) as monitor:
        for step in range(8):
            model.poison_at = 3 if step == poison_step else None
            x = torch.randn(7, 16, 4)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[-1, :, :1]).backward()
            opt.step()
    return monitor


def test_cell_called_many_times_per_step_trains_silently():
    model = LoopedCell()
    monitor = _train_rnn(model, constant_output={"every": 1}, dead_units={"every": 1})
    assert monitor.alerts == []
    assert monitor.step_count == 8
    assert set(monitor.grad_norms()) == {"cell", "head"}


@pytest.mark.parametrize("check", ["auto", "step", "deferred"])
def test_nan_fed_into_one_call_of_a_looped_cell_is_named_at_its_step(check):
    monitor = _train_rnn(LoopedCell(), poison_step=5, nonfinite_forward={"check": check})
    first = next(a for a in monitor.alerts if a.rule.startswith("nonfinite"))
    # The NaN is made by the division in the root's own forward, before the cell.
    assert (first.rule, first.step) == ("nonfinite_forward", 5)
    assert first.module == ""


class Siamese(nn.Module):
    """One encoder applied to both inputs of a pair."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return nn.functional.cosine_similarity(self.encoder(a), self.encoder(b))


def test_shared_encoder_called_twice_per_step_trains_silently():
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False, constant_output={"every": 1}) as monitor:
        for _ in range(10):
            a, b = torch.randn(16, 8), torch.randn(16, 8)
            opt.zero_grad()
            (1 - model(a, b)).mean().backward()
            opt.step()
    assert monitor.alerts == []
    assert set(monitor.grad_norms()) == {"encoder.0", "encoder.2"}


class ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)
        self.cut_a = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.cut_a:
            h = h.detach()
        return self.c(torch.relu(self.b(h)))


def _parametrised() -> ThreeLayers:
    model = ThreeLayers()
    parametrizations.spectral_norm(model.a)
    parametrizations.weight_norm(model.b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old hook-based API
        nn.utils.spectral_norm(model.c)
    return model


@pytest.mark.parametrize("cut", [False, True], ids=["healthy", "a-detached"])
def test_parametrised_layers_are_named_after_the_layer_they_parametrise(cut):
    torch.manual_seed(0)
    model = _parametrised()
    model.cut_a = cut
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
    if cut:
        (alert,) = monitor.alerts
        assert (alert.rule, alert.module) == ("zero_gradient", "a")
        assert "a.parametrizations.weight.original" in alert.data["parameters"]
    else:
        assert monitor.alerts == []
        assert set(monitor.grad_norms()) == {"a", "b", "c"}


class LoRALinear(nn.Module):
    """A frozen base plus a trainable low-rank update (B starts at zero)."""

    def __init__(self, width: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block1 = LoRALinear(8)
        self.block2 = LoRALinear(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block2(torch.relu(self.block1(x)))))


@pytest.mark.parametrize("holds", ["trainable", "everything"])
def test_lora_with_a_frozen_base_is_silent_unless_the_optimizer_holds_the_base(holds):
    torch.manual_seed(0)
    model = LoRANet()
    params = (
        [p for p in model.parameters() if p.requires_grad]
        if holds == "trainable"
        else list(model.parameters())
    )
    opt = torch.optim.AdamW(params, lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(8):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
    rules = {(a.rule, a.module) for a in monitor.alerts}
    if holds == "trainable":
        assert rules == set()
    else:
        assert rules == {
            ("frozen_in_optimizer", "block1.base"),
            ("frozen_in_optimizer", "block2.base"),
        }
