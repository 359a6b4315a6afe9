"""broadcast: an (N, 1) whose size-1 axis was given in the loss or metric code.

A pairwise IoU (``area_a[:, None] + area_b - inter``, as DETR-style matching
costs and YOLO/ATSS assigners compute it), a ranking margin between every
positive and every negative (``pos[:, None] - neg``) or a kernel between the
data and the model's samples (``y.unsqueeze(1) - s``) pairs an ``(N, 1)`` with
an ``(N,)`` on purpose: the axis that meets the other's batch was given where
the pairing is written. Beside each, the bugs of the same shapes keep being
told: an ``(N, 1)`` that came out of the model or with the data, a target
given its axis but handed to a loss function, a ``view(-1, 1)`` put on the
wrong side, and an advantage whose ``(N, 1)`` came from the critic.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import TinyNet, rules_of
from trainwatch.collect.broadcast import batch_broadcast

N = 16


@pytest.mark.parametrize(
    ("first", "second", "given", "result"),
    [
        ((N, 1), (N,), frozenset({1}), None),  # area_a[:, None] + area_b
        ((N,), (N, 1), frozenset({1}), None),  # on either side
        ((N, 1), (N,), frozenset(), (N, N)),  # the axis came out of the model or the data
        ((N, 1), (N,), frozenset({0}), (N, N)),
        ((N, 1, 1), (N, 1), frozenset({2}), (N, N, 1)),  # y.unsqueeze(-1): y's own axis pairs
    ],
)
def test_an_outer_size_one_axis_given_in_the_loss_is_no_pattern(first, second, given, result):
    assert batch_broadcast(first, second, None, given) == result


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every box of ``a`` against every box of ``b``, as torchvision computes it."""
    area_a = (a[:, 2] - a[:, 0]).clamp(min=0) * (a[:, 3] - a[:, 1]).clamp(min=0)
    area_b = (b[:, 2] - b[:, 0]).clamp(min=0) * (b[:, 3] - b[:, 1]).clamp(min=0)
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    wh = (rb - lt).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (area_a[:, None] + area_b - inter + 1e-6)


def _detector() -> nn.Module:
    """A box (4 coordinates) and an IoU-quality score per sample."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 5))


def _boxes(gen: torch.Generator) -> torch.Tensor:
    corner = torch.rand(N, 2, generator=gen) * 0.5
    return torch.cat([corner, corner + 0.1 + torch.rand(N, 2, generator=gen) * 0.4], dim=1)


def _detect(quiet_watch, loss_fn: Callable, steps: int = 3):
    model = _detector()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        out = model(torch.randn(N, 8, generator=gen))
        loss = loss_fn(out, _boxes(gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


def _iou_loss(out, boxes):
    return 1 - box_iou(out[:, :4], boxes).diagonal().mean()


def _quality_loss(quality: Callable):
    """IoU-aware detection: the quality head regressed on each box's IoU."""

    def loss(out, boxes):
        iou = box_iou(out[:, :4], boxes).diagonal()
        return (1 - iou).mean() + ((quality(out) - iou.detach()) ** 2).mean()

    return loss


def test_a_pairwise_iou_in_a_training_loss_is_silent(quiet_watch):
    assert rules_of(_detect(quiet_watch, _iou_loss)) == []


def test_a_quality_head_left_n_by_1_against_the_iou_is_caught_beside_it(quiet_watch):
    monitor = _detect(quiet_watch, _quality_loss(lambda out: out[:, 4:]))
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.data["op"] == "sub"
    assert alert.data["shapes"] == [[N, 1], [N]] and alert.data["result"] == [N, N]


def test_the_quality_head_taken_as_n_beside_the_iou_is_silent(quiet_watch):
    assert rules_of(_detect(quiet_watch, _quality_loss(lambda out: out[:, 4]))) == []


