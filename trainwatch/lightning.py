"""``TrainWatchCallback``: the Lightning adapter over the same Monitor plain loops use.

The only module that imports Lightning. What Lightning changes, and how the
callback meets it:

* Lightning passes a closure to ``optimizer.step``; backward and gradient
  clipping run inside it, after the optimizer's step pre-hook. The callback
  gathers the gradients in ``on_before_optimizer_step``, which Lightning calls
  after backward and *before* clipping, so norms and rules see the gradients
  the model produced, not the clipped ones. The optimizer's post-hook still
  ends the step, in automatic and manual optimisation alike. Under a
  GradScaler ("16-mixed") Lightning steps after the hook, without a closure:
  the step's pre-hook keeps the gathering. In manual optimisation the loop
  clips itself before ``opt.step()``: the gathering made before that clip is
  the step's (see trainwatch/clip_gathering.py).
* ``accumulate_grad_batches``: Lightning steps (and zero_grads) once per N
  batches; steps are optimizer steps, so no false accumulated-gradient alarm.
* DDP: every rank collects; alerts are stamped with their rank and gathered
  to global rank zero (:mod:`trainwatch.relay`), which alone prints and writes.
* The loop phase (sanity check, train, validate, test, predict) is tracked in
  :attr:`TrainWatchCallback.phase`; Lightning flips ``train()``/``eval()`` at
  exactly these boundaries, which is what mode rules will compare against.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from typing import IO, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch.optim import Optimizer

from trainwatch.alert import Alert
from trainwatch.config import Config, load_config
from trainwatch.errors import TrainingHealthError, WatchError
from trainwatch.monitor import Monitor
from trainwatch.raised import note_raise
from trainwatch.relay import Reporter, gather_to_zero
from trainwatch.sinks import ConsoleSink, Sink, default_sinks
from trainwatch.switched_off import SETUP_COMPONENT, switched_off_monitor

Phase = str  # "sanity_check" | "train" | "validate" | "test" | "predict"


class TrainWatchCallback(Callback):
    """Watches a LightningModule for silent training bugs; add it to ``Trainer(callbacks=...)``.

    ``log_dir`` defaults to the trainer's log dir (the TensorBoardLogger's
    version directory). Alerts from every rank are reported by global rank
    zero only.

    Each ``trainer.fit()`` is a run of its own: a callback handed to several
    Trainers in turn (k-fold cross-validation) starts every fit with a fresh
    Monitor and fresh tallies, so a finding is told in each fit that has it and
    no fit's summary or ``alert_counts.json`` holds another's. ``validate()``,
    ``test()`` or ``predict()`` after a run goes on from it instead: its alerts
    stay, and no second summary is printed unless the evaluation found something.
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
        console: bool | IO[str] = True,
        **overrides: Any,
    ) -> None:
        # Validate now, so a typo fails when the callback is built, not mid-fit.
        self.config = load_config(config, overrides)
        self.log_dir = log_dir
        self.console = console
        self._monitor: Monitor | None = None
        self._reporter: Reporter | None = None
        self._restored: dict[str, Any] | None = None
        # The findings an evaluation run took over from the run before it.
        self._carried: set[Any] | None = None
        self._phase: Phase | None = None
        self._batches = 0
        self._failed = False
        # The run's start failed (told once): its later loop starts do not try again.
        self._off = False

    # -- public surface ------------------------------------------------------
    @property
    def alerts(self) -> list[Alert]:
        """The latest ``fit()``'s alerts (and those of the evaluation runs after it),
        oldest first; on rank zero, those of every rank. An earlier fit's are on
        disk (``alerts.jsonl``), not here: each fit is a run of its own."""
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.alerts  # noqa: B018 - lands a lagged readback
        if self._reporter is None:
            return []
        return list(self._reporter.memory.alerts)

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor of the current (or last) run; None before ``fit`` starts."""
        return self._monitor

    @property
    def phase(self) -> Phase | None:
        return self._phase

    # -- starting and stopping -----------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start(trainer, pl_module, list(trainer.optimizers), carry=False)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_for_evaluation(trainer, pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_for_evaluation(trainer, pl_module)

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_for_evaluation(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank is here together, the process group is still up and the
        # logger's writer still open: the last gather, then rank zero reports.
        self._stop(trainer, gather=not self._failed)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer, gather=not self._failed)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer, gather=not self._failed)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":  # trainer.validate(): the run ends here
            self._stop(trainer, gather=not self._failed)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop(trainer, gather=False)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # Before anything else: Lightning re-raises the exception when this returns.
        _quietly(note_raise, exception, [pl_module])
        # Other ranks may never reach another collective: report locally and stop.
        self._failed = True
        self._stop(trainer, gather=False)

    def _start_for_evaluation(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (self._monitor is None or self._monitor.closed) and not self._off:
            self._start(trainer, pl_module, [], carry=True)

    def _start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        optimizers: list[Any],
        *,
        carry: bool,
    ) -> None:
        if self._monitor is not None and not self._monitor.closed:
            return
        self._failed = False
        self._off = False
        self._batches = 0
        # trainer.log_dir is a broadcast: every rank must ask, in step.
        log_dir = self.log_dir if self.log_dir is not None else trainer.log_dir
        rank = trainer.global_rank
        try:
            sinks = self._rank_zero_sinks(trainer, log_dir, pl_module) if rank == 0 else []
            reporter = Reporter(rank, sinks)
            earlier = self._reporter if carry else None
            if earlier is not None:
                _quietly(_carry, earlier, reporter)
            # "16-mixed" precision keeps its GradScaler on the precision plugin.
            scaler = getattr(trainer.precision_plugin, "scaler", None)
        except Exception as exc:  # no sink to tell it through: never break training
            self._off = True
            warnings.warn(
                f"trainwatch could not start and is off for this run: {exc}", stacklevel=2
            )
            return
        monitor = self._attach(pl_module, reporter, scaler, _global_step(trainer))
        if monitor is None:
            return
        self._reporter, self._monitor = reporter, monitor
        if type(pl_module).forward is pl.LightningModule.forward:
            # No forward of its own: every step calls its parts (self.net(x)).
            self._guarded("model parts", monitor.watch_parts)
        # A halt under DDP: every rank delivers its alerts to rank zero first.
        monitor.relayed = True
        monitor.before_halt.append(lambda: gather_to_zero(reporter))
        if self._restored is not None:
            # Before the optimizers: their attach audit must see what already fired.
            restored, self._restored = self._restored, None
            self._guarded("checkpoint state", self._apply_state, restored)
        elif step := _global_step(trainer):
            # trainer.test() after fit(), or a fit resumed from a checkpoint saved
            # without this callback: alerts still carry Lightning's global_step.
            self._guarded("resumed step", monitor.load_state_dict, {"step": step})
        for optimizer in optimizers:
            self._guarded("optimizer watch", monitor.add_optimizer, _unwrap(optimizer))
        # What the run before left (a checkpoint's findings too) was told already.
        self._carried = _findings(reporter) if earlier is not None else None

    def _attach(
        self, pl_module: pl.LightningModule, reporter: Reporter, scaler: Any, step: int
    ) -> Monitor | None:
        """The run's Monitor, as ``tw.watch`` builds it: where building it fails inside
        trainwatch (a module of a kind it mishandles), one with every check off that
        tells the failure once through the run's sinks (console, alerts.jsonl,
        TensorBoard) and counts the steps. None where trainwatch is off for the
        run: the module refused (a ``WatchError``: warned, as a refusal is no bug of
        trainwatch's), or even the stand-in failed (the failure told all the same,
        dated at ``step``)."""
        relay = [reporter.relay()]
        try:
            return Monitor(pl_module, config=self.config, sinks=relay, scaler=scaler)
        except WatchError as exc:
            self._off = True
            warnings.warn(
                f"trainwatch could not start and is off for this run: {exc}", stacklevel=3
            )
            _quietly(reporter.close)
            return None
        except Exception as exc:  # trainwatch's own failure: training goes on
            failure = exc
        try:
            return switched_off_monitor(pl_module, [], self.config, relay, failure)
        except Exception as exc:
            self._off = True
            self._reporter, self._monitor = reporter, None  # closed with the run
            reporter.dispatcher.internal_error(SETUP_COMPONENT, exc, step)
            return None

    def _rank_zero_sinks(
        self, trainer: pl.Trainer, log_dir: Any, pl_module: pl.LightningModule
    ) -> list[Sink]:
        """The default sinks; TensorBoard writes through the logger's writer when there is one."""
        writer = None
        if self.config.tensorboard.enabled:
            logger = next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
            writer = logger.experiment if logger is not None else None
        return default_sinks(
            log_dir, self.config, console=self.console, writer=writer, model=pl_module
        )

    def _stop(self, trainer: pl.Trainer, *, gather: bool) -> None:
        self._off = False
        monitor, reporter = self._monitor, self._reporter
        if monitor is not None and not monitor.closed:
            _quietly(monitor.close)  # lands the last readback into the relay
        if gather:
            gather_to_zero(reporter if reporter is not None and not reporter.closed else None)
        if reporter is not None and not reporter.closed:
            if reporter.idle is not None and not self._trained_without_a_step(trainer):
                reporter.idle = None
            if reporter.outbox is not None and reporter.outbox.pending:
                self._report_undelivered(reporter)
            if self._carried is not None and _findings(reporter) <= self._carried:
                # The run before already told these (an evaluation seeing one of
                # them again counts it): no summary saying them again.
                _quietly(_without_summary, reporter)
            _quietly(reporter.close)

    def _trained_without_a_step(self, trainer: pl.Trainer) -> bool:
        """Whether the monitor's closing note (the model ran, no step was watched) is
        this run's story, as it is a plain loop's under ``tw.watch``: a fit that ran
        training batches, none of which stepped an optimizer (manual optimisation
        that never calls ``opt.step()``, every step skipped by the GradScaler).

        Not for an evaluation run (``validate``, ``test``, ``predict``: no step is
        due), a fit that ran no training batch (``limit_train_batches=0``, a tuner's
        trial steps alone, undone after: Lightning says so itself), one that ended
        in an exception (its traceback is the story), nor one whose only optimizer
        is Lightning's stand-in for none (``configure_optimizers`` returned None):
        "its optimizer never stepped" would name an optimizer the user never made."""
        if self._failed or trainer.state.fn != "fit" or self._monitor is None:
            return False
        if not any(_holds_parameters(opt) for opt in self._monitor.optimizers):
            return False
        return _training_batches_run(trainer) > 0

    def _report_undelivered(self, reporter: Reporter) -> None:
        """A rank that can no longer reach rank zero says what it saw itself."""
        if self.console is False or reporter.outbox is None:
            return
        stream = sys.stderr if self.console is True else self.console
        sink = ConsoleSink(stream, summary=False)
        for record in reporter.outbox.take():
            _quietly(sink.emit, Alert.from_dict(record))

    # -- the step ------------------------------------------------------------
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        monitor = self._monitor
        if monitor is not None and not monitor.closed and monitor.optimizers:
            # Always before this step's backward: the loss of the step in progress.
            self._guarded("loss", monitor.record_loss, loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        monitor = self._monitor
        if monitor is not None and not monitor.closed:
            # After backward, before Lightning clips: norms of what the model produced.
            # Under a GradScaler ("16-mixed") the step comes after this, without a
            # closure (``scaler.step(optimizer)``): its pre-hook keeps this gathering.
            held = getattr(trainer.precision_plugin, "scaler", None) is not None
            monitor.collect_before_step(_unwrap(optimizer), hold=held)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._batches += 1
        every = self.config.distributed.gather_every
        if every and self._batches % every == 0:
            gather_to_zero(self._reporter)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gather_to_zero(self._reporter)

    # -- phases: the seam for mode rules -------------------------------------
    def _enter(self, phase: Phase) -> None:
        """Lightning sets train()/eval() at these boundaries; mode rules will read this."""
        self._phase = phase

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("sanity_check")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("train")
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return
        # A new pass over the training data: its batches may be of another make.
        self._guarded("training data", monitor.data_restarted)
        if not _overfitting(trainer):
            # Loaded by now (reloaded each epoch with reload_dataloaders_every_n_epochs).
            for loader in _loaders(trainer.train_dataloader):
                self._guarded("training data", monitor.watch_data, loader)
                if monitor.data_order is not None:
                    break

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("sanity_check" if trainer.sanity_checking else "validate")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("train" if trainer.state.fn == "fit" else "validate")

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("test")

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("predict")

    # -- checkpoints and pickling --------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._monitor is None or self._reporter is None:
            return dict(self._restored or {})
        return {
            "monitor": self._monitor.state_dict(),
            "reported": self._reporter.dispatcher.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start on most strategies.
        if self._monitor is not None and not self._monitor.closed:
            if self._monitor.in_trial:
                # A tuner loading back the checkpoint it saved before its trial steps
                # (a LearningRateFinder run inside the fit): the monitor goes back to
                # where they began, and their findings, which went nowhere, with it.
                self._guarded("tuner trial", self._monitor.end_trial)
                return
            self._guarded("checkpoint state", self._apply_state, state_dict)
        else:
            self._restored = dict(state_dict)

    def _apply_state(self, state: dict[str, Any]) -> None:
        if self._monitor is not None and "monitor" in state:
            self._monitor.load_state_dict(state["monitor"])
        if self._reporter is not None and "reported" in state:
            restored = self._reporter.dispatcher.load_state_dict(state["reported"])
            self._reporter.memory.alerts.extend(restored)

    def _guarded(self, what: str, fn: Any, *args: Any) -> None:
        """Training goes on whatever trainwatch does. A failure of its own is told
        once, as an ``internal_error`` through the run's sinks (the component:
        ``lightning callback: <what>``); a Python warning only where no monitor is
        open to tell it. A refusal (``WatchError``: an optimizer over another
        model's parameters) is the user's to hear, not a bug of trainwatch's: a
        warning, as before."""
        monitor = self._monitor
        try:
            fn(*args)
        except TrainingHealthError:
            raise
        except WatchError as exc:
            warnings.warn(f"trainwatch: {exc}", stacklevel=3)
        except Exception as exc:
            if monitor is not None and not monitor.closed:
                monitor.internal_failure(f"lightning callback: {what}", exc)
            else:
                warnings.warn(f"trainwatch: {exc!r}", stacklevel=3)

    def __getstate__(self) -> dict[str, Any]:
        """Hooks, open files and a live console do not travel: a copy starts fresh."""
        state = dict(self.__dict__)
        state["_monitor"] = None
        state["_reporter"] = None
        if not isinstance(self.console, bool) and not isinstance(self.console, io.StringIO):
            state["console"] = True
        return state


def _carry(earlier: Reporter, later: Reporter) -> None:
    """An evaluation run of the same callback (``trainer.validate()`` or ``test()``
    after ``fit()``) goes on from the earlier run's alerts: ``alerts`` still holds
    them, a repeat of one is counted as a repeat, and the counts written when the
    later run ends (``alert_counts.json``) include them. A later ``fit()`` does not:
    it trains a model of its own, whose findings are all news."""
    later.dispatcher.load_state_dict(earlier.dispatcher.state_dict())
    later.memory.alerts.extend(earlier.memory.alerts)


def _findings(reporter: Reporter) -> set[Any]:
    """The findings told so far: an evaluation run that adds none told nothing new.

    Their keys, not their counts: ``test()`` audits its first passes afresh and
    meets the fit's broadcast again (the same op, line and shapes in a shared
    loss), which counts it once more but is no news.
    """
    return set(reporter.dispatcher.tallies)


def _without_summary(reporter: Reporter) -> None:
    for sink in reporter.dispatcher.sinks:
        if isinstance(sink, ConsoleSink):
            sink.print_summary = False


def _global_step(trainer: pl.Trainer) -> int:
    """Lightning's global step, that of the checkpoint being resumed included.

    ``on_fit_start`` comes after the checkpoint is loaded but before the loops'
    progress is restored from it: ``trainer.global_step`` still reads 0 there.
    """
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None)
    resumed = loaded.get("global_step", 0) if isinstance(loaded, dict) else 0
    return max(trainer.global_step, int(resumed or 0))


def _training_batches_run(trainer: pl.Trainer) -> int:
    """Training batches the fit ran, as Lightning counts them: a tuner's trial batches
    are not among them once it loads its checkpoint back."""
    try:
        return int(trainer.fit_loop.epoch_loop.batch_progress.total.completed)
    except Exception:  # a loop of another shape: say nothing rather than guess
        return 0


def _holds_parameters(optimizer: Optimizer) -> bool:
    """Lightning's stand-in for no optimizer (``_MockOptimizer``) holds none."""
    return any(group["params"] for group in optimizer.param_groups)


def _unwrap(optimizer: Any) -> Any:
    """A LightningOptimizer wraps the torch one: hooks live on the torch optimizer."""
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, Optimizer) else optimizer


def _overfitting(trainer: pl.Trainer) -> bool:
    """``Trainer(overfit_batches=...)``: Lightning swaps a ``SequentialSampler`` into
    the training loader itself (the same few batches every epoch, a debugging run),
    so reading in order is its choice, not the user's loader's."""
    return bool(getattr(trainer, "overfit_batches", 0))


def _loaders(value: Any) -> list[Any]:
    """The training loaders: one, or the values of a list or dict of them."""
    if value is None:
        return []
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _quietly(fn: Any, *args: Any) -> None:
    """Training goes on whatever trainwatch's own bookkeeping does (where no open
    monitor can tell a failure: closing, an exception on its way out)."""
    try:
        fn(*args)
    except TrainingHealthError:
        raise
    except Exception as exc:
        warnings.warn(f"trainwatch: {exc!r}", stacklevel=2)
