"""The sinks every entry point opens (``tw.watch``, the Lightning callback, ``trainwatch run``).

One place decides their order: files first (alerts.jsonl, then TensorBoard),
the console last. Sinks are called in list order, so an alert is on disk
before it is printed, and at close a shutdown that stalls on the console has
closed the files already. What differs between the entry points (where the
files go, where the console writes, whose SummaryWriter to use) is an argument.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

from torch import nn

from trainwatch.config import Config
from trainwatch.sinks.base import Sink, Summary
from trainwatch.sinks.console import ConsoleSink
from trainwatch.sinks.jsonl import JsonlSink


def default_sinks(
    log_dir: str | os.PathLike[str] | None,
    config: Config,
    *,
    console: bool | IO[str] = True,
    writer: Any = None,
    model: nn.Module | None = None,
) -> list[Sink]:
    """alerts.jsonl and TensorBoard (when there is somewhere to write them), then the console.

    ``console``: True for stderr, False for none, or a text stream. ``writer``:
    an open ``SummaryWriter`` to write TensorBoard through (the Lightning
    logger's, which stays its owner); without one, TensorBoard gets its own
    writer in ``log_dir``. ``model``: the one model whose alerts they carry,
    named in alerts.jsonl once another model writes there too (None: the
    alerts name their models already, as ``trainwatch run``'s). Raises
    ``OSError`` when ``log_dir`` cannot be written; the files opened by then
    are closed again.
    """
    sinks: list[Sink] = []
    try:
        if log_dir is not None:
            sinks.append(JsonlSink(Path(log_dir), model))
        if config.tensorboard.enabled and (writer is not None or log_dir is not None):
            sinks.append(_tensorboard_sink(log_dir, config, writer))
    except BaseException:
        for sink in sinks:
            sink.close(Summary(steps=0, tallies=[], latest_norms={}))
        raise
    if console is not False:
        stream = None if console is True else console  # None: the ConsoleSink's stderr
        view = config.console
        sinks.append(ConsoleSink(stream, summary=view.summary, top_layers=view.top_layers))
    return sinks


def _tensorboard_sink(log_dir: str | os.PathLike[str] | None, config: Config, writer: Any) -> Sink:
    """Imported here, so ``import trainwatch`` does not pull in TensorBoard."""
    from trainwatch.sinks.tensorboard import TensorBoardSink

    if writer is not None:
        return TensorBoardSink(writer, config.tensorboard, halt_on=config.halt_on)
    assert log_dir is not None
    return TensorBoardSink.in_dir(Path(log_dir), config.tensorboard, halt_on=config.halt_on)
