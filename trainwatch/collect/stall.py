"""Whether training changes what the model computes: its first batch, re-run now and then.

A forward pass with gradients of a training phase's first step leaves a few
rows of its inputs behind (at most ``rows``, cloned once) and, before any
update, the model's output on them: the first pass of the last module to
run. The last module, not the first: a loop that calls the model's parts
(``self.head(self.encoder(x))``) runs a frozen encoder first, whose output
nothing trains, and the part the loss comes out of last. Its first pass: a
step with a closure (LBFGS) updates the weights between its evaluations. A
pass through a module with no trainable parameter is never kept (re-run on
its own inputs it cannot move), and one whose module got no gradient while
the step's weights did (cut off by a stray ``detach()``) is dropped: the
phase is not measured. Every ``every`` steps
the model is run on those rows again, in eval mode, without gradients and
under the quiet marker (no other collector sees the pass), with the RNG
forked and the buffers swapped for copies, so training goes on bit for bit
as it would have. Batch-norm running statistics are the ones kept at the
start of the phase: they move on every training pass whatever the learning
rate, so only the weights can move the output.

On the same sampled steps the weights are copied before the optimizer's
update (for a step with a closure, as ``step(closure)`` begins: it is
gathered only once it returned, its update made), which gives each layer's
update-to-weight ratio ``||dW|| / ||W||`` after it: about 1e-3 in healthy
runs, orders of magnitude less when the learning rate is effectively zero.
One step in ``RATE_EVERY`` is sampled as well, for the optimizers' learning
rates alone: a rate that collapsed shows there long before the re-runs see
the updates stop.
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from collections.abc import Sequence
from contextlib import ExitStack
from itertools import compress, groupby, repeat
from operator import attrgetter, is_, itemgetter, methodcaller, truediv
from typing import Any

import torch
from torch import nn

from trainwatch.collect import quiet
from trainwatch.collect.grads import layer_norms
from trainwatch.collect.nonfinite_replay import replay_target
from trainwatch.collect.op_trace import swapped_buffers
from trainwatch.collect.passes import ModelPasses
from trainwatch.collect.small_norms import LayerSums
from trainwatch.collect.tensors import detached_copies, floating_tensors, tensor_leaves
from trainwatch.compiled import eager
from trainwatch.layers import LayerMap
from trainwatch.process_steps import PROCESS_STEPS
from trainwatch.record import StallReport, StepRecord
from trainwatch.rng import forked_rngs

_NORM_STATS = nn.modules.batchnorm._NormBase
_TRAINING = attrgetter("training")
_STATE = attrgetter("__dict__")  # a module's plain attributes, its mode among them
_REQUIRES_GRAD = attrgetter("requires_grad")
_GRAD = attrgetter("grad")
_NUMEL = methodcaller("numel")
_LAYER_INDEX = attrgetter("layer_index")
_OWNER = attrgetter("owner")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_DETACH = methodcaller("detach")
_CLONE = methodcaller("clone")
_FLOAT = methodcaller("float")
_POSITIVE = (0.0).__lt__  # a norm above zero (NaN is not)
_consume = deque(maxlen=0).extend  # runs a C loop (a ``map``) for its effects
# Steps between two looks at the learning rates: a look reads every param
# group's ``lr`` in Python, which a healthy step must not pay for.
RATE_EVERY = 10


class FirstBatchProbe:
    """Keeps a phase's first batch (a few rows) and measures how far the output moved on it.

    Healthy steps must not pay for it: it listens to the passes only until it
    has its batch, and the monitor reads the sampled steps off plain
    attributes (``loss_until``, ``look_from``) without a call. A model wrapped in
    DDP is re-run through its inner module (no collective on one rank), one with
    SyncBatchNorm or FSDP-sharded parts not at all.
    """

    def __init__(self, passes: ModelPasses, every: int, rows: int, loss_window: int) -> None:
        self.every = every
        self.rows = rows
        self.loss_window = loss_window
        self._passes = passes
        self.phase = 0  # counts the training phases, from 1
        self._phase_start = 0  # the first step of the current phase
        # The sampled steps: the first ``loss_window`` of the phase, the
        # ``loss_window`` before each re-run, and the step the re-run follows.
        self.loss_until = 0
        self.due = 0
        self.loss_from = 0
        # The next look at the learning rates, and the first sampled step after
        # ``loss_until``: the earlier of that look and ``loss_from``.
        self.rates_due = 0
        self.look_from = 0
        self._kept = False  # a batch is kept, or the attempt gave up for this phase
        # While not kept: PROCESS_STEPS.taken at the latest pass with gradients
        # (None: none yet this phase). A step taken since ends the first step:
        # its last pass is the one to keep.
        self._since: int | None = None
        # The weights as a step with a closure began (its step, its parameters,
        # their copies): that step is gathered after its update.
        self._held: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None
        # monitor.step() comes after the update: the weights at the boundary before a re-run.
        self._weights_at_boundary: list[torch.Tensor] | None = None
        self._module: weakref.ref[nn.Module] | None = None
        self._args: Any = None
        self._kwargs: Any = None
        self._reference: torch.Tensor | None = None
        self._spread = 0.0
        self._stats: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        # Kept between reports while the parameters stay as they were: the
        # per-layer sums of the update ratios, and the trainable counts.
        self._sums: tuple[list[str], tuple[int, ...], tuple[LayerSums, list[str]]] | None = None
        self._counts: tuple[list[str], Any, tuple[int, int, list[str]]] | None = None

    # -- the passes ------------------------------------------------------------
    def pass_starts(self, module: nn.Module) -> None:
        return None

    def pass_ends(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._kept or not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        since = self._since
        if since is not None and since != PROCESS_STEPS.taken:
            # A step ended since the latest pass (one not sampled): that pass
            # was the first step's last.
            self._settle(None)
            return
        self._since = PROCESS_STEPS.taken
        target = replay_target(module)  # never a collective: DDP's inner module, or nothing
        if target is None or (self._module is not None and self._module() is target):
            # Its first pass of the step is kept: the later ones (micro-batches, an
            # LBFGS step's evaluations, which follow updates of its own) add nothing.
            return
        if any(map(_REQUIRES_GRAD, target.parameters())):
            self._keep(target, args, kwargs)  # the step's last module so far

    def restart(self, step: int) -> None:
        """A new phase (the first, a new optimizer, a replaced module): a new first batch."""
        self.phase += 1
        self._phase_start = step
        self.loss_until = step + self.loss_window
        self._schedule(step + self.every - 1)
        self._kept = False
        self._since = None
        self._module = self._args = self._kwargs = self._reference = None
        self._stats = []
        self._weights_at_boundary = self._held = None
        if not self._passes.listens(self):
            self._passes.subscribe("stalled training", self, starts=False)

    def passed(self, step: int) -> None:
        """The re-run at ``step`` is over (or was not possible): the next one."""
        self._schedule(step + self.every)

    def _schedule(self, due: int) -> None:
        self.due = due
        self.loss_from = due - self.loss_window + 1
        self.look_from = min(self.loss_from, self.rates_due)

    def rates_read(self, step: int) -> None:
        """The learning rates were read at ``step``: the next look, ``RATE_EVERY`` on."""
        self.rates_due = step + RATE_EVERY
        self.look_from = min(self.loss_from, self.rates_due)

    def detach(self) -> None:
        self._passes.unsubscribe(self)
        self._kept = True
        self._module = self._args = self._kwargs = self._reference = None
        self._stats = []
        self._weights_at_boundary = self._held = None

    def _settle(self, params: Sequence[torch.Tensor] | None) -> None:
        """The first step is over: the pass kept of its last module with trainable
        parameters is the phase's batch, unless that module got no gradient while
        ``params`` (the step's weights, where known) did: its output, cut off from
        the loss, cannot tell whether training changes anything. Nothing kept: the
        phase is not measured."""
        self._kept = True
        self._passes.unsubscribe(self)  # the passes that follow cost nothing
        module = self._module() if self._module is not None else None
        if module is None or params is None or not _any_grad(params):
            return
        if not _any_grad(filter(_REQUIRES_GRAD, module.parameters())):
            self._module = self._args = self._kwargs = self._reference = None
            self._stats = []

    def closure_step_begins(self, params: Sequence[torch.Tensor], step: int) -> None:
        """A step with a closure begins on the re-run's step: the weights
        before its update, kept for :meth:`sample` (reached after the update)."""
        self._held = (step, list(params), _copies(params))

    # -- the sampled steps -------------------------------------------------------
    def sample(
        self, record: StepRecord, params: Sequence[torch.Tensor], step: int
    ) -> tuple[bool, list[torch.Tensor] | None]:
        """One of the sampled steps: the rule sees its loss. Returns whether the re-run
        follows this step, and the weights before its update (None: not known).

        An optimizer's pre-step hook comes before the update; ``monitor.step()``
        after it, so there the weights are copied one step boundary earlier; a
        step with a closure is gathered after its update, so its weights were
        copied as it began (:meth:`closure_step_begins`).
        """
        record.stall_phase = self.phase
        if not self._kept and self._since is not None:
            self._settle(params)  # the first step's passes are over
        if step > self.due:
            self.passed(step - 1)  # steps counted elsewhere (a resumed run)
        ready = self._reference is not None
        manual = record.source == "manual"
        if manual and step == self.due - 1 and ready:
            self._weights_at_boundary = _copies(params)
        if step != self.due:
            return False, None
        if not ready:
            self.passed(step)  # no batch kept (yet): the next stretch
            return False, None
        if manual:
            before, self._weights_at_boundary = self._weights_at_boundary, None
            return True, before
        held = self._held
        if held is not None and held[0] == step:
            # A step with a closure: the weights as it began, if it stepped the same ones.
            kept, copies = held[1], held[2]
            same = len(kept) == len(params) and all(map(is_, kept, params))
            return True, copies if same else None
        return True, _copies(params)

    def report(
        self,
        step: int,
        params: Sequence[torch.Tensor],
        before: list[torch.Tensor] | None,
        layers: LayerMap,
    ) -> StallReport:
        """The output's move on the first batch and each layer's update ratio, after the update."""
        self.passed(step)
        self._held = None
        ratios = self._ratios(params, before, layers)
        trainable, total, where = self._trainable(layers)
        return StallReport(
            steps=step - self._phase_start + 1,
            change=self._change(),
            update_ratios=ratios,
            trainable=trainable,
            total=total,
            trainable_in=where,
        )

    def _ratios(
        self, params: Sequence[torch.Tensor], before: list[torch.Tensor] | None, layers: LayerMap
    ) -> dict[str, float]:
        """Each layer's ``||dW|| / ||W||``: the norms in one batched kernel each, their
        per-layer sums in C loops (:class:`LayerSums`, kept while the parameters stay)."""
        flags = list(map(_REQUIRES_GRAD, params))
        now = list(compress(params, flags))
        old = list(compress(before or [], flags))
        if len(old) < len(now):  # fewer weights kept than the step holds: those kept
            now = now[: len(old)]
        if not now:
            return {}
        with torch.no_grad():
            floats = list(map(_FLOAT, map(_DETACH, now)))
            moved = torch._foreach_sub(floats, list(map(_FLOAT, old)))
            both = [*torch._foreach_norm(moved), *torch._foreach_norm(floats)]
            norms = torch.stack(both).tolist()
        count = len(now)
        kept = self._layer_sums(now, layers)
        if kept is not None:
            sums, names = kept
            updates, weights = sums.of(norms[:count]), sums.of(norms[count:])
            if updates is not None and weights is not None:
                return _divided(updates[0], weights[0], names)
        # A weight outside the model, or a non-finite norm: the general way.
        infos = [layers.info(p) for p in now]
        weights = layer_norms(infos, norms[count:], layers.layers)[0]
        updates = layer_norms(infos, norms[:count], layers.layers)[0]
        return _divided(updates, weights, list(weights))

    def _layer_sums(
        self, params: list[torch.Tensor], layers: LayerMap
    ) -> tuple[LayerSums, list[str]] | None:
        """The per-layer sums of these parameters, in this order, and their layers in
        the order the parameters name them; None when one is not the model's. The
        map keeps the parameters it knows alive, so their ids key the sums safely
        while it is the map."""
        key = tuple(map(id, params))
        kept = self._sums
        if kept is not None and kept[0] is layers.layers and kept[1] == key:
            return kept[2]
        infos = list(map(layers.known().get, key))
        if any(map(is_, infos, repeat(None))):
            return None
        names = list(dict.fromkeys(map(layers.layers.__getitem__, map(_LAYER_INDEX, infos))))
        found = LayerSums(infos, layers.layers), names
        self._sums = (layers.layers, key, found)
        return found

    def _trainable(self, layers: LayerMap) -> tuple[int, int, list[str]]:
        """Trainable and total parameter counts, and the modules holding the most
        trainable ones: worked out again only when a size or a flag changed."""
        params = layers.parameters()
        key = (tuple(map(_NUMEL, params)), tuple(map(_REQUIRES_GRAD, params)))
        kept = self._counts
        if kept is not None and kept[0] is layers.layers and kept[1] == key:
            return kept[2]
        found = _trainable(layers, params, *key)
        self._counts = (layers.layers, key, found)
        return found

    # -- internals ---------------------------------------------------------------
    def _keep(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """``module``'s pass as the phase's batch, in place of the one kept before it,
        if its output can be measured (a constant one, or a failed re-run: the
        earlier stays)."""
        batch = _batch_size(args, kwargs)
        rows = _first_rows(args, batch, self.rows)
        named = _first_rows(kwargs, batch, self.rows)
        stats = [
            (sub._buffers, name, buf.detach().clone())
            for sub in module.modules()
            if isinstance(sub, _NORM_STATS)
            for name, buf in sub._buffers.items()
            if buf is not None
        ]
        output = self._run(module, rows, named, stats)
        if output is None:
            return
        spread = float(output.std()) if output.numel() > 1 else 0.0
        if not math.isfinite(spread) or spread <= 0.0:
            return  # a constant output: nothing to measure a move against
        self._module = weakref.ref(module)
        self._args, self._kwargs, self._stats = rows, named, stats
        self._reference, self._spread = output, spread

    def _change(self) -> float | None:
        reference = self._reference
        module = self._module() if self._module is not None else None
        output = None
        if module is not None:
            output = self._run(module, self._args, self._kwargs, self._stats)
        if reference is None or output is None or output.shape != reference.shape:
            return None
        moved = float((output - reference).pow(2).mean().sqrt())
        return moved / self._spread if math.isfinite(moved) else None

    def _run(
        self,
        module: nn.Module,
        args: Any,
        kwargs: Any,
        stats: list[tuple[dict[str, Any], str, torch.Tensor]],
    ) -> torch.Tensor | None:
        """Rows through ``module``, as training would never see it; None if it fails."""
        subs = list(module.modules())
        modes = list(map(_TRAINING, subs))
        # A forward may keep state in plain attributes (a call counter, an
        # RNN's hidden state carried between batches): every module's
        # attributes are put back as they were, so the re-run leaves no trace
        # the training sees. Saved and put back in C loops, whatever the depth.
        states = list(map(_STATE, subs))
        saved = list(map(dict.copy, states))
        devices = _cuda_devices(module)
        try:
            with ExitStack() as stack:
                stack.enter_context(swapped_buffers(module, subs))
                stack.enter_context(forked_rngs(devices=devices))
                stack.enter_context(torch.no_grad())
                stack.enter_context(quiet.replay())
                stack.enter_context(eager())
                for buffers, name, kept in stats:
                    buffers[name] = kept.clone()  # the phase's running statistics
                _consume(map(setattr, subs, repeat("training"), repeat(False)))
                output = module(*detached_copies(args), **detached_copies(kwargs))
                flat = [t.detach().float().reshape(-1) for t in floating_tensors(output)]
                return torch.cat(flat) if flat else None
        except Exception:
            # A model that cannot run on a few of its own rows again (state kept
            # between calls, a fixed batch size) is not measured; training is
            # untouched either way.
            return None
        finally:
            _restore(states, saved)
            _consume(map(setattr, subs, repeat("training"), modes))


def _restore(states: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    """Each module's attributes as saved: what the re-run added goes, what it changed
    or removed comes back. What it added is held until every module is restored, so
    nothing freed on the way (a ``__del__``, a weakref callback) meets a module
    half restored."""
    added = list(map(dict.copy, states))
    _consume(map(dict.clear, states))
    _consume(map(dict.update, states, saved))
    del added


def _divided(
    updates: dict[str, float], weights: dict[str, float], names: list[str]
) -> dict[str, float]:
    """``updates[layer] / weights[layer]`` for each of ``names`` (in that order) whose
    weights' norm is above zero, in C loops."""
    values = list(map(weights.__getitem__, names))
    positive = list(map(_POSITIVE, values))
    moved = map(updates.__getitem__, compress(names, positive))
    return dict(zip(compress(names, positive), map(truediv, moved, compress(values, positive))))


def _any_grad(params: Any) -> bool:
    """Whether any of ``params`` holds a gradient."""
    return not all(map(is_, map(_GRAD, params), repeat(None)))


def _copies(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(map(_CLONE, map(_DETACH, params)))


def _batch_size(args: Any, kwargs: Any) -> int | None:
    for _, tensor in tensor_leaves((args, kwargs)):
        if tensor.dim() > 0:
            return tensor.shape[0]
    return None


def _first_rows(value: Any, batch: int | None, rows: int) -> Any:
    """``value`` with each batch-first tensor cut to its first ``rows`` rows, all cloned."""
    if isinstance(value, torch.Tensor):
        if batch is not None and batch > rows and value.dim() > 0 and value.shape[0] == batch:
            value = value[:rows]
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_first_rows(item, batch, rows) for item in value))
    if type(value) in (tuple, list):
        return type(value)(_first_rows(item, batch, rows) for item in value)
    if type(value) is dict:
        return {key: _first_rows(item, batch, rows) for key, item in value.items()}
    return detached_copies(value)


def _cuda_devices(module: nn.Module) -> list[int]:
    first = next(module.parameters(), None)
    if first is None or first.device.type != "cuda":
        return []
    return [first.device.index if first.device.index is not None else 0]


def _trainable(
    layers: LayerMap, params: list[torch.Tensor], counts: tuple[int, ...], flags: tuple[bool, ...]
) -> tuple[int, int, list[str]]:
    """Trainable and total parameter counts (``counts``, ``flags``: the map's
    ``params``' sizes and whether each is trainable), and the three modules
    holding the most trainable ones, the first named first among equals."""
    known = layers.known()
    owners = list(map(_OWNER, map(known.__getitem__, map(id, compress(params, flags)))))
    trainable = list(compress(counts, flags))
    pairs = sorted(zip(owners, trainable))
    by_owner = {owner: sum(map(_SECOND, pair)) for owner, pair in groupby(pairs, _FIRST)}
    where = sorted(dict.fromkeys(owners), key=by_owner.__getitem__, reverse=True)[:3]
    return sum(trainable), sum(counts), where
