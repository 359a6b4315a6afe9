"""The never-called check listens to the model's passes only while a layer waits.

Once every tracked module has been called, the passes of a model pay nothing
for it; a head added later (a new training phase) is tracked again, and a
never-called one among the new layers is still named.
"""

from __future__ import annotations

import io

import torch
from torch import nn

import trainwatch as tw
from tests.test_never_called_in_optimizer import TwoHeads


def _listening(monitor: tw.Monitor) -> bool:
    return "call tracker" in monitor._pipeline.passes.listener_names()


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 8)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
        opt.step()


def test_every_layer_called_stops_the_call_tracker_listening_and_nothing_fires():
    torch.manual_seed(0)
    model = TwoHeads()
    model.use_aux = True
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        assert _listening(monitor)
        _steps(model, opt, 2)
        assert not _listening(monitor)
        _steps(model, opt, 4)
    assert monitor.alerts == []


def test_a_layer_never_called_keeps_it_listening_and_is_named():
    torch.manual_seed(0)
    model = TwoHeads()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        _steps(model, opt, 6)
        assert _listening(monitor)
    assert [(a.rule, a.module, a.data["kind"]) for a in monitor.alerts] == [
        ("zero_gradient", "aux_head", "never_called")
    ]


class _Grown(nn.Module):
    """A trunk trained alone, then a second phase that adds three heads (see ``_grow``)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.main_head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main_head(self.trunk(x))


def _grow(model: _Grown) -> torch.optim.Optimizer:
    model.extra = nn.Linear(16, 1)  # called from the new phase's forward
    model.cut = nn.Linear(16, 1)  # called, its output detached: a cut, not an unused head
    model.spare = nn.Linear(16, 4)  # left out of it: never called

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model.trunk(x)
        out = model.main_head(h) + model.extra(h)
        return out + model.cut(h).detach() if hasattr(model, "cut") else out

    model.forward = forward
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _two_phases(keep_unused: bool) -> tw.Monitor:
    """Three steps of the trunk alone, then eight with the heads ``_grow`` adds
    (``keep_unused``: False, the cut and the spare removed again)."""
    torch.manual_seed(0)
    model = _Grown()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        _steps(model, opt, 3)
        assert not _listening(monitor)
        opt = _grow(model)
        if not keep_unused:
            del model.spare, model.cut
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        monitor.add_optimizer(opt)
        _steps(model, opt, 8)
        assert _listening(monitor) == keep_unused  # the spare still waits for a call
    return monitor


def test_layers_added_after_every_layer_was_called_are_tracked_again():
    monitor = _two_phases(keep_unused=True)
    found = [(a.rule, a.module, a.data.get("kind")) for a in monitor.alerts if a.severity != "info"]
    assert ("zero_gradient", "spare", "never_called") in found
    assert ("zero_gradient", "cut", "never_called") not in found
    assert any(module == "cut" for _, module, _ in found)
    assert all(module != "extra" for _, module, _ in found)


def test_layers_added_and_all_called_are_clean():
    monitor = _two_phases(keep_unused=False)
    assert [a for a in monitor.alerts if a.severity != "info"] == []


class _Attending(nn.Module):
    """Self-attention over 4 tokens; ``cut``: the attention's output is detached."""

    def __init__(self, cut: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(-1, 4, 2))
        attended = self.attn(h, h, h, need_weights=False)[0]
        if self.cut:
            attended = attended.detach()
        return self.head(attended + h).mean(dim=1)


def _stops_listening(model: nn.Module) -> tw.Monitor:
    """Two steps, after which the tracker must have stopped listening, then four more."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        _steps(model, opt, 2)
        assert not _listening(monitor)
        _steps(model, opt, 4)
    return monitor


def _watched(model: nn.Module, steps: int) -> tw.Monitor:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        _steps(model, opt, steps)
    return monitor


def test_multihead_attention_out_proj_counts_as_called():
    # MultiheadAttention reads out_proj's weight itself and never calls it: it is
    # no layer waiting for a first call, so a model using it stops listening.
    torch.manual_seed(0)
    assert _stops_listening(_Attending()).alerts == []


def test_an_attention_cut_by_detach_is_a_cut_not_a_layer_never_called():
    torch.manual_seed(0)
    monitor = _watched(_Attending(cut=True), 6)
    found = {(a.rule, a.module, a.data.get("kind")) for a in monitor.alerts}
    assert {module for rule, module, _ in found if rule == "zero_gradient"} == {
        "attn",
        "attn.out_proj",
    }
    assert all(kind != "never_called" for _, _, kind in found), found


class _HeadsInAList(nn.Module):
    """Heads kept in a ModuleList (never called itself); ``heads[2]`` unused unless ``all``."""

    def __init__(self, use_all: bool) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.heads = nn.ModuleList(nn.Linear(16, 1) for _ in range(3))
        self.use_all = use_all

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        used = self.heads if self.use_all else self.heads[:2]
        return sum(head(h) for head in used)


def test_a_head_in_a_module_list_never_called_is_still_reported_without_the_claim():
    # A ModuleList is never called itself, so its children are never claimed
    # uncalled (a mixture's rare expert must not be); the head still goes without
    # a gradient, and zero_gradient says so.
    # A member of a container whose siblings ran is given longer (a router that
    # starts collapsed sends an expert its first token late): 104 steps, the
    # patience and the steps such a member not yet run is given.
    torch.manual_seed(0)
    monitor = _watched(_HeadsInAList(use_all=False), 104)
    assert [(a.rule, a.module) for a in monitor.alerts] == [("zero_gradient", "heads.2")]
    alert = monitor.alerts[0]
    assert alert.data["kind"] == "not_run" and alert.data["siblings_ran"] == ["heads.0", "heads.1"]
    assert "heads.2 has not run in 103 steps" in alert.message


def test_layers_in_containers_all_called_stop_the_listening():
    torch.manual_seed(0)
    assert _stops_listening(_HeadsInAList(use_all=True)).alerts == []


def test_a_transformer_encoder_stops_the_listening():
    # Its layers sit in a ModuleList and its attention's out_proj is never called.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    model = nn.Sequential(encoder, nn.Flatten(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for _ in range(3):
            x = torch.randn(16, 1, 8)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, 0, :1]).backward()
            opt.step()
        assert not _listening(monitor)
    assert monitor.alerts == []
