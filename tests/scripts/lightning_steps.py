"""LightningModules that plant one bug at a known ``global_step`` and record it.

Run as a script (``trainwatch run``), it fits one model per case named on the
command line, in order, and prints one JSON line: each case with the
``global_step`` its bug was planted at. The callback tests import it instead.

Cases are ``<optimisation>:<bug>``:

* optimisation: ``auto`` (automatic), ``auto-accum`` (``accumulate_grad_batches=2``),
  ``manual``, ``manual-accum`` (manual optimisation, two backward passes per
  step written by hand: Lightning refuses ``accumulate_grad_batches`` there);
* bug: ``clean``, ``forward_nan`` (a NaN made in ``body``), ``loss_nan`` (the
  loss times NaN), ``loss_inf`` (``log(0)`` added to the loss: gradients stay
  finite), ``no_zero_grad`` (``zero_grad`` skipped from then on).
"""

from __future__ import annotations

import json
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

PLANT_AT = 3
STEPS = 7


class PlantedStepNet(pl.LightningModule):
    def __init__(self, optimisation: str, bug: str) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.bug = bug
        self.automatic_optimization = optimisation.startswith("auto")
        self.per_step = 2 if optimisation == "manual-accum" else 1
        self.planted_at: int | None = None
        self.stale = False  # a zero_grad was skipped after gradients were used

    def _due(self) -> bool:
        # The first batch of step PLANT_AT: with accumulation, only its first micro-batch.
        return self.global_step == PLANT_AT and self.planted_at is None

    def _plant(self) -> None:
        if self.planted_at is None:
            self.planted_at = self.global_step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.body(x))
        # Every pass of that step (a replay of it too) makes the NaN.
        if self.bug == "forward_nan" and self.training and self.global_step == PLANT_AT:
            self._plant()
            hidden = hidden * torch.log(-torch.ones(()))  # log(-1): NaN
        return self.head(hidden)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.stale and self.planted_at is None:
            self._plant()  # this batch's backward adds onto used gradients
        loss = nn.functional.mse_loss(self(x), y)
        if self.bug in ("loss_nan", "loss_inf") and self._due():
            self._plant()
            if self.bug == "loss_nan":
                loss = loss * float("nan")
            else:
                loss = loss + torch.log(torch.zeros(()))
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        self.manual_backward(loss / self.per_step)
        if (batch_idx + 1) % self.per_step == 0:
            optimizer.step()
            if self.bug == "no_zero_grad" and self.global_step >= PLANT_AT:
                self.stale = True
            else:
                optimizer.zero_grad()
        return None

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        # Lightning calls this between training_step and backward.
        if self.bug == "no_zero_grad" and self.global_step >= PLANT_AT:
            self._plant()  # the backward about to run adds onto used gradients
            return
        optimizer.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(160, 8, generator=gen)
        return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=8)


def trainer(optimisation: str, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        accumulate_grad_batches=2 if optimisation == "auto-accum" else 1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **kwargs,
    )


def fit(case: str, **trainer_kwargs) -> PlantedStepNet:
    optimisation, bug = case.split(":")
    model = PlantedStepNet(optimisation, bug)
    trainer(optimisation, **trainer_kwargs).fit(model)
    return model


if __name__ == "__main__":
    torch.set_num_threads(1)
    planted = {case: fit(case).planted_at for case in sys.argv[1:]}
    print(json.dumps(planted))
