"""What a model is called where alerts of several models share one place.

``trainwatch run`` names each model it watches by its class; a second model
of the same class is ``Net#2``. A log dir that several ``tw.watch`` monitors
of one process write into names its models the same way
(``trainwatch/sinks/shared_log_dir.py``), so a report reads both alike.
"""

from __future__ import annotations

from torch import nn

from trainwatch.compiled import unwrap


def class_name(model: nn.Module) -> str:
    """The model's class; a compiled model's is the class it wraps (not ``OptimizedModule``)."""
    return type(unwrap(model)).__name__


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base#2``, ``base#3``... : the first not in ``taken``, which gets it."""
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}#{n}"
    taken.add(name)
    return name
