"""broadcast in an evaluation: a validation loss or metric that pairs (N, 1) with (N,).

Training may be sound while the number model selection, early stopping or a
plateau scheduler reads is wrong: ``((pred - y) ** 2).mean()`` with ``pred
(N, 1)`` and ``y (N,)`` averages every prediction against every target. The
first evaluation passes of a run are followed into what the loop computes
from them, whenever they come, and what they find is told with
``data["phase"] == "evaluation"``. Each planted bug has its healthy form
beside it, and the evaluation code every run has (accuracy, top-k,
calibration, a confusion matrix, retrieval distances, torchmetrics,
``inference_mode``) stays silent.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches, rules_of


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (the planted op's source line)."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "_line(" not in text)


def _validation_data(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=gen)
    return x, x[:, 0].sin()  # targets (N,), as a dataset of scalars yields them


def _fit(model, opt, steps: int, evaluate, every: int) -> None:
    """A plain loop with ``evaluate()`` after every ``every``-th step (from step every-1)."""
    for step, (x, y) in enumerate(batches(steps)):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step % every == every - 1:
            evaluate()


def _evaluation(model, loss, no_grad: bool = True):
    """The usual validation: eval mode, no gradients, the model put back in training."""
    xv, yv = _validation_data()

    def evaluate() -> float:
        model.eval()
        with torch.no_grad() if no_grad else torch.enable_grad():
            value = loss(model(xv), yv).item()
        model.train()
        return value

    return evaluate


def _broadcasts(monitor) -> list[tw.Alert]:
    return [a for a in monitor.alerts if a.rule == "broadcast"]


def _buggy(out, y):
    return ((out - y) ** 2).mean()  # EVAL-BUG: (N, 1) - (N,)


def _healthy(out, y):
    return ((out.squeeze(-1) - y) ** 2).mean()


def test_a_validation_loss_pairing_n1_with_n_is_caught_after_the_training_audit(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 12, _evaluation(model, _buggy), every=5)  # first evaluation after step 4
    (alert,) = _broadcasts(monitor)
    assert alert.severity == "error" and alert.module is None
    assert alert.step == 5  # the step the evaluation ran in, past the 3 audited steps
    assert alert.data["phase"] == "evaluation"
    assert alert.data["op"] == "sub" and alert.data["result"] == [40, 40]
    assert alert.data["shapes"] == [[40, 1], [40]]
    assert alert.data["source"].endswith(f"test_broadcast_in_evaluation.py:{_line('EVAL-BUG')}")
    assert "in an evaluation pass" in alert.message
    assert "early stopping" in alert.hint


def test_a_healthy_validation_loss_is_silent_and_leaves_no_mode_or_listener(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"evaluation_passes": 3})
    _fit(model, opt, 30, _evaluation(model, _healthy), every=5)
    assert rules_of(monitor) == []
    # The evaluation audit is spent: nothing of it runs on the steps or passes after.
    assert torch._C._len_torch_function_stack() == 0
    assert "broadcast audit of evaluations" not in monitor._pipeline.passes.listener_names()


def test_the_training_audits_broadcast_is_still_told_as_training(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(4):
        opt.zero_grad()
        ((model(x) - y.squeeze(-1)) ** 2).mean().backward()
        opt.step()
    (alert,) = _broadcasts(monitor)
    assert alert.step == 0 and alert.data["phase"] == "training"
    assert "in an evaluation pass" not in alert.message


def test_mse_loss_in_a_validation_at_the_first_step_is_caught(quiet_watch):
    """An evaluation during the training audit's steps: the evaluation audit's."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "Using a target size"
        _fit(model, opt, 4, _evaluation(model, F.mse_loss), every=1)
    (alert,) = _broadcasts(monitor)
    assert alert.step == 1 and alert.data["phase"] == "evaluation"
    assert alert.data["op"] == "mse_loss"


def test_a_validation_after_the_last_step_is_told_when_the_monitor_closes(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 6, lambda: None, every=100)
    _evaluation(model, _buggy)()
    assert _broadcasts(monitor) == []  # no pass after it has ended its span yet
    monitor.close()
    (alert,) = _broadcasts(monitor)
    assert alert.step == 6 and alert.data["phase"] == "evaluation"
    assert torch._C._len_torch_function_stack() == 0


