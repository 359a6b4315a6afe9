"""stalled_training's re-run of the first batch never breaks, nor changes, the training it watches.

Planted: models whose eval-mode forward writes into a weight in place (an
``nn.Embedding(max_norm=...)`` tied to its decoder, which renormalises the rows
it looks up on every call; an AWD-LSTM whose training path is embedding dropout
and whose eval path calls the embedding) and one whose eval forward registers
its raw weight as a parameter (salesforce's ``WeightDrop``). Re-run between the
forward and the backward, the first failed the user's backward (a weight the
graph saved written in place); the second failed the next step (a parameter
left registered). Each shape trains bit for bit as without trainwatch: with an
optimizer, with ``monitor.step()`` and no optimizer, with LBFGS's closure, in a
Lightning Trainer and under ``trainwatch run``. What a re-run writes into a
weight is put back (values and version counter), so such a model is re-run
and measured at every sampled step like any other, and a stall is told at
the same step. Controls: the same models without ``max_norm``.
"""

from __future__ import annotations

import io

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.same_training import plain_and_under_run
from trainwatch.lightning import TrainWatchCallback
from trainwatch.tensorboard_plugin import metadata

V, H = 50, 32  # vocabulary, width
# A re-run every 3 steps from the first: the first step's reference, then steps 2, 5, 8, 11.
OFTEN = {"every": 3, "warmup": 1}


def _stalls(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "stalled_training"]


def _internal(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.rule == "internal_error"]


# -- models -------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """Embedding -> GRU -> decoder sharing the embedding's weight."""

    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, H, max_norm=max_norm)
        self.rnn = nn.GRU(H, H, batch_first=True)
        self.out = nn.Linear(H, V)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0])


class AWDLM(nn.Module):
    """AWD-LSTM's embedding dropout (``F.embedding`` on a masked weight, no
    renormalisation) in training, the embedding module itself in eval."""

    eval_calls = 0  # on the class: no re-run puts it back

    def __init__(self, max_norm: float | None) -> None:
        super().__init__()
        self.encoder = nn.Embedding(V, H, max_norm=max_norm)
        self.rnn = nn.LSTM(H, H, batch_first=True)
        self.decoder = nn.Linear(H, V)
        self.decoder.weight = self.encoder.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            mask = self.encoder.weight.new_empty((V, 1)).bernoulli_(0.9) / 0.9
            h = F.embedding(x, self.encoder.weight * mask)
        else:
            type(self).eval_calls += 1
            h = self.encoder(x)
        return self.decoder(self.rnn(h)[0])


class WeightDrop(nn.Module):
    """salesforce/awd-lstm-lm's DropConnect: the raw weight dropped out into the
    LSTM's ``weight_hh_l0`` on every call; in eval ``F.dropout`` returns the raw
    ``nn.Parameter`` itself, which ``setattr`` registers as a parameter."""

    def __init__(self, module: nn.Module, name: str, dropout: float) -> None:
        super().__init__()
        self.module, self.name, self.dropout = module, name, dropout
        weight = getattr(module, name)
        del module._parameters[name]
        module.register_parameter(name + "_raw", nn.Parameter(weight.data))

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raw = getattr(self.module, self.name + "_raw")
        setattr(self.module, self.name, F.dropout(raw, p=self.dropout, training=self.training))
        return self.module(*args)


class DroppedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = WeightDrop(nn.LSTM(8, 16, batch_first=True), "weight_hh_l0", 0.3)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1]).squeeze(-1)


