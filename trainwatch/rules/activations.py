"""Sampled activation checks: outputs that stopped varying, ReLU layers gone dead.

Both decide on sampled steps only (the record's ``activations`` is empty on
the others) and need ``patience`` consecutive sampled checks; the alert
carries the step of the first check of the streak.
"""

from __future__ import annotations

import math

from trainwatch.alert import Alert
from trainwatch.collect.activations import PASS_TARGET, TARGET
from trainwatch.config import ConstantOutputConfig, DeadUnitsConfig
from trainwatch.record import ActivationStats, StepRecord
from trainwatch.rules.base import Rule

# Spreads this small relative to the values are rounding noise, not variation.
_EXACT = 1e-6
_INPUT_CONSTANT = 1e-8


class _State:
    __slots__ = ("max_spread", "max_ratio", "held", "recent", "start", "count", "reported")

    def __init__(self) -> None:
        self.max_spread = 0.0
        self.max_ratio = 0.0
        self.held = 0.0  # the largest spread held over ``patience`` checks in a row
        self.recent: list[float] = []  # the spreads of the last ``patience`` checks
        self.start = -1
        self.count = 0
        self.reported = False

    def hold(self, spread: float, patience: int) -> None:
        """Count ``spread`` towards the level the output held.

        A reference is held for ``patience`` checks in a row, as a collapse is:
        one pass's spread is no level an output falls from. The check made on the
        initial weights, before the loop's first clip rescaled them (a WGAN
        critic's ``clamp_``), or a discriminator's one pass on real data between
        passes on its generator's narrow fakes, would otherwise stand as the
        reference for good.
        """
        recent = self.recent
        recent.append(spread)
        if len(recent) > patience:
            del recent[0]
        if len(recent) == patience:
            self.held = max(self.held, min(recent))

    def due(self, bad: bool, step: int, patience: int) -> bool:
        """Count a streak of bad checks; True once, when it reaches ``patience``."""
        if not bad:
            self.count = 0
            return False
        if self.count == 0:
            self.start = step
        self.count += 1
        if self.count < patience or self.reported:
            return False
        self.reported = True
        return True


