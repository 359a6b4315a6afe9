"""Dropout and batch norm called as functions: which modules call them, and when they act.

Graph networks and many research models call ``F.dropout(x, p,
training=self.training)`` or ``F.batch_norm(..., training=self.training)``
with no ``Dropout`` or ``BatchNorm`` module anywhere, so no module type says
that the model behaves differently in training mode. The calls themselves
say it: in training mode they drop units or normalise with the batch's own
statistics (and overwrite the running ones); in eval mode they do neither.

A look is a ``TorchFunctionMode`` over one whole pass of the model, with
global module hooks that keep the stack of the model's modules running, so
each call is put on the innermost of them. For an evaluation left in training
mode it runs on sampled no-grad passes made in training mode: the first few
of such a model, then one in ``every``. Once a module is seen calling one of
these functions, the plain ``.training`` check covers it like any
``Dropout`` module, and no further look is needed.

Training in eval mode (``model.eval()`` in an evaluation, ``model.train()``
never called back) needs the same knowledge, which those looks never give
where every no-grad pass runs in eval mode. So the passes with gradients
among the first ``training_passes`` of a model no module type flags are
looked at too, those made in training mode, and the modules seen there with
dropout or batch norm acting are held. A call that acts in training mode may
act in any mode (``F.dropout(x, p)`` keeps its default ``training=True``): a
module held is taken for mode-dependent only once a later look at a no-grad
pass with the module in eval mode sees its call not act (the evaluation that
``model.eval()`` was called for); a call that acts there too is let go.
Later passes with gradients get no look: a healthy step past the first ones
asks one attribute whether its grad mode gets a look, as it did before.

Stochastic depth written as a module (timm's ``DropPath``: a Bernoulli mask
per sample, drawn only when ``self.training``) calls no such function: it
draws random numbers. A module seen drawing them in training mode, in any
look, is run once more as its call ends, itself and its parts in eval mode
(``collect/eval_rerun.py``): drawing none there, it acts as dropout does and
is found; drawing there too (a VAE's sampling, noise injected in any mode, an
augmentation inside the model), it is let go. Each module is judged once.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode

from trainwatch.collect import quiet
from trainwatch.collect.broadcast import _stack_is_ours_to_use
from trainwatch.collect.eval_rerun import run_in_eval
from trainwatch.collect.mode_stack import enter as enter_mode
from trainwatch.collect.mode_stack import leave as leave_mode
from trainwatch.collect.modes import Listed
from trainwatch.compiled import user_name
from trainwatch.hooks import HookGroup, KwargsHookHandle, WeakHook


def _argument(func: Callable[..., Any], name: str, position: int, default: Any) -> Callable:
    """Reads one argument of a call to ``func``, by name or by position.

    A Python function's own signature gives the position and default; a
    builtin's (which has none to inspect) are the ones given here.
    """
    try:
        parameter = inspect.signature(func).parameters[name]
        position = list(inspect.signature(func).parameters).index(name)
        if parameter.default is not inspect.Parameter.empty:
            default = parameter.default
    except (TypeError, ValueError, KeyError):
        pass

    def read(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[position] if len(args) > position else default

    return read


def _dropout(func: Callable[..., Any], train_name: str = "training") -> Callable:
    """Drops units when its training flag is on and ``p > 0``."""
    read_p = _argument(func, "p", 1, 0.5)
    read_training = _argument(func, train_name, 2, False)

    def acts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(read_training(args, kwargs)) and float(read_p(args, kwargs)) > 0.0

    return acts


def _batch_norm(func: Callable[..., Any], stats: int, train_name: str = "training") -> Callable:
    """Normalises with the batch's statistics and overwrites the running ones when training."""
    read_stats = _argument(func, "running_mean", stats, None)
    read_training = _argument(func, train_name, 5, False)

    def acts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return bool(read_training(args, kwargs)) and read_stats(args, kwargs) is not None

    return acts


def _attention(func: Callable[..., Any], position: int, training: bool) -> Callable:
    """Drops attention weights when ``dropout_p > 0`` (and its training flag, if any, is on)."""
    read_p = _argument(func, "dropout_p", position, 0.0)
    read_training = _argument(func, "training", 13, True) if training else None

    def acts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if read_training is not None and not read_training(args, kwargs):
            return False
        return float(read_p(args, kwargs)) > 0.0

    return acts


