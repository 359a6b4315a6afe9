"""A NaN replay draws what the pass drew, from the generators the model holds or is handed.

A text model drops whole tokens with its own ``torch.Generator``
(``torch.rand(..., generator=self.gen)``, reproducible augmentation) and
mean-pools what is left: a one-token text whose token is dropped pools 0/0.
The replay that names the module and op forked and put back the model's
generator, but did not rewind it to where the pass began: it drew the next
mask, kept the token, found no NaN, and the alert named the whole model with
no op (forward), or another module's weights (a root-pool's NaN gradient).
The same for a numpy ``Generator`` the model holds and for a
``torch.Generator`` handed to ``forward(..., generator=g)``.

Now the states of the generators the model holds are read as each pass
begins (found once, as the model is attached; a model holding none reads
what it read), and a generator handed to the call is copied as received;
the replay (and its op trace) draws from those states, and the generators
are put back after it. Each planted NaN is told at the step it happens,
naming ``pool`` and its op; training, losses and the generators' states
after it are bit for bit those of the run without trainwatch. Controls: the
same models with no one-token text stay silent; the model drawing from
torch's global generator is told as before.
"""

from __future__ import annotations

import textwrap

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from tests.test_run import alerts as logged_alerts
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

STEPS = 12


def _told(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.severity != "info"]


class TokenDropout(nn.Module):
    """Drops whole tokens (p = 0.1), drawn from the generator it is given or holds."""

    def __init__(self, gen=None) -> None:
        super().__init__()
        self.gen = gen

    def forward(self, mask: torch.Tensor, generator=None) -> torch.Tensor:
        gen = generator if generator is not None else self.gen
        if isinstance(gen, np.random.Generator):
            return mask & torch.from_numpy(gen.random(tuple(mask.shape)) >= 0.1)
        return mask & (torch.rand(mask.shape, generator=gen) >= 0.1)


class MeanPool(nn.Module):
    """The mean of the tokens kept: 0/0 for a text whose every token was dropped."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kept = mask.unsqueeze(-1).float()
        return (h * kept).sum(1) / kept.sum(1)


class RootPool(nn.Module):
    """The root of the kept tokens' summed squares: 0 for a text with none kept, and an
    infinite derivative there (a finite forward, a NaN gradient)."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((h * mask.unsqueeze(-1).float()) ** 2).sum(1))


class TextClassifier(nn.Module):
    def __init__(self, draws: str, pool: str = "mean") -> None:
        super().__init__()
        if draws == "own torch generator":
            self.gen = torch.Generator().manual_seed(0)
        elif draws == "own numpy generator":
            self.gen = np.random.default_rng(5)
        else:  # handed to the call, or torch's global generator
            self.gen = None
        self.emb = nn.Embedding(50, 16)
        self.drop = TokenDropout(self.gen)
        self.pool = MeanPool() if pool == "mean" else RootPool()
        self.head = nn.Linear(16, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, generator=None) -> torch.Tensor:
        return self.head(self.pool(self.emb(tokens), self.drop(mask, generator)))


def _batch(step: int, one_token_text: bool):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 50, (16, 8), generator=gen)
    lengths = torch.randint(4, 9, (16,), generator=gen)
    if one_token_text:
        lengths[0] = 1  # a one-token text in every batch: now and then its token is dropped
    mask = torch.arange(8)[None] < lengths[:, None]
    return tokens, mask, torch.randint(0, 2, (16,), generator=gen)


def _state(gen) -> list:
    if gen is None:
        return []
    if isinstance(gen, torch.Generator):
        return gen.get_state().tolist()
    return [repr(gen.bit_generator.state)]


def _train(draws: str, bad: bool, pool: str = "mean", check: str | None = None):
    """Losses (NaN as None), weights, the generator's state after, the steps whose loss
    or gradients were non-finite (skipped), the alerts (None unwatched)."""
    torch.manual_seed(0)
    model = TextClassifier(draws, pool)
    handed = torch.Generator().manual_seed(0) if draws == "handed generator" else None
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = None
    if check is not None:
        monitor = tw.watch(model, opt, console=False, nonfinite_forward={"check": check})
    losses, skipped = [], []
    try:
        for step in range(STEPS):
            tokens, mask, y = _batch(step, bad)
            loss = F.cross_entropy(model(tokens, mask, generator=handed), y)
            if not torch.isfinite(loss):
                skipped.append(step)
                losses.append(None)
                continue  # the loop skips a non-finite loss
            opt.zero_grad()
            loss.backward()
            opt.step()  # (a NaN gradient goes into the weights: the first is what counts)
            losses.append(loss.item())
    finally:
        if monitor is not None:
            monitor.close()
    weights = [p.detach().clone() for p in model.parameters()]
    gen = handed if handed is not None else model.gen
    alerts = None if monitor is None else monitor.alerts
    return losses, weights, _state(gen), skipped, alerts


