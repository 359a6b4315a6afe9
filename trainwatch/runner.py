"""``trainwatch run SCRIPT ARGS``: a training script watched with no code change.

The script runs in this process as ``__main__``, with ``sys.argv`` and
``sys.path[0]`` set as ``python SCRIPT ARGS`` would set them, so it cannot
tell the difference; :class:`~trainwatch.autowatch.AutoWatch` finds its models
and optimizers. The exit status is the script's own, so the command can stand
in for ``python`` in CI; ``--fail-on`` turns alerts into a failing status.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from trainwatch.alert import SEVERITIES, severity_rank
from trainwatch.autowatch import AutoWatch, StopRun
from trainwatch.compiled import unwrap
from trainwatch.config import Config, load_config
from trainwatch.raised import note_raise
from trainwatch.registry import owners
from trainwatch.sinks import ALERTS_FILE, Sink, default_sinks
from trainwatch.store_relay import RankSender, StoreLink, env_rank

FAIL_ON = ("never", *SEVERITIES[1:])  # never, warning, error
EXIT_ALERTS = 3  # --fail-on: an alert at or above the level was raised
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # what a shell reports for a process ended by Ctrl-C

_OWN_MODULES = {__name__, "runpy"}


def default_log_dir(root: str | Path = "runs/trainwatch", prefix: str = "") -> Path:
    """A fresh ``runs/trainwatch/<prefix><timestamp>``; never one an earlier run wrote."""
    base = Path(root) / time.strftime(f"{prefix}%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def run_script(
    script: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    log_dir: str | os.PathLike[str] | None = None,
    config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
    max_steps: int | None = None,
    fail_on: str = "never",
    console: bool = True,
) -> int:
    """Run ``script`` as ``python script args`` would, watched; return the exit status."""
    note = Console(stderr=True, highlight=False, soft_wrap=True)
    if fail_on not in FAIL_ON:
        raise ValueError(f"fail_on: {fail_on!r}; choose from {', '.join(FAIL_ON)}")
    path = Path(script)
    if not path.is_file():
        note.print(f"trainwatch run: can't open file {str(script)!r}: no such file")
        return EXIT_USAGE
    cfg = load_config(config)
    out = Path(log_dir) if log_dir is not None else default_log_dir()
    # Under torchrun: rank zero alone writes and prints; the other ranks post
    # their alerts to it through the process group's store.
    link = _relay(cfg)
    if link is not None and link.rank != 0:
        sinks: list[Sink] = [RankSender(link, console)]
    else:
        try:
            sinks = default_sinks(out, cfg, console=console)
        except OSError as exc:
            note.print(f"trainwatch run: --log-dir: cannot write alerts into {str(out)!r}: {exc}")
            return EXIT_USAGE
    watcher = AutoWatch(
        config=cfg, sinks=sinks, max_steps=max_steps, relay=link, script=str(script)
    )
    rank_zero = link is None or link.rank == 0  # trainwatch's own notes are rank zero's
    console = console and rank_zero
    if console:
        note.print(f"[dim]trainwatch run: watching {path}; alerts go to {out / ALERTS_FILE}[/]")
    code = _run_watched(path, list(args), watcher)
    if console and watcher.stopped:
        note.print(f"[dim]trainwatch run: stopped after {watcher.steps} steps (--max-steps)[/]")
    worst = watcher.worst
    if link is not None and fail_on != "never":
        # Every rank exits with the same status: the worst alert standing on any rank.
        worst = link.agree_worst(worst)
    if (
        code == 0
        and fail_on != "never"
        and worst is not None
        and severity_rank(worst) >= severity_rank(fail_on)
    ):
        if rank_zero:
            note.print(
                f"trainwatch run: failing (exit {EXIT_ALERTS}): an alert of severity "
                f"{worst} was raised and --fail-on is {fail_on}"
            )
        code = EXIT_ALERTS
    return code


def _relay(cfg: Config) -> StoreLink | None:
    """This rank's link when a launcher (torchrun) started more than one rank."""
    rank, world = env_rank()
    if world < 2 or not cfg.distributed.relay:
        return None
    return StoreLink("run", rank=rank, world=world, wait_s=cfg.distributed.close_wait_s)


def _run_watched(path: Path, args: list[str], watcher: AutoWatch) -> int:
    """Run the script; whatever happens, hooks come off and alerts are flushed."""
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [str(path), *args]
    script_dir = str(path.resolve().parent)
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    code = 0
    # What keeps the script's globals alive until the run closes: its namespace,
    # or the exception it ended with (whose traceback holds them). Under plain
    # python they live until the interpreter exits, where a monitor the script
    # never closed is closed and tells its summary; runpy drops them on return,
    # which would collect such a monitor unheard.
    ended: object = None
    watcher.install()
    try:
        # __file__ absolute, as python gives it to a script: one that changes
        # directory and then opens files beside itself works the same.
        ended = runpy.run_path(os.path.abspath(path), run_name="__main__")
    except StopRun as exc:
        ended, code = exc, 0
    except SystemExit as exc:
        ended, code = exc, _exit_status(exc.code)
    except KeyboardInterrupt as exc:
        ended = exc
        _print_traceback(exc)
        code = EXIT_INTERRUPTED
    except BaseException as exc:
        ended = exc
        _name_the_module(exc, watcher)
        _print_traceback(exc)
        code = 1
    finally:
        watcher.close()  # the script's own monitors left open first (see AutoWatch)
        del ended
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
    return code


def _name_the_module(exc: BaseException, watcher: AutoWatch) -> None:
    """The note naming the watched module the error escaped from, before the traceback prints."""
    try:
        models = [unwrap(monitor.model) for monitor in watcher.monitors]
        # A script that watches its own model (tw.watch without `with`): its
        # monitor is still open, and its model is where the error came from.
        models += [unwrap(owner.model) for owner in owners() if hasattr(owner, "model")]
        note_raise(exc, list({id(model): model for model in models}.values()))
    except Exception as failure:  # the script's own error is what must be seen
        print(f"trainwatch run: could not name the module: {failure!r}", file=sys.stderr)


def _exit_status(code: object) -> int:
    """What ``sys.exit(code)`` makes the interpreter exit with."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException) -> None:
    """The traceback python would print: the script's frames, not the runner's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in _OWN_MODULES:
        tb = tb.tb_next
    sys.stdout.flush()
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
    if sys.version_info < (3, 11):  # notes are printed with the traceback from 3.11 on
        for note in getattr(exc, "__notes__", ()):
            print(note, file=sys.stderr)
    sys.stderr.flush()