def test_a_healthy_validation_after_the_last_step_is_silent_at_close(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 6, lambda: None, every=100)
    _evaluation(model, _healthy)()
    monitor.close()
    assert rules_of(monitor) == []
    assert torch._C._len_torch_function_stack() == 0


def test_a_validation_with_gradients_on_in_eval_mode_is_caught(quiet_watch):
    """``model.eval()`` without ``no_grad``: still an evaluation."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 12, _evaluation(model, _buggy, no_grad=False), every=5)
    (alert,) = _broadcasts(monitor)
    assert alert.step == 5 and alert.data["phase"] == "evaluation"


def test_a_healthy_validation_with_gradients_on_in_eval_mode_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 12, _evaluation(model, _healthy, no_grad=False), every=5)
    assert rules_of(monitor) == []


def test_a_model_trained_in_eval_mode_is_no_evaluation_and_its_evaluation_is_still_audited(
    quiet_watch,
):
    """No dropout, ``model.eval()`` once and never undone: its training passes are not
    evaluations (each is trained on), and the later validation is still followed."""
    torch.manual_seed(0)
    model = TinyNet().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    xv, yv = _validation_data()
    for step, (x, y) in enumerate(batches(20)):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if step == 5:
            # Past the training audit: every training pass hereafter costs no mode.
            assert torch._C._len_torch_function_stack() == 0
        if step == 15:
            with torch.no_grad():
                _buggy(model(xv), yv).item()
    (alert,) = _broadcasts(monitor)
    assert alert.step == 16 and alert.data["phase"] == "evaluation"


class _QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 32)
        self.q = nn.Linear(32, 3)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.q(torch.relu(self.body(s)))


def _dqn(steps: int, *, target_first: bool, bug: bool, quiet_watch) -> tw.Monitor:
    """One network, its TD target under ``no_grad`` before or after the online pass."""
    torch.manual_seed(0)
    net = _QNet()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    monitor = quiet_watch(net, opt)
    for _ in range(steps):
        s, s2 = torch.randn(32, 4), torch.randn(32, 4)
        a, r = torch.randint(0, 3, (32, 1)), torch.randn(32)
        if target_first:
            with torch.no_grad():
                target = r + 0.99 * net(s2).max(1).values  # (N,)
        q = net(s).gather(1, a)  # (N, 1)
        if not target_first:
            with torch.no_grad():
                target = r + 0.99 * net(s2).max(1).values
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loss = F.smooth_l1_loss(q if bug else q.squeeze(1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return monitor


@pytest.mark.parametrize("target_first", [False, True], ids=["after_online", "before_online"])
def test_a_dqn_target_pass_is_the_training_audits_target_side(target_first, quiet_watch):
    monitor = _dqn(12, target_first=target_first, bug=True, quiet_watch=quiet_watch)
    (alert,) = _broadcasts(monitor)
    assert alert.step == 0 and alert.data["phase"] == "training"
    assert alert.data["op"] == "smooth_l1_loss" and alert.data["result"] == [32, 32]


@pytest.mark.parametrize("target_first", [False, True], ids=["after_online", "before_online"])
def test_a_healthy_dqn_target_pass_is_silent(target_first, quiet_watch):
    monitor = _dqn(12, target_first=target_first, bug=False, quiet_watch=quiet_watch)
    assert rules_of(monitor) == []
    assert torch._C._len_torch_function_stack() == 0


def test_only_the_first_evaluation_passes_are_followed(quiet_watch):
    """A long validation is not slowed throughout: ``evaluation_passes``, then nothing."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"evaluation_passes": 2})
    _fit(model, opt, 4, lambda: None, every=100)
    xv, yv = _validation_data()
    model.eval()
    with torch.no_grad():
        for i in range(5):
            out = model(xv)
            if i == 2:
                assert torch._C._len_torch_function_stack() == 0  # the span has ended
                _buggy(out, yv)  # the third pass: too late to see
            else:
                _healthy(out, yv)
    monitor.close()
    assert rules_of(monitor) == []


# -- evaluation code that pairs on purpose ----------------------------------------


