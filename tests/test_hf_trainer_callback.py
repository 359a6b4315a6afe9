"""trainwatch.hf.TrainWatchCallback with a real ``transformers.Trainer`` (CPU, offline)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from tests.hf_models import ATTENTION, Tokens, freeze, model_of, plant_nan, unplant

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import trainwatch as tw  # noqa: E402
from trainwatch.hf import TrainWatchCallback  # noqa: E402


def _args(out: Path, **kwargs) -> TrainingArguments:
    options = dict(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        dataloader_num_workers=0,
    )
    options.update(kwargs)
    return TrainingArguments(**options)


class _Steps(TrainerCallback):
    """What the monitor saw at each of the Trainer's step ends (runs after trainwatch's)."""

    def __init__(self, watch: TrainWatchCallback) -> None:
        self.watch = watch
        self.seen: list[tuple[int, int, float | None]] = []

    def on_step_end(self, args, state, control, **kwargs):
        monitor = self.watch.monitor
        self.seen.append((state.global_step, monitor.step_count, monitor.total_grad_norm))


def _fit(tmp_path, family="gpt2", *, model=None, extra=(), **kwargs):
    watch = kwargs.pop("watch", None) or TrainWatchCallback(console=io.StringIO())
    model = model if model is not None else model_of(family)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", **kwargs),
        train_dataset=Tokens(family),
        callbacks=[watch, *extra],
    )
    trainer.train()
    return watch, trainer


def _found(watch: TrainWatchCallback) -> list[tuple[str, int, str | None]]:
    return [(a.rule, a.step, a.module) for a in watch.alerts if a.severity != "info"]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_clean_trainer_run_is_silent_and_steps_equal_global_step(tmp_path, family):
    watch = TrainWatchCallback(console=io.StringIO())
    steps = _Steps(watch)
    _fit(tmp_path, family, watch=watch, extra=[steps], gradient_accumulation_steps=2)
    assert _found(watch) == []
    assert [(g, s) for g, s, _ in steps.seen] == [(g, g) for g in range(1, 7)]
    assert watch.monitor.closed


def test_norms_are_the_unclipped_ones_with_gradient_accumulation(tmp_path):
    watch = TrainWatchCallback(console=io.StringIO())
    steps = _Steps(watch)
    _, trainer = _fit(
        tmp_path, watch=watch, extra=[steps], gradient_accumulation_steps=2, max_grad_norm=1e-4
    )
    # The Trainer logs the total norm its clipping measured, before clipping.
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    ours = [norm for _, _, norm in steps.seen]
    assert len(ours) == len(logged) == 6
    assert ours == pytest.approx(logged, rel=1e-4)
    assert min(ours) > 1e3 * 1e-4  # far above what clipping left


def test_a_nan_gradient_is_named_at_its_module_though_the_trainer_clips_it_into_nans(tmp_path):
    model = model_of("gpt2")
    name = "transformer.h.1.mlp.c_fc"
    module = model.get_submodule(name)
    original = module.forward

    class _PlantAtStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:
                # sqrt at 0: finite forward, infinite derivative, NaN gradient.
                module.forward = lambda x: original(x) + torch.sqrt(x * 0.0).sum(-1, keepdim=True)
            elif "forward" in module.__dict__:
                del module.forward

    watch, _ = _fit(tmp_path, model=model, extra=[_PlantAtStep()], max_steps=5)
    found = _found(watch)
    assert found[:1] == [("nonfinite_backward", 3, name)]
    assert watch.alerts[0].data.get("op") == "aten::sqrt"


def test_a_nan_made_in_one_attention_block_is_named(tmp_path):
    model = model_of("llama")
    name = ATTENTION["llama"]

    class _PlantAtStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                plant_nan(model, name)
            else:
                unplant(model, name)

    watch, _ = _fit(tmp_path, "llama", model=model, extra=[_PlantAtStep()], max_steps=4)
    assert _found(watch)[:1] == [("nonfinite_forward", 2, name)]


def test_a_frozen_layer_in_the_trainers_own_optimizer_is_not_reported(tmp_path):
    # The Trainer builds its optimizer over trainable parameters only.
    model = model_of("gpt2")
    freeze(model, "transformer.h.0.attn.c_attn")
    watch, _ = _fit(tmp_path, model=model, max_steps=3)
    assert _found(watch) == []


def test_a_frozen_layer_in_a_hand_built_optimizer_is_named(tmp_path):
    model = model_of("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    freeze(model, "transformer.h.1.attn.c_attn")
    watch = TrainWatchCallback(console=io.StringIO())
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=3),
        train_dataset=Tokens("gpt2"),
        callbacks=[watch],
        optimizers=(optimizer, None),
    )
    trainer.train()
    assert _found(watch) == [("frozen_in_optimizer", 0, "transformer.h.1.attn.c_attn")]


def test_alerts_go_to_output_dir_without_tensorboard(tmp_path):
    model = model_of("gpt2")
    freeze(model, "transformer.h.1.attn.c_attn")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=2),
        train_dataset=Tokens("gpt2"),
        callbacks=[TrainWatchCallback(console=io.StringIO())],
        optimizers=(optimizer, None),
    )
    trainer.train()
    lines = (tmp_path / "out" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == ["frozen_in_optimizer"]
    assert not list((tmp_path / "out").rglob("events.out.tfevents*"))


def test_alerts_and_norms_go_where_the_trainers_tensorboard_writes(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    model = model_of("gpt2")
    freeze(model, "transformer.h.1.attn.c_attn")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=2, report_to=["tensorboard"]),
        train_dataset=Tokens("gpt2"),
        callbacks=[TrainWatchCallback(console=io.StringIO())],
        optimizers=(optimizer, None),
    )
    trainer.train()
    (run,) = (tmp_path / "out" / "runs").iterdir()
    assert (run / "alerts.jsonl").is_file()
    events = list(run.glob("events.out.tfevents*"))
    assert len(events) >= 2  # the Trainer's writer and trainwatch's, side by side
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for event_file in events:
        accumulator = EventAccumulator(str(event_file))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    assert "trainwatch/grad_norm/total" in tags
    assert "train/loss" in tags  # the Trainer's own, in the same directory


def test_log_dir_overrides_where_alerts_go(tmp_path):
    model = model_of("gpt2")
    freeze(model, "transformer.h.1.attn.c_attn")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=2),
        train_dataset=Tokens("gpt2"),
        callbacks=[TrainWatchCallback(log_dir=tmp_path / "mine", console=io.StringIO())],
        optimizers=(optimizer, None),
    )
    trainer.train()
    assert (tmp_path / "mine" / "alerts.jsonl").is_file()


class _Missing(TrainerCallback):
    """Drops the Trainer's zero_grad from ``step`` on: gradients pile up across steps."""

    def __init__(self, model, step: int) -> None:
        self.model, self.step = model, step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.model.zero_grad = lambda *a, **k: None


