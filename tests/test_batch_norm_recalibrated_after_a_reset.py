"""Batch norm statistics re-estimated after a reset are no evaluation in training mode.

After pruning, quantisation or a hand-written weight average (SWA), and for
AdaBN's domain adaptation, a loop calls ``reset_running_stats()`` on its batch
norms and forwards batches in training mode under ``no_grad``: the default
momentum re-estimates the statistics. Those passes were told as an evaluation
that forgot ``model.eval()``, whose hint would have made the re-estimation do
nothing. The same passes without the reset (validation batches poured into
the statistics training gathered) are still told, at the same step; so are
passes that leave dropout on beside a re-estimation (an evaluation in training
mode as much as a re-estimation: told whole, as before).
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from trainwatch.runner import run_script


def _evaluations(monitor: tw.Monitor) -> list[tuple[int, str | None]]:
    return [(a.step, a.module) for a in monitor.alerts if a.rule == "eval_in_train_mode"]


def _reset(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 64),
        nn.BatchNorm1d(64),
        nn.ReLU(),
        nn.Linear(64, 4),
    )


def _pruned_and_recalibrated(reset: bool) -> list[tuple[int, str | None]]:
    """Magnitude pruning at step 3, then 20 no-grad passes in training mode."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(8):
            if step == 3:
                with torch.no_grad():
                    w = model[3].weight
                    w.mul_((w.abs() > w.abs().median()).float())
                if reset:
                    _reset(model)
                with torch.no_grad():
                    for _ in range(20):
                        model(torch.randn(128, 20))
            x = torch.randn(64, 20)
            loss = F.cross_entropy(model(x), (x[:, :4] - x[:, 4:8]).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return _evaluations(monitor)


def test_statistics_re_estimated_after_pruning_are_silent():
    assert _pruned_and_recalibrated(reset=True) == []


def test_the_same_passes_without_a_reset_are_still_an_evaluation():
    assert _pruned_and_recalibrated(reset=False) == [(3, "1")]


PRUNED = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(),
    nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4),
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(8):
    if step == 3:
        with torch.no_grad():
            w = model[3].weight
            w.mul_((w.abs() > w.abs().median()).float())
        if sys.argv[1] == "reset":
            for m in model.modules():
                if isinstance(m, nn.BatchNorm1d):
                    m.reset_running_stats()
        with torch.no_grad():
            for _ in range(20):
                model(torch.randn(128, 20))
    x = torch.randn(64, 20)
    loss = F.cross_entropy(model(x), (x[:, :4] - x[:, 4:8]).argmax(1))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# A model built here, its statistics first estimated by no-grad passes in training
# mode, then fine-tuned with its batch norms frozen (in eval mode) and validated in
# eval mode: or validated every 10 steps in training mode, the statistics polluted.
ESTIMATED_FIRST = """
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
)
with torch.no_grad():
    for _ in range(20):
        model(torch.randn(32, 1, 12, 12))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model[1].eval()
for step in range(30):
    x = torch.randn(8, 1, 12, 12)
    loss = F.cross_entropy(model(x), (x.mean((1, 2, 3)) > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 9:
        if sys.argv[1] == "eval":
            model.eval()
        else:
            model[1].train()
        with torch.no_grad():
            model(torch.randn(32, 1, 12, 12))
        model.train()
        model[1].eval()
"""


def _run(tmp_path, source: str, arg: str) -> list[tuple[int, str | None]]:
    script = tmp_path / "script.py"
    script.write_text(source)
    log = tmp_path / arg
    run_script(script, [arg], log_dir=log, console=False)
    lines = (log / "alerts.jsonl").read_text().splitlines()
    alerts = [json.loads(line) for line in lines]
    return [(a["step"], a["module"]) for a in alerts if a["rule"] == "eval_in_train_mode"]


def test_re_estimation_after_pruning_is_silent_under_run(tmp_path):
    assert _run(tmp_path, PRUNED, "reset") == []
    assert _run(tmp_path, PRUNED, "noreset") == [(3, "1")]


def test_statistics_estimated_before_training_are_silent_under_run(tmp_path):
    """A freshly built batch norm's statistics are at their reset: estimating them
    before training is the same re-estimation. Validations in training mode
    later (one no-grad pass every 10 steps, after steps that did not touch the
    frozen statistics) are still told: optimizer steps came since."""
    assert _run(tmp_path, ESTIMATED_FIRST, "eval") == []
    told = _run(tmp_path, ESTIMATED_FIRST, "train")
    assert told and told[0] == (10, "1")


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def _images(n: int, shift: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, 8, 8) + shift
    return x, (x[:, 0].mean((1, 2)) > x[:, 1].mean((1, 2))).long() + 2 * (x[:, 2].std((1, 2)) > 1)


def _averaged_weights(reset: bool) -> list[tuple[int, str | None]]:
    """Hand-written SWA: the weights averaged over the last steps are loaded at step
    30, the statistics re-estimated for them (they belong to no model trained),
    and the averaged model tested in eval mode."""
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    average: dict[str, torch.Tensor] = {}
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(31):
            x, y = _images(32)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step >= 20:
                seen = step - 20
                for name, param in model.named_parameters():
                    kept = average.setdefault(name, param.detach().clone())
                    kept.mul_(seen / (seen + 1)).add_(param.detach() / (seen + 1))
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(average[name])
        if reset:
            _reset(model)
        model.train()
        with torch.no_grad():
            for _ in range(10):
                model(_images(64)[0])
        model.eval()
        with torch.no_grad():
            x, y = _images(128)
            (model(x).argmax(1) == y).float().mean()
    return _evaluations(monitor)


