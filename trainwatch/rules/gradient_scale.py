"""Per-layer gradient norms far out of their usual range: exploding and vanishing.

Both read the per-layer norms the step already has (one batched kernel), so
they cost a few float operations per layer.

Exploding compares each layer with its own recent past (an exponential
average of log norms: scale-free, so one default fits layers whose norms
differ by orders of magnitude), requires the jump to reach the median of the
layers' typical norms, and optionally checks an absolute bound.
Vanishing compares each layer with the other layers of the same step, for
several steps in a row: a layer that is merely small (a rarely used
embedding) is still within a few orders of magnitude of the rest.
"""

from __future__ import annotations

import math
import statistics
import weakref
from collections import deque
from itertools import repeat
from operator import add, mul, sub
from typing import Any

from trainwatch.alert import Alert
from trainwatch.config import ExplodingGradientConfig, VanishingGradientConfig
from trainwatch.record import StepRecord
from trainwatch.rules.base import Rule
from trainwatch.rules.state import rebuilt

_EXPLODING_HINT = (
    "usually a learning rate too high for this point of training, a loss term "
    "that blows up (log of ~0, division by a tiny std), or bad data in this batch. "
    "Clip gradients (torch.nn.utils.clip_grad_norm_), lower the learning rate or "
    "add warm-up, and check the batch that caused it."
)
_VANISHING_HINT = (
    "the signal dies on its way back to this layer: saturating activations "
    "(sigmoid/tanh) in a deep stack, a bad initialisation, or a very small "
    "residual/gating factor. Use ReLU-family activations, normalisation layers, "
    "residual connections or a proper init (kaiming/xavier) for this depth."
)


# How far above the median of the layers' typical norms a jump must end.
_ABOVE_OTHERS = 10.0
# Steps the short-term average spans: a jump is sudden against it too.
_RECENT_WINDOW = 4


def _consume(calls: Any) -> None:
    """Runs a lazy ``map`` of calls made for their effect, in C."""
    deque(calls, maxlen=0)


class _LogAverage:
    """A layer's history as saved before the rule kept them in lists (old checkpoints)."""

    __slots__ = ("mean", "count", "recent")


