"""broadcast: a class-index label map broadcast over a segmentation output's C channels.

A hand-written multi-class Dice loss takes softmax probabilities ``(N, C, H, W)``
and the mask as it comes, ``mask.unsqueeze(1).float()``: ``(N, 1, H, W)`` of
class indices 0..C-1, not a one-hot map. The product broadcasts the indices
across the C channels; nothing fails, the loss falls, and the model learns no
segmentation. So does ``(probs - target) ** 2``, a dataset that yields the mask
as ``(1, H, W)`` floats, a Dice loss beside a cross-entropy given the right
``(N, H, W)`` target, and a 3D volume. Each is told at the step it happens,
naming the op's line and the model (or the part called on its own).

The shapes alone are those of legitimate code: a 0/1 validity mask blanking an
ignored region, a per-pixel weight map, a binary head against its mask, a
two-class map (no telling it from a mask), a gate multiplied inside the model.
Each stays silent beside its planted twin.
"""

from __future__ import annotations

import json
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from tests.same_training import plain_and_under_run
from trainwatch.collect.class_index_map import broadcast_channel
from trainwatch.lightning import TrainWatchCallback
from trainwatch.rules.broadcast import _one_hot

N, C, H = 4, 4, 12


@pytest.mark.parametrize(
    ("output", "target", "axis"),
    [
        ((N, C, H, H), (N, 1, H, H), 1),
        ((N, C, 3, H, H), (N, 1, 3, H, H), 1),  # a volume
        ((N, H, H, C), (N, H, H, 1), 3),  # channels last
        ((N, C, H, H), (N, C, H, H), None),  # one-hot: no broadcast
        ((N, 2, H, H), (N, 1, H, H), None),  # two channels: a class map is a mask
        ((N, C), (N, 1), None),  # a value per sample: no map
        ((N, C, H, H), (1, C, 1, 1), None),  # per-class weights
        ((N, C, H, H), (N, 1, H, 1), None),  # more than the channels differ
    ],
)
def test_a_size_one_channel_axis_against_three_or_more_channels_is_measured(output, target, axis):
    assert broadcast_channel("mul", output, target) == axis
    assert broadcast_channel("where", output, target) is None  # a condition first


@pytest.mark.parametrize(
    ("output", "axis", "made"),
    [
        ((N, C, H, H), 1, "F.one_hot(mask, 4).permute(0, 3, 1, 2).float()"),
        ((N, C, 3, H, H), 1, "F.one_hot(mask, 4).permute(0, 4, 1, 2, 3).float()"),
        ((N, H, H, C), 3, "F.one_hot(mask, 4).float()"),
    ],
)
def test_the_hints_one_hot_puts_the_classes_on_the_channel_axis(output, axis, made):
    assert _one_hot(output, axis) == made
    mask = torch.zeros(output[:axis] + output[axis + 1 :], dtype=torch.long)
    assert eval(made, {"F": F, "mask": mask}).shape == output


class SegNet(nn.Module):
    """A tiny segmenter; ``gate``: its features multiplied by a whole-number map of
    the input inside ``forward`` (a map the loss never sees)."""

    def __init__(self, classes: int = C, volume: bool = False, gate: bool = False) -> None:
        super().__init__()
        conv = nn.Conv3d if volume else nn.Conv2d
        self.body = conv(3, 8, 3, padding=1)
        self.head = conv(8, classes, 1)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if self.gate:
            h = h * x[:, :1].abs().round().clamp(max=C - 1)  # (N, 1, H, W) of 0..3
        return self.head(h)


def _mask(x: torch.Tensor, classes: int) -> torch.Tensor:
    """Class indices 0..classes-1 from the first input channel: every class present."""
    edges = torch.linspace(-0.8, 0.8, classes - 1)
    return torch.bucketize(x[:, 0].contiguous(), edges)