class ConstantOutputRule(Rule):
    """A module's output no longer depends on its input.

    "Constant" is relative, never against zero (a collapsed regression still
    varies by a few per mille of its targets' spread):

    - the model's output (module ``""``): below ``ratio`` of the loss
      target's spread across the batch (measured during the broadcast audit;
      without it, judged against its own history as a hidden module is), and
      shrunk to at most half its own largest spread (an untrained model's
      small but growing output is not a collapse). An output that does not
      vary at all while its input does is reported from the first check.
      On a pass whose loss asks no more variation of it than it has (a
      target the same for every row: a PINN's boundary points, all held to
      0; ``collect/output_target.py``) it is no collapse, unless it does not
      vary at all.
    - a hidden module: below ``ratio`` of the largest spread it held over
      ``patience`` checks in a row, while its input still varies as much
      relative to its output (its gain, on the same pass) as it did, so the
      module where the variation dies is named, not every module after it. A
      module that never varied (a positional table read for the input's
      length, a zero-initialised branch) is structural, not a collapse.

    Each floating output of a module (a dict's or a dataclass's fields) is
    judged on its own. Only the model's primary output (the first that
    carries gradient: its prediction) is held to the first test; its other
    outputs (a mask, a pooled feature) are judged like a hidden module's, so
    one that never varied is structural there too.
    """

    id = "constant_output"
    needs = frozenset({"activation_sampler", "broadcast_audit"})
    reads = "activations"
    config: ConstantOutputConfig

    def __init__(self, config: ConstantOutputConfig) -> None:
        super().__init__(config)
        self._states: dict[tuple[str, str], _State] = {}
        self._target: float | None = None

    def _constant(
        self, stats: ActivationStats, state: _State, step: int, pass_target: float | None
    ) -> bool:
        spread, in_spread = stats.out_spread, stats.in_spread
        assert spread is not None and in_spread is not None
        gain = spread / in_spread
        # A spread within float rounding of the output's size is no variation: an
        # output the same for every row by design (a flow layer's log-determinant,
        # expanded over the batch) measures 1e-8 one step and 0 the next.
        rounding = spread <= _EXACT * max(stats.out_rms or 0.0, 1e-30)
        if not rounding:
            state.max_spread = max(state.max_spread, spread)
        varies = 0.0 if rounding else spread
        # Judged against the levels of the checks before this one, then this one joins them.
        held, max_ratio = state.held, state.max_ratio
        state.hold(varies, self.config.patience)
        state.max_ratio = max(max_ratio, gain)
        ratio = self.config.ratio
        if _model_output(stats):
            if rounding:
                return True
            if pass_target is not None and spread >= ratio * pass_target:
                # The loss asks no more variation of it on this pass: a boundary
                # condition's points all held to one value (a target of spread 0).
                return False
            if step < self.config.warmup:
                return False
            if self._target:
                return spread <= ratio * self._target and spread <= 0.5 * state.max_spread
            # Against its own history, as a hidden module: a model whose passes see
            # inputs of very different spreads (a discriminator on real data, then on
            # its generator's narrow fakes) varies less on the narrower input, by as
            # much as the input does.
            return (
                spread <= ratio * held
                and spread <= 0.5 * state.max_spread
                and gain <= ratio * max_ratio
            )
        return state.max_spread > 0.0 and varies <= ratio * held and gain <= ratio * max_ratio

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if record.same_weights:
            # The previous step moved no weight (every learning rate 0, a warm-up's
            # first step): a zero-initialised output still exactly 0 is that
            # check again, not a second one.
            return []
        alerts = []
        pass_target = _pass_target(record.activations)
        for stats in record.activations:
            spread, in_spread = stats.out_spread, stats.in_spread
            if stats.module == PASS_TARGET:
                continue
            if stats.module == TARGET:
                if spread is not None and math.isfinite(spread) and spread > 0.0:
                    self._target = max(self._target or 0.0, spread)
                continue
            if spread is None or in_spread is None:
                continue
            if not (math.isfinite(spread) and math.isfinite(in_spread)):
                continue
            key = (stats.module, stats.output)
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = _State()
            if (
                stats.out_rms == 0.0
                and state.max_spread > 0.0
                and not _model_output(stats)
                and not _holds_weights(stats.module, record.layer_norms)
            ):
                # A module without weights (a drop-path module) whose output is
                # exactly zero everywhere after it varied: stochastic depth dropped
                # the branch for the whole batch this step (mode="batch"). It
                # neither extends nor ends a streak. A module with weights whose
                # output a zero gate silenced is still judged.
                continue
            # A constant input explains a constant output.
            bad = in_spread > _INPUT_CONSTANT and self._constant(
                stats, state, record.step, pass_target
            )
            if state.due(bad, record.step, self.config.patience):
                alerts.append(self._alert(record, stats, state))
        return alerts

    def _alert(self, record: StepRecord, stats: ActivationStats, state: _State) -> Alert:
        spread, in_spread = stats.out_spread or 0.0, stats.in_spread or 0.0
        name = stats.module
        model_output = _model_output(stats)
        field = f" ({stats.output})" if stats.output else ""
        if model_output and self._target:
            versus = (
                f" ({spread / self._target:.2%} of the loss target's spread, {self._target:.3g})"
            )
        elif state.held > 0.0:
            versus = f" ({spread / state.held:.2%} of the spread it held, {state.held:.3g})"
        else:
            versus = ""
        if model_output:
            what = (
                f"the model's output{field} collapsed to ~{stats.out_mean:.4g}: it varies across "
                f"the batch by {spread:.3g}{versus} while its input varies by {in_spread:.3g}"
            )
            hint = (
                "the model predicts (nearly) the same value for every sample: the "
                "target mean or the class prior. Usual causes: a loss that broadcasts "
                "(N, 1) against (N,) (see the broadcast rule), a dead layer upstream, "
                "or a learning rate so high that the weights collapsed."
            )
        else:
            what = (
                f"output{field} of {name or 'the model'} no longer varies across the batch: "
                f"spread {spread:.3g}"
                f"{versus} while its input varies by {in_spread:.3g}"
            )
            hint = (
                "this layer ignores its input: saturated or dead units, weights decayed "
                "to zero, or a bias that dominates. Check its weights' norm and the "
                "learning rate; everything downstream sees a constant."
            )
        steps = "" if state.start == record.step else f" (checks from step {state.start} on)"
        return self.alert(
            state.start,
            name,
            what + steps,
            hint,
            {
                "spread": spread,
                "input_spread": in_spread,
                "largest_spread": state.max_spread,
                "held_spread": state.held,
                "target_spread": self._target if model_output else None,
                "output": stats.output,
                "value": stats.out_mean,
                "rows": stats.rows,
                "checks": state.count,
            },
        )