class ExplodingGradientRule(Rule):
    """Each layer's log norm against its own averages: a long one (about ``window``
    steps) and a recent one (a few steps).

    The averages are kept in lists, one position per layer, so a healthy step
    (every norm finite and non-zero, none far above its average) is judged and
    its averages moved in C loops, with no Python per layer; a step where some
    layer may have jumped goes through the full look, layer by layer.
    """

    id = "exploding_gradient"
    config: ExplodingGradientConfig

    def __init__(self, config: ExplodingGradientConfig) -> None:
        super().__init__(config)
        self._position: dict[str, int] = {}  # layer -> its place in the lists below
        self._means: list[float] = []
        self._recents: list[float] = []
        self._counts: list[int] = []  # 0: no history (new, or restarted)
        # Per layout of a step's layers (kept by the step pipeline): their positions.
        self._positions_of: weakref.WeakKeyDictionary[Any, tuple[list[str], list[int]]] = (
            weakref.WeakKeyDictionary()
        )

    _NOT_STATE = Rule._NOT_STATE | {"_positions_of"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        old = state.get("_history")
        if old:  # saved as one object per layer
            for layer, history in rebuilt(old, type(self).__module__).items():
                place = self._place(layer)
                self._means[place] = history.mean
                self._recents[place] = getattr(history, "recent", history.mean)
                self._counts[place] = history.count

    def _place(self, layer: str) -> int:
        place = self._position.get(layer)
        if place is None:
            place = self._position[layer] = len(self._counts)
            self._means.append(0.0)
            self._recents.append(0.0)
            self._counts.append(0)
        return place

    def evaluate(self, record: StepRecord) -> list[Alert]:
        for layer in record.restarted_layers:
            # New parameters under an old name, or a new training phase: the
            # old history says nothing about these gradients.
            place = self._position.get(layer)
            if place is not None:
                self._counts[place] = 0
        if record.source not in ("optimizer", "manual") or not record.layer_norms:
            return []
        if record.layout is not None and self._healthy_step(record):
            return []
        return self._look(record)

    def _healthy_step(self, record: StepRecord) -> bool:
        """Judged and learnt from in C loops when no layer can have jumped; False: look."""
        norms = record.layer_norms
        values = list(norms.values())
        if 0.0 in values or not all(map(math.isfinite, values)):
            return False
        config = self.config
        if config.max_norm is not None and max(values) > config.max_norm:
            return False
        layers = list(norms)
        kept = self._positions_of.get(record.layout)
        if kept is None or kept[0] != layers:  # new, or the model's layers renamed since
            kept = self._positions_of[record.layout] = (layers, list(map(self._place, layers)))
        places = kept[1]
        counts = list(map(self._counts.__getitem__, places))
        if 0 in counts:
            return False  # a layer without history starts it in the full look
        means = list(map(self._means.__getitem__, places))
        logs = list(map(math.log, values))
        above = list(map(sub, logs, means))
        if max(above) > math.log(config.factor):
            return False  # some layer may have jumped
        alpha = 2.0 / (config.window + 1)
        fast = 2.0 / (_RECENT_WINDOW + 1)
        recents = list(map(self._recents.__getitem__, places))
        # The same float operations as the full look's, element by element.
        new_means = map(add, means, map(mul, repeat(alpha), above))
        new_recents = map(add, recents, map(mul, repeat(fast), map(sub, logs, recents)))
        _consume(map(self._means.__setitem__, places, new_means))
        _consume(map(self._recents.__setitem__, places, new_recents))
        _consume(map(self._counts.__setitem__, places, map(add, counts, repeat(1))))
        return True

    def _look(self, record: StepRecord) -> list[Alert]:
        config = self.config
        alpha = 2.0 / (config.window + 1)
        limit = math.log(config.factor)
        sudden = limit / 2.0  # sqrt(factor) above the last few steps
        fast = 2.0 / (_RECENT_WINDOW + 1)
        max_norm = config.max_norm
        warmup = config.warmup
        means, recents, counts = self._means, self._recents, self._counts
        rows = []
        suspect = False  # some layer jumped against its own past
        for layer, norm in record.layer_norms.items():
            if not 0.0 < norm < math.inf:
                continue  # the non-finite and zero-gradient rules own those
            log_norm = math.log(norm)
            place = self._place(layer)
            # Sudden too: a layer whose norm rose steadily for tens of steps
            # (a deep plain stack waking up from a near-dead start) is far
            # above its long average but not above its last few steps.
            jump = (
                counts[place] > 0
                and log_norm - means[place] > limit
                and log_norm - recents[place] > sudden
            )
            suspect = suspect or jump
            rows.append((layer, norm, log_norm, place, jump))
        # A layer recovering from tiny gradients (a deep stack whose units
        # were nearly dead waking up) jumps by 1e3-1e4 against its own past
        # in healthy runs, but only up to the other layers' level: a jump
        # counts when it also ends well above the layers' typical norms (their
        # median, before this step; taken only when some layer jumped).
        floor = 0.0
        if suspect:
            typical_norms = [mean for mean, count in zip(means, counts) if count]
            floor = _ABOVE_OTHERS * math.exp(statistics.median(typical_norms))
        spikes: list[tuple[float, str, float, float | None]] = []
        for layer, norm, log_norm, place, jump in rows:
            count = counts[place]
            jump = jump and norm >= floor
            over_bound = max_norm is not None and norm > max_norm
            # Each layer has its own warm-up: one first trained late, or
            # restarted, is not judged on its first gradients.
            if count >= warmup and (over_bound or jump):
                typical = math.exp(means[place]) if count else None
                ratio = norm / typical if typical else math.inf
                spikes.append((ratio if jump else 0.0, layer, norm, typical))
                continue  # a spike does not become the new normal
            counts[place] = count + 1
            if count == 0:
                means[place] = recents[place] = log_norm
            else:
                means[place] += alpha * (log_norm - means[place])
                recents[place] += fast * (log_norm - recents[place])
        if not spikes:
            return []
        spikes.sort(key=lambda row: (-row[0], -row[2]))
        ratio, layer, norm, typical = spikes[0]
        if typical is not None and ratio > 0.0:
            what = f"{ratio:.3g}x its recent typical norm {typical:.3g}"
        else:
            what = f"above the configured bound {config.max_norm:g}"
        others = f" ({len(spikes) - 1} other layers too)" if len(spikes) > 1 else ""
        return [
            self.alert(
                record.step,
                layer,
                f"gradient norm of {layer or 'the root module'} jumped to {norm:.3g}, "
                f"{what}{others}",
                _EXPLODING_HINT,
                {
                    "norm": norm,
                    "typical": typical,
                    "ratio": ratio if ratio > 0.0 else None,
                    "layers": [row[1] for row in spikes],
                    "total_norm": record.total_norm,
                },
            )
        ]


class VanishingGradientRule(Rule):
    id = "vanishing_gradient"
    config: VanishingGradientConfig

    def __init__(self, config: VanishingGradientConfig) -> None:
        super().__init__(config)
        self._streaks: dict[str, int] = {}  # layer -> first step of its current streak
        self._lengths: dict[str, int] = {}
        self._reported: set[str] = set()
        self._steps = 0

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.source not in ("optimizer", "manual") or len(record.layer_norms) < 3:
            return []
        self._steps += 1
        values = record.layer_norms.values()
        if 0.0 not in values and all(map(math.isfinite, values)):
            # The usual step, in C: no layer far below the median, no streak open.
            median = statistics.median(values)
            if not self._streaks and min(values) >= self.config.ratio * median:
                return []
            finite = record.layer_norms
        else:
            finite = {k: v for k, v in record.layer_norms.items() if math.isfinite(v) and v > 0.0}
            if len(finite) < 3:
                return []
            median = statistics.median(finite.values())
        low = {k: v for k, v in finite.items() if v < self.config.ratio * median}
        for layer in list(self._streaks):
            if layer not in low:
                del self._streaks[layer]
                del self._lengths[layer]
        for layer in low:
            self._streaks.setdefault(layer, record.step)
            self._lengths[layer] = self._lengths.get(layer, 0) + 1
        if self._steps <= self.config.warmup:
            return []
        due = [
            layer
            for layer in low
            if self._lengths[layer] >= self.config.patience and layer not in self._reported
        ]
        if not due:
            return []
        self._reported.update(due)
        worst = min(due, key=lambda layer: low[layer])
        since = min(self._streaks[layer] for layer in due)
        others = f" ({len(due) - 1} other layers too)" if len(due) > 1 else ""
        return [
            self.alert(
                since,
                worst,
                f"gradient norm of {worst or 'the root module'} is {low[worst]:.3g}, "
                f"{low[worst] / median:.2g}x the median layer's {median:.3g}, for "
                f"{self._lengths[worst]} steps since step {since}{others}",
                _VANISHING_HINT,
                {
                    "norm": low[worst],
                    "median": median,
                    "ratio": low[worst] / median,
                    "layers": due,
                    "since_step": since,
                },
            )
        ]