def _dice(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    axes = tuple(range(2, probs.dim()))
    inter = (probs * target).sum(dim=axes)
    union = probs.sum(dim=axes) + target.sum(dim=axes)
    return (1 - (2 * inter + 1) / (union + 1)).mean()


def _loss(variant: str, logits: torch.Tensor, mask: torch.Tensor, x: torch.Tensor):
    """The loss of each way of writing it; the planted ones pair the index map."""
    classes = logits.shape[1]
    probs = logits.softmax(dim=1)
    index_map = mask.unsqueeze(1).float()  # (N, 1, H, W) of class indices
    if variant == "binary":
        return _dice(torch.sigmoid(logits), (mask > 0).unsqueeze(1).float())
    one_hot = F.one_hot(mask, classes).movedim(-1, 1).float()
    if variant in ("dice", "volume", "two_classes", "from_dataset"):
        return _dice(probs, index_map)
    if variant == "long_map":
        return _dice(probs, mask.unsqueeze(1))
    if variant == "squared":
        return ((probs - index_map) ** 2).mean()
    if variant == "dice_and_ce":
        return F.cross_entropy(logits, mask) + _dice(probs, index_map)
    if variant == "ignore_region":
        valid = (x[:, 1:2] > -1).float()  # (N, 1, H, W) of 0 and 1
        return _dice(probs * valid, one_hot * valid)
    if variant == "weight_map":
        weights = 1 + x[:, 1:2].abs()  # (N, 1, H, W), not whole numbers
        return (weights * (probs - one_hot) ** 2).mean()
    return F.cross_entropy(logits, mask) + _dice(probs, one_hot)  # one_hot, gate


BUGS = ["dice", "long_map", "squared", "dice_and_ce", "from_dataset", "volume"]
CONTROLS = ["one_hot", "ignore_region", "weight_map", "binary", "two_classes", "gate"]


def _train(quiet_watch, variant: str, steps: int = 3):
    volume = variant == "volume"
    classes = {"binary": 1, "two_classes": 2}.get(variant, C)
    torch.manual_seed(0)
    model = SegNet(classes, volume, gate=variant == "gate")
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    size = (N * steps, 3, 3, H, H) if volume else (N * steps, 3, H, H)
    x_all = torch.randn(size, generator=gen)
    masks = _mask(x_all, max(classes, 2))
    if variant == "from_dataset":
        masks = masks.unsqueeze(1).float()  # the dataset yields (1, H, W) floats
    for x, mask in DataLoader(TensorDataset(x_all, masks), batch_size=N):
        if variant == "from_dataset":
            loss = _dice(model(x).softmax(dim=1), mask)
        else:
            loss = _loss(variant, model(x), mask, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


@pytest.mark.parametrize("variant", BUGS)
def test_a_class_index_map_paired_with_the_channels_is_told_at_its_step(quiet_watch, variant):
    monitor = _train(quiet_watch, variant)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.module is None and alert.severity == "error"
    output = [N, C, 3, H, H] if variant == "volume" else [N, C, H, H]
    channel = [N, 1, *output[2:]]
    assert alert.data["kind"] == "class_index_map"
    assert sorted(alert.data["shapes"]) == sorted([output, channel])
    assert alert.data["classes"] == C and alert.data["channel_axis"] == 1
    assert alert.data["values"] == [0, C - 1]
    assert alert.data["op"] == ("sub" if variant == "squared" else "mul")
    assert alert.data["source"].split(":")[0] == __file__
    assert "holds class indices (0 to 3)" in alert.message
    assert "class-index map broadcast over the 4 channels" in alert.hint
    permute = "(0, 4, 1, 2, 3)" if variant == "volume" else "(0, 3, 1, 2)"
    assert f"F.one_hot(mask, 4).permute{permute}" in alert.hint
    assert "every sample is paired" not in alert.message  # not a batch pairing
    assert rules_of(monitor) == ["broadcast"]


@pytest.mark.parametrize("variant", CONTROLS)
def test_masks_weights_one_hot_targets_and_gates_in_the_model_are_silent(quiet_watch, variant):
    assert rules_of(_train(quiet_watch, variant)) == []


def test_a_map_whose_indices_pass_the_channels_is_no_class_map(quiet_watch):
    """Indices 0..7 against four channels: more values past the channels than the one
    a map marks ignored pixels with (``test_a_class_index_map_with_an_ignore_value``)."""
    torch.manual_seed(0)
    model = SegNet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(3):
        x = torch.randn(N, 3, H, H)
        mask = _mask(x, 2 * C)
        loss = _dice(model(x).softmax(dim=1), mask.unsqueeze(1).float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert rules_of(monitor) == []


def test_a_validation_dice_over_the_index_map_is_told_as_an_evaluation(quiet_watch):
    torch.manual_seed(0)
    model = SegNet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(3):
        x = torch.randn(N, 3, H, H)
        loss = _loss("one_hot", model(x), _mask(x, C), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == 1:
            with torch.no_grad():
                x = torch.randn(N, 3, H, H)
                _dice(model(x).softmax(dim=1), _mask(x, C).unsqueeze(1).float()).item()
    monitor.close()
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["phase"] == "evaluation" and alert.data["kind"] == "class_index_map"
    assert alert.step == 2 and "in an evaluation pass" in alert.message  # after two steps


class LitSegmenter(pl.LightningModule):
    """No ``forward`` of its own: ``training_step`` calls ``self.net``, the part named."""

    def __init__(self, buggy: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SegNet()
        self.buggy = buggy

    def training_step(self, batch, batch_idx):
        x, mask = batch
        logits = self.net(x)
        probs = logits.softmax(dim=1)
        if self.buggy:
            target = mask.unsqueeze(1).float()
        else:
            target = F.one_hot(mask, C).permute(0, 3, 1, 2).float()
        return F.cross_entropy(logits, mask) + _dice(probs, target)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4 * N, 3, H, H, generator=gen)
        return DataLoader(TensorDataset(x, _mask(x, C)), batch_size=N)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("buggy", [True, False])
def test_a_lightning_segmenter_with_the_index_map_in_its_dice_is_told_at_the_part(tmp_path, buggy):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=4, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on a tiny run
        trainer.fit(LitSegmenter(buggy))
    found = [
        (a.rule, a.step, a.module, a.data.get("kind"))
        for a in callback.alerts
        if a.severity in ("warning", "error")
    ]
    assert found == ([("broadcast", 0, "net", "class_index_map")] if buggy else [])


SCRIPT = """
import json
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

ONE_HOT = {one_hot}
C = 5


class Masks(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 3, 10, 10, generator=gen)
        self.y = torch.bucketize(self.x[:, 0], torch.tensor([-0.8, -0.3, 0.3, 0.8]))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class UNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(8, C, 1)

    def forward(self, x):
        return self.out(self.enc(x))


def dice_loss(logits, mask, eps=1.0):
    probs = logits.softmax(dim=1)
    if ONE_HOT:
        target = F.one_hot(mask, C).permute(0, 3, 1, 2).float()
    else:
        target = mask.unsqueeze(1).float()
    inter = (probs * target).sum(dim=(2, 3))
    union = probs.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
    return (1 - (2 * inter + eps) / (union + eps)).mean()


torch.manual_seed(0)
model = UNetish()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for epoch in range(2):
    for x, mask in DataLoader(Masks(), batch_size=8, shuffle=True):
        loss = dice_loss(model(x), mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
json.dump(losses, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("one_hot", [False, True])
def test_under_trainwatch_run_the_unmodified_dice_script_is_told_and_trains_the_same(
    tmp_path, one_hot
):
    plain, watched, rules = plain_and_under_run(tmp_path, SCRIPT.format(one_hot=one_hot))
    assert plain == watched  # bit for bit the same training
    if one_hot:
        assert rules == []
        return
    assert rules == ["broadcast"]
    lines = (tmp_path / "out" / "alerts.jsonl").read_text().splitlines()
    (alert,) = [json.loads(line) for line in lines]
    assert alert["step"] == 0 and alert["module"] is None
    assert alert["data"]["model"] == "UNetish"
    assert alert["data"]["kind"] == "class_index_map" and alert["data"]["classes"] == 5
    line = SCRIPT.splitlines().index("    inter = (probs * target).sum(dim=(2, 3))") + 1
    assert alert["data"]["source"].endswith(f"train.py:{line}")
    assert "F.one_hot(mask, 5).permute(0, 3, 1, 2)" in alert["hint"]
