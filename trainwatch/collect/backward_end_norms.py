"""The gradients' norms as backward left them, before the loop's own writes.

Some loops write into ``.grad`` in place between ``backward()`` and
``optimizer.step()`` by design: stochastic-gradient Langevin dynamics adds
Gaussian noise to every gradient once its burn-in is over
(``p.grad.add_(noise)``), gradient-noise schedules do from the first step.
The norms the step reads at the optimizer's step carry those additions, which
lift them 100x in one step when the noise is switched on, while the gradients
backward made did not move: no explosion, and neither a clip nor a lower
learning rate is the fix. (``clip_grad_norm_`` is told apart another way: the
step is gathered before it rescales, see trainwatch.clip_gathering.)

Only exploding_gradient asks, after a jump and for as long as the loop's
writes keep lifting the norms far: over the next few steps each backward's
end has the tracker note what it left (``GradResetTracker.left``, as
``LeavingsNotes`` does) and takes the gradients' norms in one batched kernel,
kept on the device. The step reads them back beside its own where some
gradient was written since that backward ended (a mapping of each layer's
norm, ``StepRecord.backward_layer_norms``, computed only when the rule reads
it). A healthy step pays nothing: no listener, no kernel, no readback.

Under an enabled GradScaler backward leaves the gradients scaled and
``unscale_`` writes them in place: its norms are not taken there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not
from typing import Any

import torch

from trainwatch.collect.accumulation import GradResetTracker
from trainwatch.collect.backward_end_listener import BackwardEndListener
from trainwatch.collect.dropped_gradients import rewritten_since
from trainwatch.collect.grads import gradient_norms, layer_norms
from trainwatch.frame import Slot, StepFrame
from trainwatch.layers import ParamInfo
from trainwatch.process_steps import PROCESS_STEPS

_GRAD = attrgetter("grad")


class LayerNormsLeft(Mapping[str, float]):
    """Each layer's gradient norm as the step's last backward left it, computed from
    the step's readback the first time a rule reads it."""

    def __init__(self, infos: Sequence[ParamInfo], norms: Slot, layers: Sequence[str]) -> None:
        self._infos = infos
        self._norms = norms
        self._layers = layers
        self._per_layer: dict[str, float] | None = None

    def _computed(self) -> dict[str, float]:
        per_layer = self._per_layer
        if per_layer is None:
            per_layer, _ = layer_norms(self._infos, self._norms.values(), self._layers)
            self._per_layer = per_layer
        return per_layer

    def __getitem__(self, layer: str) -> float:
        return self._computed()[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self._computed())

    def __len__(self) -> int:
        return len(self._computed())


class BackwardEndNorms(BackwardEndListener):
    """Takes the gradients' norms at each backward's end over the steps a request
    covers (``request``); the listener goes once they are past."""

    def __init__(self, tracker: GradResetTracker) -> None:
        super().__init__(tracker)
        # What the latest backward looked at left: the process's backward count as it
        # ended (a later backward anywhere moves it), what the tracker noted of it
        # (each gradient's id and version), the parameters holding a gradient then
        # and their norms on the device.
        self._backwards = -1
        self._left: dict[int, tuple[int, int]] = {}
        self._params: list[torch.Tensor] = []
        self._norms: torch.Tensor | None = None

    def at_backward_end(self, tracker: GradResetTracker) -> None:
        # Kept apart from the tracker's notes: a clip gathered before it notes the
        # gradients again as clipped.
        self._left = tracker.left or {}
        params = tracker.parameters()
        grads = list(map(_GRAD, params))
        held = list(map(is_not, grads, repeat(None)))
        kept = list(compress(grads, held))
        self._params = list(compress(params, held))
        self._norms = gradient_norms(kept) if kept else None
        self._backwards = PROCESS_STEPS.backwards

    def read_with_step(
        self,
        params: Sequence[torch.Tensor],
        frame: StepFrame,
        info: Any,
        layers: Sequence[str],
        scaled: bool = False,
    ) -> tuple[bool, LayerNormsLeft | None]:
        """At the step's gathering (before or after a clip, after a closure step):
        whether the latest backward, this step's, was looked at, and, where the loop
        wrote into some of ``params``' gradients since it ended, the layers' norms as
        it left them (read back with the step's ``frame``). ``scaled``: backward
        left them scaled by a GradScaler, none to compare."""
        norms = self._norms
        if self._backwards != PROCESS_STEPS.backwards:
            return False, None  # another backward began since
        if norms is None or scaled or not rewritten_since(params, self._left):
            return True, None
        infos = list(map(info, self._params))
        return True, LayerNormsLeft(infos, frame.add(norms), layers)

    def stop(self) -> None:
        super().stop()
        self._norms = None
        self._params = []
        self._left = {}