def _detector_evaluation(quiet_watch, metric: Callable) -> list:
    """Two training steps, then evaluations computing ``metric(out, boxes, targets)``."""
    model = _detector()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        loss = _iou_loss(model(torch.randn(N, 8, generator=gen)), _boxes(gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for _ in range(2):
            out = model(torch.randn(N, 8, generator=gen))
            boxes = _boxes(gen)
            metric(out, boxes, torch.rand(N, generator=gen))  # the stored IoU targets
    model.train()
    monitor.close()
    return [a for a in monitor.alerts if a.rule == "broadcast"]


def test_a_pairwise_iou_in_an_evaluation_is_silent(quiet_watch):
    def matched(out, boxes, _):
        iou = box_iou(out[:, :4], boxes)
        return iou.max(1).values.mean(), torch.cdist(out[:, :4], boxes).min(1).values

    assert _detector_evaluation(quiet_watch, matched) == []


@pytest.mark.parametrize(
    ("quality", "told"),
    [(lambda out: out[:, 4:], True), (lambda out: out[:, 4], False)],
    ids=["quality_n_by_1", "quality_n"],
)
def test_a_quality_error_in_an_evaluation_is_caught_beside_the_iou(quiet_watch, quality, told):
    def metrics(out, boxes, target):
        box_iou(out[:, :4], boxes).max(1).values.mean()
        return (quality(out) - target).abs().mean()

    found = _detector_evaluation(quiet_watch, metrics)
    assert [(a.data["phase"], a.data["shapes"]) for a in found] == (
        [("evaluation", [[N, 1], [N]])] if told else []
    )


def _scores(quiet_watch, loss_fn: Callable, steps: int = 3):
    """A scorer trained on ``loss_fn(model, x, y)``: ``y`` (N,) from the data."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(N, 8, generator=gen)
        loss = loss_fn(model, x, x[:, 0].sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


def _pos_neg(model, x):
    """Scores (N,) of positives and of negatives: the loss pairs them after both passes."""
    return model(x).squeeze(-1), model(x + 0.5).squeeze(-1)


# Pairings of scores p, n (N,) with each other or with the data's y (N,).
PAIRWISE = {
    "margin_indexed": lambda p, n, y: F.relu(1 - (p[:, None] - n)),
    "margin_unsqueezed": lambda p, n, y: F.relu(1 - (p.unsqueeze(1) - n)),
    "margin_negative_side": lambda p, n, y: F.relu(1 + (n - p.unsqueeze(-1))),
    "margin_scaled_after_given": lambda p, n, y: torch.sigmoid(p[:, None] / 0.5 - n),
    "every_pair_of_one_batch": lambda p, n, y: F.relu(
        torch.sign(y[:, None] - y[None, :]) * (p[None, :] - p[:, None])
    ),
    "kernel_data_unsqueezed": lambda p, n, y: -torch.exp(-((y.unsqueeze(1) - p) ** 2)),
    "kernel_data_indexed": lambda p, n, y: -torch.exp(-((y[:, None] - p) ** 2)),
    "kernel_samples_given": lambda p, n, y: -torch.exp(-((p[:, None] - y) ** 2)),
}


@pytest.mark.parametrize("name", list(PAIRWISE))
def test_a_pairing_given_its_axis_in_the_loss_is_silent(quiet_watch, name):
    monitor = _scores(quiet_watch, lambda m, x, y: PAIRWISE[name](*_pos_neg(m, x), y).mean())
    assert rules_of(monitor) == []


def _unsqueezed_before_the_pass(m, x, y):
    """The target shaped in the loop before the forward pass, as data: y's axis."""
    target = y.unsqueeze(1)
    return (m(x).squeeze(-1) - target) ** 2


BUGS = {
    # the (N, 1) came out of the model
    "margin_on_the_model_output": lambda m, x, y: F.relu(1 - (m(x) - m(x + 0.5).squeeze(-1))),
    "weighted_output": lambda m, x, y: (m(x) * y.abs()[:, None] - y) ** 2,
    # the (N, 1) came with the data
    "target_from_the_data": lambda m, x, y: (m(x).squeeze(-1) - x[:, :1].sin()) ** 2,
    "target_unsqueezed_before_the_pass": _unsqueezed_before_the_pass,
    # a view to (N, 1), the usual shape fix, put on the wrong side
    "target_viewed": lambda m, x, y: (m(x).squeeze(-1) - y.view(-1, 1)) ** 2,
    "target_reshaped": lambda m, x, y: (m(x).squeeze(-1) - y.reshape(N, 1)).abs(),
}


@pytest.mark.parametrize("name", list(BUGS))
def test_an_n_by_1_not_given_in_the_loss_is_caught(quiet_watch, name):
    monitor = _scores(quiet_watch, lambda m, x, y: BUGS[name](m, x, y).mean())
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.step == 0 and alert.data["result"] == [N, N]


LOSSES = {
    "mse_loss": F.mse_loss,
    "l1_loss": F.l1_loss,
    "smooth_l1_loss": F.smooth_l1_loss,
    "huber_loss": F.huber_loss,
}


@pytest.mark.parametrize("given", ["unsqueeze", "indexed"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_function_given_a_target_with_an_axis_given_is_caught(quiet_watch, name, given):
    """A loss function compares an output with its target: never a pairwise matrix."""

    def loss(m, x, y):
        pred = m(x).squeeze(-1)
        return LOSSES[name](pred, y.unsqueeze(1) if given == "unsqueeze" else y[:, None])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own warning of the sizes
        monitor = _scores(quiet_watch, loss)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["op"] == name and alert.data["result"] == [N, N]


def test_the_same_loss_functions_on_matching_shapes_are_silent(quiet_watch):
    monitor = _scores(
        quiet_watch,
        lambda m, x, y: sum(f(m(x), y.unsqueeze(1)) for f in (F.mse_loss, F.smooth_l1_loss)),
    )
    assert rules_of(monitor) == []


def _actor_critic(quiet_watch, advantage: Callable):
    """Logits and a value per sample from one model; returns (N,) from the rollout."""
    torch.manual_seed(0)
    model = TinyNet(outputs=5)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        out = model(torch.randn(N, 8, generator=gen))
        dist = torch.distributions.Categorical(logits=out[:, :4])
        actions = dist.sample()
        returns = torch.randn(N, generator=gen)
        adv = advantage(returns, out[:, 4:])  # the critic's value: (N, 1)
        loss = -(dist.log_prob(actions) * adv.detach()).mean() + adv.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return monitor


def test_an_advantage_whose_n_by_1_came_from_the_critic_is_caught(quiet_watch):
    """``returns.unsqueeze(1)`` matches the critic's (N, 1): the axis of the advantage
    is the critic's as much as the loss's, and the policy term pairs every sample."""
    monitor = _actor_critic(quiet_watch, lambda returns, values: returns.unsqueeze(1) - values)
    (alert,) = [a for a in monitor.alerts if a.rule == "broadcast"]
    assert alert.data["op"] == "mul"
    assert sorted(alert.data["shapes"], key=len) == [[N], [N, 1]]


def test_the_advantage_taken_as_n_is_silent(quiet_watch):
    monitor = _actor_critic(quiet_watch, lambda returns, values: returns - values.squeeze(1))
    assert rules_of(monitor) == []
