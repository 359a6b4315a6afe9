"""Unshuffled data: batches far less varied than the run, or a training loader read in order.

Data sorted by label and read in order gives every batch one class: the model
chases one class at a time and forgets the others. From the batches, in any
loop: the sampled batches' distinct classes are compared with how many a
batch of the same size drawn at random from the run's targets (pooled over
the sampled batches) would hold. Shuffled data holds about as many as the
random draw, imbalanced classes included, since the draw follows the run's
own class frequencies; sorted data holds one or two where the draw holds
nearly all.

Where the training loader is visible, its sampler says the same ahead of
the evidence: a sequential sampler alone is one ``info`` line (data may be
stored shuffled); with the targets' deficit, or with no targets to look at,
it is a warning. A class loss over tokens or pixels (a language model's
contiguous stream, read in order by design) ends the check, silently.
"""

from __future__ import annotations

from collections import Counter
from itertools import repeat
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


class UnshuffledDataRule(Rule):
    """Sampled batches' classes against the run's; the training sampler's order."""

    id = "unshuffled_data"
    needs = frozenset({"class_targets"})
    reads = "class_targets"  # set on sampled steps only

    def __init__(self, config: object) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.pooled: list[float] = []  # the run's targets per class, over sampled batches
        self.recent: list[list[float]] = []  # (targets, distinct classes) per sampled batch
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
            self.done = True
            return [
                self._order_alert(
                    record.step,
                    "info",
                    f"its batches' classes look shuffled ({self.batches} sampled batches): "
                    "the data may be stored shuffled",
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
        self.recent.append([sum(counts), float(len(counts) - counts.count(0.0))])
        del self.recent[: max(0, len(self.recent) - self.config.window)]  # type: ignore[attr-defined]
        self.batches += 1

    def _expected_distinct(self, sizes: list[float]) -> float:
        """Distinct classes in a batch of each of ``sizes`` targets drawn at random from
        the run's targets, on average over the batches.

        Batches are mostly one size: each size is worked out once, over the
        classes in one C loop, since this runs at every sampled step.
        """
        total = sum(self.pooled)
        missed = [1.0 - c / total for c in self.pooled if c > 0]  # P(not this class), one draw
        classes = len(missed)
        expected = 0.0
        for size, batches in Counter(sizes).items():
            expected += batches * (classes - sum(map(pow, missed, repeat(size))))
        return expected / len(sizes)

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
        expected = self._expected_distinct(sizes)
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
            f"the last {len(recent)} sampled batches held {held:.1f} classes each on average "
            f"where batches drawn at random from this run's targets would hold {expected:.1f} "
            f"({classes} classes seen): the data arrives grouped by class{where}",
            _HINT,
            {
                "classes_per_batch": round(held, 3),
                "expected_classes_per_batch": round(expected, 3),
                "classes_seen": classes,
                "sampled_batches": len(recent),
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
