"""broadcast: a class-index map that marks ignored pixels, or that ``forward`` is given.

Segmentation labels mark the pixels to ignore with one value outside the
classes: 255 (VOC's border, Cityscapes' void) or a negative one (-1, -100, the
``ignore_index`` of ``cross_entropy``). A hand-written Dice that broadcasts such
a map ``(N, 1, H, W)`` over the ``(N, C, H, W)`` probabilities is the same bug as
one over a map of 0..C-1 alone, and is told the same way, the ignore value
named. So is a Dice that a Hugging Face style model computes in its own
``forward(pixel_values, labels=None)`` from the labels it is given.

Each planted map has a clean twin beside it that stays silent: the one-hot
target with the ignored pixels masked out of both sides, a binary mask stored as
0/255, a two-class map, a binary sigmoid head, a map of more indices than
channels, a gate computed inside the model from its input.
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
from trainwatch.collect.class_index_map import PendingClassMap, class_index_evidence
from trainwatch.lightning import TrainWatchCallback

N, C, H = 4, 4, 12


def _measured(values: list[float], classes: int = C):
    """What a map holding ``values`` (each on many pixels) is judged to be."""
    target = torch.tensor(values).repeat(N, 1, 8, 1)  # (N, 1, 8, len(values))
    output = (N, classes, *target.shape[2:])
    evidence = class_index_evidence(target, classes)
    found = PendingClassMap(evidence, "mul", (output, target.shape), output, 1, None, None)
    return found.values()


@pytest.mark.parametrize(
    ("values", "told"),
    [
        ([0, 1, 2, 3], (0, 3, None)),
        ([0, 1, 2, 3, 255], (0, 3, 255)),
        ([0, 1, 2, 255], (0, 2, 255)),
        ([0, 1, 2, 3, -100], (0, 3, -100)),
        ([-1, 0, 1, 2, 3], (0, 3, -1)),
        ([0, 255], None),  # a binary mask stored as 0/255
        ([0, 1, 255], None),  # two classes beside the ignore value: a mask
        ([0, 1, 2, 3, 254, 255], None),  # two values past the channels
        ([0, 1, 2, 3, 200], None),  # no ignore value: more classes than channels
        ([0, 1, 2, 3, 255, -100], None),
        ([0.5, 1, 2, 3, 255], None),  # not whole numbers
    ],
)
def test_a_class_map_may_hold_one_ignore_value_beside_its_indices(values, told):
    found = _measured(values)
    assert (None if found is None else (found.low, found.high, found.ignored)) == told


def test_two_channels_hold_no_class_map_even_beside_an_ignore_value():
    assert _measured([0, 1, 255], classes=2) is None


class SegNet(nn.Module):
    """A tiny segmenter. Given ``labels``, it returns its own Dice loss (Hugging Face
    style) with ``logits``; ``one_hot``: the correct target, ignored pixels masked out;
    ``gate``: its features multiplied by a whole-number map of the input."""

    def __init__(self, classes: int = C, one_hot: bool = False, gate: bool = False) -> None:
        super().__init__()
        self.body = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, classes, 1)
        self.one_hot = one_hot
        self.gate = gate

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None):
        h = torch.relu(self.body(pixel_values))
        if self.gate:
            h = h * pixel_values[:, :1].abs().round().clamp(max=C - 1)  # (N, 1, H, W) of 0..3
        logits = self.head(h)
        if labels is None:
            return logits
        probs = logits.softmax(dim=1)
        if self.one_hot:
            return {"loss": _ignoring_dice(probs, labels, 255), "logits": logits}
        return {"loss": _dice(probs, labels.unsqueeze(1).float()), "logits": logits}


def _dice(probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    axes = tuple(range(2, probs.dim()))
    inter = (probs * target).sum(dim=axes)  # the op told
    union = probs.sum(dim=axes) + target.sum(dim=axes)
    return (1 - (2 * inter + 1) / (union + 1)).mean()


_TOLD_LINE = f"{__file__}:{_dice.__code__.co_firstlineno + 2}"


def _ignoring_dice(probs: torch.Tensor, mask: torch.Tensor, ignored: int) -> torch.Tensor:
    """The correct multi-class Dice: one-hot targets, ignored pixels in neither side."""
    valid = (mask != ignored).unsqueeze(1).float()
    one_hot = F.one_hot(mask.masked_fill(mask == ignored, 0), probs.shape[1])
    return _dice(probs * valid, one_hot.movedim(-1, 1).float() * valid)


def _masks(x: torch.Tensor, classes: int, ignored: int | None) -> torch.Tensor:
    """Class indices 0..classes-1 from the first input channel, every class present;
    pixels where the second channel is high marked ``ignored``."""
    edges = torch.linspace(-0.8, 0.8, classes - 1)
    mask = torch.bucketize(x[:, 0].contiguous(), edges)
    return mask if ignored is None else mask.masked_fill(x[:, 1] > 1, ignored)


def _loss(variant: str, model: nn.Module, x: torch.Tensor, mask: torch.Tensor):
    """Each way of writing the loss outside the model; the planted ones pair the map."""
    logits = model(x)
    probs = logits.softmax(dim=1)
    if variant == "clean":
        return _ignoring_dice(probs, mask, 255)
    if variant == "binary_0_255":  # a validity mask stored as 0/255 (N, 1, H, W)
        stored = (x[:, 1:2] < 1).float() * 255
        one_hot = F.one_hot(mask, C).movedim(-1, 1).float()
        return _dice(probs * stored / 255, one_hot * stored / 255)
    if variant == "binary_sigmoid":
        valid = (mask != 255).unsqueeze(1).float()
        target = (mask == 1).unsqueeze(1).float()
        return _dice(torch.sigmoid(logits) * valid, target * valid)
    if variant == "squared_minus_100":
        return ((probs - mask.unsqueeze(1).float()) ** 2).mean()
    if variant == "long_map_minus_1":
        return _dice(probs, mask.unsqueeze(1))
    return _dice(probs, mask.unsqueeze(1).float())  # dice_255, two_classes, gate


# variant: (classes, ignore value in the labels, whether the map is told)
LOOP = {
    "dice_255": (C, 255, True),
    "squared_minus_100": (C, -100, True),
    "long_map_minus_1": (C, -1, True),
    "clean": (C, 255, False),
    "binary_0_255": (C, None, False),
    "binary_sigmoid": (1, 255, False),
    "two_classes": (2, 255, False),
    "gate": (C, 255, False),
}


def _train_loop(quiet_watch, variant: str, steps: int = 3):
    classes, ignored, _ = LOOP[variant]
    torch.manual_seed(0)
    model = SegNet(classes, gate=variant == "gate")
    if variant == "gate":
        model.one_hot = True
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(N, 3, H, H, generator=gen)
        mask = _masks(x, max(classes, 2), ignored)
        if variant == "gate":
            loss = model(x, labels=mask)["loss"]
        else:
            loss = _loss(variant, model, x, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


def _assert_told_class_map(alert, ignored: int | None, module: str | None) -> None:
    assert alert.step == 0 and alert.module == module and alert.severity == "error"
    assert alert.data["kind"] == "class_index_map" and alert.data["classes"] == C
    assert alert.data["values"] == [0, C - 1] and alert.data["ignored"] == ignored
    assert sorted(alert.data["shapes"]) == sorted([[N, C, H, H], [N, 1, H, H]])
    told = "(0 to 3)" if ignored is None else f"(0 to 3, and {ignored} for pixels to ignore)"
    assert f"holds class indices {told}" in alert.message
    assert "F.one_hot(mask, 4).permute(0, 3, 1, 2)" in alert.hint
    if ignored is not None:
        assert f"valid = (mask != {ignored})" in alert.hint


@pytest.mark.parametrize("variant", [v for v, (_, _, told) in LOOP.items() if told])
def test_a_class_map_with_an_ignore_value_in_the_loops_dice_is_told(quiet_watch, variant):
    monitor = _train_loop(quiet_watch, variant)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    _assert_told_class_map(alert, LOOP[variant][1], None)
    if variant == "squared_minus_100":
        assert alert.data["op"] == "sub"
    else:
        assert alert.data["op"] == "mul" and alert.data["source"] == _TOLD_LINE
    assert rules_of(monitor) == ["broadcast"]


@pytest.mark.parametrize("variant", [v for v, (_, _, told) in LOOP.items() if not told])
def test_masked_one_hot_0_255_masks_two_classes_sigmoid_and_gates_are_silent(quiet_watch, variant):
    assert rules_of(_train_loop(quiet_watch, variant)) == []


# variant: (model options, ignore value in the labels, labels by keyword)
IN_FORWARD = {
    "map": ({}, None, True),
    "map_255": ({}, 255, True),
    "map_255_positional": ({}, 255, False),
    "map_minus_100": ({}, -100, True),
    "clean": ({"one_hot": True}, 255, True),
    "gate": ({"one_hot": True, "gate": True}, 255, True),
}


def _train_in_forward(quiet_watch, variant: str, steps: int = 3):
    options, ignored, by_keyword = IN_FORWARD[variant]
    torch.manual_seed(0)
    model = SegNet(**options)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(N, 3, H, H, generator=gen)
        mask = _masks(x, C, ignored)
        output = model(x, labels=mask) if by_keyword else model(x, mask)
        opt.zero_grad()
        output["loss"].backward()
        opt.step()
    monitor.close()
    return monitor


@pytest.mark.parametrize("variant", [v for v in IN_FORWARD if v.startswith("map")])
def test_a_dice_over_the_labels_map_inside_forward_is_told_naming_the_model(quiet_watch, variant):
    monitor = _train_in_forward(quiet_watch, variant)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    _assert_told_class_map(alert, IN_FORWARD[variant][1], "")  # "": the model itself
    assert alert.data["op"] == "mul" and alert.data["source"] == _TOLD_LINE
    assert rules_of(monitor) == ["broadcast"]


@pytest.mark.parametrize("variant", ["clean", "gate"])
def test_a_masked_one_hot_dice_or_a_gate_inside_forward_is_silent(quiet_watch, variant):
    assert rules_of(_train_in_forward(quiet_watch, variant)) == []


class LitSegmenter(pl.LightningModule):
    """The Dice in ``training_step`` (``in_forward``: in the part's ``forward``, given
    the labels), over labels holding 255 for the pixels to ignore."""

    def __init__(self, buggy: bool, in_forward: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = SegNet(one_hot=not buggy)
        self.buggy = buggy
        self.in_forward = in_forward

    def training_step(self, batch, batch_idx):
        x, mask = batch
        if self.in_forward:
            return self.net(x, labels=mask)["loss"]
        probs = self.net(x).softmax(dim=1)
        if self.buggy:
            return _dice(probs, mask.unsqueeze(1).float())
        return _ignoring_dice(probs, mask, 255)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(4 * N, 3, H, H, generator=gen)
        return DataLoader(TensorDataset(x, _masks(x, C, 255)), batch_size=N)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("in_forward", [False, True])
@pytest.mark.parametrize("buggy", [True, False])
def test_a_lightning_dice_over_a_map_with_255_is_told_at_the_part(tmp_path, buggy, in_forward):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_steps=4, limit_val_batches=0, num_sanity_val_steps=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own notes on a tiny run
        trainer.fit(LitSegmenter(buggy, in_forward))
    found = [
        (a.rule, a.step, a.module, a.data.get("kind"), a.data.get("ignored"), a.data.get("source"))
        for a in callback.alerts
        if a.severity in ("warning", "error")
    ]
    told = ("broadcast", 0, "net", "class_index_map", 255, _TOLD_LINE)
    assert found == ([told] if buggy else [])


SCRIPT = """
import json
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

