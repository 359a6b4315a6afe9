"""Unshuffled data: batches far less varied than the run, or a training loader read in order.

Data sorted by label and read in order gives every batch one class: the model
chases one class at a time and forgets the others. From the batches, in any
loop: the sampled batches' distinct classes are compared with how many a
batch of the same size drawn at random from the run's targets (pooled over
the sampled batches) would hold. Shuffled data holds about as many as the
random draw, imbalanced classes included, since the draw follows the run's
own class frequencies; sorted data holds one or two where the draw holds
nearly all.

Training task by task (class-incremental continual learning: each task's
few classes from a shuffled loader of its own) also gives batches of few of
the run's classes, by design. What tells it from sorted data is how the
classes change. A task's batches draw from one set of at least two classes
for a long stretch, about as a random draw from that set would, and the set
changes at a few boundaries: a phase. Sorted data's class drifts on through
the epoch: a stretch of its batches holds one class, or takes in new
classes with every batch, and no two of its batches share two classes (only
a batch across the boundary of two classes' blocks holds both). Where the
window holds phases, their batches are compared with a draw from their own
phase, and batches cut off by the window at its ends are left out; a window
without a phase is compared with the run's targets, as before.

A P x K identity sampler (re-identification, metric learning: P classes a
batch, exactly K samples of each, new classes every batch) gives few classes
a batch by design too, and its composition shows in the targets alone:
every batch holds each of its classes exactly K >= 2 times (those cut short
at an epoch's end aside), and its labels lie scattered. Data sorted by
label whose blocks happen to fill batches evenly gives the same counts, but
each batch then holds a run of neighbouring labels, and the runs of two
batches are the same or apart. Such a window ends the check, silently, as
the visible loader's own sampler does.

Where the training loader is visible, its sampler says the same ahead of
the evidence: a sequential sampler alone is one ``info`` line (data may be
stored shuffled); with the targets' deficit, or with no targets to look at,
it is a warning. A class loss over tokens or pixels (a language model's
contiguous stream, read in order by design) ends the check, silently.
"""

from __future__ import annotations

from collections import Counter
from itertools import combinations, repeat
from operator import add, itemgetter

from trainwatch.alert import Alert
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule

_HINT = (
    "shuffle the training data: DataLoader(dataset, shuffle=True) (or a RandomSampler); "
    "data stored sorted by label gives every batch one class, so each step pulls the model "
    "towards one class and away from the others. Validation loaders need no shuffling"
)
# Classes the run must have shown before a batch can hold too few of them.
_MIN_CLASSES = 3
# Fewer targets than this per batch cannot show a deficit (a batch of one holds one class).
_MIN_TARGETS = 4
# A phase (one task's classes) holds at least this share of the classes that
# random draws from the phase's own targets would hold.
_PHASE_COVERED = 0.6


