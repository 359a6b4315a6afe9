"""Lightning's BaseFinetuning under the DDP strategy, two CPU ranks: run by
tests/test_ddp_staged_unfreeze.py.

The callback freezes ``fc1`` in ``setup()``, before the strategy wraps the model
in DDP, and unfreezes it at epoch 1 (step 2): DDP never all-reduces it. Lightning's
launcher re-runs this very command for rank 1. Each rank writes
``OUT/rank<r>.json``: what trainwatch's callback told and its copy of ``fc1``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch.utils.data import DataLoader, TensorDataset

from tests.lightning_models import BoringNet, quiet_trainer
from trainwatch.lightning import TrainWatchCallback


class UnfreezeAtEpochOne(BaseFinetuning):
    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.fc1)

    def finetune_function(self, pl_module, epoch, optimizer) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.fc1, optimizer)


class Net(BoringNet):
    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=16)


def main(out: Path) -> None:
    torch.manual_seed(0)
    watch = TrainWatchCallback(console=False)
    model = Net()
    callbacks = [watch, UnfreezeAtEpochOne()]
    trainer = quiet_trainer(str(out), callbacks, devices=2, strategy="ddp", max_epochs=3)
    trainer.fit(model)
    told = [
        [a.module, a.step, a.data["finding"], a.data["parameters"]]
        for a in watch.alerts
        if a.rule == "trainable_parameters"
    ]
    weight = model.fc1.weight.detach().flatten().tolist()
    record = {"told": told, "weight": weight}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
