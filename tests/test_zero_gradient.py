"""zero_gradient: detached layers (None) and dead signal (exact zeros), with controls."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import rules_of, train


@pytest.mark.parametrize("bug_from", [0, 4])
def test_detached_layer_alerts_none_at_the_step_it_started(model, quiet_watch, bug_from):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)

    def plant(step: int) -> None:
        model.detach_fc1 = step + 1 >= bug_from

    model.detach_fc1 = bug_from == 0
    train(model, opt, 10, before_step=plant)
    (alert,) = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert alert.module == "fc1"
    assert alert.step == bug_from
    assert alert.data["kind"] == "none"
    assert "None" in alert.message and "detach" in alert.hint
    assert alert.data["parameters"] == ["fc1.weight", "fc1.bias"]


def test_exact_zero_gradient_is_told_apart_from_none(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    model.zero_fc2 = True  # fc1 and fc2 are reached by backward, but with zeros
    train(model, opt, 5)
    zero = {a.module: a for a in monitor.alerts if a.rule == "zero_gradient"}
    assert set(zero) == {"fc1", "fc2", "head"}
    assert all(a.data["kind"] == "zero" and a.step == 0 for a in zero.values())
    assert zero["head"].data["parameters"] == ["head.weight"]  # its bias still learns
    assert "exactly zero" in zero["fc1"].message


def test_healthy_training_raises_no_zero_gradient(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 20)
    assert rules_of(monitor) == []


def test_one_step_of_zeros_from_zero_init_is_within_patience(quiet_watch):
    """LoRA-style B=0 init: A's gradient is exactly zero at step 0 only."""

    class LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 2, bias=False)
            self.b = nn.Linear(2, 1, bias=False)
            nn.init.zeros_(self.b.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    torch.manual_seed(0)
    model = LoRA()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    train(model, opt, 10)
    assert rules_of(monitor) == []


def test_patience_is_configurable(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, zero_gradient={"patience": 8})
    model.detach_fc1 = True
    train(model, opt, 6)
    assert rules_of(monitor) == []
    train(model, opt, 3)
    assert rules_of(monitor) == ["zero_gradient"]


def test_frozen_parameters_outside_the_optimizer_are_not_zero_gradient(model, quiet_watch):
    for p in model.fc1.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6)
    assert rules_of(monitor) == []


def test_manual_steps_without_optimizer_check_every_trainable_parameter(model, quiet_watch):
    monitor = quiet_watch(model)
    model.detach_fc1 = True
    for _ in range(4):
        model.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
        monitor.step()
    assert monitor.step_count == 4
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.step) == ("zero_gradient", "fc1", 0)


class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


@pytest.mark.parametrize("dead", [False, True])
def test_a_bias_the_loss_cancels_is_silent_but_a_dead_layer_is_not(quiet_watch, dead):
    """A WGAN critic's loss ``D(fake).mean() - D(real).mean()`` cancels its output
    bias exactly (and a linear layer's bias before batch norm is cancelled the same
    way): zero, while the layer's weight learns. A layer fed only zeros is dead."""
    torch.manual_seed(0)
    critic = Critic()
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    monitor = quiet_watch(critic, opt)
    for _ in range(6):
        real, fake = torch.randn(16, 8) + 1.0, torch.randn(16, 8)
        if dead:
            real, fake = real * 0.0, fake * 0.0
        opt.zero_grad()
        (critic(fake).mean() - critic(real).mean()).backward()
        opt.step()
    found = {a.module: a.data["parameters"] for a in monitor.alerts if a.rule == "zero_gradient"}
    if dead:
        assert found["body.0"] == ["body.0.weight", "body.0.bias"]
        assert found["out"] == ["out.weight", "out.bias"]
    else:
        assert found == {}


def test_a_bias_before_batch_norm_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    train(model, opt, 6)
    assert rules_of(monitor) == []


class _Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=-1)


def _triplets(generator: torch.Generator, centres: torch.Tensor, n: int = 64):
    anchor_class = torch.randint(0, len(centres), (n,), generator=generator)
    other = (anchor_class + torch.randint(1, len(centres), (n,), generator=generator)) % len(
        centres
    )

    def noisy(classes: torch.Tensor) -> torch.Tensor:
        return centres[classes] + 0.1 * torch.randn(n, centres.shape[1], generator=generator)

    return noisy(anchor_class), noisy(anchor_class), noisy(other)


