"""The user's warnings, shown as they would be without trainwatch.

Python decides whether to show a warning from its filters and, for the
``default`` action (once per code location), from a registry kept in the
globals of the module the warning names. Any change to the filters
(entering or leaving ``warnings.catch_warnings``, ``simplefilter``)
invalidates every registry in the process, so a warning meant to be shown
once shows again at its next occurrence. Nothing here touches the filters.
Both context managers replace ``warnings.showwarning``, which Python calls
only for a warning its filters and registries chose to show (one the filters
turn into an error has raised before), handle what this thread warns and
hand any other thread's warning on, and put back what was there:

- ``reattributed``, around an op a loss audit's function mode runs for the
  user: called from the mode, the op's warning names the mode's frame (a loss
  function warns with ``stacklevel=2``, a C++ op from the innermost Python
  frame). A warning naming trainwatch's code is held, its mark in our
  module's registry undone, and warned again after the op from the frame that
  called the op (the user's line, or ``nn.MSELoss.forward``'s for
  ``F.mse_loss``), the line it names without trainwatch, under the filters
  and registry there. Any other warning is shown as it came.
- ``muted``, around trainwatch's own re-runs of the model (``quiet.replay``):
  what the re-run warns is not shown, and its registry marks are undone, so
  the user's own passes warn as they would have.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType, TracebackType
from typing import Any

import torch

_TRAINWATCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Between a Python op (``F.mse_loss``) and the mode it is handed to.
_DISPATCH_FILE = torch.overrides.__file__


class _ShowHook:
    """``warnings.showwarning`` replaced for the block; what was there is put back."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._previous: Any = None
        self._hook = self._show  # one bound method, so it can be recognised on the way out

    def __enter__(self) -> _ShowHook:
        self._previous = warnings.showwarning
        warnings.showwarning = self._hook
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if warnings.showwarning is self._hook:
            warnings.showwarning = self._previous
        # Otherwise the block replaced it in turn and left it: theirs stays.

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        if threading.get_ident() != self._thread or not self._take(message, category, filename):
            self._previous(message, category, filename, lineno, file, line)
            return
        _forget(message, category, filename, lineno)

    def _take(self, message: Warning | str, category: type[Warning], filename: str) -> bool:
        """Whether this thread's warning is ours to handle (not shown where it came)."""
        raise NotImplementedError


class muted(_ShowHook):
    """trainwatch's own re-run of the user's model shows no warning, and marks no registry.

    A re-run under ``no_grad`` of a reentrant checkpoint would warn "None of
    the inputs have requires_grad=True", the very sign of a real pitfall; a
    warning left marked in a registry would keep the user's own pass from
    showing it later.
    """

    def _take(self, message: Warning | str, category: type[Warning], filename: str) -> bool:
        return True


class reattributed(_ShowHook):
    """``op`` run for the user by a function mode of trainwatch's: its warnings name
    the line that called it, as without the mode."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self._op = op
        self._held: list[Warning] = []

    def _take(self, message: Warning | str, category: type[Warning], filename: str) -> bool:
        if not filename.startswith(_TRAINWATCH_DIR):
            return False  # named PyTorch's line or the user's, as without trainwatch
        self._held.append(message if isinstance(message, Warning) else category(message))
        return True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(kind, exc, tb)
        if not self._held:
            return
        held, self._held = self._held, []
        try:
            _warn_from_callers_line(self._op, held)
        except Warning:
            if kind is None:
                raise  # the user's filters made it an error, as they would have
            # The op's own exception goes on, not one of its warnings.
        except Exception:  # trainwatch's own failure: the warning is lost, training is not
            pass


def _callers_frame(op: Any) -> FrameType | None:
    """The frame that called ``op``: past trainwatch's modes, PyTorch's hand-off to
    them, and the op's own frames (a Python op runs once to reach the mode, once
    from it; a decorated one in its wrapper too)."""
    codes = set()
    for _ in range(8):  # the op and the functions its decorators wrap
        code = getattr(op, "__code__", None)
        if code is not None:
            codes.add(code)
        op = getattr(op, "__wrapped__", None)
        if op is None:
            break
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code in codes
        or frame.f_code.co_filename.startswith(_TRAINWATCH_DIR)
        or frame.f_code.co_filename == _DISPATCH_FILE
    ):
        frame = frame.f_back
    return frame


def _warn_from_callers_line(op: Any, held: list[Warning]) -> None:
    """Warn each again as ``warnings.warn`` would from the op's caller: the same
    filename, line, module and registry it takes from there. Not the caller's
    globals as ``module_globals``: ``warnings.warn`` passes none, and with them
    Python asks the module's loader for the source line, which fails for code
    run by ``exec`` inside a module that has a loader (a line past the end of
    that module's own source)."""
    frame = _callers_frame(op)
    if frame is None:
        return
    globals_ = frame.f_globals
    registry = globals_.setdefault("__warningregistry__", {})
    for message in held:
        warnings.warn_explicit(
            message,
            type(message),
            frame.f_code.co_filename,
            frame.f_lineno or 0,
            module=globals_.get("__name__", "<string>"),
            registry=registry,
        )


def _forget(message: Warning | str, category: type[Warning], filename: str, lineno: int) -> None:
    """Undo the registry marks Python made for a warning it just chose to show.

    They sit in the globals of the frame the warning names (found by its file
    and line among the frames below): one for the line, and for the ``once``
    and ``module`` actions one for the whole module, ``(text, category)`` (the
    C implementation keeps ``once`` there too; the Python one in
    ``warnings.onceregistry``, and ``module`` under ``(text, category, 0)``).
    A mark the warning found already set would have kept it from showing, so
    each one here is its own.
    """
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and not (
        frame.f_code.co_filename == filename and frame.f_lineno == lineno
    ):
        frame = frame.f_back
    if frame is None:
        return  # a warning given its place by hand (warn_explicit): left as it is
    text = str(message)
    registry = frame.f_globals.get("__warningregistry__")
    if not isinstance(registry, dict):
        return
    registry.pop((text, category, lineno), None)
    action = _action(text, category, frame.f_globals.get("__name__", "<string>"), lineno)
    if action == "module":
        registry.pop((text, category), None)
        registry.pop((text, category, 0), None)
    elif action == "once" and registry.pop((text, category), None) is None:
        warnings.onceregistry.pop((text, category), None)


def _action(text: str, category: type[Warning], module: str, lineno: int) -> str:
    """The filters' action for a warning, matched as ``warnings.warn_explicit`` does."""
    for action, message, kind, where, line in warnings.filters:
        if (
            (message is None or message.match(text))
            and issubclass(category, kind)
            and (where is None or where.match(module))
            and (line == 0 or line == lineno)
        ):
            return str(action)
    return str(warnings.defaultaction)
