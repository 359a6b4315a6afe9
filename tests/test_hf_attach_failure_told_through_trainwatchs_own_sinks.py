"""A failure inside trainwatch while the Hugging Face callback attaches is told where
trainwatch's findings go, once, and the Trainer trains on unchanged.

``tw.watch`` and the Lightning callback meet a model trainwatch mishandles by
attaching a monitor with every check off, which reports the failure once as an
``internal_error`` (console, alerts.jsonl, TensorBoard) and counts the steps. The
``transformers.Trainer`` callback gave the same failure only a Python
``warnings.warn``, and nothing of it reached the run's files.

The failure is provoked the way real projects meet it: a project's base model
declaring a ``module`` property its subclasses override when they wrap a network
(trainwatch reads ``.module`` to unwrap DDP). It sits beside a control, the same
model without that base, which attaches cleanly.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.hf_models import Tokens, model_of

transformers = pytest.importorskip("transformers")
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from trainwatch.hf import TrainWatchCallback  # noqa: E402

SETUP = "monitor setup (every check is off)"
STEPS = 4


class _WrapsNoNetwork:
    """A project's base model: subclasses that wrap a network name it here."""

    @property
    def module(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} wraps no network")


class TemplateLM(_WrapsNoNetwork, GPT2LMHeadModel):
    pass


def _model(template: bool) -> nn.Module:
    plain = model_of("gpt2")
    if not template:
        return plain
    torch.manual_seed(0)
    return TemplateLM(plain.config)


def _train(out: Path, model: nn.Module, callback: TrainWatchCallback | None, **kwargs):
    """A few Trainer steps on CPU; the Python warnings trainwatch gave, with the trainer."""
    options = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    options.update(kwargs)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(**options),
        train_dataset=Tokens("gpt2"),
        callbacks=[callback] if callback is not None else [],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return trainer, [str(w.message) for w in caught if "trainwatch" in str(w.message)]


def _tensorboard_alerts(run: Path) -> list[tuple[int, str]]:
    """(step, rule) of each alert in the trainwatch tab's data, in every event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainwatch.tensorboard_plugin import metadata

    told = []
    for events_file in run.glob("events.out.tfevents*"):
        events = EventAccumulator(str(events_file), size_guidance={"tensors": 0})
        events.Reload()
        if metadata.ALERTS_TAG not in events.Tags()["tensors"]:
            continue
        for event in events.Tensors(metadata.ALERTS_TAG):
            payload = metadata.decode(event.tensor_proto.string_val[0])
            told += [(event.step, alert["rule"]) for alert in payload["alerts"]]
    return told


def test_a_model_trainwatch_cannot_walk_is_told_once_in_its_own_sinks_and_trains_on(
    tmp_path, monkeypatch
):
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    out = io.StringIO()
    callback = TrainWatchCallback(console=out)
    trainer, warned = _train(tmp_path / "out", _model(True), callback, report_to=["tensorboard"])
    assert warned == []  # not a Python warning: trainwatch's own channels
    assert [(a.rule, a.data["component"]) for a in callback.alerts] == [("internal_error", SETUP)]
    assert "TemplateLM wraps no network" in callback.alerts[0].message
    assert out.getvalue().count("internal_error") == 2  # the line and the summary row
    assert out.getvalue().count("wraps no network") == 1
    assert f"{STEPS} steps watched" in out.getvalue()
    (run,) = (tmp_path / "out" / "runs").iterdir()
    records = [json.loads(line) for line in (run / "alerts.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["data"]["component"]) for r in records] == [("internal_error", SETUP)]
    assert _tensorboard_alerts(run) == [(0, "internal_error")]
    # Training went on: every step counted by the stand-in monitor.
    assert trainer.state.global_step == STEPS and callback.monitor.step_count == STEPS


def test_control_a_model_trainwatch_walks_attaches_cleanly(tmp_path):
    out = io.StringIO()
    callback = TrainWatchCallback(console=out)
    trainer, warned = _train(tmp_path / "out", _model(False), callback)
    assert warned == [] and callback.alerts == []
    assert "internal_error" not in out.getvalue() and f"{STEPS} steps watched" in out.getvalue()
    assert (tmp_path / "out" / "alerts.jsonl").read_text() == ""
    assert trainer.state.global_step == STEPS and callback.monitor.step_count == STEPS


def test_the_stand_in_monitor_leaves_training_bit_identical(tmp_path):
    watched, plain = _model(True), _model(True)
    _train(tmp_path / "watched", watched, TrainWatchCallback(console=False))
    _train(tmp_path / "plain", plain, None)
    for (name, a), (_, b) in zip(watched.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