# function -> (kind, label, does this call behave as in training mode?)
_MODE_FUNCTIONS: dict[Any, tuple[str, str, Callable[[tuple, dict], bool]]] = {
    F.dropout: ("dropout", "F.dropout", _dropout(F.dropout)),
    F.dropout1d: ("dropout", "F.dropout1d", _dropout(F.dropout1d)),
    F.dropout2d: ("dropout", "F.dropout2d", _dropout(F.dropout2d)),
    F.dropout3d: ("dropout", "F.dropout3d", _dropout(F.dropout3d)),
    F.alpha_dropout: ("dropout", "F.alpha_dropout", _dropout(F.alpha_dropout)),
    F.feature_alpha_dropout: (
        "dropout",
        "F.feature_alpha_dropout",
        _dropout(F.feature_alpha_dropout),
    ),
    torch.dropout: ("dropout", "torch.dropout", _dropout(torch.dropout, "train")),
    torch.feature_dropout: (
        "dropout",
        "torch.feature_dropout",
        _dropout(torch.feature_dropout, "train"),
    ),
    torch.alpha_dropout: (
        "dropout",
        "torch.alpha_dropout",
        _dropout(torch.alpha_dropout, "train"),
    ),
    F.scaled_dot_product_attention: (
        "dropout",
        "F.scaled_dot_product_attention(dropout_p)",
        _attention(F.scaled_dot_product_attention, 4, training=False),
    ),
    F.multi_head_attention_forward: (
        "dropout",
        "F.multi_head_attention_forward(dropout_p)",
        _attention(F.multi_head_attention_forward, 10, training=True),
    ),
    F.batch_norm: ("norm", "F.batch_norm", _batch_norm(F.batch_norm, 1)),
    torch.batch_norm: ("norm", "torch.batch_norm", _batch_norm(torch.batch_norm, 3)),
    F.instance_norm: (
        "norm",
        "F.instance_norm",
        _batch_norm(F.instance_norm, 1, "use_input_stats"),
    ),
}

# Functions and tensor methods that draw random numbers: a module calling them in
# training mode and not in eval mode (a stochastic-depth DropPath's Bernoulli
# mask, ``keep + torch.rand(shape)`` floored) acts as dropout does.
_RANDOM_DRAWS: frozenset[Any] = frozenset(
    getattr(owner, name)
    for owner, names in (
        (
            torch,
            "rand rand_like randn randn_like randint randint_like randperm bernoulli "
            "normal poisson multinomial",
        ),
        (
            torch.Tensor,
            "bernoulli bernoulli_ uniform_ normal_ random_ exponential_ geometric_ "
            "cauchy_ log_normal_ multinomial",
        ),
    )
    for name in names.split()
    if hasattr(owner, name)
)


class _CallMode(TorchFunctionMode):
    def __init__(self, look: FunctionalLook) -> None:
        super().__init__()
        self.look = weakref.ref(look)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _MODE_FUNCTIONS:
            look = self.look()
            if look is not None:
                try:
                    look.saw(func, args, kwargs)
                except Exception as exc:  # never break the user's forward
                    look.fail(exc)
        elif func in _RANDOM_DRAWS:
            look = self.look()
            if look is not None:
                try:
                    look.drew()
                except Exception as exc:
                    look.fail(exc)
        return out


def _read_modes_above(depth: int | None) -> bool:
    """Whether every mode above the stack's first ``depth`` is zero_gradient's look
    at the parameters a pass reads (which leaves at the pass's end)."""
    from trainwatch.collect.parameter_reads import _ReadMode  # imports broadcast

    if depth is None:
        return True
    above = range(depth, torch._C._len_torch_function_stack())
    return all(isinstance(torch._C._get_function_stack_at(i), _ReadMode) for i in above)


# Values of ``torch.is_grad_enabled()``.
_GRAD = frozenset({True})
_ANY_GRAD = frozenset({True, False})


