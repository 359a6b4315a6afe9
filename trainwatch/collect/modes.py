"""Which modules behave differently in training and in eval mode, and in which mode they are.

Pure Python over ``.training`` flags of a cached list of modules: no tensor is
touched, so a check costs a few microseconds per forward pass of the model.

The list is kept in call order, so a report names the first module that
behaves differently, not the first one registered: a positional encoding's
dropout defined after the encoder still runs before it. The order is learned
once, from forward pre-hooks put on the listed modules for one pass of the
model and taken off at its end; the model's tree changing learns it again.
Modules the learning pass did not call keep their registration order, after
the called ones.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainwatch.collect.norm_reestimation import NormReestimation
from trainwatch.compiled import user_name
from trainwatch.fast_paths import hook_module, layer_members
from trainwatch.hooks import HookGroup, WeakHook
from trainwatch.record import ModeReport

if TYPE_CHECKING:
    from trainwatch.collect.calls import CallTracker

_REF = itemgetter(3)  # a Listed's module reference
_DEREF = weakref.ref.__call__
_TRAINING = attrgetter("training")
_REQUIRES_GRAD = attrgetter("requires_grad")

_DROPOUT: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


def mode_kind(module: nn.Module) -> str | None:
    """ "dropout" or "norm" when the module's output depends on ``.training``; else None.

    Dropout with p=0 and norms without running statistics behave the same in
    both modes, so they do not count.
    """
    if isinstance(module, _DROPOUT):
        return "dropout" if getattr(module, "p", 0.0) > 0.0 else None
    if isinstance(module, _NORMS):
        return "norm" if getattr(module, "track_running_stats", False) else None
    if isinstance(module, nn.MultiheadAttention):
        return "dropout" if module.dropout > 0.0 else None
    if isinstance(module, nn.RNNBase):
        return "dropout" if module.dropout > 0.0 and module.num_layers > 1 else None
    return None


class Listed(NamedTuple):
    """One mode-dependent module, as the checks see it."""

    name: str  # qualified, as in named_modules()
    kind: str  # "dropout" or "norm"
    label: str  # what a report calls it: the class name, or the function it calls
    ref: weakref.ref[nn.Module]


class ModeWatch:
    def __init__(
        self, model: nn.Module, on_error: Callable[[str, BaseException], None] | None = None
    ) -> None:
        self._root = weakref.ref(model)
        self._on_error = on_error
        # The mode-dependent modules (dropout, batch norm), in call order once learned.
        self.listed: list[Listed] = []
        # Modules seen calling dropout or batch norm as functions (no module type
        # says so), kept across rebuilds of the cache.
        self._functional: list[Listed] = []
        # Read on every pass (an attribute, not a call): False until the call
        # order of the listed modules has been learned.
        self.ordered = False
        self.learning = HookGroup()  # the one-pass pre-hooks that learn the order
        self._calls: list[int] = []  # indices into listed, in the order called
        # Per part of the model called on its own, its share of ``listed`` (made
        # at its first pass; dropped whenever ``listed`` changes).
        self._parts: dict[str, list[Listed]] = {}
        # Per listed module's name, the parameters of the nearest module holding
        # some, from it up (see _in_frozen_part): read at a training step's pass
        # with modules in eval mode, with no walk of the model (a linear probe's
        # model.eval() asks it at every step, for every batch norm of its backbone).
        # Their flags are read live; the list is made again with the model's tree.
        self._holders: dict[str, tuple[nn.Parameter, ...]] = {}
        # Per listed module, the modules above it (qualified name, reference),
        # from the root down: made when a no-grad pass first finds dropout in
        # training mode under a module in eval mode (see _switched_alone).
        self._above: dict[str, tuple[tuple[str, weakref.ref[nn.Module]], ...]] = {}
        # Per pass root (a part's name, "" for the model): its listed modules and
        # the modules above them, whose modes are read together; and per layout of
        # those modes, the modules ``.eval()`` was called on, with their layers'
        # parameters. Read on training passes that find modules in eval mode
        # without the pass's root (see _parts_in_eval).
        self._chains: dict[str, tuple[weakref.ref[nn.Module], ...]] = {}
        self._tops: dict[tuple[object, ...], tuple[tuple[str, tuple[nn.Parameter, ...]], ...]] = {}
        # The listed modules inside a large frozen part of a model that trains
        # (a teacher, a backbone): read on training passes (see frozen_parts).
        self.in_frozen: list[Listed] = []
        # The flags of ``in_frozen``, the call tracker's count and the training
        # pass's root when those in training mode were last found not running
        # (see frozen_in_training).
        self._not_running: tuple[tuple[bool, ...], int, str] | None = None
        # The large frozen parts of a model that trains, by name, where they hold
        # listed modules (none where the whole model is frozen: no part of it
        # trains around them).
        self.frozen_parts: list[str] = []
        # Parts of the model seen called on their own, outside its passes
        # (``model.teacher(x)`` under no_grad in the loop): the frozen parts in
        # them run, though the call tracker, which sees the model's passes only,
        # never saw them (see part_called).
        self._called_alone: set[str] = set()
        # No parameter of the model trains (a loss network watched on its own).
        self.wholly_frozen = False
        # Ids of parameters that keep requires_grad=True yet train no more than
        # frozen ones: no watched optimizer holds them and no step has seen them
        # with a gradient (a teacher run under no_grad, never frozen). Told by the
        # step pipeline, which knows the optimizers' membership (see held_by_none);
        # empty without an optimizer.
        self.idle: frozenset[int] = frozenset()
        # Ids of parameters no optimizer holds that a step saw with a gradient:
        # updated by hand from it, or meant to train; never idle again.
        self._got_gradients: set[int] = set()
        # Batch norms re-estimating statistics reset since they last trained (a
        # recalibration after pruning or weight averaging, AdaBN): looked at on
        # no-grad passes with them in training mode.
        self.reestimation = NormReestimation()
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the cache (the model's tree changed)."""
        self.stop_learning(apply=False)
        model = self._root()
        self.listed = []
        self._listing_changed()
        self._above = {}
        self._holders = {}
        self.reestimation.clear()
        self.ordered = False
        if model is None:
            return
        functional = {id(item.ref()): item for item in self._functional}
        for name, module in model.named_modules():
            kind = mode_kind(module)
            if kind is not None:
                label = type(module).__name__
                self.listed.append(Listed(user_name(name), kind, label, weakref.ref(module)))
            elif id(module) in functional:
                self.listed.append(functional[id(module)]._replace(name=user_name(name)))
        self.ordered = not self.listed  # nothing to order
        self.find_frozen_parts()

    def find_frozen_parts(self) -> None:
        """The listed modules inside a large frozen part: asked again when the
        parameters' ``requires_grad`` flags change, or which of them are
        :attr:`idle` (one walk of the model then).

        A large frozen part is a subtree that trains no parameter while the
        module around it does, holding at least :data:`FROZEN_SHARE` of the
        model's parameters: a teacher, a frozen backbone; or the whole model,
        when none of its parameters trains. The frozen base
        layers of a LoRA model are many small subtrees beside trained adapters,
        frozen embeddings a small share: neither is one, and their dropout is
        meant to be on. The frozen modules beside a large one belong to the same
        part (see :func:`_with_frozen_siblings`): a ResNet's stages frozen under
        its trained ``fc`` are one backbone, named by each of them.
        """
        model = self._root()
        self.in_frozen = []
        self.frozen_parts = []
        self._not_running = None
        self.wholly_frozen = False
        if model is None or not self.listed:
            return
        idle = self.idle
        total, trained = _counts(model, idle)
        if trained == total:
            return  # nothing is frozen: no walk of the modules
        if not trained:
            # Nothing trains: the whole model is frozen (a perceptual loss's
            # network, watched on its own by trainwatch run; backward runs
            # through it to the image a generator made).
            self.in_frozen = list(self.listed)
            self.wholly_frozen = True
            return
        large: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(part + ".") for part in large):
                continue
            size, trains = _counts(module, idle)
            big = size >= FROZEN_SHARE * total
            if size and not trains and big and not _embeddings_only(module):
                large.append(name)
        if large:
            parts = [user_name(name) for name in _with_frozen_siblings(model, large, idle)]
            self.in_frozen = [
                item for item in self.listed if any(_inside(item.name, part) for part in parts)
            ]
            if self.in_frozen:
                self.frozen_parts = parts

    def frozen_in_training(
        self, calls: CallTracker | None = None, within: str = ""
    ) -> ModeReport | None:
        """Listed modules of a large frozen part in training mode (None: none is).

        ``calls``: which modules ran. A frozen part never called (an EMA copy
        updated by hand, a backbone kept for later) computes nothing for the
        rest of the model, whatever its mode: it is left out once the tracker
        saw the module holding it called and not it, unless it was seen called
        on its own (:meth:`part_called`: a teacher the loop calls itself).

        ``within``: the part whose training pass asks ("" for the whole
        model's). A frozen part outside it is a pass of its own, never run by
        this one: it runs beside the training only if it was seen called on its
        own in training mode (:meth:`part_called`). That the tracker saw it
        called says nothing of its mode then: an EMA copy the loop evaluates as
        ``model.eval(); model.ema(x); model.train()`` ran, in eval mode, and
        its dropout, in training mode again, runs for nothing.

        Cheap on the usual step: the list is empty unless a part is frozen, and
        then its flags are read in C loops; a part found not running is asked
        again only when its flags change or the tracker sees a new module run.
        """
        listed = self.in_frozen
        if not listed:
            return None
        try:
            flags = tuple(map(_TRAINING, map(_DEREF, map(_REF, listed))))
        except AttributeError:
            return None  # a module gone: the next rebuild lists what is there
        if True not in flags:
            return None
        seen_count = calls.seen_count if calls is not None else 0
        if (flags, seen_count, within) == self._not_running:
            return None
        found = [item for item in listed if (module := item.ref()) is not None and module.training]
        if not found:
            return None
        root = self._root()
        idle = self.idle
        if root is not None and not all(_in_frozen_part(root, item.name, idle) for item in found):
            # Unfrozen since the list was made (a backbone trained again from this
            # step, put back in training mode with it): the parts are found anew.
            self.find_frozen_parts()
            found = [
                item
                for item in self.in_frozen
                if (module := item.ref()) is not None
                and module.training
                and _in_frozen_part(root, item.name, idle)
            ]
            if not found:
                return None
        alone = self._called_alone
        found = [
            item
            for item in found
            if any(_inside(item.name, part) for part in alone)
            or (_inside(item.name, within) and (calls is None or calls.ran(item.name) is not False))
        ]
        if not found:
            self._not_running = (flags, seen_count, within)
            return None
        return ModeReport(
            [item.name for item in found],
            [item.label for item in found],
            False,
            len(self.listed),
            in_frozen_parts=[item.name for item in found],
            held_by_no_optimizer=root is not None
            and any(_idle_part(root, item.name, idle) for item in found),
            frozen_parts=[
                part
                for part in self.frozen_parts
                if any(_inside(item.name, part) for item in found)
            ],
        )

    def part_called(self, name: str, now: bool = True) -> bool:
        """A part of the model (``name``) was called on its own, outside the model's
        passes, while the model trains: ``model.teacher(x)`` under ``no_grad`` in the
        loop, ``self.teacher(x)`` in a LightningModule's ``training_step``. The large
        frozen parts it holds or lies in run, though the call tracker, which sees
        the model's passes only, cannot tell: :meth:`frozen_in_training` is told.
        Returns whether it lies in one (a teacher, a frozen backbone: no
        evaluation of the model's).

        ``now``: told as the call starts, the part's modes those it runs in: kept
        only if dropout or batch norm in it is in training mode. An EMA copy
        evaluated in eval mode (Lightning enters its validation's ``no_grad``
        before ``model.eval()``) runs nothing in training mode, whatever mode
        ``model.train()`` puts it back in after. False: told later (a part
        watched as a model of its own until the model was found), kept whatever
        its mode.
        """
        if name not in self._called_alone and (not now or self._in_training_under(name)):
            # Kept whatever is frozen now: a part found frozen later (held by no
            # optimizer, known once one attaches) ran all the same.
            self._called_alone.add(name)
            self._not_running = None  # asked again at the next training pass
        return any(_inside(name, part) for part in self.frozen_parts)

    def _in_training_under(self, name: str) -> bool:
        """Whether a listed module in the part ``name`` is in training mode now (all
        listed, not only those of frozen parts: a part is found frozen later when no
        optimizer holds it)."""
        return any(
            _inside(item.name, name) and (module := item.ref()) is not None and module.training
            for item in self.listed
        )

    def still_frozen(self, names: list[str]) -> bool:
        """Whether the parts around these listed modules train no parameter now."""
        root = self._root()
        idle = self.idle
        return root is not None and all(_in_frozen_part(root, name, idle) for name in names)

    def all_train(self, names: list[str]) -> bool:
        """Whether the part around each of these listed modules trains now (a
        parameter of it requires grad and is not :attr:`idle`): a freeze undone
        for all of them, not for some (gradual unfreezing, top layers first)."""
        root = self._root()
        if root is None:
            return False
        idle = self.idle
        holders = [_holder(root, name) for name in names]
        return all(
            holder is not None
            and any(p.requires_grad and id(p) not in idle for p in holder.parameters())
            for holder in holders
        )

    def held_by_none(self, params: Iterable[nn.Parameter]) -> None:
        """The model's parameters no watched optimizer holds, anew (the optimizers'
        membership changed: at an optimizer's attach, a param group added).

        Those with requires_grad=True never seen with a gradient are :attr:`idle`:
        a teacher called under ``no_grad`` inside the model's own pass and never
        frozen is as frozen a part as one with ``requires_grad_(False)``.
        """
        self._set_idle(frozenset(id(p) for p in params if p.requires_grad) - self._got_gradients)

    def got_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Parameters no optimizer holds had gradients at a step: they are updated
        by hand from them, or meant to train (a part left out of the optimizer,
        ``not_optimized``'s finding): no frozen part."""
        ids = {id(p) for p in params}
        self._got_gradients |= ids
        if not self.idle.isdisjoint(ids):
            self._set_idle(self.idle - ids)

    def _set_idle(self, idle: frozenset[int]) -> None:
        if idle != self.idle:
            self.idle = idle
            self.find_frozen_parts()

    def learn_functional(self, found: list[Listed]) -> None:
        """Add modules seen calling dropout or batch norm as functions, in the order seen."""
        listed = {id(item.ref()) for item in self.listed}
        added = False
        for item in found:
            if id(item.ref()) in listed:
                continue
            listed.add(id(item.ref()))
            self._functional.append(item)
            self.listed.append(item)
            self._listing_changed()
            added = True
        if added:
            self.stop_learning(apply=False)
            self.ordered = False  # learn the order again, with the new ones in it

    def __len__(self) -> int:
        return len(self.listed)

    def _listing_changed(self) -> None:
        """``listed`` changed (rebuilt, grown, put in call order): what is kept per
        position in it is made again when next asked."""
        self._parts = {}
        self._chains = {}
        self._tops = {}

    def _listed_in(self, part: str) -> list[Listed]:
        found = self._parts.get(part)
        if found is None:
            found = self._parts[part] = [item for item in self.listed if _inside(item.name, part)]
        return found

    # -- call order ------------------------------------------------------------
    def start_learning(self) -> None:
        """Hook the listed modules for this pass only, to see in which order they run."""
        if self.ordered or self.learning:
            return
        self._calls = []
        seen: set[int] = set()
        root = self._root()
        members = layer_members(root) if root is not None else set()
        for index, item in enumerate(self.listed):
            module = item.ref()
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            hook = WeakHook(self, "_called", index)
            self.learning.add(hook_module(module, hook, pre=True, in_layer=id(module) in members))

    def _called(self, index: int, module: nn.Module, args: Any) -> None:
        if index not in self._calls:
            self._calls.append(index)

    def stop_learning(self, apply: bool = True) -> None:
        """The pass is over: take the hooks off and put the list in call order."""
        if not self.learning:
            return
        self.learning.remove_all()
        calls, self._calls = self._calls, []
        if not apply:
            return
        called = set(calls)
        rest = [i for i in range(len(self.listed)) if i not in called]
        self.listed = [self.listed[i] for i in [*calls, *rest]]
        self._listing_changed()
        self.ordered = True

    def fail(self, exc: BaseException) -> None:
        """Learning the order failed: registration order stays, the checks go on."""
        self.learning.remove_all()
        self.ordered = True
        if self._on_error is not None:
            self._on_error("mode call order", exc)

    # -- the check -------------------------------------------------------------
    def in_mode(
        self,
        training: bool,
        skip_dropout: bool = False,
        part: tuple[str, nn.Module] | None = None,
        pass_over: bool = False,
    ) -> ModeReport | None:
        """The mode-dependent modules whose ``.training`` equals ``training``, in call order.

        ``part``: (its name, itself) for a pass of one part of the model called on
        its own (``self.net(x)`` in a LightningModule): only that part's modules.
        ``pass_over``: asked at the end of a no-grad pass (not at its start): the
        batch norms' counts include it (see :class:`NormReestimation`).
        """
        listed = self.listed if part is None else self._listed_in(part[0])
        try:
            # The usual pass, where no module is in that mode: told in C loops,
            # with no Python per module (a GPT-2 has 37 dropouts).
            if training not in map(_TRAINING, map(_DEREF, map(_REF, listed))):
                return None
        except AttributeError:
            pass  # a module gone (its reference dead): the loop below skips it
        root = self._root()
        ran = root if part is None else part[1]
        if isinstance(ran, DistributedDataParallel):
            # model.eval() on the module inside leaves the wrapper's own flag as it was.
            ran = ran.module
        # The pass's root in eval mode: a dropout in training mode may have been
        # switched on by itself (Monte-Carlo dropout).
        maybe_alone = training and ran is not None and not ran.training
        within = "" if part is None else part[0]
        names: list[str] = []
        kinds: list[str] = []
        found_kinds: list[str] = []
        reestimating = 0  # batch norms among them re-estimating reset statistics
        for name, kind, label, ref in listed:
            module = ref()
            if module is None or module.training != training:
                continue
            if training and kind == "norm" and getattr(module, "momentum", 0.0) is None:
                # A batch norm averaging over every batch it sees (momentum None):
                # its statistics are being recomputed on purpose (PreciseBN,
                # swa_utils.update_bn), in training mode under no_grad.
                return None
            if training and kind == "norm" and self.reestimation.from_reset(module, pass_over):
                # Re-estimating statistics reset since it last trained (a
                # recalibration after pruning or weight averaging, AdaBN): in
                # training mode on purpose, if nothing else is (see below).
                reestimating += 1
            if skip_dropout and kind == "dropout":
                continue
            if maybe_alone and kind == "dropout" and self._switched_alone(name, within):
                continue
            names.append(name)
            kinds.append(label)
            found_kinds.append(kind)
        if len(names) == reestimating:
            # None, or only batch norms re-estimating statistics reset since they
            # last trained. Dropout on beside them makes the pass an evaluation in
            # training mode (or a re-estimation of activations with units dropped),
            # told whole.
            return None
        whole = ran is not None and ran.training == training
        if whole and training and part is not None and root is not None:
            # A part run in training mode on its own, the model around it in eval
            # (``model.eval()`` then ``model.cell.train()``): a chosen part, not the
            # whole model left in training mode.
            model = root.module if isinstance(root, DistributedDataParallel) else root
            whole = model.training
        report = ModeReport(names, kinds, whole, len(listed))
        if not training and root is not None:
            if not whole:
                # The pass's root trains, but a module between it and these may not:
                # ``self.net.eval()`` left on under a LightningModule run as self(x).
                report.parts_in_eval = self._parts_in_eval(listed, within)
            if (
                whole
                or report.parts_in_eval
                or self.wholly_frozen
                or any(k != "norm" for k in found_kinds)
            ):
                # Only where it can matter: normalisation layers in eval beside layers
                # in training mode are an idiom anyway, so the usual fine-tuning step
                # (frozen batch norm after model.train()) walks nothing. With the
                # whole model (or a trained part of it) in eval they are the forgotten
                # model.train(), unless a frozen part holds them: a linear probe's
                # model.eval() over its frozen backbone.
                report.in_frozen_parts = [name for name in names if self._frozen_holder(root, name)]
        return report

    def _parts_in_eval(self, listed: list[Listed], within: str) -> list[str]:
        """The modules ``.eval()`` was called on, above listed modules in eval mode
        and below the pass's root (``within``, in training mode), whose layers
        train: named in call order of the listed modules they hold.

        Each is the topmost of an unbroken run of modules in eval mode above a
        listed one. A norm layer put in eval alone (``m.eval()`` for each batch
        norm: frozen statistics while the layers around it train) has none: its
        parent is in training mode. A frozen backbone's ``.eval()`` has one whose
        layers train nothing, a backbone fine-tuned in its last stage only one
        whose layers train in part: both freezes made on purpose. A trained
        ``net`` in eval under a wrapper that trains is the forgotten
        ``net.train()``; its layers (norm layers left aside: no reason for
        ``.eval()`` on a block of norms alone) all train.

        Read on every training pass that finds modules in eval mode without the
        pass's root: the flags of the listed modules and of the modules above
        them, read in C loops, key what is found for them, so the step walks
        nothing once its layout of modes was seen; whether a part trains is read
        live, from its parameters' flags (frozen or unfrozen at any step).
        """
        watched = self._chains.get(within)
        if watched is None:
            watched = self._chains[within] = self._with_modules_above(listed, within)
        try:
            key = (within, tuple(map(_TRAINING, map(_DEREF, watched))))
        except AttributeError:
            return []  # a module gone: the next rebuild lists what is there
        tops = self._tops.get(key)
        if not tops:
            if tops is not None:
                return []  # the usual fine-tuning step: its layout seen, nothing found
            if len(self._tops) >= _LAYOUTS_KEPT:
                self._tops = {}  # modes switched in many ways: keep the recent ones
            tops = self._tops[key] = self._find_tops(listed, within)
        idle = self.idle
        return [name for name, params in tops if _wholly_trains(params, idle)]

    def _with_modules_above(
        self, listed: list[Listed], within: str
    ) -> tuple[weakref.ref[nn.Module], ...]:
        """These listed modules, then every module above them from the pass's root
        down, once each: whose modes say which modules ``.eval()`` was called on."""
        if any(item.name not in self._above for item in listed):
            self._learn_above()
        seen: dict[str, weakref.ref[nn.Module]] = {}
        for item in listed:
            for prefix, ref in self._above.get(item.name, ()):
                if _inside(prefix, within):
                    seen.setdefault(prefix, ref)
        return (*map(_REF, listed), *seen.values())

    def _find_tops(
        self, listed: list[Listed], within: str
    ) -> tuple[tuple[str, tuple[nn.Parameter, ...]], ...]:
        """For one layout of modes (see :meth:`_parts_in_eval`): the topmost module
        in eval mode above each listed one in eval mode, with its layers' parameters."""
        tops: dict[str, tuple[nn.Parameter, ...]] = {}
        for item in listed:
            module = item.ref()
            if module is None or module.training:
                continue
            top: tuple[str, nn.Module] | None = None
            for prefix, ref in reversed(self._above.get(item.name, ())):
                if prefix == within or not _inside(prefix, within):
                    break  # the pass's root, in training mode, and what is above it
                above = ref()
                if above is None or above.training or isinstance(above, DistributedDataParallel):
                    break
                top = (prefix, above)
            if top is not None and top[0] not in tops:
                tops[top[0]] = _layer_parameters(top[1])
        return tuple(tops.items())

    def _frozen_holder(self, root: nn.Module, name: str) -> bool:
        """:func:`_in_frozen_part`, the holder's parameters found once per listed module."""
        params = self._holders.get(name)
        if params is None:
            holder = _holder(root, name)
            params = self._holders[name] = () if holder is None else tuple(holder.parameters())
        idle = self.idle
        if not idle:
            return bool(params) and True not in map(_REQUIRES_GRAD, params)  # in C
        return bool(params) and not any(p.requires_grad and id(p) not in idle for p in params)

    def _switched_alone(self, name: str, within: str) -> bool:
        """Whether this dropout in training mode was switched on by itself: every
        module above it, from the pass's root (``within``) down, is in eval mode.

        Monte-Carlo dropout's recipe, ``model.eval()`` and then ``.train()`` on each
        dropout module, leaves exactly that; a forgotten ``model.eval()`` leaves the
        modules above in training mode too, and so does ``model.encoder.train()``
        after ``model.eval()``. Read only on no-grad passes whose root is in eval
        mode with some dropout in training mode.
        """
        above = self._above.get(name)
        if above is None:
            self._learn_above()
            above = self._above.get(name, ())
        seen = False
        for prefix, ref in above:
            if not _inside(prefix, within):
                continue  # above the part called on its own
            module = ref()
            if module is None:
                return False
            if isinstance(module, DistributedDataParallel):
                continue  # its flag stays as it was when the module inside is switched
            if module.training:
                return False
            seen = True
        return seen

    def _learn_above(self) -> None:
        """The modules above each listed module, by one walk of the model."""
        root = self._root()
        if root is None:
            return
        by_name: dict[str, nn.Module] = {}
        for qualified, module in root.named_modules():
            by_name.setdefault(user_name(qualified), module)
        for item in self.listed:
            if item.name in self._above:
                continue
            path = item.name.split(".") if item.name else []
            prefixes = [".".join(path[:depth]) for depth in range(len(path))]
            if all(prefix in by_name for prefix in prefixes):
                self._above[item.name] = tuple(
                    (prefix, weakref.ref(by_name[prefix])) for prefix in prefixes
                )
            else:
                self._above[item.name] = ()  # not found: never taken as switched alone


# A frozen subtree holding at least this share of the model's parameters is a
# frozen part of its own (a teacher, a backbone), not a frozen layer.
FROZEN_SHARE = 1 / 3

# Layouts of modes (which modules are in eval) whose parts in eval are kept: a
# run switches between a few (training, an evaluation's, a phase's).
_LAYOUTS_KEPT = 64


def _layer_parameters(module: nn.Module) -> tuple[nn.Parameter, ...]:
    """The parameters of the layers in ``module`` other than normalisation layers."""
    return tuple(
        param
        for sub in module.modules()
        if not isinstance(sub, _NORM_LAYERS)
        for param in sub.parameters(recurse=False)
    )


def _wholly_trains(params: tuple[nn.Parameter, ...], idle: frozenset[int]) -> bool:
    """Whether every one of ``params`` trains: requires grad, and is not ``idle``.

    A part put in eval that holds frozen layers is a freeze made on purpose (a
    backbone fine-tuned in its last stage only, its batch-norm statistics kept
    for all of it): the idiom, not a forgotten ``.train()``.
    """
    if not params:
        return False
    if not idle:
        return False not in map(_REQUIRES_GRAD, params)  # in C
    return all(p.requires_grad and id(p) not in idle for p in params)


def _counts(module: nn.Module, idle: frozenset[int]) -> tuple[int, int]:
    """(parameters, those that train), in elements: one trains when it requires
    grad and is not ``idle`` (see :attr:`ModeWatch.idle`)."""
    total = trained = 0
    for param in module.parameters():
        size = param.numel()
        total += size
        if param.requires_grad and id(param) not in idle:
            trained += size
    return total, trained


# Normalisation layers of any kind (with running statistics or not).
_NORM_LAYERS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, *_NORMS)


