"""``trainwatch run`` on a Lightning script whose module is only called through its parts.

Lightning calls ``training_step``, not the module: a LightningModule without a
``forward`` of its own (or one whose steps call ``self.encoder(x)`` and
``self.head(z)`` directly) is never called itself. Each part used to be
watched as a model of its own, named without its prefix (``0`` for
``encoder.0``), and a head left out of ``configure_optimizers`` looked like
learned loss weights. The LightningModule is the model, as under the
callback, and each outermost call of a part is one of its passes.
"""

from __future__ import annotations

import json

import pytest

from trainwatch.runner import run_script

SCRIPT = """
import sys
import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

variant = sys.argv[1]


class LitClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16)
        )
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(16, 3))

    def on_train_epoch_start(self):
        if variant == "eval_dropout":
            self.encoder.eval()

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = self.encoder(x)
        if variant == "detach":
            z = z.detach()
        return F.cross_entropy(self.head(z), y)

    def configure_optimizers(self):
        params = self.encoder.parameters() if variant == "not_optimized" else self.parameters()
        return torch.optim.Adam(params, lr=1e-3)


torch.manual_seed(0)
x = torch.randn(256, 16)
data = DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=32, shuffle=True)
trainer = pl.Trainer(
    max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(LitClassifier(), data)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("healthy", set()),
        ("detach", {("zero_gradient", "encoder.0"), ("zero_gradient", "encoder.3")}),
        ("eval_dropout", {("train_in_eval_mode", "encoder.2")}),
        ("not_optimized", {("not_optimized", "head.1")}),
    ],
)
def test_the_lightning_module_is_the_model_and_names_keep_their_prefix(tmp_path, variant, expected):
    script = tmp_path / "lit.py"
    script.write_text(SCRIPT)
    run_script(script, [variant], log_dir=tmp_path / "log", console=False)
    alerts = [json.loads(line) for line in (tmp_path / "log" / "alerts.jsonl").open()]
    warned = [a for a in alerts if a["severity"] != "info"]
    assert {(a["rule"], a["module"]) for a in warned} == expected
    assert {a["data"]["model"] for a in warned} <= {"LitClassifier"}
    assert all(a["step"] == 0 for a in warned)