class UnshuffledDataRule(Rule):
    """Sampled batches' classes against the run's; the training sampler's order."""

    id = "unshuffled_data"
    needs = frozenset({"class_targets"})
    reads = "class_targets"  # set on sampled steps only

    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.pooled: list[float] = []  # the run's targets per class, over sampled batches
        # (targets, distinct classes, counts) per sampled batch
        self.recent: list[tuple[float, float, list[float]]] = []
        self.batches = 0
        self.order: str | None = None  # how the training loader reads in order, when it does
        self.done = False  # one finding per run

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if self.done:
            return []
        look = record.class_targets
        if look is None:
            return []
        if look.per_position or look.own_batching is not None:
            # Tokens of a text stream or pixels of an image: the targets vary
            # within each sample, and reading the stream in order is the design.
            # A sampler of the user's own composes batches of few classes on
            # purpose (P x K identities, N-way K-shot episodes).
            self.done = True
            return []
        if look.data_order is not None:
            self.order = look.data_order
        if look.counts:
            self._add(look.counts)
            found = self._deficit(record.step)
            if found is not None:
                self.done = True
                return [found]
        if self.order is None:
            return []
        config = self.config
        if not self.batches and record.step >= config.min_batches * config.every:  # type: ignore[attr-defined]
            self.done = True
            # Nothing to check the order against (an autoencoder, a regression):
            # the sampler alone says too little for a warning.
            return [
                self._order_alert(
                    record.step,
                    "info",
                    "no class targets were seen to check (data stored sorted by time, "
                    "target or source would make successive batches alike)",
                )
            ]
        if self.batches >= 2 * config.window:  # type: ignore[attr-defined]
            classes = len(self.pooled) - self.pooled.count(0.0)
            if classes >= _MIN_CLASSES:
                self.done = True
                return [
                    self._order_alert(
                        record.step,
                        "info",
                        f"its batches' classes look shuffled ({self.batches} sampled batches): "
                        "the data may be stored shuffled",
                    )
                ]
            # Too few classes seen for the batches to show a deficit: a run trained
            # task by task in class order, or data sorted by label, may still be in
            # its first classes (the warning comes with a third). A binary task
            # never shows one: the sampler alone, after twice as many batches.
            if self.batches >= 4 * config.window:  # type: ignore[attr-defined]
                self.done = True
                return [
                    self._order_alert(
                        record.step,
                        "info",
                        f"its batches were not judged ({classes} classes seen in "
                        f"{self.batches} sampled batches: too few to tell)",
                    )
                ]
        return []

    def _add(self, counts: list[float]) -> None:
        if sum(counts) < 2:
            return  # every target ignored (ignore_index): nothing to compare
        if len(counts) != len(self.pooled):
            self.pooled = [0.0] * len(counts)  # another head: start over
            self.recent = []
        self.pooled = list(map(add, self.pooled, counts))
        # Counts are whole and never negative: the classes held are those not at zero.
        self.recent.append((sum(counts), float(len(counts) - counts.count(0.0)), counts))
        del self.recent[: max(0, len(self.recent) - self.config.window)]  # type: ignore[attr-defined]
        self.batches += 1

    def _deficit(self, step: int) -> Alert | None:
        config = self.config
        recent = self.recent
        if len(recent) < config.min_batches:  # type: ignore[attr-defined]
            return None
        classes = len(self.pooled) - self.pooled.count(0.0)
        if classes < _MIN_CLASSES:
            return None
        sizes = list(map(itemgetter(0), recent))
        if sum(sizes) < _MIN_TARGETS * len(recent):
            return None
        held = sum(map(itemgetter(1), recent)) / len(recent)
        expected = expected_distinct(self.pooled, sizes) / len(recent)
        if held > config.ratio * expected:  # type: ignore[attr-defined]
            return None
        if identity_batches(recent):
            # P identities of K samples each, drawn anew every batch (re-ID,
            # metric learning): few classes a batch is the sampler's design.
            self.done = True
            return None
        judged = len(recent)
        # Few of the run's classes a batch: told only where the batches are
        # no phases of a run trained task by task (asked on a deficit only).
        phased = against_phases(recent, self.pooled)
        if phased is not None:
            held, expected, judged = phased
            if held > config.ratio * expected:  # type: ignore[attr-defined]
                return None
        where = (
            f"; the training DataLoader reads in order through {self.order}"
            if self.order is not None
            else ""
        )
        return self.alert(
            step,
            None,
            f"the last {judged} sampled batches held {held:.1f} classes each on average "
            f"where batches drawn at random from this run's targets would hold {expected:.1f} "
            f"({classes} classes seen): the data arrives grouped by class{where}",
            _HINT,
            {
                "classes_per_batch": round(held, 3),
                "expected_classes_per_batch": round(expected, 3),
                "classes_seen": classes,
                "sampled_batches": judged,
                "sampler": self.order,
            },
        )

    def _order_alert(self, step: int, severity: str | None, evidence: str) -> Alert:
        return self.alert(
            step,
            None,
            f"the training DataLoader reads its data in order through {self.order}; {evidence}",
            _HINT,
            {"sampler": self.order, "sampled_batches": self.batches},
            severity=severity,
        )


def expected_distinct(pool: list[float], sizes: list[float]) -> float:
    """Distinct classes in batches of ``sizes`` targets each, drawn at random from the
    targets counted per class in ``pool``: the sum over the batches.

    Batches are mostly one size: each size is worked out once, over the
    classes in one C loop, since this runs at every sampled step.
    """
    total = sum(pool)
    missed = [1.0 - c / total for c in pool if c > 0]  # P(not this class), one draw
    classes = len(missed)
    expected = 0.0
    for size, batches in Counter(sizes).items():
        expected += batches * (classes - sum(map(pow, missed, repeat(size))))
    return expected


def stretches(recent: list[tuple[float, float, list[float]]]) -> list[list[int]]:
    """The batches (by index) cut into stretches: a batch continues the stretch when
    its targets fall mostly in classes the stretch has held so far and it holds
    more than half the classes a random draw from the stretch's targets would;
    any other starts the next.

    A run trained task by task gives one stretch a task, whether the next
    task brings new classes or narrows to a few of the old ones; sorted data
    gives stretches of one class, or of one batch where each brings new
    classes.
    """
    found: list[list[int]] = []
    pool: list[float] = []
    for index, (size, held, batch) in enumerate(recent):
        if found and len(batch) == len(pool):
            inside = sum(n for n, seen in zip(batch, pool) if seen)
            if 2 * inside > size and 2 * held > expected_distinct(pool, [size]):
                found[-1].append(index)
                pool = list(map(add, pool, batch))
                continue
        found.append([index])
        pool = list(batch)
    return found