@pytest.mark.parametrize("dead", [False, True])
def test_a_triplet_loss_every_sample_satisfies_is_silent_but_a_dead_layer_is_not(quiet_watch, dead):
    """Well separated clusters: past the first steps the margin holds for every
    triplet and the loss, and every gradient, is exactly zero on most steps. The
    gradient entering the model is zero too: nothing says a layer is dead. A
    layer whose units are all stuck at zero is still found."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(8, 16) * 4
    model = _Embedder()
    if dead:
        with torch.no_grad():
            model.net[0].bias.fill_(-1e3)  # every ReLU unit of the hidden layer at zero
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    criterion = nn.TripletMarginLoss(margin=0.2)
    zero_loss_steps = 0
    for _ in range(60):
        anchor, positive, negative = _triplets(generator, centres)
        loss = criterion(model(anchor), model(positive), model(negative))
        zero_loss_steps += loss.item() == 0.0
        opt.zero_grad()
        loss.backward()
        opt.step()
    found = [(a.module, a.severity) for a in monitor.alerts if a.rule == "zero_gradient"]
    if dead:
        assert ("net.0", "warning") in found
    else:
        assert zero_loss_steps >= 20  # the shape this pins: many steps of zero loss
        # No layer named; at most the note that the loss has sent nothing for long.
        assert [f for f in found if f != (None, "info")] == []


def test_a_loss_that_sends_nothing_into_the_model_for_long_is_one_note(quiet_watch):
    """A loss multiplied by zero: no layer is named; after 50 steps, one info line."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for _ in range(60):
        x = torch.randn(32, 8)
        opt.zero_grad()
        (nn.functional.mse_loss(model(x), x[:, :1]) * 0.0).backward()
        opt.step()
    found = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [(a.module, a.severity, a.step, a.data["kind"]) for a in found] == [
        (None, "info", 0, "no_signal")
    ]
    assert "for 50 consecutive steps" in found[0].message


HINGE_SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
centres = torch.randn(4, 10) * 5
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
criterion = nn.MultiMarginLoss(margin=0.5)  # a multi-class SVM's hinge
for step in range(80):
    y = torch.randint(0, 4, (64,))
    x = centres[y] + 0.1 * torch.randn(64, 10)
    loss = criterion(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_trainwatch_run_on_a_hinge_loss_at_rest_names_no_layer(tmp_path):
    import json

    from trainwatch.runner import run_script

    script = tmp_path / "svm.py"
    script.write_text(HINGE_SCRIPT)
    assert run_script(script, log_dir=tmp_path / "log", console=False) == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["severity"], a["module"]) for a in map(json.loads, lines)]
    assert [f for f in found if f[1] != "info"] == []