class _Classifier(nn.Module):
    """Logits over 10 classes, and the features they come from (an embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _class_batches(n: int, batch: int = 16):
    gen = torch.Generator().manual_seed(3)
    for _ in range(n):
        yield torch.randn(batch, 8, generator=gen), torch.randint(0, 10, (batch,), generator=gen)


def _metrics_of_one_batch(out: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    classes = out.shape[1]
    probs = out.softmax(1)
    conf, pred = probs.max(1)
    correct = (pred == y).float()
    onehot = (y[:, None] == torch.arange(classes)).float()
    bins = torch.linspace(0, 1, 11)
    in_bin = (conf[:, None] > bins[None, :-1]) & (conf[:, None] <= bins[None, 1:])
    gap = (conf[:, None] - correct[:, None]).abs() * in_bin
    return [
        (out.argmax(1) == y).float().mean(),  # accuracy
        (out.topk(5).indices == y.view(-1, 1)).any(1).float().mean(),  # top-5
        gap.sum() / len(y),  # expected calibration error
        ((probs - onehot) ** 2).sum(1).mean(),  # Brier score
        F.cross_entropy(out, y),
        torch.bincount(y * classes + pred, minlength=classes * classes).view(classes, classes),
    ]


def test_classification_metrics_of_an_evaluation_are_silent(quiet_watch):
    torchmetrics = pytest.importorskip("torchmetrics")
    torch.manual_seed(0)
    model = _Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"audit_steps": 50})
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
    calibration = torchmetrics.classification.MulticlassCalibrationError(num_classes=10)
    for x, y in _class_batches(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    outs, labels = [], []
    with torch.no_grad():
        for x, y in _class_batches(6):
            out = model(x)
            _metrics_of_one_batch(out, y)
            accuracy.update(out, y)
            calibration.update(out.softmax(1), y)
            outs.append(out)
            labels.append(y)
        every = torch.cat(outs)  # collected, judged at the end
        _metrics_of_one_batch(every, torch.cat(labels))
        accuracy.compute(), calibration.compute()
    model.train()
    monitor.close()
    assert rules_of(monitor) == []


def test_retrieval_distances_between_two_evaluation_outputs_are_silent(quiet_watch):
    """Queries and a gallery both from the model: every pair is meant (equal sizes too)."""
    torch.manual_seed(0)
    model = TinyNet(outputs=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"audit_steps": 50})
    for x, y in batches(4, outputs=4):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        gallery = torch.cat([model(x) for x, _ in batches(2, batch=16)])  # (32, 4)
        for x, _ in batches(3, seed=5):
            q = model(x)  # (32, 4): as many queries as gallery items
            (q[:, None] - gallery[None]).pow(2).sum(-1).argmin(1)
            sq_q, sq_g = (q**2).sum(1), (gallery**2).sum(1)
            (sq_q.unsqueeze(1) + sq_g - 2 * q @ gallery.T).argmin(1)  # (N, 1) + (N,) on purpose
            torch.cdist(q, gallery).topk(3, largest=False)
    model.train()
    monitor.close()
    assert rules_of(monitor) == []


def test_a_regression_metric_accumulated_over_an_evaluation_is_caught_and_its_fix_silent(
    quiet_watch,
):
    """torchmetrics-like accumulation by hand: the broadcast in ``update`` is found."""
    for bug, found in ((True, ["broadcast"]), (False, [])):
        torch.manual_seed(0)
        model = TinyNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = quiet_watch(model, opt)
        _fit(model, opt, 4, lambda: None, every=100)
        total, count = torch.zeros(()), 0
        model.eval()
        with torch.no_grad():
            for x, y in batches(3, seed=9):
                pred = model(x) * 2.0 + 0.5  # de-normalised: followed without gradients
                target = y.squeeze(-1)
                error = pred - target if bug else pred.squeeze(-1) - target
                total += error.abs().sum()
                count += len(target)
        model.train()
        monitor.close()
        assert rules_of(monitor) == found, bug


def test_inference_under_inference_mode_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = _Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in _class_batches(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.inference_mode():
        for x, _ in _class_batches(5):
            probs = model(x).softmax(-1)
            probs.max(1).values.mean(), probs.argmax(1)
    monitor.close()
    assert rules_of(monitor) == []


def test_an_evaluation_loss_caught_under_inference_mode(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 4, lambda: None, every=100)
    xv, yv = _validation_data()
    model.eval()
    with torch.inference_mode():
        _buggy(model(xv), yv)
    monitor.close()
    (alert,) = _broadcasts(monitor)
    assert alert.data["phase"] == "evaluation"


# -- comparisons: an accuracy pairing (N, 1) with (N,) --------------------------


def _binary_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return x, (x[:, 0] + x[:, 1] > 0).float()  # labels (N,), as a dataset yields them


def _binary_accuracy(form: str, buggy: bool):
    """An accuracy of a one-logit head; ``buggy`` pairs ``(N, 1)`` with the ``(N,)`` labels."""

    def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        target = y if buggy else y.unsqueeze(1)
        if form == "thresholded":
            return ((out > 0).float() == target).float().mean()  # ACC-BUG
        return (torch.sigmoid(out).round() == target).float().mean()

    return accuracy


@pytest.mark.parametrize("form", ["thresholded", "rounded_sigmoid"])
@pytest.mark.parametrize("buggy", [True, False], ids=["bug", "healthy"])
def test_a_binary_accuracy_pairing_n1_with_n_is_caught(form, buggy, quiet_watch):
    """``((logits > 0).float() == y).float().mean()``: about one half whatever the model."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    accuracy = _binary_accuracy(form, buggy)
    xv, yv = _binary_data(200, 2)
    for epoch in range(2):
        for step in range(8):
            x, y = _binary_data(32, 10 * epoch + step)
            opt.zero_grad()
            F.binary_cross_entropy_with_logits(model(x), y.unsqueeze(1)).backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            value = accuracy(model(xv), yv).item()
        model.train()
        assert (abs(value - 0.5) < 0.05) == buggy  # the bug's number, next to the fix's
    monitor.close()
    if not buggy:
        assert rules_of(monitor) == []
        return
    (alert,) = _broadcasts(monitor)
    assert alert.step == 8 and alert.data["phase"] == "evaluation"
    assert alert.data["op"] == "eq" and alert.data["result"] == [200, 200]
    assert alert.data["shapes"] == [[200, 1], [200]]
    if form == "thresholded":
        assert alert.data["source"].endswith(f"in_evaluation.py:{_line('ACC-BUG')}")


