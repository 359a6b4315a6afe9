"""The processes a script starts under ``trainwatch run``, for its closing line.

``trainwatch run`` watches the process it starts, not the processes the script
starts in turn: a script that starts its ranks with ``torch.multiprocessing``
(``mp.spawn``, ``start_processes``, Lightning's ``ddp_spawn``) trains in
them, and the run itself sees no step. Saying "no optimizer stepped" there
points the user at their loop, which is sound; the line names the processes
instead, and what watches them.

``multiprocessing``'s ``BaseProcess.start`` is wrapped while the run lasts (as
``DataLoader.__iter__`` is): one Python call per process started, never on a
training step. A DataLoader's workers read data and are not counted.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from multiprocessing.process import BaseProcess
from typing import Any

from trainwatch.patches import MethodPatch

# What the target of a process started by torch.multiprocessing's spawn or
# start_processes is defined in (its _wrap, which runs the script's function).
_TORCH_SPAWN = "torch.multiprocessing.spawn"
# Where a DataLoader worker's target is defined: data loading, not training.
_DATA_WORKERS = "torch.utils.data"


class ChildProcesses:
    """Counts the processes the script starts, by launcher, while installed."""

    def __init__(self) -> None:
        self.started: Counter[str] = Counter()
        self._lock = threading.Lock()  # start_processes may start them from threads
        self._wrapped: MethodPatch | None = None

    def install(self) -> None:
        owner = weakref.ref(self)

        def wrap(original: Any) -> Any:
            def start(process: BaseProcess) -> None:
                counter = owner()
                if counter is not None:
                    try:
                        counter._starting(process)
                    except Exception:  # never stand between the script and its processes
                        pass
                original(process)

            return start

        self._wrapped = MethodPatch(BaseProcess, "start", wrap)

    def remove(self) -> None:
        if self._wrapped is not None:
            self._wrapped.remove()
            self._wrapped = None

    def _starting(self, process: BaseProcess) -> None:
        where = getattr(getattr(process, "_target", None), "__module__", None) or ""
        if where.startswith(_DATA_WORKERS):
            return
        launcher = "torch.multiprocessing" if where == _TORCH_SPAWN else "multiprocessing"
        with self._lock:
            self.started[launcher] += 1

    def note(self, script: str) -> str | None:
        """The closing line of a run that watched no step while the script started
        processes of its own; None when it started none."""
        ranks = self.started["torch.multiprocessing"]
        if ranks:
            return (
                "trainwatch: no training step watched in this process: the script started "
                f"{ranks} process{'es' if ranks > 1 else ''} with torch.multiprocessing "
                "(mp.spawn or start_processes), which trainwatch run does not follow. Start "
                f"the ranks with torchrun instead (torchrun --nproc-per-node={ranks} -m "
                f"trainwatch run {script}, the script reading RANK and WORLD_SIZE from the "
                "environment instead of spawning), or call tw.watch(model, optimizer) inside "
                "the function the processes run (it reports from each of them)"
            )
        others = self.started["multiprocessing"]
        if others:
            return (
                "trainwatch: no training step watched in this process: the script started "
                f"{others} process{'es' if others > 1 else ''} with multiprocessing, which "
                "trainwatch run does not follow: a model trained there is watched by calling "
                "tw.watch(model, optimizer) inside the function the process runs"
            )
        return None
