"""A watched model stays a normal model: save, pickle, deepcopy, state_dict."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from torch import nn

import trainwatch as tw
from tests.conftest import TinyNet, batches


def _step(model, opt):
    x, y = next(batches(1))
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _train_cut_off(copied, steps: int) -> None:
    """Train a copy of the watched model with fc1 cut off (.detach()): a zero_gradient
    bug, would it report into the original's monitor."""
    copied.detach_fc1 = True
    opt = torch.optim.SGD(copied.parameters(), lr=0.01)
    for _ in range(steps):
        _step(copied, opt)


def test_whole_model_save_and_load_while_watched_even_weights_only(tmp_path):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False):
        _step(model, opt)
        path = tmp_path / "model.pt"
        torch.save(model, path)
        torch.serialization.add_safe_globals([TinyNet, nn.Linear])
        loaded = torch.load(path, weights_only=True)
        _step(model, opt)
    assert isinstance(loaded, TinyNet)
    assert not loaded._forward_hooks and not loaded.fc1._forward_hooks


def test_pickle_and_deepcopy_do_not_drag_trainwatch_along():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        _step(model, opt)
        ema = copy.deepcopy(model)
        restored = pickle.loads(pickle.dumps(model))
        _train_cut_off(ema, 4)  # would be a zero_gradient if the copy reported in
        _train_cut_off(restored, 4)
        _step(model, opt)
        assert monitor.step_count == 2
        assert monitor.alerts == []


def test_state_dict_round_trip_is_unchanged_by_watching():
    torch.manual_seed(0)
    model = TinyNet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with tw.watch(model, console=False):
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        assert set(model.state_dict()) == set(before)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert all(torch.equal(state[k], before[k]) for k in before)


class NormNet(nn.Module):
    """Batch norm and dropout: what makes a teacher's train-mode forward matter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 1)
        self.cut = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.fc1(x))))
        return self.head(h.detach() if self.cut else h)


def test_ema_teacher_copied_mid_training_stays_outside_the_monitor():
    torch.manual_seed(0)
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with tw.watch(model, opt, console=False) as monitor:
        _step(model, opt)
        teacher = copy.deepcopy(model)  # an EMA / mean teacher, run in train mode
        teacher.requires_grad_(False)
        for x, y in batches(6):
            with torch.no_grad():
                target = teacher(x)  # no_grad + dropout on: not the watched model's business
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y) + nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            with torch.no_grad():
                for t, s in zip(teacher.parameters(), model.parameters()):
                    t.mul_(0.9).add_(s, alpha=0.1)
        assert monitor.step_count == 7
        assert monitor.alerts == []


def test_whole_model_saved_mid_training_loads_and_is_watched_on_its_own(tmp_path):
    torch.manual_seed(0)
    model = NormNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    path = tmp_path / "whole.pt"
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(6):
            _step(model, opt)
            if step == 2:
                torch.save(model, path)
        torch.serialization.add_safe_globals([NormNet, nn.Linear, nn.BatchNorm1d, nn.Dropout])
        for weights_only in (True, False):
            loaded = torch.load(path, weights_only=weights_only)
            loaded.cut = True  # a bug in the reloaded copy only
            loaded_opt = torch.optim.SGD(loaded.parameters(), lr=0.05)
            with tw.watch(loaded, loaded_opt, console=False) as second:
                for _ in range(4):
                    _step(loaded, loaded_opt)
                    _step(model, opt)
            assert {(a.rule, a.module) for a in second.alerts} == {
                ("zero_gradient", "fc1"),
                ("zero_gradient", "bn"),
            }
        assert monitor.alerts == []  # the original never heard of the copy's bug
        assert monitor.step_count == 14


def test_moving_a_watched_model_to_another_dtype_trains_as_unwatched():
    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = NormNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        monitor = tw.watch(model, opt, console=False) if watched else None
        for step, (x, y) in enumerate(batches(8)):
            if step == 3:
                assert model.to(torch.float64) is model
            dtype = next(model.parameters()).dtype
            opt.zero_grad()
            nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
            opt.step()
        if monitor is not None:
            assert monitor.alerts == [] and monitor.step_count == 8
            monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    plain, watched = run(False), run(True)
    assert all(a.dtype == torch.float64 and torch.equal(a, b) for a, b in zip(plain, watched))


class OwnDeepcopyNet(TinyNet):
    """A class with its own __deepcopy__ (it copies __dict__, hooks included)."""

    def __deepcopy__(self, memo):
        clone = type(self).__new__(type(self))
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone


def test_a_copy_that_took_the_hooks_along_does_not_report_into_the_monitor():
    torch.manual_seed(0)
    model = OwnDeepcopyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        _step(model, opt)
        _train_cut_off(copy.deepcopy(model), 4)  # its passes must not count
        _step(model, opt)
        assert monitor._pipeline.passes.passes == 2  # the model's own two passes only
        assert monitor.alerts == []
