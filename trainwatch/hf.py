"""``TrainWatchCallback``: the Hugging Face ``transformers.Trainer`` adapter over the same Monitor.

The only module that imports ``transformers``. What the Trainer does, and how
the callback meets it:

* The Trainer clips the gradients before ``on_pre_optimizer_step``, and when
  no ``max_grad_norm`` is set it still measures the norm with
  ``clip_grad_norm_(..., inf)``, which scales every gradient by
  ``min(inf / total, 1)``: a non-finite total makes every gradient NaN and
  erases where the NaN came from. So the callback gathers the gradients at the
  end of the step's last backward pass instead: one post-accumulate-grad hook
  on one trainable parameter queues an autograd end-of-backward callback, and
  there, when ``accelerate`` says this micro-batch syncs (the last one of the
  accumulation), the step's gradients are gathered, before any clipping.
* fp16 with a ``GradScaler``: the gradients are still scaled where backward
  ends, so they are gathered as in a plain AMP loop: just before the Trainer's
  ``clip_grad_norm_`` rescales them, once unscaled (in the optimizer's step
  hook when nothing clips); skipped steps are the scaler's own and stay
  silent. bf16 and fp32 are gathered where backward ends.
* Gradient accumulation: the optimizer steps once per ``gradient_accumulation_steps``
  micro-batches, so the Monitor's steps are ``state.global_step``.
* ``halt_on``: the alert is on disk when the Trainer's step ends; the callback
  then sets ``control.should_training_stop``, the Trainer ends its loop cleanly
  (checkpoint callbacks, loggers and this monitor close) and
  ``TrainingHealthError`` is raised from ``on_train_end`` (``raise_on_halt=False``
  stops without raising). Under ``torch.distributed`` every rank checks at
  each step's end whether any rank halted (one one-number all-reduce, as
  ``tw.watch`` does) and all stop at that step with the first rank's alert.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import weakref
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.optim import Optimizer
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainwatch import store_relay
from trainwatch.alert import Alert
from trainwatch.config import Config, load_config
from trainwatch.errors import TrainingHealthError, WatchError
from trainwatch.halt_sync import HaltSync, running_distributed
from trainwatch.monitor import Monitor
from trainwatch.optimizer_wrappers import inner_optimizer
from trainwatch.sinks import Sink, default_sinks
from trainwatch.sinks.base import Summary
from trainwatch.switched_off import switched_off_monitor


class TrainWatchCallback(TrainerCallback):
    """Watches a ``transformers.Trainer``'s model; add it to ``Trainer(callbacks=[...])``.

    Alerts go to the console and to ``alerts.jsonl`` in ``log_dir``, else in
    the directory the Trainer's TensorBoard integration writes to (when
    ``report_to`` includes ``"tensorboard"``, which also gets the alerts and
    gradient norms), else in ``output_dir``.
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
        console: bool | IO[str] = True,
        raise_on_halt: bool = True,
        **overrides: Any,
    ) -> None:
        # Validate now, so a typo fails when the callback is built, not mid-train.
        self.config = load_config(config, overrides)
        self.log_dir = log_dir
        self.console = console
        self.raise_on_halt = raise_on_halt
        self._monitor: Monitor | None = None
        self._halt = _HaltWatch(self.config.halt_on)
        self._backward_end: _BackwardEnd | None = None
        # Under torch.distributed with halt_on: every rank stops at the same step.
        self._sync: HaltSync | None = None

    # -- public surface ------------------------------------------------------
    @property
    def alerts(self) -> list[Alert]:
        """The latest ``train()``'s alerts, oldest first: each ``train()`` is a run of its own."""
        return self._monitor.alerts if self._monitor is not None else []

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor of the current (or last) run; None before ``train()`` starts."""
        return self._monitor

    # -- starting and stopping -------------------------------------------------
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self._monitor is not None and not self._monitor.closed:
            return
        if model is None:
            return
        self._halt.found = None
        sinks: list[Sink] = []
        try:
            # Under DDP the other ranks post their alerts to rank zero through the
            # process group's store (trainwatch/store_relay.py).
            link = store_relay.watch_relay(self.config)
            if link is not None and link.rank != 0:
                sinks = [store_relay.RankSender(link, self.console)]
            elif state.is_world_process_zero:
                log_dir, tensorboard = self._where(args)
                config = self.config
                if not tensorboard and config.tensorboard.enabled:
                    config = dataclasses.replace(
                        config, tensorboard=dataclasses.replace(config.tensorboard, enabled=False)
                    )
                sinks = default_sinks(log_dir, config, console=self.console, model=model)
            torch_optimizer = _unwrap(optimizer)
        except Exception as exc:  # no sink to tell it through: never break training
            self._off(sinks, exc)
            return
        # The halt is applied at the step's end, through the Trainer's own
        # control flow: the Monitor itself never raises inside optimizer.step.
        quiet_config = dataclasses.replace(self.config, halt_on=[])
        scaler = getattr(optimizer, "scaler", None)
        sinks = [*sinks, self._halt]
        try:
            monitor = Monitor(model, config=quiet_config, sinks=sinks, scaler=scaler)
            standing_in = False
        except WatchError as exc:  # the model refused: the user's to hear, no bug of ours
            self._off(sinks, exc)
            return
        except Exception as exc:  # trainwatch's own failure: told once, training goes on
            try:
                monitor = switched_off_monitor(model, [], quiet_config, sinks, exc)
            except Exception as failure:
                self._off(sinks, failure)
                return
            standing_in = True
        if state.global_step:
            # A resumed run: steps continue from the checkpoint's.
            _guarded(monitor, "resumed step", monitor.load_state_dict, {"step": state.global_step})
        if torch_optimizer is not None:
            _guarded(monitor, "optimizer watch", monitor.add_optimizer, torch_optimizer)
        if link is not None:
            _guarded(monitor, "rank relay", store_relay.join, monitor, link, self.console)
        self._monitor = monitor
        self._sync = None
        if self.config.halt_on and running_distributed():
            self._sync = HaltSync(self.config.distributed.halt_check_every)
        if (
            torch_optimizer is not None
            and monitor.optimizers
            and not standing_in
            and not getattr(scaler, "_enabled", False)
        ):
            # With fp16's GradScaler the gradients are still scaled when backward
            # ends (unscaled just before clipping): its overflows, routine and
            # skipped, would look like NaN gradients. They are gathered in the
            # optimizer's step hook instead, like a plain AMP loop's.
            self._backward_end = _BackwardEnd.attach(monitor, torch_optimizer)

    def _off(self, sinks: list[Sink], exc: BaseException) -> None:
        """trainwatch is off for this run: where no sink was opened to tell it through
        (or the model refused, a ``WatchError``, or even the stand-in monitor failed),
        a Python warning says so, and the sinks opened close."""
        for sink in sinks:
            try:
                sink.close(Summary(steps=0, tallies=[], latest_norms={}))
            except Exception:
                pass
        warnings.warn(f"trainwatch could not start and is off for this run: {exc}", stacklevel=3)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._stop()
        halt = self._halt.found
        if halt is not None and self.raise_on_halt:
            self._halt.found = None
            raise TrainingHealthError(halt)

    def _stop(self) -> None:
        if self._backward_end is not None:
            self._backward_end.detach()
            self._backward_end = None
        monitor = self._monitor
        if monitor is not None and not monitor.closed:
            try:
                monitor.close()
            except Exception as exc:
                warnings.warn(f"trainwatch: {exc!r}", stacklevel=2)

    def _where(self, args: TrainingArguments) -> tuple[Path, bool]:
        """Where alerts.jsonl goes, and whether TensorBoard gets the alerts too."""
        report_to = args.report_to or []
        tensorboard = "tensorboard" in (report_to if isinstance(report_to, list) else [report_to])
        if self.log_dir is not None:
            return Path(self.log_dir), tensorboard
        if tensorboard:
            return _tensorboard_dir(args), True
        return Path(args.output_dir), False

    # -- the step ----------------------------------------------------------------
    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # A new pass over the training data: its batches may be of another make
        # (a collator or tokenizer changed by a callback of the user's).
        monitor = self._monitor
        if monitor is not None and not monitor.closed:
            try:
                monitor.data_restarted()
            except Exception as exc:
                warnings.warn(f"trainwatch: {exc!r}", stacklevel=2)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        sync = self._sync
        if sync is not None:
            # Every rank, every step: one rank stopping alone would leave the
            # others waiting in their next collective.
            if self._halt.found is not None:
                sync.hold(TrainingHealthError(self._halt.found))
            try:
                sync.at_step(state.global_step - 1)
            except TrainingHealthError as halt:
                self._halt.found = halt.alert  # the first rank's, stamped with it
        if self._halt.found is not None:
            control.should_training_stop = True

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Under torch.distributed the ranks stop together, at a step's end.
        if self._halt.found is not None and self._sync is None:
            control.should_training_stop = True

    # -- pickling --------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Hooks and open files do not travel: a copy starts fresh."""
        state = dict(self.__dict__)
        state["_monitor"] = None
        state["_backward_end"] = None
        state["_sync"] = None
        if not isinstance(self.console, bool):
            state["console"] = True
        return state


