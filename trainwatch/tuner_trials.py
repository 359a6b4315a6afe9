"""A Lightning tuner's trial steps: training steps that are no part of the fit.

Lightning's learning-rate finder (``Tuner.lr_find``, the ``LearningRateFinder``
callback, run before a fit or inside one at chosen epochs) and its batch-size
scaler (``Tuner.scale_batch_size``, ``BatchSizeFinder``) save a checkpoint, run
the fit loop for a few trial steps, then load that checkpoint back: weights,
optimizer state and ``global_step`` return to where they were. The range test
raises the learning rate until the loss diverges, on purpose. A monitor that
judged those steps would warn of exploding gradients the fit never had, learn
their divergence as the model's gradient history and date the fit's steps after
them; so a monitor sets them aside (``Monitor.begin_trial``) from the tuner's
checkpoint save, or from its first step inside one, to the load that undoes them.

Told by the tuner's code on the stack, the one thing every way into it shares;
asked only when an optimizer's state is saved or an optimizer is first watched,
never per step.
"""

from __future__ import annotations

import sys
from typing import Any

# Where Lightning keeps its tuners (the package under both of its names).
_TUNER = ("/lightning/pytorch/tuner/", "/pytorch_lightning/tuner/")
# Frames looked through: a trial's optimizer step sits some 40 frames below the
# tuner's own, inside the fit loop.
_DEPTH = 160


def tuner_trial_running() -> bool:
    """Whether a Lightning tuner runs trial steps of a fit now (the caller is inside
    one, or inside its checkpoint save before them).

    A tuner run for ``validate`` or ``test`` (a batch size for evaluation) takes no
    optimizer step and loads no optimizer back: it is left alone.
    """
    if "lightning.pytorch" not in sys.modules and "pytorch_lightning" not in sys.modules:
        return False
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return False
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(part in name for part in _TUNER):
            return _fitting(frame.f_locals.get("trainer"))
        frame = frame.f_back
    return False


def _fitting(trainer: Any) -> bool:
    """The tuner's trainer is fitting (its state's ``fn`` is ``TrainerFn.FITTING``)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is not None and str(getattr(fn, "value", fn)) == "fit"