class FunctionalLook:
    """One watched pass of the model: a sampled no-grad pass, watched for dropout and
    batch-norm calls acting as in training; one of the first training passes, for the
    modules that call them; a no-grad pass in eval mode, for whether those calls stop."""

    def __init__(
        self,
        first: int,
        every: int,
        on_error: Callable[[str, BaseException], None],
        training_passes: int = 0,
    ):
        self.first = first
        self.every = every
        self._on_error = on_error
        self._candidates = 0  # no-grad passes in training mode seen so far
        # Training passes in training mode still to look at, and no-grad passes in
        # eval mode looked at for the modules held (counted from the last one held).
        self._training_left = training_passes
        self._judged = 0
        # Read as each pass of the model starts (an attribute, not a call): the
        # values of ``torch.is_grad_enabled()`` whose passes get no look. Empty
        # while training passes are still to be looked at; passes with gradients
        # from then on; every pass once looks are broken.
        self.skipped_grad_modes = _GRAD if training_passes <= 0 else frozenset()
        # Modules seen with dropout or batch norm acting in a training pass made in
        # training mode, by id, not yet seen calling them in eval mode.
        self.held: dict[int, Listed] = {}
        self._judging = False  # the pass watched is a no-grad pass in eval mode
        self._training = False  # the pass watched is a training pass
        self._mode = _CallMode(self)
        self._depth: int | None = None  # the mode stack's depth with ours on top
        self._hooks = HookGroup()
        self._names: dict[int, tuple[str, weakref.ref[nn.Module]]] = {}
        self._stack: list[int] = []
        self._skip_dropout = False
        # Modules seen drawing random numbers, by id: whether their draws stop in
        # eval mode (found mode-dependent), asked once each by running the module
        # again in eval mode at the end of its call (see _judge_draws).
        self._draws: dict[int, tuple[weakref.ref[nn.Module], bool]] = {}
        # Modules of the pass watched that drew in training mode, by id, not yet judged.
        self._drawing: set[int] = set()
        # The module being run again in eval mode (its id), and whether it drew there.
        self._rerun: int | None = None
        self._rerun_drew = False
        self.found: list[Listed] = []
        self.broken = False
        # Read after every pass of the model (an attribute, not a call): a look is on.
        self.active = False
        # Our mode is still on the stack under one entered after it: popped at a
        # later step boundary, when it is on top again.
        self.pending = False

    def due(self) -> bool:
        """Counts a candidate pass; whether this one is looked at."""
        n = self._candidates
        self._candidates += 1
        return not self.broken and (n < self.first or (self.every > 0 and n % self.every == 0))

    def training_due(self) -> bool:
        """Counts a pass with gradients, in any mode (a model trained in eval mode
        from the start does not pay for the question at every step); whether it is
        among the first ``training_passes``."""
        if self._training_left <= 0 or self.broken:
            return False
        self._training_left -= 1
        if self._training_left <= 0:
            self.skipped_grad_modes = _GRAD  # the healthy step asks nothing more
        return True

    def no_more_training_passes(self) -> None:
        """Training passes need no look (module types already flag the model)."""
        self._training_left = 0
        if not self.broken:
            self.skipped_grad_modes = _GRAD

    def judge_due(self) -> bool:
        """A no-grad pass in eval mode while modules are held: whether it is looked at
        (the first ``first`` such passes after a module was last held)."""
        if not self.held or self.broken or self._judged >= self.first:
            return False
        self._judged += 1
        return True

    def start(
        self, model: nn.Module, skip_dropout: bool, training: bool = False, judging: bool = False
    ) -> None:
        """Watch the pass that begins now (called from the model's own pre-hook).

        ``training``: a training pass, whose acting calls are held; ``judging``: a
        no-grad pass in eval mode, which tells the held modules mode-dependent or not.
        """
        if self.active or self._depth is not None or not _stack_is_ours_to_use():
            return  # (our mode still on the stack under another: not entered twice)
        self._skip_dropout = skip_dropout
        self._training = training
        self._judging = judging
        self.found = []
        self._stack = []
        self._names = {
            id(module): (user_name(name), weakref.ref(module))
            for name, module in model.named_modules()
        }
        self._hooks.add(module_hooks.register_module_forward_pre_hook(WeakHook(self, "enter")))
        self._hooks.add(
            KwargsHookHandle(
                module_hooks.register_module_forward_hook(
                    WeakHook(self, "leave"), with_kwargs=True, always_call=True
                )
            )
        )
        self._stack.append(id(model))
        enter_mode(self._mode)
        self._depth = torch._C._len_torch_function_stack()
        self.active = True

    def finish(self) -> list[Listed]:
        """The pass is over: every hook and the mode come off; the modules seen calling."""
        self._hooks.remove_all()
        self.active = False
        self.release()
        if self.pending and not _read_modes_above(self._depth):
            # A mode entered inside the pass is still on top: popping now would
            # pop it instead of ours. Ours stays, inert, until a step boundary
            # finds it on top again; no look runs after that. zero_gradient's
            # look at the parameters a pass reads, entered after ours as the
            # pass began, leaves as it ends and takes ours along.
            self._break()
        self._training = self._judging = False
        self._names = {}
        self._stack = []
        self._drawing = set()
        found, self.found = self.found, []
        return found

    def release(self) -> None:
        """Pop our mode if it is on top of the stack (``__exit__`` pops whatever is)."""
        if self._depth is not None and leave_mode(self._mode):
            self._depth = None
        self.pending = self._depth is not None

    # -- inside the pass -------------------------------------------------------
    def enter(self, module: nn.Module, args: Any) -> None:
        if id(module) in self._names:
            self._stack.append(id(module))

    def leave(self, module: nn.Module, args: Any, *rest: Any) -> None:
        """``rest``: (kwargs, output); (output,) alone where the call raised (PyTorch
        calls an always-called global hook that way on an exception's way out: the
        module's call was not made whole, so it is not re-run)."""
        if self._stack and self._stack[-1] == id(module):
            self._stack.pop()
        if self._drawing and id(module) in self._drawing and self._rerun is None:
            self._drawing.discard(id(module))
            if len(rest) == 2:
                self._judge_draws(module, args, rest[0])

    def drew(self) -> None:
        """A random number was drawn: by the module innermost in the pass."""
        if not self._stack or self._stack[-1] not in self._names:
            return
        key = self._stack[-1]
        if self._rerun is not None:
            self._rerun_drew = self._rerun_drew or key == self._rerun
            return
        if not self.active or self.broken or quiet.replaying() or self._skip_dropout:
            return  # (Monte-Carlo dropout on purpose: draws are dropout's)
        seen = self._draws.get(key)
        if seen is not None and seen[0]() is self._names[key][1]():
            return  # judged already
        module = self._names[key][1]()
        if module is None:
            return
        if module.training:
            self._drawing.add(key)  # judged as its call ends
        else:
            self._draws[key] = (weakref.ref(module), False)  # draws in eval mode too

    def _judge_draws(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A module drew random numbers in training mode: run it again in eval mode.
        Drawing none there, it behaves differently in training mode (stochastic
        depth); drawing there too, it is noise in any mode (a VAE's sampling)."""
        key = id(module)
        self._rerun, self._rerun_drew = key, False
        try:
            ran = run_in_eval(module, args, kwargs)
        finally:
            self._rerun = None
        gated = ran and not self._rerun_drew
        self._draws[key] = (weakref.ref(module), gated)
        if gated and all(item.ref() is not module for item in self.found):
            name = self._names[key][0] if key in self._names else ""
            label = f"{type(module).__name__}, random in training"
            self.found.append(Listed(name, "dropout", label, weakref.ref(module)))

    def saw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active or self.broken or quiet.replaying():
            return  # trainwatch's own re-run of a module is not the user's pass
        kind, label, acts = _MODE_FUNCTIONS[func]
        if self._skip_dropout and kind == "dropout":
            return
        if not self._stack or self._stack[-1] not in self._names:
            return
        key = self._stack[-1]
        name, ref = self._names[key]
        if self._judging:
            self._judge(key, ref(), acts(args, kwargs))
        elif not acts(args, kwargs):
            return
        elif self._training:
            module = ref()
            if module is not None and module.training and key not in self.held:
                self.held[key] = Listed(name, kind, label, ref)
                self._judged = 0  # the next evaluations are looked at for it
        elif all(item.ref() is not ref() for item in self.found):
            self.found.append(Listed(name, kind, label, ref))

    def _judge(self, key: int, module: nn.Module | None, acted: bool) -> None:
        """A held module called dropout or batch norm in a no-grad pass: in eval mode,
        a call that does not act makes it mode-dependent (found); one that acts, not."""
        item = self.held.get(key)
        if item is None or module is None or item.ref() is not module or module.training:
            return
        del self.held[key]
        if not acted:
            self.found.append(item)

    def _break(self) -> None:
        self.broken = True
        self.skipped_grad_modes = _ANY_GRAD

    def fail(self, exc: BaseException) -> None:
        """A look failed: looks end (the mode comes off at the pass's end), the rest goes on."""
        self._break()
        self._hooks.remove_all()
        self._on_error("functional mode look", exc)

    def detach(self) -> None:
        self._break()
        self.held = {}
        self.finish()
