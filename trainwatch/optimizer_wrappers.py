"""The torch optimizer inside the wrappers training libraries put around it.

Lightning's ``LightningOptimizer`` is a dynamic subclass of the wrapped
optimizer's class holding a copy of its ``__dict__`` (``_optimizer``: the
wrapped one); accelerate's ``AcceleratedOptimizer`` subclasses ``Optimizer``
without running its ``__init__`` (no hook tables of its own) and holds the
wrapped one as ``optimizer``, whose ``step`` runs only on the steps that apply
an update. Both show the wrapped optimizer's own ``param_groups``: that is
what tells a wrapper sharing its state from an optimizer that merely has an
attribute of that name. Hooks go on the innermost one, and watching both
would count every step twice.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

_WRAPPED = ("_optimizer", "optimizer")  # Lightning's, accelerate's


def inner_optimizer(optimizer: Any) -> Any:
    """The innermost torch optimizer sharing ``optimizer``'s param groups (itself if none)."""
    while True:
        own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
        for name in _WRAPPED:
            inner = own.get(name)
            if (
                isinstance(inner, Optimizer)
                and inner is not optimizer
                and getattr(optimizer, "param_groups", None) is inner.param_groups
            ):
                optimizer = inner
                break
        else:
            return optimizer
