"""SAM's second backward adding onto the gradients that made its perturbation.

SAM (sharpness-aware minimization; ASAM and GSAM alike) moves every weight in
place by ``e`` made from the first backward's gradient ``g(w)``, and must reset
the gradients before the second backward at ``w + e``: the update is to apply
``g(w + e)`` alone. ``first_step()`` without ``zero_grad`` (or a hand-written
perturbation without ``opt.zero_grad()``) makes it apply ``g(w) + g(w + e)``:
``accumulated_gradient`` at step 0 (``data.method: perturbation``), whether the
perturbation writes the weights in place or through ``.data``, under
``tw.watch`` and ``trainwatch run``. ``second_step()`` without ``zero_grad``
lets the next step's first backward add onto the gradients the update used,
and that sum makes the perturbation before ``first_step``'s reset: told at
step 1, as the usual missing ``zero_grad()``.

Silent: SAM as written, in every shape; ASAM, GSAM (the first gradient cloned
before the reset), a reset through ``p.grad.data.zero_()``; adversarial
training on the embedding alone (FGM: one weight moved, the two gradients
summed by design); first-order MAML adapting the weights in place with
``torch.autograd.grad`` while the query gradients of its tasks add up in
``.grad``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.lightning_models import BoringNet, quiet_trainer
from tests.optimizer_wrappers import SAM, WRAPPERS
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

F = nn.functional
STEPS = 8


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 3),
    )


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


def _batch(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    shape = (16, 1, 8, 8) if isinstance(model[0], nn.Conv2d) else (16, 8)
    x = torch.randn(*shape, generator=generator)
    return x, torch.randint(0, 3, (16,), generator=generator)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(model, step)
    return F.cross_entropy(model(x), y)


def _told(monitor) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.data.get("method")) for a in monitor.alerts if a.severity != "info"]


class DataSAM(torch.optim.Optimizer):
    """SAM as many copies write it: ASAM's adaptive scale, the weights perturbed and
    restored through ``.data`` (no version counter moves)."""

    def __init__(self, params, base_optimizer, rho=0.5, adaptive=True, **kwargs):
        super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([(p.abs() * p.grad).norm() for p in params]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                scale = torch.pow(p, 2) if group["adaptive"] else 1.0
                p.data.add_(scale * p.grad * group["rho"] / (norm + 1e-12))
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        if zero_grad:
            self.zero_grad()


WRAPPED = {"sam": SAM, "asam_through_data": DataSAM}


def _sam_loop(quiet_watch, model, wrapper, *, first_reset=True, second_reset=True):
    opt = WRAPPED[wrapper](model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    for step in range(STEPS):
        _loss(model, step).backward()
        opt.first_step(zero_grad=first_reset)
        _loss(model, step).backward()
        opt.second_step(zero_grad=second_reset)
    assert monitor.step_count == STEPS
    return monitor


@pytest.mark.parametrize("wrapper", list(WRAPPED))
@pytest.mark.parametrize("build", [_cnn, _mlp], ids=["cnn", "mlp"])
def test_sam_whose_first_step_keeps_the_gradients_is_told_at_step_0(quiet_watch, build, wrapper):
    monitor = _sam_loop(quiet_watch, build(), wrapper, first_reset=False)
    assert _told(monitor) == [("accumulated_gradient", 0, "perturbation")]
    (alert,) = monitor.alerts
    assert "an earlier backward of step 0 had already used to move the weights" in alert.message
    assert "first_step(zero_grad=True)" in alert.hint
    assert alert.data["parameters"] == len(list(build().parameters()))


@pytest.mark.parametrize("wrapper", list(WRAPPED))
@pytest.mark.parametrize("build", [_cnn, _mlp], ids=["cnn", "mlp"])
def test_sam_as_written_is_silent(quiet_watch, build, wrapper):
    assert _told(_sam_loop(quiet_watch, build(), wrapper)) == []


def test_sam_whose_second_step_keeps_the_gradients_is_told_at_step_1(quiet_watch):
    """The next step's first backward adds onto the gradients step 0 applied; the sum
    perturbs the weights before first_step's reset."""
    monitor = _sam_loop(quiet_watch, _mlp(), "sam", second_reset=False)
    assert _told(monitor) == [("accumulated_gradient", 1, "optimizer_step")]
    assert "step 0 had already used" in monitor.alerts[0].message


