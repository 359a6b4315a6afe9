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
        ema.detach_fc1 = True  # would be a zero_gradient if the copy reported in
        ema_opt = torch.optim.SGD(ema.parameters(), lr=0.01)
        for _ in range(4):
            _step(ema, ema_opt)
            _step(restored, torch.optim.SGD(restored.parameters(), lr=0.01))
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