class _TwoTasks(nn.Module):
    """A shared trunk, a classification head and a regression head (two outputs)."""

    def __init__(self, cut_inside: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.cls_head = nn.Linear(32, 4)
        self.reg_head = nn.Linear(32, 1)
        self.cut_inside = cut_inside

    def forward(self, x: torch.Tensor):
        h = self.trunk(x)
        reg = self.reg_head(h).squeeze(-1)
        if self.cut_inside:
            reg = reg * 0.0  # planted: the head's output thrown away inside the model
        return self.cls_head(h), reg


def _two_task_run(quiet_watch, model: nn.Module, weight_of) -> list:
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(80):
        x = torch.randn(32, 16)
        logits, reg = model(x)
        loss = nn.functional.cross_entropy(logits, x[:, :4].argmax(1))
        loss = loss + weight_of(step) * nn.functional.mse_loss(reg, x[:, 4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [a for a in monitor.alerts if a.rule == "zero_gradient"]


def test_a_task_weighted_by_zero_for_a_while_is_a_note_not_a_dead_head(quiet_watch):
    torch.manual_seed(0)
    found = _two_task_run(quiet_watch, _TwoTasks(), lambda step: 0.0 if step < 50 else 1.0)
    assert [(a.severity, a.module, a.data["kind"], a.data["outputs"]) for a in found] == [
        ("info", "reg_head", "output_without_signal", [1])
    ]


def test_control_a_head_zeroed_inside_the_model_is_still_a_warning(quiet_watch):
    torch.manual_seed(0)
    found = _two_task_run(quiet_watch, _TwoTasks(cut_inside=True), lambda step: 1.0)
    assert [(a.severity, a.module, a.data["kind"]) for a in found] == [
        ("warning", "reg_head", "zero")
    ]


class _BoxHead(nn.Module):
    """A detector's shape: class logits and boxes, both returned every step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.cls = nn.Linear(32, 3)
        self.box = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor):
        h = torch.relu(self.body(x))
        return self.cls(h), self.box(h)


def _detector_run(quiet_watch, box_loss_on, steps: int) -> list[tuple[str, str, int]]:
    """The box loss is added only on the steps ``box_loss_on`` allows (a batch with
    a positive box)."""
    torch.manual_seed(0)
    model = _BoxHead()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        x = torch.randn(16, 8)
        logits, boxes = model(x)
        loss = nn.functional.cross_entropy(logits, torch.randint(0, 3, (16,)))
        if box_loss_on(step):
            loss = loss + nn.functional.smooth_l1_loss(boxes, x[:, :4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [(a.rule, a.severity, a.step) for a in monitor.alerts if a.module == "box"]


def test_a_box_loss_skipped_on_batches_without_positives_is_no_cut(quiet_watch):
    found = _detector_run(quiet_watch, lambda step: not 5 <= step < 12, 40)
    assert found == [("unused_parameter", "info", 5)]


def test_a_box_loss_missing_on_the_first_batches_is_no_cut(quiet_watch):
    found = _detector_run(quiet_watch, lambda step: step >= 4, 40)
    assert found == [("unused_parameter", "info", 4)]


def test_control_a_box_loss_dropped_for_good_is_still_found(quiet_watch):
    found = _detector_run(quiet_watch, lambda step: step < 10, 70)
    assert ("zero_gradient", "warning", 10) in found


def test_control_a_box_loss_never_added_is_still_found_early(quiet_watch):
    found = _detector_run(quiet_watch, lambda step: False, 20)
    assert found == [("zero_gradient", "warning", 0)]


class _GuidedNet(nn.Module):
    """Classifier-free guidance's shape: a learned null embedding, a bare parameter of
    the model, stands in for the class embedding on the steps the labels are dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.classes = nn.Embedding(4, 8)
        self.null = nn.Parameter(torch.zeros(8))
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor, drop: bool, cut: bool = False):
        condition = self.classes(y)
        if drop:
            null = self.null.detach() if cut else self.null
            condition = null.expand_as(condition)
        return self.body(torch.cat([x, condition], 1))


def _guided_run(quiet_watch, drop_on, cut_from: int | None = None, steps: int = 120):
    torch.manual_seed(0)
    model = _GuidedNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for step in range(steps):
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        cut = cut_from is not None and step >= cut_from
        out = model(x, y, drop_on(step), cut)
        loss = nn.functional.mse_loss(out.squeeze(-1), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"]


def test_a_null_embedding_used_on_some_steps_only_is_no_cut(quiet_watch):
    """The whole batch drops its labels every eighth step: the null embedding goes
    seven steps at a time without a gradient (unused_parameter notes it once)."""
    assert _guided_run(quiet_watch, lambda step: step % 8 == 1) == []


def test_control_a_null_embedding_cut_from_the_start_is_still_found_early(quiet_watch):
    # Never trained: the usual patience (the model ran every step, read it or not).
    found = _guided_run(quiet_watch, lambda step: step % 8 == 1, cut_from=0)
    assert found == [("zero_gradient", "", 0)]


def test_control_a_null_embedding_cut_for_good_later_is_still_found(quiet_watch):
    # Trained, then cut: found once it outlasts the patience given to a part read
    # on some steps only.
    found = _guided_run(quiet_watch, lambda step: step % 2 == 1, cut_from=21)
    assert found == [("zero_gradient", "", 20)]