DRAWS = ["own torch generator", "own numpy generator", "handed generator"]


@pytest.mark.parametrize("check", ["auto", "step"])
@pytest.mark.parametrize("draws", DRAWS)
def test_a_nan_hanging_on_the_models_own_draws_is_placed_in_the_module_that_made_it(draws, check):
    plain_losses, plain_weights, plain_gen, skipped, _ = _train(draws, bad=True)
    assert skipped, "the planted one-token text must lose its token at some step"
    losses, weights, gen, _, alerts = _train(draws, bad=True, check=check)
    first = _told(alerts)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", skipped[0], "pool")
    assert first.data["cause"] == "module" and first.data["op"] == "aten::div"
    # The replays drew from the pass's states and put the generators back.
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert gen == plain_gen


@pytest.mark.parametrize("draws", ["own torch generator", "handed generator"])
def test_a_nan_gradient_hanging_on_the_models_own_draws_is_placed_in_the_module_that_made_it(
    draws,
):
    *_, alerts = _train(draws, bad=True, pool="root", check="auto")
    first = _told(alerts)[0]
    assert (first.rule, first.module) == ("nonfinite_backward", "pool")
    assert first.data["cause"] == "module" and first.data["op"] == "aten::sqrt"


@pytest.mark.parametrize("draws", [*DRAWS, "global generator"])
def test_control_the_same_models_without_a_one_token_text_stay_silent_and_train_as_without(draws):
    plain_losses, plain_weights, plain_gen, skipped, _ = _train(draws, bad=False)
    assert skipped == []
    losses, weights, gen, _, alerts = _train(draws, bad=False, check="auto")
    assert _told(alerts) == []
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert gen == plain_gen


def test_control_the_model_drawing_from_the_global_generator_is_told_as_before():
    *_, skipped, _ = _train("global generator", bad=True)
    *_, alerts = _train("global generator", bad=True, check="auto")
    first = _told(alerts)[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", skipped[0], "pool")
    assert first.data["op"] == "aten::div"


# -- Lightning --------------------------------------------------------------------------
class LitText(pl.LightningModule):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.net = TextClassifier("own torch generator")
        self.bad = bad

    def training_step(self, batch, batch_idx):
        tokens, mask, y = _batch(batch_idx, self.bad)
        return F.cross_entropy(self.net(tokens, mask), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("bad", [True, False])
def test_lightning_places_the_nan_of_a_token_dropout_drawn_from_the_models_generator(tmp_path, bad):
    *_, skipped, _ = _train("own torch generator", bad=True)
    callback = TrainWatchCallback(console=False)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=skipped[0] + 1)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)))
    trainer.fit(LitText(bad), loader)
    told = _told(callback.monitor.alerts)
    if not bad:
        assert told == []
        return
    first = told[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", skipped[0], "net.pool")
    assert first.data["op"] == "aten::div"


# -- trainwatch run -------------------------------------------------------------------------
SCRIPT = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)

class TextClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 2)
    def forward(self, tokens, mask):
        keep = mask & (torch.rand(mask.shape, generator=self.gen) >= 0.1)
        kept = keep.unsqueeze(-1).float()
        return self.head((self.emb(tokens) * kept).sum(1) / kept.sum(1))

model = TextClassifier()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(12):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 50, (16, 8), generator=gen)
    lengths = torch.randint(4, 9, (16,), generator=gen)
    if BAD:
        lengths[0] = 1
    mask = torch.arange(8)[None] < lengths[:, None]
    loss = F.cross_entropy(model(tokens, mask), torch.randint(0, 2, (16,), generator=gen))
    if not torch.isfinite(loss):
        continue
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize("bad", [True, False])
def test_trainwatch_run_places_the_nan_of_a_token_dropout_drawn_from_the_models_generator(
    tmp_path, bad
):
    *_, skipped, _ = _train("own torch generator", bad=True)
    script = tmp_path / "text.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("BAD", str(bad)))
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    told = [a for a in logged_alerts(tmp_path / "log") if a["severity"] != "info"]
    if not bad:
        assert told == []
        return
    first = told[0]
    assert (first["rule"], first["step"]) == ("nonfinite_forward", skipped[0])
    assert first["module"] == "" and first["data"]["cause"] == "module"
    assert first["data"]["op"] == "aten::div"