@pytest.mark.parametrize("buggy", [True, False], ids=["bug", "healthy"])
def test_argmax_with_keepdim_against_the_labels_is_caught(buggy, quiet_watch):
    """Classes kept as ``(N, 1)`` by ``keepdim=True``, compared with ``(N,)`` labels."""
    torch.manual_seed(0)
    model = _Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in _class_batches(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        for x, y in _class_batches(3):
            out = model(x)
            pred = out.argmax(1, keepdim=True) if buggy else out.argmax(1)
            (pred == y).float().mean()
    model.train()
    monitor.close()
    assert rules_of(monitor) == (["broadcast"] if buggy else [])
    if buggy:
        (alert,) = _broadcasts(monitor)
        assert alert.data["op"] == "eq" and alert.data["shapes"] == [[16, 1], [16]]


def _comparisons_on_purpose(out: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Evaluation code comparing on purpose, with as many samples as classes."""
    n, classes = out.shape
    probs = out.softmax(1)
    conf, pred = probs.max(1)
    top5 = out.topk(5, 1, True, True).indices
    ranked = top5.t()  # (5, N): the ImageNet example's accuracy
    correct = ranked.eq(y.view(1, -1).expand_as(ranked))
    lengths = pred + 1  # a length per sample, predicted
    bins = torch.linspace(0, 1, n + 1)
    thresholds = torch.full((classes,), 0.2)
    padded = torch.where(torch.arange(n) % 4 == 0, torch.full_like(y, -100), y)
    kept = padded != -100
    return [
        (out.argmax(1) == y).float().mean(),
        (top5 == y.view(-1, 1)).any(1).float().mean(),
        correct[:1].reshape(-1).float().sum(0, keepdim=True) * (100.0 / n),
        (lengths[:, None] > torch.arange(n)).float().sum(1),  # a mask of each length
        (conf[:, None] > bins[None, :]).float().sum(0),  # calibration bins
        (probs > thresholds).float().mean(0),  # a threshold per class
        ((pred == padded) & kept).float().sum() / kept.sum(),  # labels ignored at -100
        (torch.sigmoid(out) > 0.5).eq(F.one_hot(y, classes).bool()).float().mean(),
        torch.isclose(probs.sum(1), torch.ones(n)).all(),
    ]


def test_comparisons_made_on_purpose_in_an_evaluation_are_silent(quiet_watch):
    torch.manual_seed(0)
    model = _Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in _class_batches(4, batch=10):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    outs, labels = [], []
    with torch.no_grad():
        for x, y in _class_batches(5, batch=10):  # as many samples as classes
            out = model(x)
            _comparisons_on_purpose(out, y)
            outs.append(out)
            labels.append(y)
        _comparisons_on_purpose(torch.cat(outs), torch.cat(labels))
    model.train()
    monitor.close()
    assert rules_of(monitor) == []


def test_a_comparison_in_a_training_step_is_not_judged(quiet_watch):
    """A training loss goes through no comparison (it carries no gradient): an accuracy
    logged beside the loss is left to the evaluations, which judge the same code."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    for step in range(4):
        x, y = _binary_data(32, step)
        out = model(x)
        loss = F.binary_cross_entropy_with_logits(out, y.unsqueeze(1))
        (torch.sigmoid(out).round() == y).float().mean()  # logged, not trained on
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    assert rules_of(monitor) == []


# -- a whole first evaluation ---------------------------------------------------


@pytest.mark.parametrize("buggy", [True, False], ids=["bug", "healthy"])
def test_a_metric_over_the_outputs_of_many_validation_batches_is_caught(buggy, quiet_watch):
    """Twelve batches collected, the error computed once over their ``torch.cat``."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit(model, opt, 4, lambda: None, every=100)
    preds, targets = [], []
    model.eval()
    with torch.no_grad():
        for x, y in batches(12, seed=4):
            preds.append(model(x))  # (N, 1)
            targets.append(y.squeeze(-1))  # (N,)
        pred, target = torch.cat(preds), torch.cat(targets)
        ((pred if buggy else pred.squeeze(-1)) - target).abs().mean()
    model.train()
    monitor.close()
    assert rules_of(monitor) == (["broadcast"] if buggy else [])
    if buggy:
        (alert,) = _broadcasts(monitor)
        assert alert.data["result"] == [384, 384] and alert.data["phase"] == "evaluation"


class _PolicyWithValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 16)
        self.policy = nn.Linear(16, 2)
        self.value = nn.Linear(16, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.body(obs))
        return self.policy(h), self.value(h)


@pytest.mark.parametrize("buggy", [True, False], ids=["bug", "healthy"])
def test_a_value_error_over_an_evaluation_episode_of_single_passes_is_caught(buggy, quiet_watch):
    """A greedy episode of 20 batch-of-one passes; its (1, 1) values stacked to (T, 1, 1)."""
    torch.manual_seed(0)
    model = _PolicyWithValue()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(4):
        logits, value = model(torch.randn(8, 4))
        loss = F.mse_loss(value.squeeze(-1), torch.randn(8)) - logits.log_softmax(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        values, rewards, obs = [], [], torch.zeros(1, 4)
        for t in range(20):
            logits, value = model(obs)
            values.append(value)  # (1, 1)
            obs = obs + 0.1 * (logits.argmax(-1).float() - 0.5)
            rewards.append(float(t == 19))
        returns = torch.tensor(rewards).flip(0).cumsum(0).flip(0)  # (T,)
        stacked = torch.stack(values)  # (T, 1, 1)
        ((stacked.view(-1, 1) if buggy else stacked.view(-1)) - returns).pow(2).mean()
    model.train()
    monitor.close()
    assert rules_of(monitor) == (["broadcast"] if buggy else [])
    if buggy:
        (alert,) = _broadcasts(monitor)
        assert alert.data["shapes"] == [[20, 1], [20]]


def test_evaluation_passes_are_set_apart_from_the_training_audits_steps(quiet_watch):
    """``audit_steps`` bounds the training audit only: a whole validation is followed."""
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, broadcast={"audit_steps": 1})
    assert monitor.config.broadcast.evaluation_passes == 64
    _fit(model, opt, 3, lambda: None, every=100)
    xv, yv = _validation_data()
    model.eval()
    with torch.no_grad():
        for i in range(40):
            out = model(xv)
            (_buggy if i == 39 else _healthy)(out, yv)
    model.train()
    monitor.close()
    (alert,) = _broadcasts(monitor)
    assert alert.data["phase"] == "evaluation"


# -- under trainwatch run: a dataset first evaluated late -----------------------

_LIGHTNING = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

bug = sys.argv[1] == "bug"


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.body(x))  # (N, 1)

    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self(x).squeeze(-1), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).squeeze(-1), y))

    def test_step(self, batch, _):
        x, y = batch
        out = self(x)
        self.log("test_mae", ((out if bug else out.squeeze(1)) - y).abs().mean())

    def predict_step(self, batch, _):
        return self(batch[0]).squeeze(-1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def data(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 8, generator=gen)
    return DataLoader(TensorDataset(x, x[:, 0].sin()), batch_size=16)


torch.manual_seed(0)
trainer = pl.Trainer(
    max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
model = Regressor()
trainer.fit(model, data(1), data(2))
trainer.test(model, data(3), verbose=False)
trainer.predict(model, data(3))
"""

_PLAIN = """
import sys
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

where = sys.argv[1]


def data(seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 8, generator=gen)
    return DataLoader(TensorDataset(x, x[:, 0].sin()), batch_size=16, shuffle=seed == 1)


def evaluate(loader, bug):
    model.eval()
    with torch.no_grad():
        for x, y in loader:
            out = model(x)  # (N, 1)
            ((out if bug else out.squeeze(1)) - y).abs().mean()
    model.train()


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
train, val, test = data(1), data(2), data(3)
for epoch in range(3):
    for x, y in train:
        opt.zero_grad()
        F.mse_loss(model(x).squeeze(-1), y).backward()
        opt.step()
    evaluate(val, where == "later_validation" and epoch == 2)
evaluate(test, where == "test")
"""


def _run_alerts(tmp_path, source: str, arg: str) -> list[tuple[str, str | None]]:
    """``trainwatch run`` on ``source``, with fewer evaluation passes than its validations."""
    from trainwatch.runner import run_script

    script = tmp_path / f"script_{arg}.py"
    script.write_text(source)
    log = tmp_path / f"log_{arg}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notes on a tiny run
        code = run_script(
            script,
            [arg],
            log_dir=log,
            console=False,
            config={"broadcast": {"evaluation_passes": 3}},
        )
    assert code == 0
    found = [json.loads(line) for line in (log / "alerts.jsonl").read_text().splitlines()]
    return [(a["rule"], a["data"].get("phase")) for a in found if a["rule"] == "broadcast"]


@pytest.mark.slow
@pytest.mark.parametrize("arg", ["bug", "healthy"])
def test_under_run_a_lightning_test_after_fit_is_audited_afresh(tmp_path, arg):
    """The sanity check and validations spent the evaluation passes; ``trainer.test``
    reads a dataset not evaluated before, and its first passes are followed again."""
    found = _run_alerts(tmp_path, _LIGHTNING, arg)
    assert found == ([("broadcast", "evaluation")] if arg == "bug" else [])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("test", [("broadcast", "evaluation")]),
        ("nowhere", []),
        # The validation set read again brings no more passes: the cost stays bounded.
        ("later_validation", []),
    ],
)
def test_under_run_a_plain_loops_test_set_is_audited_afresh(tmp_path, where, expected):
    assert _run_alerts(tmp_path, _PLAIN, where) == expected


