"""``tw.watch``: the plain loop's way in.

It checks its arguments and the model before anything is opened, opens the
default sinks, builds the Monitor and has SIGTERM close it. The Lightning
callback and ``trainwatch run`` build their Monitors themselves; what they
share with this (the checks, the sinks, the stand-in monitor with every
check off that a failure to attach leaves) lives in modules of its own.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import IO, Any

from torch import nn
from torch.optim import Optimizer

from trainwatch import store_relay, termination
from trainwatch.config import Config, load_config
from trainwatch.errors import WatchError
from trainwatch.monitor import Monitor
from trainwatch.preflight import preflight
from trainwatch.sinks import Sink, default_sinks
from trainwatch.switched_off import switched_off_monitor


def watch(
    model: nn.Module,
    optimizer: Optimizer | Iterable[Optimizer] | None = None,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
    console: bool | IO[str] = True,
    scaler: Any = None,
    data: Any = None,
    **overrides: Any,
) -> Monitor:
    """Attach trainwatch to a model (and its optimizers) now; returns the Monitor.

    ``console`` may also be a text stream to write the console view to.
    ``scaler``: the loop's ``torch.amp.GradScaler``; with it the AMP check also
    warns when the loss scale falls below 1 (even unscaled gradients overflow).
    ``data``: the training ``DataLoader``; with it a loader that reads its data
    in order (``shuffle=False``) is reported.
    """
    cfg = load_config(config, overrides)
    if optimizer is None:
        optimizers: list[Optimizer] = []
    elif isinstance(optimizer, Optimizer):
        optimizers = [optimizer]
    elif isinstance(optimizer, Iterable) and not isinstance(optimizer, (str, bytes)):
        optimizers = list(optimizer)
    else:
        optimizers = [optimizer]  # refused by preflight, naming its type
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise WatchError(
            f"log_dir: expected a path (str or os.PathLike), got {type(log_dir).__name__}"
        )
    if not (isinstance(console, bool) or hasattr(console, "write")):
        raise WatchError(
            f"console: expected True, False or a text stream, got {type(console).__name__}"
        )
    if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
        raise WatchError(f"scaler: expected a torch.amp.GradScaler, got {type(scaler).__name__}")
    if data is not None and not hasattr(data, "__iter__"):
        raise WatchError(f"data: expected the training DataLoader, got {type(data).__name__}")
    preflight(model, optimizers)
    # Under a process group of more than one rank, rank zero alone writes and
    # prints; the other ranks post their alerts to it (trainwatch/store_relay.py).
    link = store_relay.watch_relay(cfg)
    if link is not None and link.rank != 0:
        sinks: list[Sink] = [store_relay.RankSender(link, console)]
    else:
        try:
            sinks = default_sinks(log_dir, cfg, console=console, model=model)
        except OSError as exc:
            raise WatchError(f"log_dir: cannot write alerts into {str(log_dir)!r}: {exc}") from None
    try:
        monitor = Monitor(model, optimizers, config=cfg, sinks=sinks, scaler=scaler, data=data)
    except WatchError:
        raise
    except Exception as exc:  # trainwatch's own failure: training goes on, unwatched
        monitor = switched_off_monitor(model, optimizers, cfg, sinks, exc)
    if not optimizers:
        # An optimizer the loop steps but forgot to pass (and no monitor.step()).
        monitor.watch_optimizer_not_given()
    if link is not None:
        store_relay.join(monitor, link, console)
    # A plain loop owns its process: SIGTERM closes the monitor before the
    # process dies (trainwatch/termination.py). Frameworks with a SIGTERM
    # handler of their own (Lightning) keep theirs.
    termination.hold(monitor)
    return monitor
