"""How exploding_gradient / vanishing_gradient defaults were chosen: healthy runs' extremes.

Trains healthy models (the overhead benchmark's MLP and CNN, a small
transformer and an LSTM on a Zipf vocabulary, deep ReLU/tanh stacks) and one
sick one (a 20-layer sigmoid stack), and prints for each the largest jump of
a layer's gradient norm over its recent typical norm (as exploding_gradient
gates it) and the smallest ratio of a layer's norm to the step's median layer
norm (vanishing_gradient's test), both after the warm-up. The defaults sit
far outside what the healthy runs reach. Takes a few minutes on one CPU thread.

    python benchmarks/tune_gradient_scale.py
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import _cnn, _mlp, _Transformer

import trainwatch as tw
from trainwatch.config import ExplodingGradientConfig
from trainwatch.record import StepRecord
from trainwatch.rules.gradient_scale import ExplodingGradientRule

WARMUP = 50
VOCAB = 1000


def run(name: str, model: nn.Module, batch: Callable, loss_fn: Callable, steps: int, opt) -> None:
    torch.manual_seed(0)
    jumps = ExplodingGradientRule(ExplodingGradientConfig(factor=1.01, warmup=WARMUP))
    worst_jump, worst_ratio = (1.0, None, None), (1.0, None, None)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            norms = monitor.grad_norms()
            for alert in jumps.evaluate(StepRecord(step=step, layer_norms=norms)):
                ratio = alert.data["ratio"] or 0.0
                if ratio > worst_jump[0]:
                    worst_jump = (ratio, alert.module, step)
            positive = [v for v in norms.values() if v > 0.0]
            if step >= WARMUP and len(positive) >= 3:
                median = statistics.median(positive)
                layer = min((k for k in norms if norms[k] > 0.0), key=norms.__getitem__)
                if norms[layer] / median < worst_ratio[0]:
                    worst_ratio = (norms[layer] / median, layer, step)
    print(
        f"{name:12s} largest gated jump {worst_jump[0]:8.3g}x ({worst_jump[1]} @ {worst_jump[2]})"
        f"   smallest norm / median {worst_ratio[0]:.2e} ({worst_ratio[1]} @ {worst_ratio[2]})",
        flush=True,
    )


def _slices(x: torch.Tensor, y: torch.Tensor, size: int) -> Callable:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * size) % (len(x) - size)
        return x[start : start + size], y[start : start + size]

    return batch


def _deep(act: type[nn.Module], depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(32, 64), act()]
    for _ in range(depth):
        layers += [nn.Linear(64, 64), act()]
    return nn.Sequential(*layers, nn.Linear(64, 1))


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(tokens))[0]).flatten(0, 1)


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    ce, mse = nn.functional.cross_entropy, nn.functional.mse_loss
    x = torch.randn(2048, 784, generator=gen)
    mlp = _mlp(False).make_model()
    mlp_opt = torch.optim.AdamW(mlp.parameters())
    run("mlp", mlp, _slices(x, x[:, :10].argmax(1), 128), ce, 600, mlp_opt)
    xc = torch.randn(512, 3, 16, 16, generator=gen)
    cnn = _cnn(True).make_model()
    batch = _slices(xc, (xc.mean((1, 2, 3)) > 0).long(), 64)
    run("cnn", cnn, batch, ce, 400, torch.optim.AdamW(cnn.parameters()))
    zipf = 1.0 / torch.arange(1, VOCAB + 1).float()

    def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.multinomial(zipf, 8 * 33, replacement=True, generator=gen).view(8, 33)
        return t[:, :32], t[:, 1:].reshape(-1)

    lm = _Transformer(64, 2, VOCAB)
    run("transformer", lm, lm_batch, ce, 300, torch.optim.AdamW(lm.parameters(), lr=3e-4))
    lstm = _LSTM()
    run("lstm", lstm, lm_batch, ce, 300, torch.optim.AdamW(lstm.parameters(), lr=3e-3))
    xr = torch.randn(4096, 32, generator=gen)
    regression = _slices(xr, xr[:, :3].sum(1, keepdim=True).sin(), 64)
    for name, act, depth, steps in [
        ("deep-relu", nn.ReLU, 12, 400),
        ("deep-tanh", nn.Tanh, 12, 400),
        ("sigmoid-20", nn.Sigmoid, 20, 300),
    ]:
        model = _deep(act, depth)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3) if act is nn.Sigmoid else None
        opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-3)
        run(name, model, regression, mse, steps, opt)


if __name__ == "__main__":
    main()