def test_a_cnn_recalibrated_after_weight_averaging_is_silent():
    assert _averaged_weights(reset=True) == []


def test_a_cnn_run_on_averaged_weights_without_a_reset_is_told():
    assert _averaged_weights(reset=False) == [(31, "bn1")]


def test_adabn_on_the_target_domain_is_silent():
    """AdaBN: trained on the source domain, its statistics replaced by the target
    domain's (reset, then target batches in training mode), tested there in eval."""
    torch.manual_seed(0)
    model = SmallCNN()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(30):
            x, y = _images(32)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        _reset(model)
        with torch.no_grad():
            for _ in range(15):
                model(_images(64, shift=1.5)[0])
        model.eval()
        with torch.no_grad():
            x, y = _images(128, shift=1.5)
            (model(x).argmax(1) == y).float().mean()
    assert _evaluations(monitor) == []


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.bn(self.fc1(x)))))


def _dropout_net_after(recalibrate) -> tw.Monitor:
    """20 training steps, then ``recalibrate(model)``, then 5 more steps."""
    torch.manual_seed(0)
    model = DropoutNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(25):
            if step == 20:
                recalibrate(model)
            x = torch.randn(32, 16)
            loss = F.cross_entropy(model(x), x[:, :3].argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return monitor


def test_batch_norm_alone_put_back_in_training_mode_to_recalibrate_is_silent():
    """The careful recipe for a model with dropout too: ``model.eval()``, then only
    the batch norms in ``train()``, reset and re-estimated with dropout off."""

    def recalibrate(model: nn.Module) -> None:
        model.eval()
        model.bn.train()
        model.bn.reset_running_stats()
        with torch.no_grad():
            for _ in range(10):
                model(torch.randn(64, 16))
        model.train()

    assert _evaluations(_dropout_net_after(recalibrate)) == []


def test_dropout_left_on_beside_a_reset_is_still_an_evaluation():
    """A reset, then no-grad passes with the whole model in training mode, dropout
    on: the batch norm may be re-estimating, but dropout drops units in what may
    as well be a validation (and statistics re-estimated so describe activations
    with units dropped, not those of the model evaluated). Told as any evaluation
    in training mode, every module named, at the step the same passes without
    the reset are told."""

    def validate_after_reset(model: nn.Module) -> None:
        model.bn.reset_running_stats()
        with torch.no_grad():
            for _ in range(10):
                model(torch.randn(64, 16))

    monitor = _dropout_net_after(validate_after_reset)
    assert _evaluations(monitor) == [(20, "bn")]
    alert = next(a for a in monitor.alerts if a.rule == "eval_in_train_mode")
    assert alert.data["modules"] == ["bn", "drop"]


def test_a_validation_in_training_mode_without_a_reset_names_both():
    def validate(model: nn.Module) -> None:
        with torch.no_grad():
            for _ in range(10):
                model(torch.randn(64, 16))

    monitor = _dropout_net_after(validate)
    assert _evaluations(monitor) == [(20, "bn")]
    alert = next(a for a in monitor.alerts if a.rule == "eval_in_train_mode")
    assert alert.data["modules"] == ["bn", "drop"]


def test_a_validation_after_training_on_re_estimated_statistics_is_told():
    """The re-estimation ends where training begins again: the statistics then hold
    training batches, and a validation in training mode pollutes them."""
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(12):
            if step == 3:
                _reset(model)
                with torch.no_grad():
                    for _ in range(20):
                        model(torch.randn(128, 20))
            x = torch.randn(64, 20)
            loss = F.cross_entropy(model(x), (x[:, :4] - x[:, 4:8]).argmax(1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 8:
                with torch.no_grad():
                    for _ in range(5):
                        model(torch.randn(128, 20))
    assert _evaluations(monitor) == [(9, "1")]


# Hand-written SWA on a copy: the copy, made after training began, averages the
# weights, its statistics are reset and re-estimated, then it is tested in eval
# mode. Under trainwatch run the copy is found at its first pass, after the reset:
# its batch count, written more often than the batches it holds, shows the reset.
SWA_COPY = """
import copy
import sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
swa, seen = None, 0
for step in range(30):
    x = torch.randn(16, 3, 8, 8)
    loss = F.cross_entropy(model(x), (x.mean((1, 2, 3)) > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step >= 20:
        if swa is None:
            swa = copy.deepcopy(model)
        else:
            with torch.no_grad():
                for kept, param in zip(swa.parameters(), model.parameters()):
                    kept.mul_(seen / (seen + 1)).add_(param / (seen + 1))
        seen += 1
if sys.argv[1] == "reset":
    for m in swa.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
swa.train()
with torch.no_grad():
    for _ in range(12):
        swa(torch.randn(32, 3, 8, 8))
swa.eval()
with torch.no_grad():
    print(swa(torch.randn(64, 3, 8, 8)).argmax(1).float().mean().item())
"""


def test_an_swa_copy_recalibrated_after_a_reset_is_silent_under_run(tmp_path):
    assert _run(tmp_path, SWA_COPY, "reset") == []
    assert _run(tmp_path, SWA_COPY, "noreset") == [(30, "1")]
