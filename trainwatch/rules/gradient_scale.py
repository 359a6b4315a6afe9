"""Per-layer gradient norms far out of their usual range: exploding and vanishing.

Both read the per-layer norms the step already has (one batched kernel), so
they cost a few float operations per layer, and on a healthy step no Python
per layer: both take their usual step in C loops (``map`` over the norms),
exploding with its averages kept as lists per set of layers, and look at each
layer in Python only past a cheap trigger.

Exploding compares each layer with its own recent past (an exponential
average of log norms: scale-free, so one default fits layers whose norms
differ by orders of magnitude), requires the jump to reach the median of the
layers' typical norms, and optionally checks an absolute bound. A layer whose
norm is noisy by nature needs a jump beyond its own noise too: a classifier
trained to a near-zero loss has near-zero gradients but for the odd hard
example, which lifts its norms 50-150x for one step, healthily (its log norm
moves by about 1.5 a step, against 0.1-0.3 for most layers most of the time).
A jump that is gone a step later is no explosion either, unless it is huge: a
batch-of-one policy gradient has steady, tiny norms while its policy is
near-deterministic, and 60-190x that for the one step it samples the unlikely
action; such a jump is held back a step and dropped once it passed, while one
that goes on is told, dated at the step it began.
A layer's norm may also have two usual levels far apart (a detector trained one
mostly empty image a step; a policy gradient whose episodes often return
nothing): the steps past ``factor`` are averaged apart, and once they keep
coming back on a sizeable share of the steps, those steps are judged against
that upper level instead, as the others against the typical norm, which they
move as any usual step does.
Vanishing compares each layer with the other layers of the same step, for
several steps in a row: a layer that is merely small (a rarely used
embedding) is still within a few orders of magnitude of the rest. A vanishing
gradient dies on its way back from the loss, so a layer is told only where a
layer nearer the loss (later in the model's order) still gets a gradient of
the usual size: one at the output end with none such is converged, not
starved (a normalising flow's last batch-norm layer, whose closed-form optimum
leaves it a gradient of ~1e-6 by design; a regression's output offset at the
data's mean).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from copy import copy as shallow_copy
from itertools import repeat
from operator import add, mul, sub
from typing import Any

from trainwatch.alert import Alert
from trainwatch.collect.backward_end_norms import BackwardEndNorms
from trainwatch.collect.model_copies import CopiesLook, SyncedCopy
from trainwatch.collect.model_kind import RECURRENT
from trainwatch.collect.nonfinite_locate import NORM_OVERFLOW
from trainwatch.collect.weights_at_alert import HeldParameters
from trainwatch.config import ExplodingGradientConfig, VanishingGradientConfig
from trainwatch.layers import EXTERNAL
from trainwatch.record import NonfiniteReport, StepRecord
from trainwatch.rules.base import Rule

_EXPLODING_CAUSE = (
    "usually a learning rate too high for this point of training, a loss term "
    "that blows up (log of ~0, division by a tiny std), or bad data in this batch. "
)
_EXPLODING_HINT = (
    _EXPLODING_CAUSE + "Clip gradients (torch.nn.utils.clip_grad_norm_), lower the learning "
    "rate or add warm-up, and check the batch that caused it."
)
# The loop clips already: the clip bounds the update, not what made the jump.
_EXPLODING_HINT_CLIPPED = (
    _EXPLODING_CAUSE + "The loop's clip_grad_norm_ bounds the update, not the cause: lower "
    "the learning rate or add warm-up, and check the batch that caused it."
)
_OVERFLOW_HINT = (
    "values that large come from an outlier far outside the data's range in this "
    "batch (a corrupt target or input, whose error dominates the loss) or from "
    "weights the updates blew up: check this batch, drop or clamp outliers, or use "
    "a robust loss (huber_loss, smooth_l1_loss)"
)
# A model whose explosions come from its weights, not from an outlier in the data
# (trainwatch.collect.model_kind): the cause, then the fix. A recurrent one trained
# with a regression loss only where the course of its norms says so (see
# ``_one_batch_cause``).
_FROM_THE_WEIGHTS = {
    RECURRENT: (
        "a recurrent network's gradients explode through its time steps: {name} "
        "multiplies the signal by the same weights at each one, so an update that "
        "grows them grows the gradients by their power. The usual cause is a learning "
        "rate too high for it with no small clip to bound each update, not an outlier "
        "(a robust loss would not help). "
    ),
    "classification": (
        "{name} bounds each sample's gradient on the logits whatever its target, so no "
        "corrupt label makes a jump this large: the updates blew the weights up (a "
        "learning rate too high for this point of training), or an input lies far "
        "outside the data's range. "
    ),
}
# A recurrent model trained with a regression loss whose norms were steady until
# one step's jump: that batch, as in any regression. An LSTM forecaster fed one
# stuck-sensor reading of 4000 in a standardised series jumps 2e3-2e5x, its loss
# 1e7x, and is back to its usual norms the next step.
_ONE_BATCH = (
    "the gradient norms were steady until this step, and {loss} grows without bound "
    "with a target's or input's distance from the data: one value far outside the "
    "data's range in this batch (a stuck or corrupt sensor reading, a sentinel such as "
    "-999, a unit mix-up) makes a jump this large in a recurrent model ({name}) as in "
    "any other. Check the batch that caused it and drop or clamp such values{robust}"
)
_ROBUST = ", or use a robust loss (huber_loss, smooth_l1_loss)"
_BOUNDED_LOSSES = frozenset({"huber_loss", "smooth_l1_loss"})
_ONE_BATCH_CLIP = (
    ", and clip gradients (torch.nn.utils.clip_grad_norm_) so that one batch cannot "
    "throw the weights far"
)
_ONE_BATCH_CLIPS = (
    "; the loop's clip_grad_norm_ bounds one batch's update only as far as its "
    "max_norm is small (0.25 to 1.0)"
)
_ONE_BATCH_LET_THROUGH = (
    "; the loop's clip_grad_norm_ let it through to the weights (max_norm {max_norm:g}): "
    "give it a small max_norm (0.25 to 1.0)"
)
# Should the jumps go on, the other cause: the recurrent weights.
_UNLESS_IT_GOES_ON = (
    ". If the norms stay high over the next steps instead, {name}'s weights blew up "
    "(it multiplies the signal by them at each time step): lower the learning rate{clip}."
)
_CLIP_SMALL = (
    "Clip gradients between backward and the update, torch.nn.utils.clip_grad_norm_("
    "model.parameters(), max_norm) with a small max_norm (0.25 to 1.0), and lower "
    "the learning rate."
)
# The loop clips already: the clip bounds the update only as far as its max_norm does.
_CLIP_SMALLER = (
    "The loop's clip_grad_norm_ bounds the update only as far as its max_norm is "
    "small: keep it at 0.25 to 1.0, and lower the learning rate."
)
# The jump passed the loop's clip on to the weights.
_LET_THROUGH = (
    "The loop's clip_grad_norm_ let it through to the weights (max_norm {max_norm:g}): "
    "give it a small max_norm (0.25 to 1.0) and lower the learning rate"
)
# The jump came at a step whose batch through batch norm (in training mode) was far
# smaller than the usual one: the epoch's remainder a DataLoader with drop_last=False
# ends on. Batch norm normalises it by its own few samples' mean and variance.
_SMALL_BATCH = "small_batch"
_SMALL_BATCH_HINT = (
    "this step's batch held {rows} sample{s} against the usual {usual}, and {layer} "
    "(batch norm, in training mode) normalised it by those few samples' own mean and "
    "variance, which are mostly noise: the gradients jump with them. "
    "A DataLoader with drop_last=False ends each epoch on such a remainder of the "
    "dataset: pass drop_last=True to the training DataLoader (or pick a batch size "
    "that divides the dataset); the learning rate is not the cause."
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
# A jump is this many times the layer's usual step-to-step move above its
# average, at least (the move: an exponential mean of |log norm - the
# short-term average|, which one level shift, a layer waking up, barely
# raises). Six healthy saturated classifiers (300 steps each, SGD with
# momentum) jumped by up to 4.9 of theirs; a steady layer's move (0.1-0.3)
# leaves the ``factor`` bound in charge. A jump well above the highest typical
# norm the layer ever had is one however noisy the layer (a learning rate
# raised 100x on such a classifier: 19x its highest; its healthy spikes: 1.5x),
# once its last few steps rose above that highest too: a batch-of-one policy
# gradient's single-sample norms are heavy-tailed (60x its typical norm, 25x
# its highest, for one step now and then, the next step back to usual).
_SPREAD_UNITS = 6.0
_ABOVE_PEAK = 5.0
_RISEN = math.log(1.5)
# A jump in one step that no healthy run makes, in its first steps too: a layer's
# norm at least this many times its last few steps' and the highest typical norm
# it has had, and this many times the median of the layers' typical norms, as
# the update carries it (after the loop's clip). Told whatever the layer's
# warm-up or noise. In their first 50 steps healthy runs jump by at most 90x:
# transformers (pre- and post-LN, with and without LR warm-up) 2x, ResNets with
# batch norm 3x, DCGANs 2x, batch-of-one policy gradients 6x (a bandit's heavy
# tail: 60x), regressions 5x, the test suite's models 90x; a loss scaled 1e4x for
# one step, 8.5e3x. Before their clip, RNN language models at lr 20 clipped to
# 0.25 jump further (LSTM, GRU, tanh up to 18x; ReLU up to 4e5x in 74 seeds of
# 75, and from 0.1 to 1e18 in the other, which trains on): hence the jump is
# judged after the clip.
# Without one, that ReLU model jumps 1e6-1e19x the step before its weights
# overflow.
_ENORMOUS = 1e6
# The ``kind`` of such a jump's alert.
_BURST = "enormous_jump"


# A layer's norm may have two usual levels: a dense detector trained one image a
# step, most images empty, has near-zero gradients on an empty image (the focal
# loss under its prior bias) and 1e3-1e5x that on one holding an object; a
# batch-of-one policy gradient whose episodes often return nothing likewise. The
# steps past ``factor`` above the typical norm are averaged apart (``upper``),
# with how often they come: once they come on at least this share of the steps
# (an average over ``_RECURRING_WINDOWS`` windows), and the norm keeps falling
# back from them (no run of them in a row longer than chance makes at that
# share, ``_BY_CHANCE``), that level is one of the layer's usual ones. A layer's
# odd hard example (one step in 50) or a policy's rare action stays below the
# share; a norm that jumps and stays up (rewards scaled 100x for good, a layer
# waking up) makes a run no share explains, and is judged as before; a
# batch-of-one policy's 12 wins in a row at a 50% win rate are chance.
_RECURRING = 0.03
_RECURRING_WINDOWS = 4
_BY_CHANCE = 1e-4


class _LogAverage:
    """A layer's typical log norm (about ``window`` steps), its recent one (a few),
    its usual move away from the recent one (``spread``, about ``window`` steps)
    and the highest typical log norm it has had (``peak``).

    Its steps past ``factor`` above the typical norm, apart: their average log
    norm (``upper``) and move from it (``upper_spread``), both over about
    ``window`` such steps, their recent log norm (``upper_recent``, a few), how
    often they come (``upper_rate``, an average of one per such step over about
    ``_RECURRING_WINDOWS`` windows), the ``count`` after the latest
    (``upper_at``), the run of such steps in a row it ended (``upper_run``) and
    how many the level learnt from (``upper_seen``); ``upper_rate`` 0.0: none
    yet."""

    __slots__ = (
        "mean",
        "count",
        "recent",
        "spread",
        "peak",
        "upper",
        "upper_spread",
        "upper_rate",
        "upper_at",
        "upper_run",
        "upper_seen",
        "upper_recent",
    )

    def __init__(self) -> None:
        self.mean = 0.0
        self.count = 0
        self.recent = 0.0
        self.spread = 0.0
        self.peak = 0.0
        self.upper = 0.0
        self.upper_spread = 0.0
        self.upper_rate = 0.0
        self.upper_at = 0
        self.upper_run = 0
        self.upper_seen = 0
        self.upper_recent = 0.0


def _upper_level(history: _LogAverage, keep: float) -> float | None:
    """The layer's upper usual level (a log norm) for a step past ``factor`` above
    its typical norm, or None: where such steps came on a sizeable share of the
    recent steps (``keep``: how much of the share a step without one keeps), and
    this one makes no run of them in a row longer than chance does at that share.

    The share is an average over the layer's steps that began at its first at
    zero: divided by what the average of ones would be after as many steps, it
    is the share itself from the first steps on (five steps in 50 at the end of
    a warm-up are a tenth of them, not the twentieth the bare average says)."""
    if not history.upper_rate:
        return None
    since = history.count - history.upper_at
    share = history.upper_rate * keep ** max(since, 0) / (1.0 - keep ** max(history.count, 1))
    run = history.upper_run + 1 if since <= 0 else 1
    if share < _RECURRING or share**run < _BY_CHANCE:
        return None
    return history.upper


def _seen_high(
    history: _LogAverage,
    log_norm: float,
    counted: bool,
    alpha: float,
    fast: float,
    keep: float,
    far: float,
) -> None:
    """One step past ``factor`` above the layer's typical norm, learnt into its upper
    level; called before the step's own ``count`` is written (``counted``: it will
    be, as every step but a spike's). A spike more than ``far`` (a log) above the
    level counts among such steps but leaves the level where it was: an explosion
    drags it up no more than it becomes the typical norm."""
    if history.upper_rate:
        since = max(history.count - history.upper_at, 0)
        history.upper_run = history.upper_run + 1 if since == 0 else 1
        history.upper_rate = history.upper_rate * keep ** (since + 1) + (1.0 - keep)
        history.upper_recent += fast * (log_norm - history.upper_recent)
        if counted or log_norm - history.upper <= far:
            # A plain mean over its first such steps: where the first one lies
            # (a transient of the first steps) weighs no more than any other.
            seen = history.upper_seen = history.upper_seen + 1
            rate = max(alpha, 1.0 / seen)
            move = log_norm - history.upper
            history.upper_spread += rate * (abs(move) - history.upper_spread)
            history.upper += rate * move
    else:
        history.upper = history.upper_recent = log_norm
        history.upper_spread = 0.0
        history.upper_rate, history.upper_run, history.upper_seen = 1.0 - keep, 1, 1
    history.upper_at = history.count + int(counted)


class _WarmLayers:
    """The averages of one set of layers, each with a history already, as lists in
    the step's layer order: a step with no layer near a jump moves them all in C
    loops, with no Python per layer.

    ``steps``: the steps moved here since the layers' counts were last written.
    """

    __slots__ = ("names", "means", "recents", "spreads", "peaks", "steps")

    def __init__(self, names: tuple[str, ...], histories: dict[str, _LogAverage]) -> None:
        self.names = names
        self.means = [histories[name].mean for name in names]
        self.recents = [histories[name].recent for name in names]
        self.spreads = [histories[name].spread for name in names]
        self.peaks = [histories[name].peak for name in names]
        self.steps = 0

    def write_back(self, histories: dict[str, _LogAverage]) -> None:
        rows = zip(self.names, self.means, self.recents, self.spreads, self.peaks)
        for name, mean, recent, spread, peak in rows:
            history = histories[name]
            history.mean, history.recent, history.spread, history.peak = mean, recent, spread, peak
            history.count += self.steps
        self.steps = 0


# A run that diverges from its first steps: the total norm at least this many
# times the last step's, this many steps in a row, to this many times the first.
_RUNAWAY_GROWTH = 10.0
_RUNAWAY_STEPS = 3
_RUNAWAY_TOTAL = 1e3
# Or a slower geometric runaway (plain SGD on a quadratic with the learning rate
# past its stability bound grows about 3x a step): at least doubling, this many
# steps in a row. Healthy first steps do not double six times running.
_SUSTAINED_GROWTH = 2.0
_SUSTAINED_STEPS = 6


class _Runaway:
    """The total norm over the warm-up: where it began and its run of tenfold steps."""

    __slots__ = ("steps", "first", "first_step", "last", "streak", "doubling")

    def __init__(self) -> None:
        self.steps = 0
        self.first: float | None = None
        self.first_step = 0
        self.last: float | None = None
        self.streak = 0
        self.doubling = 0  # steps in a row at least _SUSTAINED_GROWTH times the last


# A target network's sync: the jumps it starts settle within ~10 steps in a
# CartPole DQN (seeds 0-3, syncs every 100-500 steps); a run of jumps still
# going this many steps after the sync is told.
_SYNC_SETTLES = 50

# A jump below this many times its typical norm may be a small batch's heavy
# tail, gone at the next step: a near-deterministic policy sampling its rare
# action (REINFORCE, one episode an update: 60-190x), a classifier's odd hard
# example near a zero loss (50-150x). A loss blown up for one batch (a term
# scaled 1e4x, a division by a tiny std) jumps 3,600-10,000x: told at once.
_PASSING_BELOW = 1000.0


class _Waiting:
    """A jump held back for a step: whether it passed (every layer that jumped back
    near its typical norm, nothing jumping now) or a copy of the model was just
    synced to it is known once the model has moved once more.

    ``look``: the copies of the model to look at then (None: none to look at);
    ``passing``: a jump small enough to be a heavy tail, dropped if it passed.
    """

    __slots__ = ("step", "optimizer", "alerts", "look", "passing", "unlooked")

    def __init__(
        self,
        step: int,
        optimizer: int | None,
        alerts: list[Alert],
        look: CopiesLook | None,
        passing: bool,
        unlooked: bool = False,
    ) -> None:
        self.step = step
        self.optimizer = optimizer
        self.alerts = alerts
        self.look = look
        self.passing = passing
        # The look at backward's end was asked at the jump (see ExplodingGradientRule.
        # _as_backward_left): a next step read before it began is held one more.
        self.unlooked = unlooked


class _Sync:
    """A copy found synced to the model at ``since``: the jumps of the steps after
    it are the targets moving, while the copy stays as it was."""

    __slots__ = ("since", "copy")

    def __init__(self, since: int, copy: SyncedCopy) -> None:
        self.since = since
        self.copy = copy


# The loss is nll_loss on raw logits (loss_input told it): it falls without bound,
# and the weights and gradients grow with it whatever the learning rate.
_UNBOUNDED_NLL_HINT = (
    "the loss is unbounded below: nll_loss at {source} is given raw logits (told by "
    "loss_input), so it falls without bound and the weights and gradients grow with it; "
    "apply F.log_softmax(x, dim=1) to its input or give the logits to F.cross_entropy. "
    "Lowering the learning rate or clipping only slows the fall."
)


class ExplodingGradientRule(Rule):
    id = "exploding_gradient"
    config: ExplodingGradientConfig
    _NOT_STATE = Rule._NOT_STATE | {
        "_warm",
        "_runaways",
        "_waiting",
        "_sync",
        "_last_jump",
        "_one_batch",
        "backward_norms",
    }
    # Takes the gradients' norms at backward's end over the next steps, asked after a
    # jump (the loop may write into them before the step); set by the pipeline.
    backward_norms: BackwardEndNorms | None = None

    def alert(
        self,
        step: int,
        module: str | None,
        message: str,
        hint: str,
        data: dict[str, Any] | None = None,
        *,
        severity: str | None = None,
    ) -> Alert:
        """Any finding, its hint the loss's where the loss is unbounded below: the
        learning rate, warm-up or a clip would only slow that run."""
        source = self.held.unbounded_loss() if self.held is not None else None
        if source is not None:
            hint = _UNBOUNDED_NLL_HINT.format(source=source)
            data = {**(data or {}), "cause": "logits_into_nll"}
        return super().alert(step, module, message, hint, data, severity=severity)

    def __init__(self, config: ExplodingGradientConfig) -> None:
        super().__init__(config)
        self._history: dict[str, _LogAverage] = {}
        # Layer sets whose averages live in lists (a GAN's two optimizers: two),
        # by their names in order; no layer is in two of them.
        self._warm: dict[tuple[str, ...], _WarmLayers] = {}
        # During the warm-up, when no layer has a past to be judged against:
        # each optimizer's total norm and its run of steps each 10x the last
        # (None once told, or once every warm-up is over: a later optimizer,
        # a new phase, is judged by the per-layer averages alone; training
        # started over with the same optimizer looks for it again).
        self._runaways: dict[int | None, _Runaway] | None = {}
        # A jump held back until the next step, the latest target-network sync
        # found, and the latest step with a jump (held back, excused or told).
        self._waiting: _Waiting | None = None
        self._sync: _Sync | None = None
        self._last_jump: int | None = None
        # The latest step whose jump was told as one batch's outlier (a recurrent
        # regression): a jump held back that went on is the weights' after all.
        self._one_batch: int | None = None

    def state_dict(self) -> dict[str, Any]:
        self._write_back()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._warm = {}
        # A loaded state goes on from its own step, not from the one before the
        # load: a jump held back then (a tuner's trial step, loaded back over),
        # a sync or a run of jumps found then continue nothing.
        self._waiting, self._sync, self._last_jump = None, None, None
        super().load_state_dict(state)
        for history in self._history.values():
            if not hasattr(history, "recent"):  # saved before the short-term average existed
                history.recent = history.mean
            if not hasattr(history, "spread"):  # saved before the spread was kept
                history.spread = 0.0
                history.peak = history.mean
            if not hasattr(history, "upper"):  # saved before the upper level was kept
                history.upper = history.upper_spread = history.upper_rate = 0.0
                history.upper_at = history.upper_run = history.upper_seen = 0
                history.upper_recent = 0.0

    def _write_back(self) -> None:
        """The histories up to date; the lists stay, equal to them."""
        for warm in self._warm.values():
            warm.write_back(self._history)

    def evaluate(self, record: StepRecord) -> list[Alert]:
        runaways = self._runaways
        if runaways is not None and record.source in ("optimizer", "manual"):
            runaway = runaways.get(record.optimizer)
            if runaway is None:
                runaway = runaways[record.optimizer] = _Runaway()
            found = self._diverging(runaway, record)
            if found is not None:
                return [found]
        if not record.restarted_layers and record.source in ("optimizer", "manual"):
            warm = self._warm.get(tuple(record.layer_norms))
            if warm is not None and self._moved_in_c(warm, record):
                return []
        backward = record.backward_layer_norms
        if backward is not None:
            record = self._as_backward_left(record, backward)
        if record.restarted_optimizers:
            self._started_over(record)
        overflow = record.nonfinite_backward
        if overflow is not None and overflow.cause == NORM_OVERFLOW:
            # Off the usual step (its norms are not finite): no layer's history
            # moves, as for any spike. A jump held back went on to this.
            self._write_back()  # the hint reads the histories
            alert = self._overflow_alert(record, overflow)
            waiting, self._waiting = self._waiting, None
            held_back = self._went_on_hints(waiting) if waiting is not None else []
            return [*held_back, alert]
        self._write_back()  # the per-layer look reads every history, writes the step's
        alerts = self._evaluate_each_layer(record)
        if alerts and backward is not None:
            alerts = [_as_backward_made(alert) for alert in alerts]
        if alerts and not record.backward_end_seen and record.source == "optimizer":
            # Did the loop write into the gradients after backward? Seen from the
            # next steps on (see _as_backward_left).
            if self.backward_norms is not None:
                self.backward_norms.request()
        if alerts or self._waiting is not None:
            alerts = self._unless_a_sync(record, alerts)
        touched = set(record.layer_norms).union(record.restarted_layers)
        self._warm = {key: warm for key, warm in self._warm.items() if touched.isdisjoint(key)}
        if not alerts and not record.restarted_layers and self._waiting is None:
            self._keep_warm(record)
        return alerts

    def _as_backward_left(self, record: StepRecord, backward: Mapping[str, float]) -> StepRecord:
        """The step as judged where the loop wrote into its gradients after backward
        ended (``backward``: each layer's norm as backward left it; see
        trainwatch.collect.backward_end_norms): each layer at the smaller of that norm
        and the one the step applies.

        Stochastic-gradient Langevin dynamics adds Gaussian noise to every gradient
        once its burn-in is over: the norms the step applies jump 100x in one step
        while backward's did not move, and neither a clip nor a lower learning rate
        is the fix. Writes that lift a norm make no jump here, and one that backward
        made is told as without them (a batch scaled 1e4x under the noise); writes
        that lower a norm (a clip by hand, a GradScaler's unscale) leave the step's,
        as before. The look goes on while the writes lift some layer's norm more than
        sqrt(``factor``): a loop adding noise has every step judged so, one whose
        writes barely move the norms stops being looked at.
        """
        norms: dict[str, float] = {}
        far = math.sqrt(self.config.factor)
        lifted = False
        for layer, norm in record.layer_norms.items():
            made = backward.get(layer)
            if made is not None and 0.0 < made < norm < math.inf:
                lifted = lifted or norm > far * made
                norm = made
            norms[layer] = norm
        if lifted and self.backward_norms is not None:
            self.backward_norms.request()
        judged = shallow_copy(record)  # the record is every rule's: not written
        judged.layer_norms = norms
        return judged

    def closing(self) -> list[Alert]:
        """A jump held back at the last step: no next step will say it passed or was
        a sync."""
        waiting, self._waiting = self._waiting, None
        return waiting.alerts if waiting is not None else []

    def _unless_a_sync(self, record: StepRecord, alerts: list[Alert]) -> list[Alert]:
        """The jumps that pass at once and those of a DQN's target-network sync held
        back, the rest told.

        A jump below ``_PASSING_BELOW`` times its typical norm that starts a
        run of them waits a step: one that passed (no layer that jumped still
        sqrt(``factor``) above its typical norm, or non-finite, and no jump at
        that step) was a small batch's heavy tail, and is dropped; one that
        went on (a learning rate blown up, a NaN after it) is told then, at
        its own step.

        The step after a target network is set to the model's weights the TD
        targets jump, and the gradients 100-250x with them. Where the first
        jump of a run of them finds a copy of the model (see
        trainwatch.collect.model_copies), it waits a step too: a copy that
        stayed still and lies within a few of the model's moves was just
        synced, and the jumps within ``_SYNC_SETTLES`` steps of it are its
        doing while it stays so, if the jump went on at that step (the targets
        stay moved). Each run of jumps costs at most one such look.
        """
        waiting = self._waiting
        if (
            waiting is not None
            and record.optimizer == waiting.optimizer
            and record.source in ("optimizer", "manual")
        ):
            self._waiting = None
            went_on = self._went_on(record, waiting.alerts)
            if waiting.passing and not (went_on or alerts) and self._finite(record, waiting):
                return alerts  # passed: a heavy tail, not an explosion
            if waiting.unlooked and not record.backward_end_seen:
                # The look at backward's end, asked at the jump, began after this step's
                # backward (the jump was read back a step late): held one step more, to
                # see at a looked step whether the loop's own writes made it.
                waiting.unlooked = False
                if self._finite(record, waiting) and all(map(_passing, alerts)):
                    waiting.alerts = [*waiting.alerts, *alerts]
                    self._waiting = waiting
                    return []
            look = waiting.look
            copy = look.synced() if went_on and look is not None else None
            if copy is None:
                if went_on or alerts or not self._finite(record, waiting):
                    held_back = self._went_on_hints(waiting)
                else:
                    held_back = waiting.alerts
                alerts = [*held_back, *alerts]
                if len(alerts) > len(held_back):
                    self._last_jump = record.step
                return alerts
            self._sync = _Sync(waiting.step, copy)
        if not alerts:
            return alerts
        step = record.step
        running = self._last_jump is not None and step - self._last_jump <= 1
        self._last_jump = step
        if any(alert.data.get("kind") == _BURST for alert in alerts):
            return alerts  # far past the 100-250x a sync's targets make
        sync = self._sync
        if sync is not None:
            settling = step - sync.since <= _SYNC_SETTLES
            still = sync.copy.unchanged()
            if settling and still:
                return []
            self._sync = None
            if running:  # a run begun at the sync: more than the targets moving
                return [_after_a_sync(alert, sync, still) for alert in alerts]
        held = self.held
        if running or self._waiting is not None:
            return alerts
        ratios = [alert.data.get("ratio") for alert in alerts]
        if None in ratios:
            return alerts  # over the configured bound: told whatever the cause
        passing = all(map(_passing, alerts))
        look = held.copies.look(step) if held is not None else None
        if look is None and not passing:
            return alerts
        unlooked = (
            passing
            and not record.backward_end_seen
            and record.source == "optimizer"
            and self.backward_norms is not None
        )
        self._waiting = _Waiting(step, record.optimizer, alerts, look, passing, unlooked)
        return []

    def _went_on(self, record: StepRecord, alerts: list[Alert]) -> bool:
        """Some layer that jumped is still sqrt(``factor``) above its typical norm a
        step later: a sync's targets stay moved for steps, while a bad batch's
        jump is gone at the next (one just after a copy of the model was taken:
        a run resumed beside the model it was saved from). A layer with two
        usual levels is back at either."""
        above = math.log(self.config.factor) / 2.0
        keep = self._upper_keep()
        norms, histories = record.layer_norms, self._history
        for layer in (name for alert in alerts for name in alert.data["layers"]):
            norm, history = norms.get(layer), histories.get(layer)
            if norm and history is not None and norm < math.inf:
                log_norm = math.log(norm)
                if log_norm - history.mean > above:
                    upper = _upper_level(history, keep)
                    if upper is None or log_norm - upper > above:
                        return True
        return False

    def _upper_keep(self) -> float:
        """How much of a layer's share of steps at its upper level a step without
        one keeps: an average over ``_RECURRING_WINDOWS`` windows."""
        return 1.0 - 2.0 / (self.config.window * _RECURRING_WINDOWS + 1)

    def _went_on_hints(self, waiting: _Waiting) -> list[Alert]:
        """The alerts held back, for a jump that went on at the next step: one told as
        a single batch's outlier is the recurrent weights blowing up after all."""
        if self._one_batch != waiting.step:
            return waiting.alerts
        self._one_batch = None
        return [
            dataclasses.replace(alert, hint=self._exploding_hint(alert.data.get("kind") == _BURST))
            for alert in waiting.alerts
        ]

    @staticmethod
    def _finite(record: StepRecord, waiting: _Waiting) -> bool:
        """No layer that jumped went non-finite a step later: a NaN after a jump is
        where the jump led."""
        norms = record.layer_norms
        layers = (name for alert in waiting.alerts for name in alert.data["layers"])
        return all(math.isfinite(norms.get(layer, 0.0)) for layer in layers)

    def _overflow_alert(self, record: StepRecord, report: NonfiniteReport) -> Alert:
        """Gradients too large for their norm's fp32 sum of squares: the largest
        explosion there is, past any warm-up, though no gradient holds a NaN/Inf."""
        dtype = (report.dtype or "torch.float32").removeprefix("torch.")
        message = (
            f"gradients too large to measure: their norm overflows {dtype} to inf, "
            "though every gradient is finite (no NaN/Inf; the largest element "
            f"{report.largest:.3g}, in {report.parameter})"
        )
        data: dict[str, Any] = {
            "cause": NORM_OVERFLOW,
            "parameter": report.parameter,
            "largest": report.largest,
            "dtype": report.dtype,
        }
        if record.source == "passes":
            # Gathered, then no optimizer step came: the loop (or a GradScaler)
            # skipped it.
            message += "; no optimizer step followed"
        elif report.clip_norm is not None and not math.isfinite(report.clip_norm):
            message += (
                "; clip_grad_norm_ measured their total norm as inf too and scales "
                "every gradient by max_norm / inf = 0: this step's update carries none "
                "of this batch's gradient"
            )
            data["clipped_to_zero"] = True
        hint = self._overflow_hint(record)
        return self.alert(record.step, report.module, message, hint, data)

    def _overflow_hint(self, record: StepRecord) -> str:
        """An outlier in the data, or weights blown up: a recurrent model, or one
        trained with a classification loss, has no outlier to blame, unless a
        regression loss trains the recurrent one and its norms were steady until
        now."""
        found = self.held.explosion_kind() if self.held is not None else None
        if found is None or self._one_batch_cause(record.layer_norms, record.step):
            return _OVERFLOW_HINT
        kind, name = found
        return _FROM_THE_WEIGHTS[kind].format(name=name or "the model") + (
            _CLIP_SMALLER if self.loop_clips else _CLIP_SMALL
        )

    def _diverging(self, runaway: _Runaway, record: StepRecord) -> Alert | None:
        """A learning rate far too high from the start: the warm-up hides it from the
        per-layer averages, but the total norm grows tenfold step after step.

        Healthy first steps move the norms by an order of magnitude once or
        twice, not three times in a row to a thousand times where they began.
        """
        runaway.steps += 1
        if runaway.steps > self.config.warmup:
            # The per-layer averages have taken over: once every optimizer's
            # warm-up is over, a step pays nothing for this check.
            runaways = self._runaways
            if runaways is not None:
                runaways.pop(record.optimizer, None)
                if not runaways:
                    self._runaways = None
            return None
        total = record.total_norm
        if total is None or not 0.0 < total < math.inf:
            return None  # nothing to compare (the non-finite rules own a NaN)
        last = runaway.last
        if runaway.first is None:
            runaway.first, runaway.first_step = total, record.step
        else:
            growing = last is not None and total >= _RUNAWAY_GROWTH * last
            runaway.streak = runaway.streak + 1 if growing else 0
            doubling = last is not None and total >= _SUSTAINED_GROWTH * last
            runaway.doubling = runaway.doubling + 1 if doubling else 0
        runaway.last = total
        if total < _RUNAWAY_TOTAL * runaway.first:
            return None
        if runaway.streak >= _RUNAWAY_STEPS:
            rate, steps = _RUNAWAY_GROWTH, runaway.streak
        elif runaway.doubling >= _SUSTAINED_STEPS:
            rate, steps = _SUSTAINED_GROWTH, runaway.doubling
        else:
            return None
        self._runaways = None  # one finding a run
        grown = total / runaway.first
        return self.alert(
            record.step,
            None,
            f"the total gradient norm grew {grown:.3g}x since step {runaway.first_step} "
            f"({runaway.first:.3g} to {total:.3g}), at least {rate:g}x a step for "
            f"the last {steps} steps: training is diverging from the start",
            "the learning rate is far too high for this model (or the loss scale of a "
            "hand-rolled mixed precision is wrong): lower it by orders of magnitude"
            + (
                " or add warm-up."
                if self.loop_clips
                else ", add warm-up, or clip gradients (torch.nn.utils.clip_grad_norm_)."
            ),
            {
                "norm": total,
                "first_norm": runaway.first,
                "growth": grown,
                "steps_growing": steps,
                "total_norm": total,
                "kind": "diverging",
            },
        )

    def _started_over(self, record: StepRecord) -> None:
        """Training started over with these optimizers (a new fold or trial reusing
        them): a run diverging from its first steps is looked for again, from
        this step on, as at the run's start, while their layers' histories start
        over (``restarted_layers``) with a warm-up of their own."""
        runaways = self._runaways
        if runaways is None:
            runaways = self._runaways = {}
        for optimizer in record.restarted_optimizers:
            runaways[optimizer] = _Runaway()
        if record.optimizer in record.restarted_optimizers and record.source in (
            "optimizer",
            "manual",
        ):
            # Its first step: where the total norm begins (nothing to tell yet).
            self._diverging(runaways[record.optimizer], record)

    def _moved_in_c(self, warm: _WarmLayers, record: StepRecord) -> bool:
        """The usual step, with no Python per layer: every norm finite and above zero,
        none over the bound, none more than ``factor`` above its long average (the
        cheap trigger: past it, the per-layer look decides). False: nothing moved.

        Whatever it moves, the per-layer look would have moved the same way:
        with no layer past the trigger it reports nothing (a jump must pass
        ``factor`` whatever the spread), and its arithmetic, ``mean += alpha *
        (log - mean)`` and ``spread += alpha * (abs(log - recent) - spread)``
        before ``recent`` moves, ``peak = max(peak, mean)``, gives the same floats.
        """
        values = list(record.layer_norms.values())
        if 0.0 in values or not all(map(math.isfinite, values)):
            return False
        max_norm = self.config.max_norm
        if max_norm is not None and max(values) > max_norm:
            return False
        logs = list(map(math.log, values))
        means = warm.means
        if max(map(sub, logs, means)) > math.log(self.config.factor):
            return False
        alpha = 2.0 / (self.config.window + 1)
        fast = 2.0 / (_RECENT_WINDOW + 1)
        warm.means = list(map(add, means, map(mul, repeat(alpha), map(sub, logs, means))))
        warm.peaks = list(map(max, warm.peaks, warm.means))
        recents, spreads = warm.recents, warm.spreads
        moves = map(sub, map(abs, map(sub, logs, recents)), spreads)
        warm.spreads = list(map(add, spreads, map(mul, repeat(alpha), moves)))
        warm.recents = list(map(add, recents, map(mul, repeat(fast), map(sub, logs, recents))))
        warm.steps += 1
        return True

    def _keep_warm(self, record: StepRecord) -> None:
        """After a per-layer look that moved every layer of the step, each with a
        history already: their next steps are moved in C."""
        names = tuple(record.layer_norms)
        if not names or record.source not in ("optimizer", "manual"):
            return
        histories = self._history
        for name, norm in record.layer_norms.items():
            history = histories.get(name)
            if not 0.0 < norm < math.inf or history is None or history.count == 0:
                return
        self._warm[names] = _WarmLayers(names, histories)

    def _evaluate_each_layer(self, record: StepRecord) -> list[Alert]:
        for layer in record.restarted_layers:
            # New parameters under an old name, or a new training phase: the
            # old history says nothing about these gradients.
            self._history.pop(layer, None)
        if record.source not in ("optimizer", "manual") or not record.layer_norms:
            return []
        config = self.config
        alpha = 2.0 / (config.window + 1)
        limit = math.log(config.factor)
        sudden = limit / 2.0  # sqrt(factor) above the last few steps
        above_peak = math.log(_ABOVE_PEAK)
        fast = 2.0 / (_RECENT_WINDOW + 1)
        max_norm = config.max_norm
        warmup = config.warmup
        enormous = max(math.log(_ENORMOUS), limit)
        keep = self._upper_keep()
        histories = self._history
        rows = []
        suspect = False  # some layer jumped against its own past
        towering = False  # some layer jumped past any healthy step's jump
        for layer, norm in record.layer_norms.items():
            if not 0.0 < norm < math.inf:
                continue  # the non-finite and zero-gradient rules own those
            log_norm = math.log(norm)
            history = histories.get(layer)
            if history is None:
                history = histories[layer] = _LogAverage()
            high = history.count > 0 and log_norm - history.mean > limit
            # Past ``factor``, a layer with two usual levels is judged against
            # its upper one, as against its typical norm: a jump is ``factor``
            # and its usual moves above that level too, or, where its last few
            # steps there, among its last few steps, already rose above it by
            # more than its usual moves (the level growing), sqrt(``factor``)
            # and those moves.
            upper = _upper_level(history, keep) if high else None
            # Further below the upper level than a jump would be above it, a step
            # past ``factor`` is the lower level rising (its typical norm lags a
            # climb of 100x over tens of steps): it moves the typical norm and is
            # judged against it, as any other step.
            seen = high and (
                upper is None
                or upper - log_norm <= max(sudden, _SPREAD_UNITS * history.upper_spread)
            )
            if not seen:
                upper = None
            climbing = False
            if upper is not None:
                over = log_norm - upper
                moves = history.upper_spread
                climbing = (
                    history.count - history.upper_at < _RECENT_WINDOW
                    and history.upper_recent - upper > max(_RISEN, moves)
                )
                jump = (
                    over > max(sudden if climbing else limit, _SPREAD_UNITS * moves)
                    and log_norm - history.recent > sudden
                )
                climbing = climbing and jump
                top = max(history.recent, history.peak, upper)
            else:
                # Sudden too: a layer whose norm rose steadily for tens of steps
                # (a deep plain stack waking up from a near-dead start) is far
                # above its long average but not above its last few steps.
                jump = (
                    high
                    and (
                        log_norm - history.mean > _SPREAD_UNITS * history.spread
                        or (
                            log_norm - history.peak > above_peak
                            and history.recent - history.peak > _RISEN
                        )
                    )
                    and log_norm - history.recent > sudden
                )
                top = max(history.recent, history.peak)
            huge = history.count > 0 and log_norm - top > enormous
            suspect = suspect or jump or huge
            towering = towering or huge
            rows.append((layer, norm, log_norm, history, jump, huge, high, seen, upper, climbing))
        # A layer recovering from tiny gradients (a deep stack whose units
        # were nearly dead waking up) jumps by 1e3-1e4 against its own past
        # in healthy runs, but only up to the other layers' level: a jump
        # counts when it also ends well above the layers' typical norms (their
        # median, before this step; taken only when some layer jumped).
        floor = 0.0
        burst = False  # a jump told whatever the warm-up: the layers' with it are too
        if suspect:
            typical_norms = [h.mean for h in histories.values() if h.count]
            typical_median = statistics.median(typical_norms)
            floor = _ABOVE_OTHERS * math.exp(typical_median)
            if towering:
                burst = self._past_the_clip(rows, typical_median, enormous, record.total_norm)
        spikes: list[tuple[float, str, float, float | None, float | None, bool]] = []
        for layer, norm, log_norm, history, jump, _, high, seen, upper, climbing in rows:
            count = history.count
            jump = jump and norm >= floor
            over_bound = max_norm is not None and norm > max_norm
            # Each layer has its own warm-up: one first trained late, or
            # restarted, is not judged on its first gradients; but in a burst
            # every layer with a past that jumped past ``factor`` is told.
            joined = burst and high
            if (count >= warmup and (over_bound or jump)) or joined:
                if upper is not None:
                    typical, lower = math.exp(upper), math.exp(history.mean)
                else:
                    typical, lower = (math.exp(history.mean) if count else None), None
                ratio = norm / typical if typical else math.inf
                row = (ratio if jump or joined else 0.0, layer, norm, typical, lower, climbing)
                spikes.append(row)
                if seen:  # told or not, a level it may keep coming back to
                    _seen_high(history, log_norm, False, alpha, fast, keep, limit)
                continue  # a spike does not become the new normal
            if seen:
                # Learnt into the upper level; at it or not, the step then moves the
                # averages as any usual step does.
                _seen_high(history, log_norm, True, alpha, fast, keep, limit)
            # Written out, not a method: this runs for every layer at every step.
            history.count = count + 1
            if count == 0:
                history.mean = history.recent = history.peak = log_norm
            else:
                history.mean += alpha * (log_norm - history.mean)
                history.peak = max(history.peak, history.mean)
                history.spread += alpha * (abs(log_norm - history.recent) - history.spread)
                history.recent += fast * (log_norm - history.recent)
        if not spikes:
            return []
        # Jumps first, the model's own layers before the parameters its optimizer
        # holds outside it (a head no monitor watches, lumped as one layer): those
        # are told among the layers, never in place of the model's own.
        spikes.sort(key=lambda row: (row[0] <= 0.0, row[1] == EXTERNAL, -row[0], -row[2]))
        ratio, layer, norm, typical, lower, _ = spikes[0]
        if typical is not None and ratio > 0.0 and lower is not None:
            what = (
                f"{ratio:.3g}x the higher of its two usual levels, {typical:.3g} (its "
                f"norm keeps coming back to it from its typical {lower:.3g})"
            )
        elif typical is not None and ratio > 0.0:
            what = f"{ratio:.3g}x its recent typical norm {typical:.3g}"
        else:
            what = f"above the configured bound {config.max_norm:g}"
        others = f" ({len(spikes) - 1} other layers too)" if len(spikes) > 1 else ""
        data: dict[str, Any] = {
            "norm": norm,
            "typical": typical,
            "ratio": ratio if ratio > 0.0 else None,
            "layers": [row[1] for row in spikes],
            "total_norm": record.total_norm,
        }
        if lower is not None:
            data["lower_level"] = lower
        if any(row[5] for row in spikes):
            # Steps at a layer's upper level rising already: told at once.
            data["climbing"] = True
            if spikes[0][5]:
                what += ", its last few steps there rising already"
        if burst:
            data["kind"] = _BURST
            total = record.total_norm
            told = [f"{len(spikes) - 1} other layers too"] if len(spikes) > 1 else []
            if total is not None:
                told.append(f"total norm {total:.3g}")
            message = (
                f"gradient norm of {layer or 'the root module'} jumped to {norm:.3g} in one "
                f"step, {what}" + (f" ({'; '.join(told)})" if told else "") + ": no healthy "
                "training jumps that far in a step, in its first steps either"
            )
        else:
            message = (
                f"gradient norm of {layer or 'the root module'} jumped to {norm:.3g}, "
                f"{what}{others}"
            )
        small = self.held.small_batch(record.step) if self.held is not None else None
        cause = self._one_batch_cause(data["layers"], record.step) if small is None else None
        if small is not None:
            rows, usual, norm_layer = small
            message += f"; this step's batch held {rows} samples, the usual {usual}"
            data.update(cause=_SMALL_BATCH, batch_size=rows, usual_batch_size=usual)
            data["batch_norm"] = norm_layer
            hint = _SMALL_BATCH_HINT.format(
                rows=rows, s="" if rows == 1 else "s", usual=usual, layer=norm_layer or "the model"
            )
        elif cause is None:
            hint = self._exploding_hint(burst)
        else:
            self._one_batch = record.step
            hint = self._one_batch_hint(*cause, burst)
        return [self.alert(record.step, layer, message, hint, data)]

    def _one_batch_cause(self, layers: Iterable[str], step: int) -> tuple[str, str] | None:
        """A recurrent model trained with a regression loss whose jump at ``step``
        came, as far as is known now, from that step's batch alone: its recurrent
        module and the loss, else None.

        Known now: no jump at the step before (held back or told: a run of jumps is
        the weights blowing up), and each layer that jumped had its last few steps
        within its usual moves of its typical norm (norms climbing into the jump, as
        an RNN's at a learning rate too high does through its warm-up, are the
        weights too). A jump that goes on at the next step is known only then: a
        held-back one is told with the weights' advice, a told one says what the
        jumps going on would mean. The loss value says nothing either way: an
        outlier batch's and blown-up weights' both jump about 1e7x.
        """
        found = self.held.explosion_kind() if self.held is not None else None
        if found is None or found[0] != RECURRENT:
            return None
        loss = self.held.regression_loss() if self.held is not None else None
        if loss is None:
            return None
        last = self._last_jump
        if self._waiting is not None or (last is not None and step - last <= 1):
            return None
        histories = self._history
        for layer in layers:
            history = histories.get(layer)
            if history is not None and history.count:
                if history.recent - history.mean > max(_RISEN, history.spread):
                    return None
        return found[1] or "the model", loss

    def _one_batch_hint(self, name: str, loss: str, burst: bool) -> str:
        """The outlier in one batch first, then what the jumps going on would mean."""
        robust = "" if loss in _BOUNDED_LOSSES else _ROBUST
        cause = _ONE_BATCH.format(loss=loss, name=name, robust=robust)
        if not self.loop_clips:
            return (
                cause
                + _ONE_BATCH_CLIP
                + _UNLESS_IT_GOES_ON.format(
                    name=name, clip=" and clip with a small max_norm (0.25 to 1.0)"
                )
            )
        max_norm = _clip_bound(self.held) if burst else None
        if max_norm is not None:
            clip = _ONE_BATCH_LET_THROUGH.format(max_norm=max_norm)
        else:
            clip = _ONE_BATCH_CLIPS
        return cause + clip + _UNLESS_IT_GOES_ON.format(name=name, clip="")

    def _past_the_clip(
        self, rows: list[Any], typical_median: float, enormous: float, total: float | None
    ) -> bool:
        """Some layer jumped past ``enormous`` against its own past and the layers'
        typical norms, as the update carries it: a loop's clip_grad_norm_ scales
        every gradient by max_norm / total, and what it bounds reaches the weights
        no further. A ReLU RNN language model at lr 20 clipped to 0.25 jumps up to
        4e5x before its clip in its first steps (once from 0.1 to 1e18), and trains
        on."""
        shrink = 0.0
        max_norm = _clip_bound(self.held)
        if max_norm is not None and total is not None and 0.0 < max_norm < total < math.inf:
            shrink = math.log(max_norm / total)
        return any(
            huge
            and log_norm
            + shrink
            - max(history.recent, history.peak, -math.inf if upper is None else upper)
            > enormous
            and log_norm + shrink - typical_median > enormous
            for _, _, log_norm, history, _, huge, _, _, upper, _ in rows
        )

    def _exploding_hint(self, burst: bool = False) -> str:
        """The cause and fix of a jump, by the model: a recurrent one, or one trained
        with a classification loss, is told to clip with a small max_norm; a
        ``burst`` that passed the loop's clip, to make its max_norm small."""
        found = self.held.explosion_kind() if self.held is not None else None
        if found is None:
            cause = _EXPLODING_CAUSE
        else:
            cause = _FROM_THE_WEIGHTS[found[0]].format(name=found[1] or "the model")
        max_norm = _clip_bound(self.held) if burst and self.loop_clips else None
        if max_norm is not None:
            fix = _LET_THROUGH.format(max_norm=max_norm)
            return cause + fix + (", and check the batch that caused it." if found is None else ".")
        if found is not None:
            return cause + (_CLIP_SMALLER if self.loop_clips else _CLIP_SMALL)
        return _EXPLODING_HINT_CLIPPED if self.loop_clips else _EXPLODING_HINT


def _as_backward_made(alert: Alert) -> Alert:
    """A jump judged by the norms backward made, the loop's own writes into the
    gradients since left out: the message says so (the norms logged are the step's)."""
    message = (
        f"{alert.message}; norms as backward made them, before the loop's own writes "
        "into the gradients"
    )
    return dataclasses.replace(
        alert, message=message, data={**alert.data, "before_loop_writes": True}
    )


def _passing(alert: Alert) -> bool:
    """A jump that may pass at the next step: below ``_PASSING_BELOW``, no burst, not
    the latest of a layer's steps at its upper level rising one after the other."""
    ratio = alert.data.get("ratio")
    return (
        ratio is not None
        and ratio < _PASSING_BELOW
        and alert.data.get("kind") != _BURST
        and not alert.data.get("climbing")
    )


def _clip_bound(held: HeldParameters | None) -> float | None:
    """The max_norm of the loop's latest clip_grad_norm_, None where none was seen."""
    max_norm = held.clip_max_norm() if held is not None else None
    try:
        return float(max_norm) if max_norm is not None else None
    except (TypeError, ValueError, RuntimeError):  # not a number (a tensor of many)
        return None


def _after_a_sync(alert: Alert, sync: _Sync, still: bool) -> Alert:
    """A jump told although its run began right after a sync: held back until now."""
    past = (
        f"past the {_SYNC_SETTLES} steps such jumps take to settle"
        if still
        else "past the copy's next sync"
    )
    message = (
        f"{alert.message}; the jumps began at step {sync.since}, right after a copy of "
        f"the model ({sync.copy.name}) was set to its weights (a target network's sync), "
        f"and went on {past}: held back until now"
    )
    return dataclasses.replace(
        alert, message=message, data={**alert.data, "since_sync": sync.since}
    )


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
        if due:
            due = self._short_of_the_loss(due, low, finite)
        if not due:
            return []
        self._reported.update(due)
        # The model's own layers before the parameters outside it (as exploding's).
        worst = min(due, key=lambda layer: (layer == EXTERNAL, low[layer]))
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

    def _short_of_the_loss(
        self, due: list[str], low: dict[str, float], norms: dict[str, float]
    ) -> list[str]:
        """The layers of ``due`` that a layer nearer the loss outgrows: one later in
        the model's order whose norm is not low.

        Where every layer nearer the loss is low too, or there is none, nothing
        died on the way back: the layer sits at the output end at its optimum (a
        flow's last batch-norm layer, an output offset), and stays untold while
        so; it is told once a layer after it is back to the usual size. The
        model's order is its registration order (see
        ``HeldParameters.layer_order``), else the step's own order of its layers.
        A layer whose place is not known (outside the model) is told as before.
        Taken only when a streak is due: never on the usual step.
        """
        order = self.held.layer_order() if self.held is not None else None
        place = {layer: i for i, layer in enumerate(norms if order is None else order)}
        place.pop(EXTERNAL, None)
        nearest = max((place[k] for k in norms if k not in low and k in place), default=-1)
        return [layer for layer in due if layer not in place or place[layer] < nearest]
