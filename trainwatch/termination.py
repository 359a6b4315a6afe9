"""SIGTERM: trainwatch closes its files, then the process ends as SIGTERM ends it.

A scheduler stops a job (preemption, ``kill``, ``docker stop``, a Kubernetes
pod going away) with SIGTERM. Its default action ends the process at once:
no ``finally`` blocks, no ``atexit``, so a monitor never closes. alerts.jsonl
is complete then all the same (each line is flushed as it is written), but
the step TensorBoard is still gathering, the events the summary writer has
not flushed yet and ``alert_counts.json`` would be lost.

So while a monitor is open, and only where SIGTERM still has its default
action, trainwatch stands in for that default: close what is open, put the
default back and send SIGTERM again, so the process still dies *by SIGTERM*
(its exit status, what a parent or a scheduler sees, is unchanged). A handler
of the user's, or of a framework (Lightning has its own graceful SIGTERM),
is never replaced, and one that chains to ours later does not end the
process through us. Handlers can only be set from the main thread: a monitor
opened elsewhere goes without.

The handler runs in the main thread wherever it was interrupted, possibly
inside a TensorBoard write that holds the summary writer's non-reentrant
lock; closing then would wait on that lock forever. trainwatch's own writes
are therefore marked :func:`uninterrupted`: a SIGTERM arriving inside one is
acted on as soon as it ends (microseconds, or as long as the writer's queue
stays full). Whatever happens, a watchdog ends the process
:data:`GRACE_SECONDS` after the signal, closed or not.

One limit of any Python-level handler: it runs when the main thread gets back
to Python code. A main thread stuck inside one long C call (a hung
collective) ends only when the call returns, or by the SIGKILL a scheduler
sends after its grace period, which loses at most the line being written.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Closable(Protocol):
    def close(self) -> None: ...


# Far longer than a healthy close (milliseconds), shorter than the grace
# periods schedulers give before SIGKILL (10-30 s).
GRACE_SECONDS = 5.0

# id(holder) -> (pid that holds it, weak reference). A forked child (a
# DataLoader worker) inherits both the handler and this table, and must not
# close its parent's monitors. Plain dict operations, no lock: the handler
# may interrupt the main thread in the middle of hold() or release().
_holders: dict[int, tuple[int, weakref.ref[Any]]] = {}
_MAIN = threading.main_thread().ident
_writing = 0  # trainwatch writes in progress on the main thread
_deferred = False  # a SIGTERM arrived during one of them


def hold(closable: Closable) -> None:
    """Close ``closable`` if SIGTERM ends the process while it is open."""
    key = id(closable)
    _holders[key] = (os.getpid(), weakref.ref(closable, _forgetter(key)))
    _install()


def release(closable: Closable) -> None:
    """``closable`` closed on its own; once nothing is held, the default comes back."""
    _holders.pop(id(closable), None)
    _uninstall_if_idle()


def installed() -> bool:
    """Whether trainwatch's handler is SIGTERM's handler now."""
    return signal.getsignal(signal.SIGTERM) is _on_sigterm


def uninterrupted(method: F) -> F:
    """A write the SIGTERM handler must not cut into: it is acted on when the write ends."""

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        global _writing, _deferred
        if threading.get_ident() != _MAIN:
            return method(*args, **kwargs)  # handlers only ever interrupt the main thread
        _writing += 1
        try:
            return method(*args, **kwargs)
        finally:
            _writing -= 1
            if _deferred and _writing == 0:
                _deferred = False
                _close_and_end()

    return guarded  # type: ignore[return-value]


def _forgetter(key: int) -> Callable[[weakref.ref[Any]], None]:
    """A holder garbage-collected without close() lets go of the handler too."""

    def forget(ref: weakref.ref[Any]) -> None:
        entry = _holders.get(key)
        if entry is not None and entry[1] is ref:
            del _holders[key]
        _uninstall_if_idle()

    return forget


def _held() -> list[Any]:
    """This process's open holders, oldest first."""
    pid = os.getpid()
    entries = list(_holders.values())
    return [obj for owner, ref in entries if owner == pid and (obj := ref()) is not None]


def _install() -> None:
    if threading.get_ident() != _MAIN:
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the user's, a framework's, ours already, SIG_IGN, or set from C
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # a sub-interpreter, a platform without SIGTERM
        return


def _uninstall_if_idle() -> None:
    if _held() or threading.get_ident() != _MAIN:
        return  # elsewhere it stays: with nothing held it acts as the default would
    try:
        if installed():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):  # interpreter shutdown
        pass


def _on_sigterm(signum: int, frame: Any) -> None:
    global _deferred
    if not installed():
        # Called by a later handler that chains to the one it found: that
        # handler decides how the process ends, as it would over the default.
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends it at once
    _start_watchdog()
    if _writing:
        _deferred = True  # finish the write first; uninterrupted() takes it from there
        return
    _close_and_end()


def _start_watchdog() -> None:
    watchdog = threading.Timer(GRACE_SECONDS, _end)
    watchdog.daemon = True
    try:
        watchdog.start()
    except RuntimeError:  # interpreter shutting down: no new threads
        pass


def _close_and_end() -> None:
    """Newest first, like ``atexit``: a run's monitors before the run that feeds on them."""
    for obj in reversed(_held()):
        try:
            obj.close()
        except BaseException:  # the process is ending; the next one may still close
            pass
    _end()


def _end() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the default action is back in place
