"""A monitor with every check off, standing in for one that failed to attach.

Building the full Monitor can fail inside trainwatch (a model of a kind it does
not yet handle). The script must not die of it, and the user must hear of it
where trainwatch's findings go (console, alerts.jsonl, TensorBoard), not in a
Python warning: ``tw.watch`` and the Lightning callback both build this
instead, which counts the steps, reports the failure once as an
``internal_error`` and closes with the usual summary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch import nn
from torch.optim import Optimizer

from trainwatch.config import Config
from trainwatch.monitor import Monitor
from trainwatch.rules import RULE_IDS
from trainwatch.sinks import Sink

# The component the failure is reported under (``data.component`` of the alert).
SETUP_COMPONENT = "monitor setup (every check is off)"


def switched_off_monitor(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    config: Config,
    sinks: Sequence[Sink],
    exc: Exception,
) -> Monitor:
    """A monitor with every rule off (no collector attached), reporting ``exc`` once.

    If even this fails, ``exc`` (the original failure) is raised.
    """
    off = dataclasses.replace(
        config,
        **{
            name: dataclasses.replace(getattr(config, name), enabled=False)
            for name in RULE_IDS
            if hasattr(getattr(config, name, None), "enabled")
        },
    )
    try:
        monitor = Monitor(model, list(optimizers), config=off, sinks=list(sinks))
    except Exception:
        raise exc from None
    monitor.internal_failure(SETUP_COMPONENT, exc)
    return monitor
