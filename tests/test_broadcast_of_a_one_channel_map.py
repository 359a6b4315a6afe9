"""broadcast: a size-1 axis inside the shape, with per-sample axes after it.

A binary segmentation head gives ``(N, 1, H, W)``; the mask is ``(N, H, W)``.
Their product in a hand-written dice loss is ``(N, N, H, W)``: every
prediction against every sample's mask, silently averaged. The same holds for
``(N, 1, T)`` against ``(N, T)``. Embeddings of two views paired on purpose
(``z1.unsqueeze(1) - z2``) have the same shapes and stay silent.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.conftest import rules_of
from trainwatch.collect.broadcast import batch_broadcast
from trainwatch.rules.broadcast import _squeezes


@pytest.mark.parametrize(
    ("first", "second", "batch", "result"),
    [
        ((4, 1, 16, 16), (4, 16, 16), 4, (4, 4, 16, 16)),
        ((4, 16, 16), (4, 1, 16, 16), 4, (4, 4, 16, 16)),
        ((8, 1, 5), (8, 5), 8, (8, 8, 5)),
        ((4, 1, 16, 16), (4, 16, 16), None, None),  # no model batch known: shapes alone
        ((5, 1, 16), (5, 16), 20, None),  # queries against prototypes, sizes equal by chance
        ((4, 1, 16, 16), (4, 1, 16, 16), 4, None),  # the same shapes
        ((4, 3, 16, 16), (4, 16, 16), 4, None),  # channels: not a size-1 axis
        ((1, 4, 16), (4, 16), 4, None),  # the size-1 axis is the leading one
    ],
)
def test_an_inner_size_one_axis_meeting_the_batch_is_the_pattern(first, second, batch, result):
    assert batch_broadcast(first, second, batch) == result


def _segmenter() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))


def _dice_loop(model, opt, steps: int, mask_shape: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 3, 16, 16, generator=gen)
        mask = (x[:, 0] > 0).float()  # (N, H, W)
        if mask_shape == "matching":
            mask = mask.unsqueeze(1)
        probs = torch.sigmoid(model(x))  # (N, 1, H, W)
        inter = (probs * mask).flatten(1).sum(1)
        denom = probs.flatten(1).sum(1) + mask.flatten(1).sum(1)
        loss = (1 - 2 * inter / denom).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_a_dice_loss_pairing_a_one_channel_map_with_an_unsqueezed_mask_is_caught_at_the_product(
    quiet_watch,
):
    model = _segmenter()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    _dice_loop(model, opt, 4, "squeezed")
    monitor.close()
    first = next(a for a in monitor.alerts if a.rule == "broadcast")
    assert first.step == 0
    assert first.data["op"] == "mul"
    assert first.data["shapes"] == [[4, 1, 16, 16], [4, 16, 16]]
    assert first.data["result"] == [4, 4, 16, 16]
    # The hint names the channel axis, the size-1 one, not the last.
    assert "squeeze the (4, 1, 16, 16) side (.squeeze(1))" in first.hint
    assert ".unsqueeze(1)" in first.hint and ".squeeze(-1)" not in first.hint
    assert "torch.stack" not in first.hint  # no stacking of per-step (1,) makes a map


def test_the_same_dice_loss_with_the_mask_given_its_channel_axis_is_silent(quiet_watch):
    model = _segmenter()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    _dice_loop(model, opt, 4, "matching")
    monitor.close()
    assert "broadcast" not in rules_of(monitor)


def test_a_sequence_head_against_per_step_targets_is_caught(quiet_watch):
    torch.manual_seed(0)
    model = nn.Conv1d(4, 1, 3, padding=1)  # (N, 1, T)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        x = torch.randn(8, 4, 12)
        target = x[:, 0]  # (N, T)
        loss = ((model(x) - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.data["result"] == [8, 8, 12]


def test_two_views_embeddings_paired_on_purpose_are_silent(quiet_watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        x = torch.randn(12, 10)
        z1, z2 = model(x), model(x + 0.1 * torch.randn_like(x))
        distances = (z1.unsqueeze(1) - z2).pow(2).sum(-1)  # (N, 1, D) - (N, D): (N, N)
        loss = F.cross_entropy(-distances, torch.arange(12))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert "broadcast" not in rules_of(monitor)


def _embedding_loss(quiet_watch, against: str) -> list[str]:
    """Each embedding against every key of a momentum encoder (run under no_grad),
    or against every class centre (a parameter): the axis is given in the loss."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 16))
    target = copy.deepcopy(model).requires_grad_(False)
    centers = nn.Parameter(torch.randn(8, 16))
    opt = torch.optim.SGD([*model.parameters(), centers], 0.01)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        x = torch.randn(8, 10)
        z = model(x)
        if against == "keys":
            with torch.no_grad():
                others = target(x + 0.1 * torch.randn_like(x))
        else:
            others = centers
        distances = (z.unsqueeze(1) - others).pow(2).sum(-1)  # (8, 1, 16) - (8, 16)
        loss = F.cross_entropy(-distances, torch.arange(8))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return rules_of(monitor)


@pytest.mark.parametrize("against", ["keys", "centres"])
def test_an_axis_given_in_the_loss_against_keys_or_centres_is_on_purpose(quiet_watch, against):
    assert "broadcast" not in _embedding_loss(quiet_watch, against)


def test_a_focal_loss_choosing_with_where_between_a_map_and_a_mask_is_caught(quiet_watch):
    model = _segmenter()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        x = torch.randn(4, 3, 16, 16)
        mask = x[:, 0] > 0  # (N, H, W)
        probs = torch.sigmoid(model(x))  # (N, 1, H, W)
        chosen = torch.where(mask, probs, 1 - probs)  # (N, N, H, W)
        loss = -((1 - chosen) ** 2 * torch.log(chosen.clamp_min(1e-6))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    first = next(a for a in monitor.alerts if a.rule == "broadcast")
    assert first.step == 0 and first.data["op"] == "where"
    assert first.data["result"] == [4, 4, 16, 16]


@pytest.mark.parametrize(
    ("high", "low", "dims", "squeeze", "reshape"),
    [
        ((4, 1, 16, 16), (4, 16, 16), 1, ".squeeze(1)", ".unsqueeze(1)"),  # a one-channel map
        ((8, 1, 5), (8, 5), 1, ".squeeze(1)", ".unsqueeze(1)"),  # (N, 1, T) against (N, T)
        ((8, 1), (8,), -1, ".squeeze(-1)", ".unsqueeze(-1)"),  # an (N, 1) output
        ((8, 1, 1), (8, 1), -1, ".squeeze(-1)", ".unsqueeze(-1)"),  # stacked (1, 1) values
        ((8, 1, 1), (8, 5), 1, ".squeeze(1)", ".unsqueeze(1)"),  # a (1, 1) target per sample
        ((8, 1, 1), (8,), (1, 2), ".squeeze((1, 2))", ".view_as(other)"),  # two axes to drop
    ],
)
def test_the_hint_names_the_size_one_axis_that_meets_the_batch(high, low, dims, squeeze, reshape):
    told_squeeze, told_reshape = _squeezes(high, low)
    assert told_squeeze == squeeze and reshape in told_reshape
    # Squeezed as told, the side pairs no samples any more.
    squeezed = torch.zeros(high).squeeze(dims)
    assert torch.broadcast_shapes(squeezed.shape, low) == torch.Size(low)
