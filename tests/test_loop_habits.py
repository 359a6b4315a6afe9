"""Real training loops' habits: none may crash, warn, or raise a false alarm.

Every check runs on every step here (the sampled ones included), and Python
warnings are errors, so a habit that trips any part of trainwatch shows.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import trainwatch as tw

EVERY_STEP = {
    "constant_output": {"every": 1},
    "dead_units": {"every": 1},
    "nonfinite_parameter": {"check_every": 1},
}


@contextmanager
def strictly_watched(model: nn.Module, optimizer=None, **overrides) -> Iterator[tw.Monitor]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tw.watch(model, optimizer, console=False, **{**EVERY_STEP, **overrides}) as monitor:
            yield monitor


def warnings_and_errors(monitor: tw.Monitor) -> list[tuple[str, str | None]]:
    return [(a.rule, a.module) for a in monitor.alerts if a.severity != "info"]


class MLP(nn.Module):
    def __init__(self, inputs: int = 4, outputs: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, 16)
        self.fc2 = nn.Linear(16, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def test_lbfgs_calling_its_closure_many_times_per_step():
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=8, history_size=5)
    x = torch.randn(64, 4)
    y = x[:, :1].sin()
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with strictly_watched(model, opt) as monitor:
        for _ in range(5):
            opt.step(closure)
    assert calls > 10  # several closure calls per step
    assert monitor.step_count == 5
    assert monitor.alerts == []
    assert set(monitor.grad_norms()) == {"fc1", "fc2"}


@pytest.mark.parametrize("check", ["auto", "step", "deferred"])
def test_rl_rollouts_of_batch_one_and_unbatched_forwards(check):
    """Acting one observation at a time (batched as 1, or not batched at all), then updating."""
    torch.manual_seed(0)
    policy = MLP(inputs=4, outputs=2)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    with strictly_watched(policy, opt, nonfinite_forward={"check": check}) as monitor:
        for _episode in range(6):
            observations, actions = [], []
            obs = torch.randn(4)
            for t in range(12):
                with torch.no_grad():
                    logits = policy(obs) if t % 2 else policy(obs.unsqueeze(0))[0]
                action = int(torch.distributions.Categorical(logits=logits).sample())
                observations.append(obs)
                actions.append(action)
                obs = obs * 0.9 + 0.1 * torch.randn(4)
            returns = torch.linspace(1.0, 0.0, len(actions))
            log_probs = torch.log_softmax(policy(torch.stack(observations)), dim=-1)
            chosen = log_probs[torch.arange(len(actions)), torch.tensor(actions)]
            opt.zero_grad()
            (-(chosen * returns).mean()).backward()
            opt.step()
            # And one update from a single transition, as some agents do.
            opt.zero_grad()
            torch.log_softmax(policy(obs.unsqueeze(0)), dim=-1)[0, 0].neg().backward()
            opt.step()
    assert monitor.step_count == 12
    assert monitor.alerts == []


class MaskedAttention(nn.Module):
    """Builds its causal and padding masks with -inf on purpose."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.masks = CausalMask()

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        bias = self.masks(x.shape[1]) + padding[:, None, :]
        return self.out(torch.softmax(scores + bias, dim=-1) @ v)


class CausalMask(nn.Module):
    def forward(self, length: int) -> torch.Tensor:
        return torch.full((length, length), float("-inf")).triu(1)


class MaskedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.attn = MaskedAttention()
        self.head = nn.Linear(16, 30)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(ids), padding))


@pytest.mark.parametrize("check", ["auto", "step", "deferred"])
def test_causal_and_padding_masks_built_with_minus_inf_are_no_nan_alarm(check):
    torch.manual_seed(0)
    model = MaskedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with strictly_watched(model, opt, nonfinite_forward={"check": check}) as monitor:
        for _ in range(6):
            ids = torch.randint(0, 30, (4, 9))
            padding = torch.zeros(4, 9)
            padding[:, 7:] = float("-inf")  # the last two positions are padding
            opt.zero_grad()
            logits = model(ids, padding)
            nn.functional.cross_entropy(logits.reshape(-1, 30), ids.reshape(-1)).backward()
            opt.step()
        model.eval()
        with torch.no_grad():  # an evaluation: nothing requires grad there
            model(torch.randint(0, 30, (2, 9)), torch.zeros(2, 9))
    assert monitor.alerts == []


