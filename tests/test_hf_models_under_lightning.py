"""Real Hugging Face models (tiny, offline) in a LightningModule under the Lightning callback.

Names are relative to the LightningModule: the wrapped model is ``model``.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.hf_models import ATTENTION, Tokens, bert, freeze, model_of, plant_nan, unplant

pl = pytest.importorskip("lightning.pytorch")
from torch.utils.data import DataLoader  # noqa: E402

from tests.lightning_models import quiet_trainer  # noqa: E402
from trainwatch.lightning import TrainWatchCallback  # noqa: E402


class HFModule(pl.LightningModule):
    """A LightningModule around a Hugging Face model; the loss is the model's own."""

    def __init__(self, family: str, *, model=None, nan_at=None, frozen=None, regression=None):
        super().__init__()
        self.family = family
        self.model = model if model is not None else model_of(family)
        self.nan_at = nan_at
        self.regression = regression  # "(N,)" or "(N, 1)": a hand-written MSE on a 1-logit head
        if frozen is not None:
            freeze(self.model, frozen)

    def training_step(self, batch, batch_idx):
        if self.nan_at is not None:
            if self.global_step == self.nan_at:
                plant_nan(self.model, ATTENTION[self.family])
            else:
                unplant(self.model, ATTENTION[self.family])
        if self.regression is None:
            return self.model(**batch).loss
        y = batch.pop("labels").float()
        y = y if self.regression == "(N,)" else y[:, None]
        return ((self.model(**batch).logits - y) ** 2).mean()

    def configure_optimizers(self):
        # Over every parameter, frozen ones too: the classic fine-tuning slip.
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(Tokens(self.family, n=48), batch_size=8)


def _fit(tmp_path, module: HFModule, steps: int = 6) -> list[tuple[str, int, str | None]]:
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [callback], max_steps=steps, limit_val_batches=0)
    trainer.fit(module)
    return [(a.rule, a.step, a.module) for a in callback.alerts if a.severity != "info"]


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_clean_lightning_fit_of_a_hugging_face_model_is_silent(tmp_path, family):
    assert _fit(tmp_path, HFModule(family)) == []


def test_a_layer_left_frozen_in_configure_optimizers_is_named(tmp_path):
    layer = "transformer.h.1.attn.c_attn"
    found = _fit(tmp_path, HFModule("gpt2", frozen=layer), steps=2)
    assert found == [("frozen_in_optimizer", 0, f"model.{layer}")]


def test_a_nan_made_in_one_attention_block_is_named(tmp_path):
    found = _fit(tmp_path, HFModule("llama", nan_at=3), steps=5)
    assert found[:1] == [("nonfinite_forward", 3, f"model.{ATTENTION['llama']}")]


def test_regression_head_against_n_labels_is_a_broadcast_and_matching_shapes_are_silent(tmp_path):
    torch.manual_seed(0)
    bad = _fit(tmp_path / "bad", HFModule("bert", model=bert(1), regression="(N,)"), steps=3)
    torch.manual_seed(0)
    good = _fit(tmp_path / "good", HFModule("bert", model=bert(1), regression="(N, 1)"), steps=3)
    # training_step calls the wrapped model; the LightningModule has no forward of
    # its own, so its parts are the passes from the first step on; the finding
    # names the part whose output was broadcast (``self.model``).
    assert bad == [("broadcast", 0, "model")]
    assert good == []