def _classes_held(counts: list[float]) -> set[int]:
    return {index for index, n in enumerate(counts) if n}


def _pooled(batches: list[tuple[float, float, list[float]]]) -> list[float]:
    return [sum(column) for column in zip(*(batch[2] for batch in batches))]


def is_phase(batches: list[tuple[float, float, list[float]]]) -> bool:
    """Whether ``batches`` (one stretch) draw from one set of classes, as a task's do.

    Two of them hold two classes or more in common, which data sorted by
    class never gives within an epoch (a batch holds two classes only
    across the boundary of their blocks, which no other batch reaches), and
    they hold about as many classes as random draws from the stretch's own
    targets would, not far fewer.
    """
    if len(batches) < 2:
        return False
    held = [_classes_held(batch[2]) for batch in batches]
    if not any(len(a & b) >= 2 for a, b in combinations(held, 2)):
        return False
    expected = expected_distinct(_pooled(batches), [batch[0] for batch in batches])
    return sum(batch[1] for batch in batches) >= _PHASE_COVERED * expected


def against_phases(
    recent: list[tuple[float, float, list[float]]], run: list[float]
) -> tuple[float, float, int] | None:
    """Classes held per batch, what random draws would hold (a phase's batches
    drawn from the phase's own targets, the others from the run's), and the
    batches judged; None where the window holds no phase.

    A run trained task by task holds few of the run's classes a batch, but
    about all of its task's: each task's batches make a phase
    (:func:`is_phase`). The stretches before the window's first phase and
    after its last are left out: their own phases are cut off by the window
    (the end of an earlier task, the first batches of the next, too few yet
    to tell). Sorted data makes no phase: its batches stay compared with the run.
    """
    cut = [[recent[i] for i in stretch] for stretch in stretches(recent)]
    phases = [is_phase(batches) for batches in cut]
    if not any(phases):
        return None
    first = phases.index(True)
    last = len(phases) - phases[::-1].index(True)
    held = expected = 0.0
    judged = 0
    for batches, phase in zip(cut[first:last], phases[first:last]):
        sizes = [batch[0] for batch in batches]
        expected += expected_distinct(_pooled(batches) if phase else run, sizes)
        held += sum(batch[1] for batch in batches)
        judged += len(batches)
    return held / judged, expected / judged, judged


def identity_batches(recent: list[tuple[float, float, list[float]]]) -> bool:
    """Whether ``recent`` batches come from a P x K identity sampler: most hold
    P >= 2 classes with exactly K >= 2 targets each (K the same throughout),
    any other is a batch cut short at an epoch's end (fewer targets, none of
    its classes more than K times); and those full batches' labels lie
    scattered.

    Data sorted by label whose blocks of K fill batches evenly gives the same
    counts; what tells it apart is where its labels lie: every batch holds a
    run of neighbouring labels (none between its lowest and highest missing),
    and two batches' runs are the same (the next epoch's) or apart.
    Identities drawn at random scatter. Neighbouring labels, not neighbours
    among the classes seen so far: the few sampled batches of a first window
    have seen too few classes for that, and random pairs of identities are
    often neighbours among them.
    """
    per_class = max(max(batch[2]) for batch in recent)
    if per_class < 2:
        return False
    # No count is above per_class: a batch holds exactly per_class of each of
    # its classes where its size is that many times the classes it holds.
    full: list[tuple[float, float, list[float]]] = []
    cut: list[tuple[float, float, list[float]]] = []
    for batch in recent:
        size, held, _ = batch
        (full if held >= 2 and size == held * per_class else cut).append(batch)
    if len(full) < 2 or len(cut) >= len(full):
        return False
    largest = max(batch[0] for batch in full)
    if any(batch[0] >= largest for batch in cut):
        return False  # a batch of another make, not one cut short
    spans = []
    for _, held, counts in full:
        classes = [index for index, n in enumerate(counts) if n]
        low, high = classes[0], classes[-1]
        if high - low + 1 != held:
            return True  # a label between them is not in this batch
        spans.append((low, high))
    # Every batch a run of neighbouring classes: sorted data unless two runs overlap.
    return any(a != b and a[0] <= b[1] and b[0] <= a[1] for a, b in combinations(spans, 2))
