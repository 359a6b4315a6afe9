"""The console note for parameters of the watched model that an optimizer not given trains.

No alert: nothing is wrong with the training (``opt_d`` steps the discriminator
every iteration), only the monitor follows less of it than the loop trains. See
:mod:`trainwatch.collect.updated_elsewhere` for how it is found.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainwatch.layers import ParamInfo
from trainwatch.rules.base import short_names
from trainwatch.rules.trainable_parameters import common_module


def trained_elsewhere_words(
    params: Sequence[ParamInfo], optimizers: Sequence[str], model: str
) -> str:
    """The console note for parameters an optimizer the monitor was not given trains."""
    modules = list(dict.fromkeys(p.owner for p in params))
    where = common_module(modules) or model
    kinds = " and ".join(optimizers) or "an optimizer"
    count = len(params)
    return (
        f"trainwatch: {count} parameter{'s' if count != 1 else ''} of the watched {model} "
        f"({short_names(params)}, in {where}) {'are' if count != 1 else 'is'} updated by "
        f"{kinds}, an optimizer not passed to tw.watch: {'their' if count != 1 else 'its'} "
        "gradients and steps are not followed. Pass it too (tw.watch(model, [opt_g, opt_d]), "
        "or monitor.add_optimizer(optimizer)) to have them checked."
    )