@pytest.mark.parametrize("check", ["auto", "step", "deferred"])
def test_nan_after_a_minus_inf_mask_is_still_located_at_its_module(check):
    """The control: masks are let pass, a real NaN beside them is not."""
    torch.manual_seed(0)
    model = MaskedLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(4):
            ids = torch.randint(0, 30, (4, 9))
            opt.zero_grad()
            # All-padding rows: softmax over nothing but -inf is NaN, made in attn.
            padding = torch.full((4, 9), float("-inf")) if step == 2 else torch.zeros(4, 9)
            logits = model(ids, padding)
            nn.functional.cross_entropy(logits.reshape(-1, 30), ids.reshape(-1)).backward()
            opt.step()
    first = next(a for a in monitor.alerts if a.rule.startswith("nonfinite"))
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "attn")
    if check != "deferred":
        assert first.data["op"] == "aten::_softmax"


class SparseInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(50, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sparse.mm(x, self.proj.weight.t()) + self.proj.bias
        return self.head(torch.relu(h))


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))


def test_sparse_input_tensors_and_sparse_gradients():
    torch.manual_seed(0)
    dense_model, sparse_grad_model = SparseInput(), SparseEmbedding()
    dense_opt = torch.optim.Adam(dense_model.parameters(), lr=1e-3)
    sparse_opt = torch.optim.SGD(sparse_grad_model.parameters(), lr=0.1)
    with (
        strictly_watched(dense_model, dense_opt) as first,
        strictly_watched(sparse_grad_model, sparse_opt) as second,
    ):
        for _ in range(6):
            x = torch.randn(16, 50)
            x[x < 1.0] = 0.0
            dense_opt.zero_grad()
            dense_model(x.to_sparse()).pow(2).mean().backward()
            dense_opt.step()
            sparse_opt.zero_grad()
            sparse_grad_model(torch.randint(0, 50, (16, 5))).pow(2).mean().backward()
            sparse_opt.step()
    assert first.alerts == [] and second.alerts == []
    assert second.grad_norms()["emb"] > 0.0  # a sparse gradient still has a norm


class WithSpareHead(nn.Module):
    """A head kept for another task: defined, in the optimizer, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = MLP()
        self.spare_head = nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _train_six_steps(model: nn.Module) -> tw.Monitor:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with strictly_watched(model, opt) as monitor:
        for _ in range(6):
            x = torch.randn(16, 4)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            opt.step()
    return monitor


def test_module_never_called_whose_parameters_the_optimizer_trains_is_a_warning():
    torch.manual_seed(0)
    monitor = _train_six_steps(WithSpareHead())
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.severity) == ("zero_gradient", "spare_head", "warning")
    assert alert.data["kind"] == "never_called"
    assert "never called" in alert.message
    assert "find_unused_parameters" in alert.hint


def test_called_module_cut_from_the_graph_is_still_a_warning():
    """The control: called every step, but detached, so it is a bug."""

    class CutHead(WithSpareHead):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) + self.spare_head(self.body(x)).detach().sum(1, keepdim=True)

    torch.manual_seed(0)
    monitor = _train_six_steps(CutHead())
    (alert,) = monitor.alerts
    assert (alert.rule, alert.module, alert.severity) == ("zero_gradient", "spare_head", "warning")
    assert alert.data["kind"] == "none"


def test_manual_sgd_without_any_optimizer():
    torch.manual_seed(0)
    model = MLP()
    with strictly_watched(model) as monitor:
        for _ in range(8):
            x = torch.randn(16, 4)
            model.zero_grad()
            loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
            loss.backward()
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.05 * param.grad
            monitor.step(loss=loss)
    assert monitor.step_count == 8
    assert monitor.alerts == []  # not_optimized stays silent without an optimizer
    assert set(monitor.grad_norms()) == {"fc1", "fc2"}


def test_manual_sgd_that_forgets_to_reset_gradients_is_still_caught():
    torch.manual_seed(0)
    model = MLP()
    with tw.watch(model, console=False) as monitor:
        for _ in range(4):
            x = torch.randn(16, 4)
            loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
            loss.backward()  # no model.zero_grad(): gradients pile up
            with torch.no_grad():
                for param in model.parameters():
                    param -= 0.05 * param.grad
            monitor.step(loss=loss)
    assert {a.rule for a in monitor.alerts} == {"accumulated_gradient"}
