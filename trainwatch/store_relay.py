"""Other ranks' alerts reach rank zero through the process group's store.

``tw.watch`` and ``trainwatch run`` under a process group of more than one
rank: rank zero alone writes ``alerts.jsonl`` and prints; every other rank
posts its alerts into the store the process group was set up with (the
``TCPStore`` of ``torchrun`` or ``env://``, or a ``FileStore``), and rank zero
reads them at its own step boundaries.

Why the store and not a gather (the Lightning callback gathers, at points
Lightning makes every rank reach together):

* No rank can be left waiting. A post and a read are each a round trip to the
  store, not a collective: a rank that stops early, closes its monitor late,
  watches on rank zero only or has died leaves nobody blocked. The one wait
  there is, rank zero's at close for the other ranks' last alerts, is bounded
  by ``distributed.close_wait_s``.
* A healthy step costs nothing on the other ranks (a post happens only when an
  alert is raised) and, on rank zero, one read of a counter every
  ``distributed.gather_every`` steps.
* The store object outlives ``dist.destroy_process_group()``: it is held from
  the moment the relay connects, so a script that tears its group down before
  the monitor closes still gets its last alerts delivered.
* A rank's alert is in the store as soon as it is raised, so a rank that fails
  right after (DDP's error at the next forward) has delivered it already.

Keys live under ``trainwatch/<channel>/``; a channel is one watched run (each
``tw.watch`` call in creation order, or the whole ``trainwatch run``), the
same on every rank of a script that does the same on every rank.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any

from trainwatch.alert import Alert, severity_rank
from trainwatch.config import Config
from trainwatch.dispatch import Dispatcher
from trainwatch.halt_sync import running_distributed
from trainwatch.sinks.base import Sink, Summary
from trainwatch.sinks.console import ConsoleSink

if TYPE_CHECKING:
    from trainwatch.monitor import Monitor

_watch_channels = itertools.count()

# deliver(alert, repeats): a first alert has repeats == 0; otherwise the alert
# fired `repeats` more times on its rank since the last delivery.
Deliver = Callable[[Alert, int], None]


def env_rank() -> tuple[int, int]:
    """(rank, world size) as a launcher set them (``torchrun``: RANK, WORLD_SIZE)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def next_watch_channel() -> str:
    return f"watch{next(_watch_channels)}"


