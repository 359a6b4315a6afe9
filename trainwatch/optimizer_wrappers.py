"""The torch optimizer inside the wrappers training libraries put around it.

Lightning's ``LightningOptimizer`` is a dynamic subclass of the wrapped
optimizer's class holding a copy of its ``__dict__`` (``_optimizer``: the
wrapped one); accelerate's ``AcceleratedOptimizer`` subclasses ``Optimizer``
without running its ``__init__`` (no hook tables of its own) and holds the
wrapped one as ``optimizer``, whose ``step`` runs only on the steps that apply
an update. SAM holds the optimizer that updates the weights as
``base_optimizer`` and steps it once after its two backward passes (the
wrapper's own ``step`` may never run: ``first_step``/``second_step``);
Lookahead (timm's, often copied without ``Optimizer.__init__``) holds it as
``_base_optimizer`` or ``optimizer``. All of them train the wrapped
optimizer's own parameters: that is what tells a wrapper from an optimizer
that merely has an attribute of that name. Hooks go on the innermost one, and
watching both would count every step twice.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

# Lightning's, accelerate's and torch-optimizer's Lookahead, SAM's, timm's Lookahead
_WRAPPED = ("_optimizer", "optimizer", "base_optimizer", "_base_optimizer")


def inner_optimizer(optimizer: Any) -> Any:
    """The innermost torch optimizer training ``optimizer``'s parameters (itself if none)."""
    while True:
        own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
        for name in _WRAPPED:
            inner = own.get(name)
            if (
                isinstance(inner, Optimizer)
                and inner is not optimizer
                and _trains_same(optimizer, inner)
            ):
                optimizer = inner
                break
        else:
            return optimizer


def _trains_same(wrapper: Any, inner: Optimizer) -> bool:
    """Whether ``inner`` shares ``wrapper``'s param groups or holds the same parameters.

    SAM built over its own groups (``base_optimizer(self.param_groups)``)
    holds the same group dicts in a list of its own.
    """
    groups = getattr(wrapper, "param_groups", None)
    if groups is inner.param_groups:
        return True
    if not isinstance(groups, list):
        return False
    try:
        mine = {id(p) for group in groups for p in group["params"]}
    except (KeyError, TypeError):
        return False
    theirs = {id(p) for group in inner.param_groups for p in group["params"]}
    return bool(mine) and mine == theirs


def takes_step_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer`` has the tables its own step hooks go in.

    A subclass that never ran ``Optimizer.__init__`` has none (nor, unless
    another instance of its class ran it, a ``step`` that runs hooks).
    """
    own = vars(optimizer) if hasattr(optimizer, "__dict__") else {}
    return "_optimizer_step_pre_hooks" in own and "_optimizer_step_post_hooks" in own