def _shared_loss(out, y):
    return ((out - y) ** 2).mean()  # SHARED-BUG: one helper for training and validation


def _fit_with_shared_loss(model, opt, steps: int, evaluate_first: bool) -> None:
    """A loop whose training and validation call one loss helper; validated before
    training starts (a baseline, as Lightning's sanity check does) or after."""
    evaluate = _evaluation(model, _shared_loss)
    if evaluate_first:
        evaluate()
    for x, y in batches(steps):
        opt.zero_grad()
        _shared_loss(model(x), y.squeeze(-1)).backward()
        opt.step()
    evaluate()


def test_an_evaluation_told_first_does_not_absorb_the_training_finding(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit_with_shared_loss(model, opt, 4, evaluate_first=True)
    evaluation, training = _broadcasts(monitor)
    assert evaluation.data["phase"] == "evaluation" and evaluation.step == 0
    assert training.data["phase"] == "training" and training.step == 0
    assert "collapses to predicting the target mean" in training.hint
    assert "training itself may be sound" not in training.hint
    source = f"test_broadcast_in_evaluation.py:{_line('SHARED-BUG')}"
    assert evaluation.data["source"].endswith(source) and training.data["source"].endswith(source)


def test_a_line_told_in_training_is_not_told_again_for_an_evaluation(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _fit_with_shared_loss(model, opt, 4, evaluate_first=False)
    (alert,) = _broadcasts(monitor)
    assert alert.data["phase"] == "training"


def test_a_healthy_shared_loss_evaluated_first_is_silent(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    evaluate = _evaluation(model, _healthy)
    evaluate()
    for x, y in batches(4):
        opt.zero_grad()
        _healthy(model(x), y.squeeze(-1)).backward()
        opt.step()
    evaluate()
    assert rules_of(monitor) == []