def _embeddings_only(module: nn.Module) -> bool:
    """Whether every layer holding parameters in ``module`` is an embedding table or
    a normalisation layer: a frozen embedding block (BERT's ``embeddings``, a large
    share of a small model's parameters) is no frozen part; its dropout is meant
    to be on while the rest trains."""
    holders = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    return (
        bool(holders)
        and all(isinstance(m, (nn.Embedding, *_NORM_LAYERS)) for m in holders)
        and any(isinstance(m, nn.Embedding) for m in holders)
    )


def _with_frozen_siblings(model: nn.Module, large: list[str], idle: frozenset[int]) -> list[str]:
    """The large frozen parts (raw qualified names) with the frozen modules beside
    them: each child of a large part's parent that holds parameters, none of which
    trains (embeddings left out: their dropout is meant to be on), in the
    parent's order.

    A backbone's modules are often the model's own children: a torchvision
    ResNet whose new ``fc`` alone trains has ``conv1``, ``bn1``, ``layer1`` to
    ``layer4`` frozen, of which only ``layer4`` holds a third of the
    parameters. Told alone, its batch norms would be named and ``.eval()`` put
    on it, leaving the others' statistics drifting. A part with no frozen
    sibling (``backbone``, ``teacher``) stays as it is.
    """
    joined: list[str] = []
    for name in large:
        parent_name = name.rpartition(".")[0]
        try:
            parent = model.get_submodule(parent_name)
        except AttributeError:
            joined.append(name)
            continue
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if full in joined:
                continue
            if full == name:
                joined.append(full)
                continue
            size, trains = _counts(child, idle)
            if size and not trains and not _embeddings_only(child):
                joined.append(full)
    return joined


