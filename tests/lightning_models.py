"""Tiny LightningModules for the callback tests (and the DDP script): named layers, seeded data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def quiet_trainer(root, callbacks=(), **kwargs) -> pl.Trainer:
    """A CPU Trainer that writes nothing of its own under ``root``: no progress
    bar, model summary, checkpoint or logger, so only trainwatch's output is there."""
    options = dict(
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=root,
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=list(callbacks), **options)


def _data(n: int = 64, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, x[:, :1].sin() * 2.0)


class BoringNet(pl.LightningModule):
    """fc1 -> fc2 -> head, MSE on a fixed synthetic set; switches plant the bugs."""

    def __init__(self, *, freeze_fc1: bool = False, lr: float = 0.05) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.lr = lr
        self.reference_norms: list[float] = []
        if freeze_fc1:
            self.fc1.weight.requires_grad_(False)
            self.fc1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def on_before_optimizer_step(self, optimizer) -> None:
        # Lightning calls this after the callbacks' hook and before clipping.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.reference_norms.append(
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in grads])
            ).item()
            if grads
            else 0.0
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=8)

    def val_dataloader(self):
        return DataLoader(_data(16, seed=1), batch_size=8)

    def test_dataloader(self):
        return DataLoader(_data(16, seed=2), batch_size=8)

    def predict_dataloader(self):
        return DataLoader(_data(16, seed=3), batch_size=8)


class ManualNet(BoringNet):
    """Manual optimisation; ``forget_zero_grad_on_rank`` plants a missing zero_grad there,
    ``zero_grad_after_backward`` one between ``manual_backward`` and ``opt.step()``."""

    def __init__(
        self, *, forget_zero_grad_on_rank: int | None = None, zero_grad_after_backward=False
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.forget_on = forget_zero_grad_on_rank
        self.zero_grad_after_backward = zero_grad_after_backward

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        forget = self.forget_on is not None and self.global_rank == self.forget_on
        if not forget and not self.zero_grad_after_backward:
            opt.zero_grad()
        self.manual_backward(loss)
        if self.zero_grad_after_backward:
            opt.zero_grad()
        opt.step()
        return loss
