"""Sees whether each backward pass between two optimizer steps began on gradients
reset since the previous one: ``zero_grad()`` inside a gradient-accumulation loop.

Each micro-batch's ``zero_grad()`` wipes what the earlier micro-batches left, so
each step applies only the last one's gradients: the effective batch is as many
times smaller as there are micro-batches, and the loss still goes down.

Looked at only once a second backward pass of a step has reached the model (an
accumulation loop, a GAN, a gradient penalty): the tracker then hands each
backward's start and end here. At the end: which gradients that backward wrote
(their tensor and version against those at its start) and where the weights
stood. At the next start, before any gradient accumulates: which of those were
set to None, replaced or written in place since. Each is a few C loops over the
parameters; nothing of it runs on a step with one backward pass.

Not a wipe: a backward with no forward pass of the model since the previous one
(several losses of one graph, each backward's gradients read and combined by
hand, as PCGrad does); one after the weights moved (SAM's perturbation between
its two passes, an LBFGS evaluation); one after any optimizer step of the process
(a GAN's discriminator step between its backward and the generator's); and a
step one of whose passes took an input that requires grad (an adversarial
perturbation computed through the model by backward before the training pass).
Gradients rewritten in place are a wipe only where they are all zero: a clip
after each micro-batch rescales them instead.

The weights' moves are seen in their version counters; a SAM that perturbs and
restores them through ``.data`` moves none. So once a step's backward passes
were found wiped, each backward's end also notes the weights' norms (float64,
on the device), read at the next backward's start only where its predecessor's
gradients were wiped with no counter moved: a perturbation found so is no wipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, count, repeat
from operator import attrgetter, eq, is_not, ne, not_
from typing import Any, NamedTuple

import torch

from trainwatch.collect.moved_between_backwards import read_flags, weight_norms
from trainwatch.collect.tensors import floating_list, floating_tensors
from trainwatch.process_steps import ANY_OPTIMIZER_STEPS, PROCESS_STEPS
from trainwatch.record import WipedReport

_GRAD = attrgetter("grad")
_PARAM = attrgetter("param")
_VERSION = attrgetter("_version")
_REQUIRES_GRAD = attrgetter("requires_grad")
_TENSOR_ONLY = {torch.Tensor}

# Autograd nodes walked back from a pass's input that requires grad, looking for
# a leaf that is none of the model's parameters (x + delta reaches delta in two).
_FOREIGN_NODES = 32
# Steps in a row with no second backward pass before the look stops (a one-off
# probe started it); the next second backward starts it again.
IDLE_STEPS = 50
# Steps in a row of an optimizer whose several backward passes accumulated (none
# wiped the one before) that settle it: a loop accumulating as intended pays for
# the look over its first steps only.
SETTLED_STEPS = 20
# Runs numbered across every look of the process (a look stopped and started
# again goes on counting: a step's verdicts are told apart by their run).
_RUNS = count(1)


def gradient_marks(params: Sequence[torch.Tensor]) -> dict[int, tuple[int, int]]:
    """Each gradient held, by its parameter's id: the tensor's id and version."""
    grads = list(map(_GRAD, params))
    held = list(map(is_not, grads, repeat(None)))
    kept = list(compress(grads, held))
    return dict(zip(compress(map(id, params), held), zip(map(id, kept), map(_VERSION, kept))))


def _key() -> tuple[int, int]:
    """Moves at every optimizer step of the process, watched or not."""
    return ANY_OPTIMIZER_STEPS.count, PROCESS_STEPS.taken


class _Left(NamedTuple):
    """What a backward left as it ended."""

    key: tuple[int, int]
    marks: dict[int, tuple[int, int]] | None  # None: not seen (the look began after it)
    wrote: list[int]  # the parameters whose gradient it wrote
    weights: list[int] | None  # the parameters' versions (None: not known)
    passes: int | None  # the model's passes so far (None: not known)
    norms: list[torch.Tensor] | None = None  # the weights' norms (once a wipe was found)


class _Between(NamedTuple):
    """What happened to one backward's gradients before the next began."""

    wrote: frozenset[int]
    spoiled: set[int]  # still there, or their weights moved since
    content: torch.Tensor | None  # max|g| of those rewritten in place or replaced