class _HaltWatch(Sink):
    """Notes the first alert whose rule is in ``halt_on``; the callback acts on it."""

    name = "halt"

    def __init__(self, halt_on: list[str]) -> None:
        self.halt_on = frozenset(halt_on)
        self.found: Alert | None = None

    def emit(self, alert: Alert) -> None:
        if self.found is None and alert.rule in self.halt_on:
            self.found = alert


class _BackwardEnd:
    """Gathers the step's gradients where its last backward pass ends, before clipping.

    One post-accumulate-grad hook on one trainable parameter the optimizer
    holds (it fires in every backward that reaches the model) queues one
    end-of-backward callback; there, only on the micro-batch ``accelerate``
    syncs, the Monitor gathers. A backward that does not reach that parameter
    leaves the gathering to the optimizer's step hook (after clipping).
    """

    def __init__(self, monitor: Monitor, optimizer: Optimizer) -> None:
        self.monitor = weakref.ref(monitor)
        self.optimizer = weakref.ref(optimizer)
        self.queued = False
        self.handle: Any = None
        self.failed = False

    @classmethod
    def attach(cls, monitor: Monitor, optimizer: Optimizer) -> _BackwardEnd | None:
        anchor = next(
            (
                p
                for group in optimizer.param_groups
                for p in group["params"]
                if isinstance(p, torch.Tensor) and p.requires_grad
            ),
            None,
        )
        if anchor is None:
            return None
        end = cls(monitor, optimizer)
        end.handle = anchor.register_post_accumulate_grad_hook(end._reached)
        return end

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _reached(self, param: torch.Tensor) -> None:
        if self.queued or self.failed:
            return
        self.queued = True
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)
        except Exception as exc:  # never break the user's backward
            self.queued = False
            self._fail(exc)

    def _ended(self, after_reducer: bool = False) -> None:
        if not after_reducer and running_distributed():
            # DDP's reducer queues its own end-of-backward callback (copying the
            # all-reduced gradients in) when its last bucket is ready, after this
            # one was queued; callbacks queued while callbacks run come after it.
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._after_reducer)
                return
            except Exception as exc:  # never break the user's backward
                self.queued = False
                self._fail(exc)
                return
        self.queued = False
        monitor, optimizer = self.monitor(), self.optimizer()
        if monitor is None or optimizer is None or monitor.closed or not _syncs_now():
            return
        try:
            monitor.collect_before_step(optimizer, hold=True)
        except TrainingHealthError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _after_reducer(self) -> None:
        self._ended(after_reducer=True)

    def _fail(self, exc: BaseException) -> None:
        self.failed = True
        warnings.warn(f"trainwatch: gathering at backward's end is off: {exc!r}", stacklevel=2)