class StoreLink:
    """One channel of the store: posts from this rank, or (rank zero) reads from the others."""

    def __init__(self, channel: str, *, rank: int, world: int, wait_s: float) -> None:
        self.channel = channel
        self.rank, self.world = rank, world
        self.wait_s = wait_s
        self.store: Any = None
        # Why the store could not be used; from then on nothing is tried again
        # (a store whose server went away could make every try slow).
        self.broken: str | None = None
        self._posts = 0
        self._taken: dict[int, int] = {}  # rank -> posts read from it (rank zero)
        self._posted_seen = 0

    def _key(self, *parts: object) -> str:
        return "/".join(["trainwatch", self.channel, *map(str, parts)])

    def connect(self) -> bool:
        """Hold the default group's store, while the group is up; True once held and working."""
        if self.broken is not None:
            return False
        if self.store is not None:
            return True
        if not running_distributed():
            return False
        import torch.distributed as dist

        try:
            store = dist.distributed_c10d._get_default_store()
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            store.set(self._key(self.rank, "opened"), "1")
        except Exception as exc:  # an unusual store: each rank keeps its alerts
            self.broken = f"{type(exc).__name__}: {exc}"
            return False
        self.store = store
        return True

    # -- the other ranks ----------------------------------------------------
    def post(self, records: list[dict[str, Any]]) -> bool:
        """Put records where rank zero reads them; False when rank zero will not."""
        if not records:
            return True
        if not self.connect():
            return False
        store = self.store
        try:
            if store.check([self._key(0, "closed")]):
                return False  # rank zero has closed: nobody reads any more
            self._posts += 1
            store.set(self._key(self.rank, self._posts), json.dumps(records))
            store.add(self._key(self.rank, "n"), 1)
            store.add(self._key("posted"), 1)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def close_rank(self) -> None:
        """This rank posts no more: rank zero stops waiting for it."""
        if self.store is None:
            return
        try:
            self.store.set(self._key(self.rank, "closed"), "1")
        except Exception:  # rank zero's wait is bounded
            pass

    # -- rank zero -----------------------------------------------------------
    def take(self) -> list[dict[str, Any]]:
        """Records posted since the last call: one counter read when there are none."""
        if not self.connect():
            return []
        store = self.store
        out: list[dict[str, Any]] = []
        try:
            posted = store.add(self._key("posted"), 0)
            if posted == self._posted_seen:
                return out
            self._posted_seen = posted
            for rank in range(1, self.world):
                count = store.add(self._key(rank, "n"), 0)
                for post in range(self._taken.get(rank, 0) + 1, count + 1):
                    key = self._key(rank, post)
                    out.extend(json.loads(store.get(key)))
                    store.delete_key(key)
                self._taken[rank] = count
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
        return out

    def take_last(self) -> tuple[list[dict[str, Any]], list[int]]:
        """At close: wait (bounded) for every rank that posts here to close, then take the rest.

        Returns the records and the ranks that had not closed in time.
        """
        if not self.connect():
            return [], []
        late = self._wait_for("closed", self._opened())
        records = self.take()
        try:
            self.store.set(self._key(0, "closed"), "1")
        except Exception:
            pass
        return records, late

    def agree_worst(self, worst: str | None) -> str | None:
        """Every rank: the highest severity raised on any rank (bounded wait)."""
        if not self.connect():
            return worst
        try:
            self.store.set(self._key(self.rank, "worst"), worst or "")
        except Exception:
            return worst
        ranks = [r for r in range(self.world) if r != self.rank]
        self._wait_for("worst", ranks)
        found = [worst]
        for rank in ranks:
            try:
                if self.store.check([self._key(rank, "worst")]):
                    found.append(self.store.get(self._key(rank, "worst")).decode() or None)
            except Exception:
                continue
        try:
            self.store.set(self._key(self.rank, "agreed"), "1")
        except Exception:
            pass
        if self.rank == 0:
            # Rank zero may host the store's server: it stays until every rank has read.
            self._wait_for("agreed", ranks)
        return max((s for s in found if s), key=severity_rank, default=None)

    def _opened(self) -> list[int]:
        try:
            return [r for r in range(1, self.world) if self.store.check([self._key(r, "opened")])]
        except Exception:
            return []

    def _wait_for(self, what: str, ranks: list[int]) -> list[int]:
        """Wait up to ``wait_s`` for each rank's key; the ranks still missing."""
        deadline = time.monotonic() + self.wait_s
        missing = list(ranks)
        while missing:
            try:
                missing = [r for r in missing if not self.store.check([self._key(r, what)])]
            except Exception:
                return missing
            if not missing or time.monotonic() >= deadline:
                break
            left = max(0.001, deadline - time.monotonic())
            try:
                self.store.wait([self._key(missing[0], what)], timedelta(seconds=min(left, 0.5)))
            except Exception:
                pass  # timed out on this one: look at them all again
        return missing


class RankSender(Sink):
    """The only sink on a rank other than zero: posts each alert into the store at once.

    A first alert is posted when it is raised; repeats are counted and go
    with the next post or at close. What cannot be delivered (rank zero has
    closed, or the store is out of reach) is printed on this rank's stderr.
    """

    name = "relay"

    def __init__(self, link: StoreLink, console: bool | IO[str] = True) -> None:
        self.link = link
        self.console = console
        self._repeats: dict[tuple[str, str | None], tuple[Alert, int]] = {}  # key -> (alert, times)

    def emit(self, alert: Alert) -> None:
        self._send([{"alert": alert.to_dict(), "repeats": 0}])

    def repeat(self, alert: Alert, count: int) -> None:
        _, times = self._repeats.get(alert.key, (alert, 0))
        self._repeats[alert.key] = (alert, times + 1)

    def close(self, summary: Summary) -> None:
        self._send([])
        self.link.close_rank()

    def _send(self, records: list[dict[str, Any]]) -> None:
        repeats, self._repeats = self._repeats, {}
        records = [
            *({"alert": a.to_dict(), "repeats": n} for a, n in repeats.values()),
            *records,
        ]
        if records and not self.link.post(records):
            self._print_here([r for r in records if not r["repeats"]])

    def _print_here(self, records: list[dict[str, Any]]) -> None:
        if self.console is False or not records:
            return
        stream = sys.stderr if self.console is True else self.console
        why = self.link.broken or "rank 0 is no longer reading"
        print(
            f"trainwatch (rank {self.link.rank}): not delivered to rank 0 ({why}):",
            file=stream,
        )
        sink = ConsoleSink(stream, summary=False)
        for record in records:
            sink.emit(Alert.from_dict(record["alert"]))