class RegistersInEval(nn.Module):
    """An eval forward that registers a weight, a buffer and a part, replaces a
    buffer and removes a part: a re-run that left any of it would show."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.spare = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.extra = nn.Parameter(torch.ones(1))
            self.register_buffer("seen", torch.ones(1))
            self.register_buffer("count", torch.ones(()))
            self.side = nn.Linear(8, 8)
            del self.spare
        return self.fc(x)


class RepointsInEval(nn.Module):
    """An eval forward that gives its weight new storage holding the same values, as
    cuDNN's ``flatten_parameters`` does to an RNN's weights on CUDA: no write."""

    eval_calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            type(self).eval_calls += 1
            with torch.no_grad():
                self.fc.weight.set_(self.fc.weight.detach().clone())
        return self.head(torch.tanh(self.fc(x)))


# -- loops --------------------------------------------------------------------------------
def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, V, (8, 12), generator=gen)


def _lm_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))


def _train_lm(model: nn.Module, loop: str, watch=None, steps: int = 12, **config) -> list[float]:
    """The loss of each step of ``loop`` over ``model``; watched when ``watch`` is given."""
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(2)
    if loop == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    elif loop == "optimizer":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:  # "monitor.step": a hand-written update, no optimizer
        opt = None
    monitor = None
    if watch is not None:
        monitor = watch(model, opt, stalled_training=OFTEN, **config)
    losses = []
    for _ in range(steps):
        x = _tokens(gen)
        if loop == "lbfgs":

            def closure(x=x) -> torch.Tensor:
                opt.zero_grad()
                loss = _lm_loss(model, x)
                loss.backward()
                return loss

            losses.append(float(opt.step(closure).detach()))
            continue
        if opt is not None:
            opt.zero_grad()
        else:
            model.zero_grad()
        loss = _lm_loss(model, x)
        loss.backward()
        if opt is not None:
            opt.step()
        else:
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.5 * param.grad
            if monitor is not None:
                monitor.step(loss=loss)
        losses.append(loss.item())
    if monitor is not None:
        monitor.close()
        assert _internal(monitor.alerts) == []
    return losses


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- planted: an eval forward that writes into a weight -------------------------------------
@pytest.mark.parametrize("loop", ["optimizer", "monitor.step", "lbfgs"])
def test_a_max_norm_embedding_tied_to_its_decoder_trains_as_without_trainwatch(quiet_watch, loop):
    """Re-run between the forward and the backward, the embedding's renormalisation
    wrote into the weight the decoder's graph saved: the first backward failed."""
    torch.manual_seed(0)
    plain = TiedLM(max_norm=1.0)
    watched = TiedLM(max_norm=1.0)
    watched.load_state_dict(plain.state_dict())
    assert _train_lm(watched, loop, quiet_watch) == _train_lm(plain, loop)
    assert _same_weights(watched, plain)


@pytest.mark.parametrize("max_norm", [1.0, None])
def test_an_awd_lstm_renormalising_in_eval_only_is_re_run_and_trains_as_without(tmp_path, max_norm):
    """Its training never renormalises; every re-run does (the reference's on copies
    of the weights, the later ones on the user's, each write put back): the
    user's stay as training left them, and the output's move is measured at
    every sampled step. Control: without ``max_norm``."""
    torch.manual_seed(0)
    plain = AWDLM(max_norm)
    watched = AWDLM(max_norm)
    watched.load_state_dict(plain.state_dict())
    expected = _train_lm(plain, "optimizer")
    AWDLM.eval_calls = 0

    def watch(model, opt, **config):
        return tw.watch(model, opt, log_dir=tmp_path, console=False, **config)

    assert _train_lm(watched, "optimizer", watch) == expected
    assert _same_weights(watched, plain)
    # The reference; once more as its embedding dropout (a mask drawn in training
    # only) is confirmed mode-dependent in eval mode; then steps 2, 5, 8, 11.
    assert AWDLM.eval_calls == 6
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    ratio = metadata.UPDATE_RATIO_PREFIX + "rnn"
    assert [e.step for e in events.Scalars(ratio)] == [2, 5, 8, 11]
    assert [e.step for e in events.Scalars(metadata.OUTPUT_CHANGE_TAG)] == [2, 5, 8, 11]


