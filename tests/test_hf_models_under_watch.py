"""Real Hugging Face models (tiny, random-initialised, offline) in a plain loop under tw.watch.

Clean runs of GPT-2 (tied embeddings, dropouts), Llama (no dropout, rotary),
BERT classification and T5 (an encoder-decoder) are silent, with the loss
computed inside ``forward`` from ``labels`` and padding masked with the
dtype's minimum; each planted bug is named at its real module.
"""

from __future__ import annotations

import io

import pytest
import torch

import trainwatch as tw
from tests.hf_models import (
    ATTENTION,
    FAMILIES,
    batch_for,
    bert,
    eval_batch_for,
    freeze,
    model_of,
    plant_nan,
    unplant,
)


def _train(
    family: str,
    steps: int,
    *,
    model=None,
    skip_zero_grad_from: int | None = None,
    nan_at: int | None = None,
    eval_at: int | None = None,
    frozen: str | None = None,
    **watch_options,
) -> list[tw.Alert]:
    model = model if model is not None else model_of(family)
    if frozen is not None:
        freeze(model, frozen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO(), **watch_options) as monitor:
        for step in range(steps):
            if skip_zero_grad_from is None or step < skip_zero_grad_from:
                optimizer.zero_grad()
            if step == nan_at:
                plant_nan(model, ATTENTION[family])
            loss = model(**batch_for(family, step)).loss
            if step == nan_at:
                unplant(model, ATTENTION[family])
            loss.backward()
            optimizer.step()
            if step == eval_at:
                model.eval()  # evaluation, and model.train() forgotten afterwards
                with torch.no_grad():
                    model(**eval_batch_for(family, step))
        return [a for a in monitor.alerts if a.severity != "info"]


def _found(alerts: list[tw.Alert]) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_clean_training_of_each_model_family_raises_no_warning(family):
    assert _found(_train(family, 12)) == []


def test_gradient_checkpointing_on_gpt2_is_silent():
    model = model_of("gpt2")
    # gradient_checkpointing_enable() under its newer name where it has one
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    assert _found(_train("gpt2", 8, model=model)) == []


def test_evaluation_under_eval_and_no_grad_between_training_steps_is_silent():
    model = model_of("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        for step in range(8):
            optimizer.zero_grad()
            model(**batch_for("gpt2", step)).loss.backward()
            optimizer.step()
            if step % 3 == 2:
                model.eval()
                with torch.no_grad():
                    model(**eval_batch_for("gpt2", step))
                model.train()
    assert [a.rule for a in monitor.alerts if a.severity != "info"] == []


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_missing_zero_grad_is_caught_at_its_step(family):
    assert _found(_train(family, 8, skip_zero_grad_from=4)) == [("accumulated_gradient", 4, None)]


@pytest.mark.parametrize(
    "family, layer",
    [("gpt2", "transformer.h.1.attn.c_attn"), ("bert", "bert.encoder.layer.0.output.dense")],
)
def test_a_layer_left_frozen_in_the_optimizer_is_named(family, layer):
    assert _found(_train(family, 3, frozen=layer)) == [("frozen_in_optimizer", 0, layer)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_nan_made_in_one_attention_block_is_named_at_that_projection(family):
    alerts = _train(family, 6, nan_at=3)
    assert _found(alerts)[:1] == [("nonfinite_forward", 3, ATTENTION[family])]
    assert alerts[0].data.get("op") == "aten::log"


@pytest.mark.parametrize(
    "family, dropout", [("gpt2", "transformer.drop"), ("bert", "bert.embeddings.dropout")]
)
def test_model_eval_forgotten_after_evaluation_names_the_first_dropout(family, dropout):
    assert _found(_train(family, 8, eval_at=4)) == [("train_in_eval_mode", 5, dropout)]


def _regression(steps: int, *, hand_written_loss: bool, labels_shape: str) -> list[tw.Alert]:
    torch.manual_seed(0)
    model = bert(num_labels=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        for step in range(steps):
            inputs = batch_for("bert", step)
            y = inputs.pop("labels").float()
            y = y if labels_shape == "(N,)" else y[:, None]
            optimizer.zero_grad()
            if hand_written_loss:
                loss = ((model(**inputs).logits - y) ** 2).mean()
            else:
                loss = model(**inputs, labels=y).loss  # the model's own MSE, in its forward
            loss.backward()
            optimizer.step()
        return [a for a in monitor.alerts if a.severity != "info"]


def test_regression_head_with_a_hand_written_loss_against_n_labels_is_a_broadcast():
    alerts = _regression(4, hand_written_loss=True, labels_shape="(N,)")
    assert _found(alerts) == [("broadcast", 0, None)]
    assert alerts[0].data["shapes"] == [[8, 1], [8]]


def test_regression_head_with_matching_label_shapes_is_silent():
    assert _found(_regression(4, hand_written_loss=True, labels_shape="(N, 1)")) == []


def test_regression_loss_computed_inside_the_models_forward_is_silent():
    # BertForSequenceClassification squeezes logits and labels alike before its MSE.
    assert _found(_regression(4, hand_written_loss=False, labels_shape="(N,)")) == []


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_an_evaluation_with_labels_metrics_and_generation_is_silent(family):
    """The loss computed in ``forward`` at eval, token or label accuracy, perplexity and
    a greedy ``generate``: every evaluation pass followed, nothing paired by mistake."""
    model = model_of(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO(), broadcast={"audit_steps": 20}) as mon:
        for step in range(4):
            optimizer.zero_grad()
            model(**batch_for(family, step)).loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            for step in range(3):
                inputs = batch_for(family, 50 + step)
                out = model(**inputs)
                out.loss.exp()
                labels = inputs["labels"]
                if family == "bert":
                    (out.logits.argmax(-1) == labels).float().mean()
                else:
                    shifted = labels[:, 1:]
                    hits = (out.logits[:, :-1].argmax(-1) == shifted) & (shifted != -100)
                    hits.sum() / (shifted != -100).sum()
            if family == "gpt2":
                ids = inputs["input_ids"][:2, :4]
                model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        model.train()
    assert [a.rule for a in mon.alerts if a.severity != "info"] == []


@pytest.mark.parametrize("bug", [True, False], ids=["n1_against_n", "squeezed"])
def test_a_regression_heads_validation_loss_written_by_hand_is_judged(bug):
    """Trained on the model's own loss; validated by hand against ``(N,)`` labels."""
    torch.manual_seed(0)
    model = bert(num_labels=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        for step in range(6):
            inputs = batch_for("bert", step)
            y = inputs.pop("labels").float()
            optimizer.zero_grad()
            model(**inputs, labels=y).loss.backward()
            optimizer.step()
            if step == 4:
                model.eval()
                with torch.no_grad():
                    logits = model(**inputs).logits  # (N, 1)
                    ((logits - y if bug else logits.squeeze(-1) - y) ** 2).mean().item()
                model.train()
    found = [(a.rule, a.step, a.data.get("phase")) for a in monitor.alerts if a.severity != "info"]
    assert found == ([("broadcast", 5, "evaluation")] if bug else [])
