"""PEFT LoRA on a tiny GPT-2: a frozen base with zero-initialised B matrices is healthy."""

from __future__ import annotations

import io

import pytest
import torch

from tests.hf_models import Tokens, batch_for, model_of

peft = pytest.importorskip("peft")
from transformers import Trainer, TrainingArguments  # noqa: E402

import trainwatch as tw  # noqa: E402
from trainwatch.hf import TrainWatchCallback  # noqa: E402


def _lora():
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn"], fan_in_fan_out=True
    )
    return peft.get_peft_model(model_of("gpt2"), config)


def _train(model, optimizer, steps: int) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        model(**batch_for("gpt2", step)).loss.backward()
        optimizer.step()


def _warnings(alerts) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in alerts if a.severity != "info"]


def test_frozen_base_with_zero_initialised_b_is_silent():
    model = _lora()
    assert all(not p.any() for n, p in model.named_parameters() if "lora_B" in n)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        _train(model, optimizer, 8)
    assert _warnings(monitor.alerts) == []


def test_an_optimizer_over_every_parameter_is_one_note_naming_the_frozen_base():
    """The frozen base beside its adapters, left in the optimizer: one info note at the
    module holding it all, not a warning per frozen base layer."""
    model = _lora()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        _train(model, optimizer, 2)
    assert _warnings(monitor.alerts) == []
    (note,) = [a for a in monitor.alerts if a.rule == "frozen_in_optimizer"]
    assert (note.severity, note.module, note.data["kind"]) == (
        "info",
        "base_model.model.transformer",
        "adapters",
    )
    modules = set(note.data["modules"])
    assert "base_model.model.transformer.h.0.attn.c_attn.base_layer" in modules
    assert "base_model.model.transformer.wte" in modules
    assert not any("lora_" in module for module in modules)  # the adapters train
    assert note.data["adapted"] == ["base_model.model.transformer.h.*.attn.c_attn (x2)"]


def test_merging_the_adapters_while_the_monitor_is_open_does_not_break_it():
    model = _lora()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    monitor = tw.watch(model, optimizer, console=io.StringIO())
    _train(model, optimizer, 3)
    merged = model.merge_and_unload()
    merged.eval()
    with torch.no_grad():
        merged(**batch_for("gpt2", 9))
    monitor.close()
    assert [a.rule for a in monitor.alerts] == []  # no internal_error either


def _trainer(tmp_path, model, optimizers=(None, None)) -> tuple[Trainer, TrainWatchCallback]:
    watch = TrainWatchCallback(console=io.StringIO())
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=8, report_to="none",
        save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens("gpt2"),
        callbacks=[watch],
        optimizers=optimizers,
    )
    return trainer, watch


def test_lora_under_the_trainer_is_silent(tmp_path):
    trainer, watch = _trainer(tmp_path, _lora())
    trainer.train()
    assert _warnings(watch.alerts) == []


def test_lora_under_the_trainer_with_an_optimizer_over_every_parameter_notes_it(tmp_path):
    model = _lora()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer, watch = _trainer(tmp_path, model, (optimizer, None))
    trainer.train()
    assert [a for a in watch.alerts if a.severity != "info"] == []
    found = [a for a in watch.alerts if a.rule == "frozen_in_optimizer"]
    assert [(a.severity, a.data["kind"]) for a in found] == [("info", "adapters")]


@pytest.mark.parametrize("b_lr", [0.0, 4e-3])
def test_a_peft_lora_b_at_a_learning_rate_of_0_is_named_for_a_zero_gradient(b_lr):
    """LoRA+ with B's learning rate truncated to 0: A's gradient stays exactly zero,
    and the message names the zero B beside it (PEFT keeps each half in a module
    of its own); with B learning, nothing is told."""
    model = _lora()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if "lora_A" in n], "lr": 1e-3},
        {"params": [p for n, p in named if "lora_B" in n], "lr": b_lr},
    ]
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    with tw.watch(model, optimizer, console=io.StringIO()) as monitor:
        _train(model, optimizer, 5)
    zero = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    if b_lr:
        assert zero == []
        return
    assert zero and all(a.module.endswith("lora_A.default") for a in zero)
    alert = zero[0]
    partner = alert.module.replace("lora_A", "lora_B") + ".weight"
    assert alert.data["zero_partner"] == partner
    assert alert.data["partner_stays_zero"] == "lr_zero"
    assert f"{partner} is all zeros" in alert.message
    assert "its param group's learning rate is 0" in alert.message