def _guarded(monitor: Monitor, what: str, fn: Any, *args: Any) -> None:
    """Training goes on whatever trainwatch does while the callback attaches. A failure
    of its own is told once, as an ``internal_error`` through the run's sinks (the
    component: ``hf callback: <what>``); a refusal (``WatchError``: an optimizer over
    another model's parameters) is the user's to hear, as a warning."""
    try:
        fn(*args)
    except WatchError as exc:
        warnings.warn(f"trainwatch: {exc}", stacklevel=3)
    except Exception as exc:
        monitor.internal_failure(f"hf callback: {what}", exc)


def _syncs_now() -> bool:
    """Whether this micro-batch is the last of its accumulation (the Trainer sets it).

    ``accelerate``'s ``GradientState`` is shared by every instance; without
    it, every backward's end is taken for a step's last.
    """
    try:
        from accelerate.state import GradientState

        return bool(GradientState().sync_gradients)
    except Exception:
        return True


def _tensorboard_dir(args: TrainingArguments) -> Path:
    """The directory the Trainer's TensorBoard integration writes to.

    ``TENSORBOARD_LOGGING_DIR`` when set; otherwise it makes
    ``output_dir/runs/<time>_<host>`` as training begins, before this
    callback's turn: the newest such directory.
    """
    env = os.environ.get("TENSORBOARD_LOGGING_DIR")
    if env:
        return Path(env).expanduser()
    runs = Path(args.output_dir) / "runs"
    found = [p for p in runs.iterdir() if p.is_dir()] if runs.is_dir() else []
    if found:
        return max(found, key=lambda p: p.stat().st_mtime)
    return Path(args.output_dir)


def _unwrap(optimizer: Any) -> Optimizer | None:
    """``accelerate``'s ``AcceleratedOptimizer`` (an ``Optimizer`` itself) wraps the
    torch one, whose ``step`` runs: hooks live there."""
    optimizer = inner_optimizer(optimizer)
    return optimizer if isinstance(optimizer, Optimizer) else None
