"""A failure inside trainwatch while the Lightning callback attaches is told where
trainwatch's findings go, once, and the fit trains on unchanged.

``tw.watch`` meets a model trainwatch mishandles by attaching a monitor with every
check off, which reports the failure once as an ``internal_error`` (console,
alerts.jsonl, TensorBoard) and counts the steps. The callback gave the same
failure only a Python ``warnings.warn`` (once per loop start: the fit, the
sanity check, each validation), and nothing of it reached the run's files; a
checkpoint holding trainwatch state of another shape (saved by another version)
stopped the resumed fit outright.

The failures are provoked the way real projects meet them: a project's base
LightningModule declaring a ``module`` property its subclasses override when they
wrap a network (trainwatch reads ``.module`` to unwrap DDP), and a resumed
checkpoint whose trainwatch tallies are of an older record shape. Each sits
beside a control that attaches cleanly.
"""

from __future__ import annotations

import io
import json
import warnings

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from tests.lightning_models import BoringNet, ManualNet, quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.tensorboard_plugin import metadata

SETUP = "monitor setup (every check is off)"


class _WrapsNoNetwork:
    """A project's base module: subclasses that wrap a network name it here."""

    @property
    def module(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} wraps no network")


class TemplateNet(_WrapsNoNetwork, BoringNet):
    pass


class ManualTemplateNet(_WrapsNoNetwork, ManualNet):
    pass


MODELS = {
    ("automatic", True): TemplateNet,
    ("manual", True): ManualTemplateNet,
    ("automatic", False): BoringNet,
    ("manual", False): ManualNet,
}


def _fit(tmp_path, model, callback=None, **kwargs):
    """Two epochs of 8 steps with validation (each loop start is a chance to retell),
    logged to TensorBoard; the Python warnings trainwatch gave, with the trainer."""
    options = dict(max_epochs=2, logger=TensorBoardLogger(str(tmp_path), name="tb"))
    options.update(kwargs)
    trainer = quiet_trainer(tmp_path, [callback] if callback else [], **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return trainer, [str(w.message) for w in caught if "trainwatch" in str(w.message)]


def _tensorboard_alerts(tmp_path) -> list[tuple[int, str]]:
    """(step, rule) of each alert in the trainwatch tab's data, as the logger wrote it."""
    (events_file,) = (tmp_path / "tb" / "version_0").glob("events.out.tfevents*")
    events = EventAccumulator(str(events_file), size_guidance={"tensors": 0})
    events.Reload()
    told = []
    for event in events.Tensors(metadata.ALERTS_TAG):
        payload = metadata.decode(event.tensor_proto.string_val[0])
        told += [(event.step, alert["rule"]) for alert in payload["alerts"]]
    return told


@pytest.mark.parametrize("optimisation", ["automatic", "manual"])
def test_a_module_trainwatch_cannot_walk_is_told_once_in_its_own_sinks_and_trains_on(
    tmp_path, optimisation
):
    out = io.StringIO()
    callback = TrainWatchCallback(console=out)
    trainer, warned = _fit(tmp_path, MODELS[optimisation, True](), callback)
    assert warned == []  # not a Python warning: trainwatch's own channels
    assert [(a.rule, a.data["component"]) for a in callback.alerts] == [("internal_error", SETUP)]
    assert "TemplateNet wraps no network" in callback.alerts[0].message
    # Told once, though the sanity check and two validations started loops after it.
    assert out.getvalue().count("internal_error") == 2  # the line and the summary row
    assert out.getvalue().count("wraps no network") == 1
    assert "16 steps watched" in out.getvalue()
    log_dir = tmp_path / "tb" / "version_0"
    records = [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]
    assert [(r["rule"], r["data"]["component"]) for r in records] == [("internal_error", SETUP)]
    assert _tensorboard_alerts(tmp_path) == [(0, "internal_error")]
    # The fit went on: every step counted by the stand-in monitor.
    assert trainer.global_step == 16 and callback.monitor.step_count == 16


@pytest.mark.parametrize("optimisation", ["automatic", "manual"])
def test_control_a_module_trainwatch_walks_attaches_cleanly(tmp_path, optimisation):
    out = io.StringIO()
    callback = TrainWatchCallback(console=out)
    trainer, warned = _fit(tmp_path, MODELS[optimisation, False](), callback)
    assert warned == [] and callback.alerts == []
    assert "internal_error" not in out.getvalue() and "16 steps watched" in out.getvalue()
    assert _tensorboard_alerts(tmp_path) == []
    assert trainer.global_step == 16 and callback.monitor.step_count == 16


def test_the_stand_in_monitor_leaves_training_bit_identical(tmp_path):
    torch.manual_seed(0)
    watched = TemplateNet()
    torch.manual_seed(0)
    plain = TemplateNet()
    _fit(tmp_path / "watched", watched, TrainWatchCallback(console=False), logger=False)
    _fit(tmp_path / "plain", plain, logger=False)
    for (name, a), (_, b) in zip(watched.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def _checkpoint(tmp_path, shape_of_state) -> str:
    """A 4-step fit's last checkpoint; ``shape_of_state`` rewrites the trainwatch
    tallies it holds (an older trainwatch's record shape) or leaves them."""
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = quiet_trainer(
        tmp_path,
        [TrainWatchCallback(console=False), saver],
        max_steps=4,
        enable_checkpointing=True,
        limit_val_batches=0,
    )
    trainer.fit(BoringNet(freeze_fc1=True))
    path = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(path, weights_only=False)
    (key,) = [k for k in state["callbacks"] if k.startswith("TrainWatchCallback")]
    state["callbacks"][key] = shape_of_state(state["callbacks"][key])
    torch.save(state, path)
    return str(path)


def _older_record_shape(state):
    """Tallies keyed as an older trainwatch wrote them: no severity in the alert."""
    for entry in state["reported"]:
        entry["alert"].pop("severity")
    return state


def _resume(tmp_path, ckpt):
    out = io.StringIO()
    callback = TrainWatchCallback(console=out)
    trainer = quiet_trainer(tmp_path, [callback], max_steps=8, limit_val_batches=0)
    trainer.fit(BoringNet(freeze_fc1=True), ckpt_path=ckpt)
    return trainer, callback, out.getvalue()


def test_a_checkpoints_trainwatch_state_it_cannot_read_is_told_and_the_fit_resumes(tmp_path):
    trainer, callback, printed = _resume(tmp_path, _checkpoint(tmp_path, _older_record_shape))
    assert trainer.global_step == 8 and callback.monitor.step_count == 8
    failures = [a for a in callback.alerts if a.rule == "internal_error"]
    assert [(a.data["component"], a.step) for a in failures] == [
        ("lightning callback: checkpoint state", 4)
    ]
    assert "KeyError" in failures[0].message and printed.count("checkpoint state") == 1


def test_control_a_checkpoints_own_trainwatch_state_resumes_silently(tmp_path):
    trainer, callback, printed = _resume(tmp_path, _checkpoint(tmp_path, lambda state: state))
    assert trainer.global_step == 8 and callback.monitor.step_count == 8
    # The fit's finding came back with the checkpoint, and was not told again.
    assert [(a.rule, a.step) for a in callback.alerts] == [("frozen_in_optimizer", 0)]
    assert "internal_error" not in printed and "WARNING frozen_in_optimizer" not in printed