def test_missing_zero_grad_is_caught_at_global_step(tmp_path):
    model = model_of("gpt2")
    watch, _ = _fit(tmp_path, model=model, extra=[_Missing(model, 3)], max_steps=5)
    assert _found(watch) == [("accumulated_gradient", 4, None)]


def test_halt_on_stops_training_cleanly_then_raises(tmp_path):
    model = model_of("gpt2")
    watch = TrainWatchCallback(console=io.StringIO(), halt_on=["accumulated_gradient"])
    steps = _Steps(watch)
    with pytest.raises(tw.TrainingHealthError, match="accumulated_gradient at step 4"):
        _fit(tmp_path, model=model, watch=watch, extra=[_Missing(model, 3), steps], max_steps=10)
    assert [g for g, _, _ in steps.seen] == [1, 2, 3, 4, 5]  # stopped after the step that fired
    assert watch.monitor.closed
    lines = (tmp_path / "out" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == ["accumulated_gradient"]


def test_halt_on_without_raising_only_stops(tmp_path):
    model = model_of("gpt2")
    watch = TrainWatchCallback(
        console=io.StringIO(), halt_on=["accumulated_gradient"], raise_on_halt=False
    )
    _, trainer = _fit(tmp_path, model=model, watch=watch, extra=[_Missing(model, 3)], max_steps=10)
    assert trainer.state.global_step == 5


def test_bad_config_fails_when_the_callback_is_built():
    with pytest.raises(tw.ConfigError, match=r"zero_gradient\.patiense"):
        TrainWatchCallback(zero_gradient={"patiense": 3})


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_keeps_the_unclipped_norms_and_stays_silent(tmp_path, reentrant):
    watch = TrainWatchCallback(console=io.StringIO())
    steps = _Steps(watch)
    _, trainer = _fit(
        tmp_path,
        watch=watch,
        extra=[steps],
        max_steps=4,
        max_grad_norm=1e-4,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert [norm for _, _, norm in steps.seen] == pytest.approx(logged, rel=1e-4)
    assert _found(watch) == []


def test_evaluation_during_training_is_silent(tmp_path):
    model = model_of("bert")
    watch = TrainWatchCallback(console=io.StringIO())
    trainer = Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=6, eval_strategy="steps", eval_steps=2),
        train_dataset=Tokens("bert"),
        eval_dataset=Tokens("bert", n=16, seed=1),
        callbacks=[watch],
    )
    trainer.train()
    assert _found(watch) == []
    assert watch.monitor.step_count == 6


@pytest.mark.parametrize("second_frozen", [True, False], ids=["both_frozen", "second_clean"])
def test_one_callback_across_two_trainings_tells_each_its_own(tmp_path, second_frozen):
    """Each ``train()`` is a run of its own: a fresh Monitor, its own summary and counts
    (in a shared log dir, the second model's under its name beside the first's)."""
    console = io.StringIO()
    watch = TrainWatchCallback(console=console, log_dir=tmp_path / "log")
    found = []
    for run, frozen in enumerate((True, second_frozen)):
        model = model_of("gpt2")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if frozen:
            freeze(model, "transformer.h.1.attn.c_attn")
        Trainer(
            model=model,
            args=_args(tmp_path / "out", max_steps=2),
            train_dataset=Tokens("gpt2"),
            callbacks=[watch],
            optimizers=(optimizer, None),
        ).train()
        counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
        name = f"{type(model).__name__}#2" if run else None
        found.append((_found(watch), [c["count"] for c in counts["counts"] if c["model"] == name]))
    own = [("frozen_in_optimizer", 0, "transformer.h.1.attn.c_attn")]
    assert found == [(own, [1]), (own, [1]) if second_frozen else ([], [])]
    assert console.getvalue().count("WARNING frozen_in_optimizer") == (2 if second_frozen else 1)
