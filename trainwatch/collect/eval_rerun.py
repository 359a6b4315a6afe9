"""One module run again in eval mode, as training would never see it.

A module that draws random numbers in training mode (a stochastic-depth
``DropPath``: ``x * mask / keep`` with a Bernoulli mask) behaves differently
in training mode only if its draws stop in eval mode; noise injected in both
modes (a VAE's reparameterisation, an augmentation inside the model) does
not. No module type says which, and a loop that forgets ``model.eval()``
never runs it in eval mode: the functional-mode look runs it once more,
itself and its parts in eval mode, to see.

The re-run changes nothing of training: torch's, Python's and numpy's
generators are forked, and so are those the module holds or is handed
(a VAE's ``self.gen``), buffers swapped for copies, whatever the forward
changes in the modules' state is put back (``UndoneEffects``), the user's
forward hooks are held off, gradients are off, and trainwatch's collectors
see no pass of it (``quiet.replay``).
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch import nn

from trainwatch.collect.rerun_effects import UndoneEffects, call_arguments
from trainwatch.collect.rerun_guard import rerun_guarded
from trainwatch.collect.tensors import detached_copies

_TRAINING = attrgetter("training")


def run_in_eval(module: nn.Module, args: Any, kwargs: Any) -> bool:
    """Call ``module(*args, **kwargs)`` once more, it and its parts in eval mode,
    under no_grad; whether the call ran to its end (a module that cannot run
    again, or whose change to its state could not be put back, did not)."""
    subs = list(module.modules())
    modes = list(map(_TRAINING, subs))
    arguments = call_arguments(args, kwargs)
    devices = sorted(
        {
            t.device.index or 0
            for t in arguments
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"
        }
    )
    effects = UndoneEffects(subs, arguments)
    try:
        with rerun_guarded(module, subs, devices, effects):
            for sub in subs:
                sub.training = False
            module(*detached_copies(args), **detached_copies(kwargs or {}))
    except Exception:
        return False  # training is untouched either way
    finally:
        for sub, mode in zip(subs, modes):
            sub.training = mode
    return not effects.lasting
