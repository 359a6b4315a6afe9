"""TrainWatchCallback with real Lightning Trainers: one callback, the same alerts as plain loops."""

from __future__ import annotations

import copy
import io
import json
import pickle

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.lightning_models import BoringNet, ManualNet, quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.tensorboard_plugin import metadata


def _trainer(tmp_path, callback, **kwargs) -> pl.Trainer:
    options = dict(max_steps=4, limit_val_batches=0, num_sanity_val_steps=0)
    options.update(kwargs)
    return quiet_trainer(tmp_path, [callback], **options)


def _rules(callback) -> list[str]:
    return [a.rule for a in callback.alerts]


def test_frozen_layer_in_optimizer_is_reported_with_the_lightning_module_names(tmp_path):
    out = io.StringIO()
    callback = TrainWatchCallback(console=out)
    _trainer(tmp_path, callback).fit(BoringNet(freeze_fc1=True))
    (alert,) = callback.alerts
    assert (alert.rule, alert.module, alert.step) == ("frozen_in_optimizer", "fc1", 0)
    assert alert.data["rank"] == 0
    assert "WARNING frozen_in_optimizer [fc1]" in out.getvalue()
    assert "4 steps watched" in out.getvalue()


def test_clean_module_raises_no_alert_and_counts_optimizer_steps(tmp_path):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback).fit(BoringNet())
    assert callback.alerts == []
    assert callback.monitor.step_count == 4
    assert set(callback.monitor.grad_norms()) == {"fc1", "fc2", "head"}
    # Without a logger, log_dir is the trainer's: default_root_dir.
    assert (tmp_path / "alerts.jsonl").read_text() == ""
    (events_file,) = tmp_path.glob("events.out.tfevents*")
    events = EventAccumulator(str(events_file))
    events.Reload()
    assert len(events.Scalars(metadata.TOTAL_TAG)) == 4


def test_norms_are_taken_before_gradient_clipping(tmp_path):
    model = BoringNet()
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback, gradient_clip_val=1e-3).fit(model)
    total = callback.monitor.total_grad_norm
    assert total == pytest.approx(model.reference_norms[-1], rel=1e-5)
    assert total > 1e-2  # far above the clip value: the unclipped gradients


def test_gradient_accumulation_is_no_missing_zero_grad(tmp_path):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback, accumulate_grad_batches=3).fit(BoringNet())
    assert callback.alerts == []
    assert callback.monitor.step_count == 4


def test_manual_optimisation_without_zero_grad_is_caught(tmp_path):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback).fit(ManualNet(forget_zero_grad_on_rank=0))
    assert _rules(callback) == ["accumulated_gradient"]
    assert callback.alerts[0].step == 1


def test_manual_optimisation_with_zero_grad_is_clean(tmp_path):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback).fit(ManualNet())
    assert callback.alerts == []
    assert callback.monitor.step_count == 4


def test_sanity_check_and_validation_add_no_steps_or_alerts(tmp_path):
    phases: list[str] = []

    class Spy(TrainWatchCallback):
        def _enter(self, phase):
            phases.append(phase)
            super()._enter(phase)

    callback = Spy(console=False)
    trainer = _trainer(
        tmp_path, callback, limit_val_batches=2, num_sanity_val_steps=2, val_check_interval=2
    )
    trainer.fit(BoringNet())
    assert callback.alerts == [] and callback.monitor.step_count == 4
    # sanity check, back to train, then each validation returns to train
    assert phases[:3] == ["sanity_check", "sanity_check", "train"]
    assert phases[3:] == ["train", "validate", "train", "validate", "train"]
    trainer.test(BoringNet(), verbose=False)
    trainer.predict(BoringNet())
    assert phases[-2:] == ["test", "predict"]


def test_alerts_go_to_the_loggers_tensorboard_and_its_log_dir(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="exp")
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback, logger=logger).fit(BoringNet(freeze_fc1=True))
    log_dir = tmp_path / "exp" / "version_0"
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == ["frozen_in_optimizer"]
    # One event file: the sink wrote through the logger's own writer.
    (events_file,) = log_dir.glob("events.out.tfevents*")
    events = EventAccumulator(str(events_file), size_guidance={"tensors": 0})
    events.Reload()
    assert metadata.norm_tag("head") in events.Tags()["scalars"]
    # The layers' summary at step 0, and the alert dated step 0 (told once the
    # first boundaries showed nothing moves the frozen layer by hand).
    steps = [e.step for e in events.Tensors(metadata.ALERTS_TAG)]
    assert set(steps) == {0}