def _inside(name: str, part: str) -> bool:
    return not part or name == part or name.startswith(part + ".")


def _in_frozen_part(root: nn.Module, name: str, idle: frozenset[int]) -> bool:
    """Whether the nearest module holding parameters, from ``name`` up, trains none
    (none requires grad, or those that do are ``idle``: held by no optimizer,
    never given a gradient).

    Dropout has none of its own: the part around it (``backbone`` for
    ``backbone.3``) says whether it is a frozen feature extractor. Asked only
    when a training pass found modules in eval mode.
    """
    holder = _holder(root, name)
    if holder is None:
        return False
    # Stops at its first trainable parameter.
    return not any(p.requires_grad and id(p) not in idle for p in holder.parameters())


def _idle_part(root: nn.Module, name: str, idle: frozenset[int]) -> bool:
    """Whether the part around ``name`` is frozen for being :attr:`ModeWatch.idle`,
    its parameters still requiring grad: the report says no optimizer holds them."""
    holder = _holder(root, name)
    return holder is not None and any(id(p) in idle for p in holder.parameters())


def _holder(root: nn.Module, name: str) -> nn.Module | None:
    """The nearest module holding parameters, from ``name`` up (None: none does)."""
    path = name.split(".") if name else []
    while True:
        try:
            module = root.get_submodule(".".join(path))
        except AttributeError:
            return None
        if next(module.parameters(), None) is not None:
            return module
        if not path:
            return None
        path.pop()