def _holds_weights(module: str, layers: dict[str, float]) -> bool:
    """Whether the module or one inside it is a layer of the step (holds parameters
    that got a gradient). Asked only for an output exactly zero everywhere."""
    prefix = module + "."
    return module in layers or any(name.startswith(prefix) for name in layers)


def _pass_target(activations: list[ActivationStats]) -> float | None:
    """The spread of the model output's loss target on the sampled pass, or None.

    Among the step's last two rows (the run's loss target may follow it) when
    the loss's ops named one.
    """
    for stats in activations[-2:]:
        if stats.module == PASS_TARGET:
            spread = stats.out_spread
            return spread if spread is not None and math.isfinite(spread) else None
    return None


def _model_output(stats: ActivationStats) -> bool:
    return stats.module == "" and stats.primary


class DeadUnitsRule(Rule):
    id = "dead_units"
    needs = frozenset({"activation_sampler"})
    reads = "activations"
    config: DeadUnitsConfig

    def __init__(self, config: DeadUnitsConfig) -> None:
        super().__init__(config)
        self._states: dict[str, _State] = {}

    def evaluate(self, record: StepRecord) -> list[Alert]:
        """Judged on the units zero for every sampled row, not on the zeros alone.

        A sparse code (a sparse autoencoder's latents at 1% density, k-sparse
        features) is zero for 99% of units and samples by design, but each
        sample's few active units are different ones, so most units fire in
        some sampled row. A dead layer's zeros are the same units in every row.
        The dead share is never above the zero share, and for a dead layer the
        two are equal within the live units' own zeros.
        """
        alerts = []
        for stats in record.activations:
            zero = stats.zero_fraction
            dead = stats.dead_fraction
            if zero is None or dead is None or not math.isfinite(dead):
                continue
            state = self._states.get(stats.module)
            if state is None:
                state = self._states[stats.module] = _State()
            found = dead >= self.config.threshold and not _sparse_code(zero, dead, self.config.rows)
            if not state.due(found, record.step, self.config.patience):
                continue
            alerts.append(
                self.alert(
                    state.start,
                    stats.module,
                    f"{stats.module or 'the root module'} outputs zero for {zero:.1%} of "
                    f"units and samples; {dead:.1%} of its units are zero for every sampled "
                    f"sample ({state.count} checks from step {state.start})",
                    "dead ReLUs: a learning rate too high (a large update pushed the "
                    "pre-activations negative for good), a large negative bias, or bad "
                    "input scaling. Lower the learning rate, check the initialisation, or "
                    "use LeakyReLU/GELU.",
                    {
                        "zero_fraction": zero,
                        "dead_fraction": dead,
                        "checks": state.count,
                        "since_step": state.start,
                    },
                )
            )
        return alerts


# Sampled rows a live unit fires in, on average, below which the zeros are a
# sparse code's: each live unit active in about one row of the sample.
_ROWS_PER_LIVE_UNIT = 1.5


def _sparse_code(zero: float, dead: float, rows: int) -> bool:
    """Whether the units that fired did so in about one sampled row each.

    A code sparser than one active unit in a hundred per sample shows few
    units in a sample of rows (16 by default): nearly every unit is then zero
    in every row, as in a dead layer. What differs is how often the units that
    did fire fired: a dead layer's survivors fire for most samples, a sparse
    code's units each for the odd one. Active entries over live units, times
    the rows, is that average. ``rows`` is the rows asked for: a smaller batch
    sampled whole makes the average look larger, so the layer is judged as before.
    """
    live = 1.0 - dead
    if live <= 0.0 or rows < 2:
        return False
    return (1.0 - zero) * rows / live < _ROWS_PER_LIVE_UNIT