def _hand_written(quiet_watch, *, shape: str, reset: str | None):
    """SAM written out around a plain SGD, no wrapper class: ``shape`` "inline" (one
    loss, perturb and restore written in the loop) or "closures" (the two passes as
    closures); ``reset``: how the gradients are reset after the perturbation."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    params = list(model.parameters())
    for step in range(STEPS):
        x, y = _batch(model, step)

        def closure(x=x, y=y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        if shape == "closures":
            closure()
        else:
            F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            perturbation = [p.grad * 0.05 / (norm + 1e-12) for p in params]
            for p, e in zip(params, perturbation):
                p.add_(e)
        if reset == "zero_grad":
            opt.zero_grad()
        elif reset == "through_data":
            for p in params:
                p.grad.data.zero_()  # legacy: no version counter moves
        if shape == "closures":
            closure()
        else:
            F.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p, e in zip(params, perturbation):
                p.sub_(e)
        opt.step()
        opt.zero_grad()
    return monitor


@pytest.mark.parametrize("shape", ["inline", "closures"])
def test_hand_written_sam_without_the_reset_is_told_at_step_0(quiet_watch, shape):
    monitor = _hand_written(quiet_watch, shape=shape, reset=None)
    assert _told(monitor) == [("accumulated_gradient", 0, "perturbation")]


@pytest.mark.parametrize("reset", ["zero_grad", "through_data"])
@pytest.mark.parametrize("shape", ["inline", "closures"])
def test_hand_written_sam_with_the_reset_is_silent(quiet_watch, shape, reset):
    assert _told(_hand_written(quiet_watch, shape=shape, reset=reset)) == []


def test_gsam_keeping_its_first_gradient_aside_is_silent(quiet_watch):
    """GSAM clones g(w), resets, and combines it with g(w + e) by hand."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    params = list(model.parameters())
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step).backward()
        with torch.no_grad():
            first = [p.grad.clone() for p in params]
            norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
            perturbation = [p.grad * 0.05 / (norm + 1e-12) for p in params]
            for p, e in zip(params, perturbation):
                p.add_(e)
        opt.zero_grad()
        _loss(model, step).backward()
        with torch.no_grad():
            for p, g, e in zip(params, first, perturbation):
                along = (g * p.grad).sum() / (p.grad.norm() ** 2 + 1e-12)
                p.grad.sub_(0.1 * (g - along * p.grad))
                p.sub_(e)
        opt.step()
    assert _told(monitor) == []


class TextNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(1))


def test_adversarial_training_on_the_embedding_alone_is_silent(quiet_watch):
    """FGM: the embedding moved along its gradient, the adversarial gradient added
    onto the clean one by design, the embedding restored before the step."""
    model = TextNet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, opt)
    weight = model.embedding.weight
    for step in range(STEPS):
        ids = torch.randint(0, 50, (8, 5), generator=torch.Generator().manual_seed(step))
        y = (ids[:, 0] > 25).long()
        F.cross_entropy(model(ids), y).backward()
        backup = weight.detach().clone()
        with torch.no_grad():
            weight.add_(0.5 * weight.grad / weight.grad.norm())
        F.cross_entropy(model(ids), y).backward()
        with torch.no_grad():
            weight.copy_(backup)
        opt.step()
        opt.zero_grad()
    assert _told(monitor) == []


def test_first_order_maml_adapting_the_weights_in_place_is_silent(quiet_watch):
    """Each task adapts the weights in place by torch.autograd.grad (no .grad written),
    and its query backward adds its meta-gradient onto the earlier tasks' by design."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 1))
    meta = torch.optim.Adam(model.parameters(), 1e-3)
    monitor = quiet_watch(model, meta)
    params = list(model.parameters())
    for _ in range(4):
        meta.zero_grad()
        saved = [p.detach().clone() for p in params]
        for task in range(3):
            x = torch.randn(10, 1)
            y = (1 + task) * torch.sin(x)
            for _ in range(2):
                grads = torch.autograd.grad(F.mse_loss(model(x), y), params)
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.sub_(0.01 * g)
            F.mse_loss(model(x), y).backward()
            with torch.no_grad():
                for p, s in zip(params, saved):
                    p.copy_(s)
        meta.step()
    assert _told(monitor) == []


SCRIPT = """
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 3))
opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
for step in range(8):
    x = torch.randn(16, 1, 8, 8)
    y = torch.randint(0, 3, (16,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.first_step(zero_grad={first})
    nn.functional.cross_entropy(model(x), y).backward()
    opt.second_step(zero_grad={second})
"""


@pytest.mark.parametrize(
    ("first", "second", "told"),
    [
        (True, True, []),
        (False, True, [("accumulated_gradient", 0, "perturbation")]),
        (True, False, [("accumulated_gradient", 1, "optimizer_step")]),
    ],
    ids=["as_written", "first_step_keeps", "second_step_keeps"],
)
def test_trainwatch_run_tells_sam_like_watch(tmp_path, first, second, told):
    script = tmp_path / "train.py"
    script.write_text(
        WRAPPERS + "from torch import nn\n" + SCRIPT.format(first=first, second=second)
    )
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    assert [(a["rule"], a["step"], a["data"].get("method")) for a in alerts] == told


class ManualSAM(BoringNet):
    """SAM in Lightning's manual optimisation."""

    def __init__(self, first_reset: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first_reset = first_reset

    def configure_optimizers(self):
        return SAM(self.parameters(), torch.optim.SGD, lr=self.lr)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.manual_backward(loss)
        opt.first_step(zero_grad=self.first_reset)
        self.manual_backward(F.mse_loss(self(x), y))
        opt.second_step(zero_grad=True)
        return loss


@pytest.mark.parametrize("first_reset", [True, False], ids=["as_written", "first_step_keeps"])
def test_lightning_manual_optimisation_sam(tmp_path, first_reset):
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(
        tmp_path, [callback], max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0
    )
    trainer.fit(ManualSAM(first_reset))
    told = [(a.rule, a.step, a.data.get("method")) for a in callback.alerts if a.severity != "info"]
    assert told == ([] if first_reset else [("accumulated_gradient", 0, "perturbation")])