def test_control_new_storage_for_the_same_values_is_no_write_the_model_is_re_run(quiet_watch):
    torch.manual_seed(0)
    plain = RepointsInEval()
    watched = RepointsInEval()
    watched.load_state_dict(plain.state_dict())
    RepointsInEval.eval_calls = 0
    for model, watching in ((plain, False), (watched, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if watching:
            monitor = quiet_watch(model, opt, stalled_training=OFTEN)
        gen = torch.Generator().manual_seed(1)
        for _ in range(12):
            x = torch.randn(16, 8, generator=gen)
            opt.zero_grad()
            F.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    assert RepointsInEval.eval_calls == 5  # the reference, then steps 2, 5, 8, 11
    assert _same_weights(watched, plain)
    assert _internal(monitor.alerts) == []


# -- planted: an eval forward that registers a weight ------------------------------------------
def test_weight_drop_registering_its_raw_weight_in_eval_trains_as_without_trainwatch(quiet_watch):
    """The re-run's ``setattr`` of the raw ``nn.Parameter`` registered it in the LSTM's
    ``_parameters``: left there, the next training call's ``setattr`` of a plain
    tensor raised TypeError."""
    torch.manual_seed(0)
    plain = DroppedLSTM()
    watched = DroppedLSTM()
    watched.load_state_dict(plain.state_dict())
    losses = []
    for model, watching in ((plain, False), (watched, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if watching:
            monitor = quiet_watch(model, opt, stalled_training={"every": 2, "warmup": 1})
        torch.manual_seed(1)
        gen = torch.Generator().manual_seed(2)
        run = []
        for _ in range(8):
            x, y = torch.randn(4, 10, 8, generator=gen), torch.randn(4, generator=gen)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[1] == losses[0]
    assert _same_weights(watched, plain)
    lstm = watched.rnn.module
    assert list(lstm._parameters) == list(plain.rnn.module._parameters)
    assert _internal(monitor.alerts) == []


def test_a_re_run_puts_back_the_weights_buffers_and_parts_it_registered_or_removed(quiet_watch):
    torch.manual_seed(0)
    plain = RegistersInEval()
    watched = RegistersInEval()
    watched.load_state_dict(plain.state_dict())
    owned = (dict(watched._parameters), dict(watched._buffers), dict(watched._modules))
    for model, watching in ((plain, False), (watched, True)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if watching:
            monitor = quiet_watch(model, opt, stalled_training={"every": 2, "warmup": 1})
        gen = torch.Generator().manual_seed(1)
        for _ in range(7):
            x = torch.randn(16, 8, generator=gen)
            opt.zero_grad()
            F.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    assert (watched._parameters, watched._buffers, watched._modules) == owned
    assert "extra" not in watched.__dict__ and "side" not in watched.__dict__
    assert _same_weights(watched, plain)
    assert _internal(monitor.alerts) == []


# -- Lightning and trainwatch run -------------------------------------------------------------
class LitTiedLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM(max_norm=1.0)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(x)

    def training_step(self, batch, batch_idx):
        loss = _lm_loss(self, batch[0])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(2)
        tokens = torch.randint(0, V, (64, 12), generator=gen)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=8)


@pytest.mark.slow
def test_a_lightning_module_with_a_tied_max_norm_embedding_trains_as_without(tmp_path):
    callback = TrainWatchCallback(console=io.StringIO(), stalled_training=OFTEN)
    runs = []
    for callbacks in ([], [callback]):
        torch.manual_seed(0)
        module = LitTiedLM()
        quiet_trainer(tmp_path, callbacks, max_steps=8).fit(module)
        runs.append((module.losses, module.state_dict()))
    (plain, plain_state), (watched, watched_state) = runs
    assert len(watched) == 8 and watched == plain
    assert all(torch.equal(watched_state[k], plain_state[k]) for k in plain_state)
    assert _internal(callback.alerts) == []


SCRIPT = """
import json, sys
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(0)
V, H = 50, 32


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H, max_norm=1.0)
        self.rnn = nn.GRU(H, H, batch_first=True)
        self.out = nn.Linear(H, V)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])


model = LM()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for step in range(8):
    x = torch.randint(0, V, (8, 12))
    opt.zero_grad()
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    losses.append(loss.item())
json.dump(losses, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_trainwatch_run_of_a_tied_max_norm_embedding_trains_as_without(tmp_path):
    plain, watched, rules = plain_and_under_run(tmp_path, SCRIPT, every=3)
    assert "internal_error" not in rules
    assert watched == plain


# -- the stall is still told ------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_updates_that_stop_are_told_at_the_same_step_re_run_or_not(quiet_watch, max_norm):
    """A learning rate at 0 from step 30: told at step 79 from the update ratios, with
    the output's move, whether or not the re-run writes into its weights."""
    torch.manual_seed(0)
    model = TiedLM(max_norm)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step < 30 else 0.0)
    config = {"every": 20, "warmup": 40, "loss_window": 10, "lr_collapse_steps": 10**6}
    monitor = quiet_watch(model, opt, stalled_training=config)
    gen = torch.Generator().manual_seed(1)
    corpus = torch.randint(0, V, (64, 13), generator=gen)
    for _ in range(100):
        x = corpus[torch.randint(0, 64, (8,), generator=gen)]
        opt.zero_grad()
        loss = _lm_loss(model, x)
        loss.backward()
        opt.step()
        sched.step()
        monitor.step(loss=loss)
    (alert,) = _stalls(monitor.alerts)
    assert (alert.step, alert.data["criterion"]) == (79, "updates_stopped")
    assert alert.data["change"] is not None
    assert _internal(monitor.alerts) == []


@pytest.mark.parametrize("lr, stalled", [(1e-12, True), (1e-2, False)])
def test_control_a_tied_embedding_without_max_norm_stalls_at_the_first_check_past_warm_up(
    quiet_watch, lr, stalled
):
    torch.manual_seed(0)
    model = TiedLM(max_norm=None)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    monitor = quiet_watch(model, opt, stalled_training={"every": 20, "warmup": 40})
    gen = torch.Generator().manual_seed(1)
    corpus = torch.randint(0, V, (64, 13), generator=gen)
    for _ in range(45):
        x = corpus[torch.randint(0, 64, (8,), generator=gen)]
        opt.zero_grad()
        loss = _lm_loss(model, x)
        loss.backward()
        opt.step()
        monitor.step(loss=loss)
    found = _stalls(monitor.alerts)
    assert [(a.step, a.data["criterion"]) for a in found] == (
        [(39, "output_change")] if stalled else []
    )