class BetweenBackwards:
    """The backward passes since the last optimizer step of the process (a run), and
    before each after the first, whether the previous one's gradients were wiped."""

    def __init__(
        self, states: dict[int, Any], passes: Any, seed: dict[int, tuple[int, int]] | None
    ) -> None:
        self._states = states  # the tracker's, by parameter id (each with .param)
        self._passes = passes  # ModelPasses: its count tells a forward between two backwards
        self.run = next(_RUNS)  # which run this is (moves when a run begins)
        self._key = _key()
        # The started look is at the start of a later backward already: the one
        # before it is the run's first, known only where the tracker noted it.
        self._count = 1
        self._between: list[_Between | None] = []
        wrote = list(seed) if seed is not None else []
        self._left: _Left | None = _Left(self._key, seed, wrote, None, None)
        self._before: dict[int, tuple[int, int]] = {}
        # The latest run with a pass whose input required grad, and the autograd
        # nodes of the outputs of the passes since the last optimizer step.
        self._grad_input_key: tuple[int, int] | None = None
        self._outputs: set[int] = set()
        self._outputs_key: tuple[int, int] | None = None
        # Found rescaled in place between two backward passes (a clip after each
        # micro-batch): gradients written in place are no wipe in this loop.
        self.rescaled = False
        # A step's backward passes were found wiped: the weights' values are noted at
        # each backward's end from then on (a perturbation through .data moves no
        # version counter).
        self.weigh = False
        self.idle = 0  # verdicts in a row whose run had a single backward pass
        ANY_OPTIMIZER_STEPS.hold()
        self._held = True

    def close(self) -> None:
        if self._held:
            self._held = False
            ANY_OPTIMIZER_STEPS.release()

    # -- the model's passes --------------------------------------------------
    def pass_starts(self, module: object) -> None:
        return None

    def pass_ends(self, module: object, args: Any, kwargs: Any, output: object) -> None:
        """A pass whose input requires grad through a tensor that is none of the
        model's (a perturbation to be found by backward); an input made from an
        earlier pass's output (a model called through its parts) is the model's."""
        if not torch.is_grad_enabled():
            return
        key = _key()
        if self._outputs_key != key:
            self._outputs_key = key
            self._outputs.clear()
        if self._grad_input_key != key and self._grad_input(args, kwargs):
            self._grad_input_key = key
        outputs = (output,) if type(output) is torch.Tensor else floating_list(output)
        for tensor in outputs:
            if tensor.grad_fn is not None:
                self._outputs.add(id(tensor.grad_fn))

    def _grad_input(self, args: Any, kwargs: Any) -> bool:
        """Some input requires grad through a tensor none of the model's passes made."""
        if kwargs or not set(map(type, args)) <= _TENSOR_ONLY:
            inputs = floating_list(args)
            if kwargs:
                inputs += floating_tensors(kwargs)
        else:  # the usual call, model(x): tensors only
            inputs = args
        if not any(map(_REQUIRES_GRAD, inputs)):
            return False
        return any(tensor.requires_grad and self._foreign(tensor) for tensor in inputs)

    def _foreign(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s graph reaches, within a few nodes, a leaf that is none
        of the model's parameters; not followed past an earlier pass's output."""
        node = tensor.grad_fn
        if node is None:
            return id(tensor) not in self._states  # a leaf input that requires grad
        seen = {id(node)}
        todo = [node]
        for _ in range(_FOREIGN_NODES):
            if not todo:
                return False
            node = todo.pop()
            variable = getattr(node, "variable", None)
            if variable is not None:
                if id(variable) not in self._states:
                    return True
                continue
            for following, _ in node.next_functions:
                if following is not None and id(following) not in seen:
                    seen.add(id(following))
                    if id(following) not in self._outputs:
                        todo.append(following)
        return False

    # -- backward passes -----------------------------------------------------
    def starts(self) -> None:
        """A backward begins: if it is a later one of the run, what became of the
        previous one's gradients."""
        params = list(map(_PARAM, self._states.values()))
        marks = gradient_marks(params)
        key = _key()
        left = self._left
        if left is None or left.key != key:
            self.run = next(_RUNS)
            self._key = key
            self._count = 1
            self._between = []
        else:
            self._count += 1
            self._between.append(self._compare(left, params, marks))
        self._before = marks

    def ended(self, left: dict[int, tuple[int, int]]) -> None:
        """A backward ended leaving ``left`` (the tracker's note of every gradient)."""
        before = self._before
        wrote = list(compress(left, map(ne, left.values(), map(before.get, left))))
        params = list(map(_PARAM, self._states.values()))
        norms = weight_norms(params) if self.weigh and wrote else None
        self._left = _Left(
            _key(), left, wrote, list(map(_VERSION, params)), self._passes.passes, norms
        )

    def _compare(
        self, left: _Left, params: list[torch.Tensor], marks: dict[int, tuple[int, int]]
    ) -> _Between | None:
        """None where the two backward passes are no micro-batches of one step, or
        the previous one was not seen."""
        if left.marks is None:
            return None
        if left.passes is not None and left.passes == self._passes.passes:
            return None  # no forward between: another loss of the same graph
        ids = list(map(id, params))
        spoiled: set[int] = set()
        if left.weights is not None:
            if len(left.weights) != len(params):
                return None  # parameters added since: not compared
            spoiled.update(compress(ids, map(ne, map(_VERSION, params), left.weights)))
        wrote, before = left.wrote, left.marks
        now = list(map(marks.get, wrote))
        same = list(map(eq, map(before.get, wrote), now))
        spoiled.update(compress(wrote, same))
        if left.norms is not None and not spoiled.issuperset(wrote):
            # Wiped, no counter moved: moved through .data (SAM's perturbation)?
            norms = weight_norms(params)
            if norms is not None and len(norms) == len(left.norms):
                spoiled.update(compress(ids, read_flags(list(map(torch.ne, norms, left.norms)))))
        # Neither kept nor set to None: zeroed in place, rescaled, or replaced.
        moved = list(map(not_, same))
        rewritten = list(
            compress(compress(wrote, moved), map(is_not, compress(now, moved), repeat(None)))
        )
        content = None
        if rewritten:
            if self.rescaled:
                spoiled.update(rewritten)
            else:
                content = _largest(params, ids, rewritten)
                if content is None:
                    spoiled.update(rewritten)
        return _Between(frozenset(wrote), spoiled, content)

    # -- the step ------------------------------------------------------------
    def verdict(self, params: Sequence[torch.Tensor]) -> tuple[int, int, bool]:
        """(backward passes of the run that wrote some of ``params``' gradients, how
        many of them began on the previous one's gradients wiped, whether every later
        one did) for an optimizer's parameters.

        Passes that wrote none of them (another optimizer's backward, an inner
        ``torch.autograd.grad``) are none of its micro-batches.
        """
        passes = self._count
        self.idle = self.idle + 1 if passes < 2 else 0
        if passes < 2 or self._grad_input_key == self._key:
            return passes, 0, False
        ids = set(map(id, params))
        wrotes: list[frozenset[int] | None] = [
            between.wrote if between is not None else None for between in self._between
        ]
        wrotes.append(frozenset(self._left.wrote) if self._left is not None else None)
        own = sum(1 for wrote in wrotes if wrote is None or not ids.isdisjoint(wrote))
        if own < 2:
            return own, 0, False
        wiped = [
            between
            for between, after in zip(self._between, wrotes[1:])
            if between is not None
            and not ids.isdisjoint(between.wrote)
            and ids.isdisjoint(between.spoiled)
            and _dropped(between, after)
        ]
        held = len(wiped) >= own - 1
        if held:
            self.weigh = True  # the next ones are weighed: a perturbation is no wipe
        if held and self._replaced(params):
            # The step's gradients are built by hand from each backward's (per-sample
            # clipping and noise, DP-SGD written out): each backward's were read
            # before the next one's zero_grad().
            return own, 0, False
        if held:
            contents = [b.content for b in wiped if b.content is not None]
            if contents and any(float(c) != 0.0 for c in contents):
                # Rewritten and not zero: rescaled (a clip after each micro-batch).
                self.rescaled = True
                return own, 0, False
        return own, min(len(wiped), own - 1), held

    def dropped(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Those of ``params`` without a gradient now that an earlier backward of the
        run wrote: only a micro-batch whose gradients were wiped reached them."""
        wrote: set[int] = set()
        for between in self._between:
            if between is not None:
                wrote |= between.wrote
        return [p for p in params if p.grad is None and id(p) in wrote]

    def _replaced(self, params: Sequence[torch.Tensor]) -> bool:
        """Some gradient the last backward left on ``params`` is another tensor now."""
        last = self._left.marks if self._left is not None else None
        if not last:
            return False
        ids = list(map(id, params))
        now = gradient_marks(params)
        return any(
            before is not None and after is not None and before[0] != after[0]
            for before, after in zip(map(last.get, ids), map(now.get, ids))
        )


def _dropped(between: _Between, after: frozenset[int] | None) -> bool:
    """Whether the gap dropped the earlier backward's work: every gradient it wrote
    was reset, or what was kept the next backward added onto (an accumulation loop
    resetting one optimizer's part only). Kept gradients the next backward leaves
    alone are another optimizer's, waiting for its step (a GAN whose generator
    loss also reaches the discriminator, whose zero_grad() then drops that part)."""
    kept = between.wrote & between.spoiled
    return not kept or (after is not None and not kept.isdisjoint(after))


def _largest(
    params: list[torch.Tensor], ids: list[int], rewritten: list[int]
) -> torch.Tensor | None:
    """max|g| over the gradients rewritten in place or replaced, a device scalar read
    only where the verdict depends on it (None where it cannot be taken)."""
    by_id = dict(zip(ids, params))
    grads = []
    for pid in rewritten:
        param = by_id.get(pid)
        grad = param.grad if param is not None else None
        if grad is None or grad.layout != torch.strided or type(grad) is not torch.Tensor:
            return None
        grads.append(grad.detach())
    try:
        norms = torch._foreach_norm(grads, float("inf"))
        return torch.stack([n.to(norms[0].device) for n in norms]).amax()
    except (TypeError, RuntimeError):
        return None


class WipedSteps:
    """Per optimizer, its latest steps' verdicts; told once when ``patience`` in a
    row held, dated at the first of them."""

    def __init__(self, patience: int) -> None:
        self._patience = max(1, patience)
        # Per optimizer: (run, step, held, backward passes, wiped), the latest last.
        self._latest: dict[int, list[tuple[int, int, bool, int, int]]] = {}
        self.told: set[int] = set()
        # Per optimizer: steps in a row whose backward passes accumulated as intended.
        self._accumulating: dict[int, int] = {}

    def settled(self, index: int) -> bool:
        """Told, or seen accumulating as intended for ``SETTLED_STEPS`` steps in a row."""
        return index in self.told or self._accumulating.get(index, 0) >= SETTLED_STEPS

    def judge(
        self, index: int, run: int, step: int, verdict: tuple[int, int, bool]
    ) -> WipedReport | None:
        """A step of optimizer ``index`` gathered; gathered again for the same run (a
        clip after each micro-batch gathers the step at each), the latest word stands."""
        if index in self.told:
            return None
        passes, wiped, held = verdict
        if passes >= 2 and wiped == 0:
            self._accumulating[index] = self._accumulating.get(index, 0) + 1
        elif passes >= 2:
            self._accumulating[index] = 0
        latest = self._latest.setdefault(index, [])
        if latest and latest[-1][0] == run:
            latest[-1] = (run, latest[-1][1], held, passes, wiped)
        else:
            latest.append((run, step, held, passes, wiped))
            del latest[: -self._patience]
        if len(latest) < self._patience or not all(entry[2] for entry in latest):
            return None
        self.told.add(index)
        return WipedReport(latest[0][1], len(latest), passes, wiped)