class _DiskWitness(io.StringIO):
    """A console stream that notes, at each print, what the log dir already holds."""

    def __init__(self, log_dir) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.seen: list[tuple[str, list[str], bool]] = []

    def write(self, text: str) -> int:
        alerts = self.log_dir / "alerts.jsonl"
        lines = alerts.read_text().splitlines() if alerts.exists() else []
        rules = [json.loads(line)["rule"] for line in lines]
        self.seen.append((text, rules, (self.log_dir / "alert_counts.json").exists()))
        return super().write(text)


def test_an_alert_is_on_disk_before_the_console_prints_it(tmp_path):
    log_dir = tmp_path / "tw"
    out = _DiskWitness(log_dir)
    callback = TrainWatchCallback(console=out, log_dir=log_dir)
    _trainer(tmp_path, callback).fit(BoringNet(freeze_fc1=True))
    (printed,) = [rules for text, rules, _ in out.seen if "frozen_in_optimizer [fc1]" in text]
    assert printed == ["frozen_in_optimizer"]
    # At close the files are done (the counts written) before the summary prints.
    (closed,) = [counts for text, _, counts in out.seen if "4 steps watched" in text]
    assert closed


def test_resuming_from_a_checkpoint_continues_steps_and_does_not_repeat_alerts(tmp_path):
    out = io.StringIO()
    first = TrainWatchCallback(console=out)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, first, max_steps=3, enable_checkpointing=True)
    trainer.callbacks.append(saver)
    trainer.fit(BoringNet(freeze_fc1=True))
    assert out.getvalue().count("WARNING frozen_in_optimizer") == 1

    resumed = TrainWatchCallback(console=out)
    _trainer(tmp_path, resumed, max_steps=6).fit(
        BoringNet(freeze_fc1=True), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt")
    )
    assert resumed.monitor.step_count == 6
    assert [(a.rule, a.step) for a in resumed.alerts] == [("frozen_in_optimizer", 0)]
    assert out.getvalue().count("WARNING frozen_in_optimizer") == 1  # not re-printed