ONE_HOT = {one_hot}
C = 5
IGNORE = 255


class VocLike(Dataset):
    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(32, 3, 10, 10, generator=gen)
        y = torch.bucketize(self.x[:, 0].contiguous(), torch.tensor([-0.8, -0.3, 0.3, 0.8]))
        self.y = y.masked_fill(self.x[:, 1] > 1, IGNORE)  # object borders

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def dice_loss(logits, mask, eps=1.0):
    probs = logits.softmax(dim=1)
    if ONE_HOT:
        valid = (mask != IGNORE).unsqueeze(1).float()
        target = F.one_hot(mask.masked_fill(mask == IGNORE, 0), C).permute(0, 3, 1, 2).float()
        probs, target = probs * valid, target * valid
    else:
        target = mask.unsqueeze(1).float()
    inter = (probs * target).sum(dim=(2, 3))
    union = probs.sum(dim=(2, 3)) + target.sum(dim=(2, 3))
    return (1 - (2 * inter + eps) / (union + eps)).mean()


class Segmenter(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(8, C, 1)

    def forward(self, x):
        return self.out(self.enc(x))


torch.manual_seed(0)
model = Segmenter()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
losses = []
for epoch in range(2):
    for x, mask in DataLoader(VocLike(), batch_size=8, shuffle=True):
        loss = dice_loss(model(x), mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
json.dump(losses, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("one_hot", [False, True])
def test_under_trainwatch_run_an_unmodified_voc_style_dice_is_told_and_trains_the_same(
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
    assert alert["data"]["model"] == "Segmenter"
    assert alert["data"]["kind"] == "class_index_map" and alert["data"]["classes"] == 5
    assert alert["data"]["values"] == [0, 4] and alert["data"]["ignored"] == 255
    line = SCRIPT.splitlines().index("    inter = (probs * target).sum(dim=(2, 3))") + 1
    assert alert["data"]["source"].endswith(f"train.py:{line}")
    assert "valid = (mask != 255)" in alert["hint"]