class RankZeroReceiver:
    """Rank zero's side: reads the store at its step boundaries, hands alerts to ``deliver``."""

    def __init__(self, link: StoreLink, deliver: Deliver, every: int, note: IO[str] | None):
        self.link = link
        self.deliver = deliver
        self.every = every
        self.note = note  # where a rank that did not close in time is named (None: nowhere)
        self.closed = False

    def at_step(self, step: int) -> None:
        """Every step's end; reads the store every ``every`` steps (0: never here)."""
        if self.every and (step + 1) % self.every == 0:
            self.receive()

    def receive(self) -> None:
        if self.closed:
            return
        try:
            self._hand_over(self.link.take())
        except Exception as exc:  # never break training: the relay goes off, said once
            self._fail(exc)

    def close(self) -> None:
        if self.closed:
            return
        try:
            records, late = self.link.take_last()
            self._hand_over(records)
        except Exception as exc:
            self._fail(exc)
            return
        self.closed = True
        if late and self.note is not None:
            ranks = ", ".join(map(str, late))
            print(
                f"trainwatch: rank(s) {ranks} had not closed {self.link.wait_s:g} s after "
                "rank 0 did; what they raise later is printed on their own stderr",
                file=self.note,
            )

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.note is not None:
            print(
                f"trainwatch: delivery of other ranks' alerts failed and is off ({exc!r}); "
                "training continues",
                file=self.note,
            )

    def _hand_over(self, records: list[dict[str, Any]]) -> None:
        try:
            alerts = [(Alert.from_dict(r["alert"]), int(r.get("repeats", 0))) for r in records]
        except Exception as exc:  # a record of another version: skip the batch, say so
            if self.note is not None:
                print(f"trainwatch: unreadable alerts from another rank: {exc!r}", file=self.note)
            return
        for alert, repeats in sorted(alerts, key=lambda pair: pair[0].step):
            self.deliver(alert, repeats)


def into_dispatcher(dispatcher: Dispatcher) -> Deliver:
    """Rank zero's sinks get another rank's alert; the same finding twice is one line, counted."""

    def deliver(alert: Alert, repeats: int) -> None:
        times = repeats or 1
        if alert.key not in dispatcher.tallies:
            held = dispatcher.held
            dispatcher.publish([alert], may_halt=False)
            # Another rank's halt is carried by the halt check, not by rank zero.
            dispatcher.held = held
            times -= 1
        tally = dispatcher.tallies.get(alert.key)
        if times and tally is not None:
            tally.count += times
            tally.last_step = max(tally.last_step, alert.step)
            for sink in list(dispatcher.sinks):
                try:
                    sink.repeat(alert, tally.count)
                except Exception:  # the dispatcher reports a failing sink on its own calls
                    pass

    return deliver


def watch_relay(config: Config) -> StoreLink | None:
    """A link for ``tw.watch`` when a process group of more than one rank is up (relay on)."""
    if not (config.distributed.relay and running_distributed()):
        return None
    import torch.distributed as dist

    link = StoreLink(
        next_watch_channel(),
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        wait_s=config.distributed.close_wait_s,
    )
    link.connect()
    return link


def join(monitor: Monitor, link: StoreLink, console: bool | IO[str]) -> None:
    """Wire a monitor into its rank's side of the link (its sinks are chosen by the caller)."""
    monitor.relayed = True  # a halting alert reaches rank zero through the store
    if link.rank != 0:
        return
    note = None if console is False else (sys.stderr if console is True else console)
    receiver = RankZeroReceiver(
        link, into_dispatcher(monitor._dispatcher), monitor.config.distributed.gather_every, note
    )
    monitor.at_boundary.append(receiver.at_step)
    monitor.before_halt.append(receiver.receive)
    monitor.before_close.append(receiver.close)