def test_halt_on_stops_the_fit_after_the_alert_was_reported(tmp_path):
    import trainwatch as tw

    out = io.StringIO()
    callback = TrainWatchCallback(
        console=out, log_dir=tmp_path / "tw", halt_on=["accumulated_gradient"]
    )
    with pytest.raises(tw.TrainingHealthError, match="accumulated_gradient at step 1"):
        _trainer(tmp_path, callback).fit(ManualNet(forget_zero_grad_on_rank=0))
    assert "ERROR accumulated_gradient" in out.getvalue()
    lines = (tmp_path / "tw" / "alerts.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == ["accumulated_gradient"]
    events = EventAccumulator(str(tmp_path / "tw"), size_guidance={"tensors": 0})
    events.Reload()
    assert [e.step for e in events.Tensors(metadata.ALERTS_TAG)][-1] == 1
    assert callback.monitor.closed


def test_callback_pickles_and_copies_before_and_after_fit(tmp_path):
    callback = TrainWatchCallback(console=False, zero_gradient={"patience": 5})
    assert pickle.loads(pickle.dumps(callback)).config.zero_gradient.patience == 5
    _trainer(tmp_path, callback).fit(BoringNet())
    clone = pickle.loads(pickle.dumps(callback))
    assert clone.monitor is None and clone.config == callback.config
    assert copy.deepcopy(callback).alerts == []


def test_bad_config_fails_when_the_callback_is_built():
    from trainwatch import ConfigError

    with pytest.raises(ConfigError, match=r"zero_gradient\.patiense"):
        TrainWatchCallback(zero_gradient={"patiense": 3})


@pytest.mark.parametrize("after", ["validate", "test", "predict"])
def test_the_fits_alerts_and_counts_outlive_an_evaluation_run_after_it(tmp_path, after):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    callback = TrainWatchCallback(console=False, log_dir=tmp_path / "log")
    # No val loader in the fit: limit_val_batches=0 would skip validate() too.
    trainer = _trainer(tmp_path, callback, limit_val_batches=None)
    model = BoringNet(freeze_fc1=True)
    trainer.fit(model)
    fitted = [(a.rule, a.module, a.step) for a in callback.alerts]
    assert fitted == [("frozen_in_optimizer", "fc1", 0)]
    x = torch.randn(16, 8)
    data = DataLoader(TensorDataset(x, x[:, :1]) if after != "predict" else x, batch_size=8)
    getattr(trainer, after)(model, data, **({"verbose": False} if after != "predict" else {}))
    assert [(a.rule, a.module, a.step) for a in callback.alerts] == fitted
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    assert [(c["rule"], c["module"]) for c in counts["counts"]] == [("frozen_in_optimizer", "fc1")]
    assert counts["steps"] == 4


def test_an_evaluation_run_after_a_clean_fit_stays_clean(tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    callback = TrainWatchCallback(console=False, log_dir=tmp_path / "log")
    trainer = _trainer(tmp_path, callback, limit_val_batches=None)
    model = BoringNet()
    trainer.fit(model)
    x = torch.randn(16, 8)
    trainer.validate(model, DataLoader(TensorDataset(x, x[:, :1]), batch_size=8), verbose=False)
    assert callback.alerts == []
    counts = json.loads((tmp_path / "log" / "alert_counts.json").read_text())
    assert counts["counts"] == []


class _LbfgsNet(BoringNet):
    """LBFGS under automatic optimisation: Lightning's closure resets the gradients
    at each evaluation, unless ``optimizer_zero_grad`` is overridden to do nothing."""

    def __init__(self, reset: bool) -> None:
        super().__init__()
        self.reset = reset

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=10)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        if self.reset:
            optimizer.zero_grad()


@pytest.mark.parametrize("reset", [True, False], ids=["lightning_resets", "reset_overridden"])
def test_lbfgs_closure_evaluations_without_reset_fire_at_the_first_step(tmp_path, reset):
    callback = TrainWatchCallback(console=False)
    _trainer(tmp_path, callback).fit(_LbfgsNet(reset))
    assert callback.monitor.step_count == 4
    told = [(a.rule, a.step) for a in callback.alerts if a.rule == "accumulated_gradient"]
    assert told == ([] if reset else [("accumulated_gradient", 0)])
    if reset:
        assert callback.alerts == []
    else:
        assert not [a for a in callback.alerts if a.rule == "amp_skipped_steps"]
        (alert,) = [a for a in callback.alerts if a.rule == "accumulated_gradient"]
        assert "an earlier evaluation of step 0's closure" in alert.message


class _ValidatedRegressor(BoringNet):
    """Targets ``(N,)`` in validation: ``bug`` pairs them with the ``(N, 1)`` output."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug

    def validation_step(self, batch, batch_idx):
        x, y = batch
        target, pred = y.squeeze(-1), self(x)
        error = pred - target if self.bug else pred.squeeze(-1) - target
        self.log("val_loss", (error**2).mean())


@pytest.mark.parametrize("sanity", [2, 0], ids=["sanity_check", "after_the_last_step"])
def test_a_validation_step_pairing_n1_with_n_is_a_broadcast_in_evaluation(tmp_path, sanity):
    """Caught in the sanity check before the first step, or (without one) in the
    validation after the last step, told when the fit ends."""
    callback = TrainWatchCallback(console=False)
    trainer = _trainer(
        tmp_path,
        callback,
        max_epochs=1,
        max_steps=-1,
        limit_val_batches=2,
        num_sanity_val_steps=sanity,
    )
    trainer.fit(_ValidatedRegressor(bug=True))
    (alert,) = callback.alerts
    assert alert.rule == "broadcast" and alert.data["phase"] == "evaluation"
    assert alert.step == (0 if sanity else 8)
    assert alert.data["shapes"] == [[8, 1], [8]] and "in an evaluation pass" in alert.message


@pytest.mark.parametrize("sanity", [2, 0], ids=["sanity_check", "after_the_last_step"])
def test_a_healthy_validation_step_is_silent(tmp_path, sanity):
    callback = TrainWatchCallback(console=False)
    trainer = _trainer(
        tmp_path,
        callback,
        max_epochs=1,
        max_steps=-1,
        limit_val_batches=2,
        num_sanity_val_steps=sanity,
    )
    trainer.fit(_ValidatedRegressor(bug=False))
    assert callback.alerts == []
    assert torch._C._len_torch_function_stack() == 0
