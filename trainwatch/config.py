"""Typed configuration: defaults live here, ``configs/*.yaml`` are presets of it.

Every key is validated when the config is loaded, so a typo fails before the
first training step and the error names the key and what it accepts.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from trainwatch.errors import ConfigError

SeverityName = Literal["info", "warning", "error"]


def _range(low: float | None = None, high: float | None = None) -> dict[str, Any]:
    return {"min": low, "max": high}


@dataclass
class RuleConfig:
    """Switch and severity shared by every rule."""

    enabled: bool = True
    severity: SeverityName = "warning"


@dataclass
class ZeroGradientConfig(RuleConfig):
    # Consecutive steps without signal before alerting: 1 step of exact zeros is
    # normal with zero-initialised branches (LoRA B, zero-init residuals).
    patience: int = field(default=3, metadata=_range(1))


@dataclass
class AccumulatedGradientConfig(RuleConfig):
    severity: SeverityName = "error"


@dataclass
class FrozenInOptimizerConfig(RuleConfig):
    pass


@dataclass
class NotOptimizedConfig(RuleConfig):
    pass


@dataclass
class TrainableParametersConfig(RuleConfig):
    # The setup table (counts by location, adapters, optimizer coverage) on the
    # console, TensorBoard and setup.json; off: only the rule's warnings.
    table: bool = True


@dataclass
class NonfiniteForwardConfig(RuleConfig):
    severity: SeverityName = "error"
    # Re-run the origin module under a dispatch trace to name the op and line
    # (only after a detection, on CPU tensors; costs nothing on healthy steps).
    trace_op: bool = True
    # Trigger, then diagnose: one sum of the model's output per pass and the
    # step's gradient norms; only when one is off is the pass replayed module
    # by module (module, op, source line, before the optimizer applies it).
    # "auto": on CPU the sum is read as the pass ends; on a GPU at the step
    # boundary, with one scalar read back per step (one sync); on a model no
    # rank can replay alone (FSDP2, SyncBatchNorm) as "deferred", to name the layer.
    # "step": at the step boundary on every device (what a GPU does, on CPU).
    # "deferred" (no sync): every module's output and gradient summed on the
    # device and read back one step later; module and step exact, no op
    # traced, halt_on one step late; for loops that must never sync.
    check: Literal["auto", "step", "deferred"] = "auto"


@dataclass
class NonfiniteConfig(RuleConfig):
    severity: SeverityName = "error"


@dataclass
class NonfiniteParameterConfig(RuleConfig):
    severity: SeverityName = "error"
    # 0: infer it from the next forward (free: the module whose weights went
    # non-finite is the next forward's origin); N: also take the norm of every
    # weight after every N-th step (one batched kernel), to hear of it at once.
    check_every: int = field(default=0, metadata=_range(0))


@dataclass
class AmpSkippedStepsConfig(RuleConfig):
    # GradScaler skipping this many backward passes in a row is news; fewer is its job.
    patience: int = field(default=10, metadata=_range(2))
    # Or skipping more than ``max_fraction`` of the last ``window`` steps. Skips
    # before any update was applied are the scaler's warm-up and never count.
    window: int = field(default=100, metadata=_range(2))
    max_fraction: float = field(default=0.5, metadata=_range(0.0, 1.0))


@dataclass
class ConstantOutputConfig(RuleConfig):
    # Sampled (a std over the batch per module costs 1.5-2.6x a step, measured on CPU):
    # on each of the first ``first_steps`` steps, then every ``every`` steps,
    # and on ``rows`` rows of the batch only.
    every: int = field(default=25, metadata=_range(1))
    first_steps: int = field(default=5, metadata=_range(0))
    rows: int = field(default=16, metadata=_range(2))
    # Constant: the across-batch spread fell below ``ratio`` times its
    # reference (the model's output: the loss target's spread; without one,
    # and a hidden module: the largest spread it held over ``patience`` checks
    # in a row, with its input still varying as much relative to it), in
    # ``patience`` consecutive checks. A collapsed regression still varies by
    # 0.1-2% of its targets' spread, so zero is no test.
    ratio: float = field(default=0.05, metadata=_range(0.0, 1.0))
    patience: int = field(default=2, metadata=_range(1))
    # A fresh model often fits the target mean first (small, shrinking output
    # spread): a relative collapse of the model's output counts from this step
    # on. An output that does not vary at all is reported at once.
    warmup: int = field(default=20, metadata=_range(0))


@dataclass
class DeadUnitsConfig(RuleConfig):
    every: int = field(default=25, metadata=_range(1))
    first_steps: int = field(default=5, metadata=_range(0))
    rows: int = field(default=16, metadata=_range(1))
    # Fraction of units (output positions) exactly zero in every sampled row.
    # A healthy ReLU layer has almost none; a sparse code (most outputs zero,
    # different units for each sample) few; a dead layer nearly all.
    threshold: float = field(default=0.99, metadata=_range(0.0, 1.0))
    patience: int = field(default=2, metadata=_range(1))


@dataclass
class EvalInTrainModeConfig(RuleConfig):
    # Monte-Carlo dropout: dropout left in training mode on purpose for
    # no-grad passes. Batch norm in training mode is still reported.
    mc_dropout: bool = False
    # Models that call F.dropout / F.batch_norm with no module of those types
    # (or whose modules draw random numbers in training mode only: DropPath):
    # the calls are looked for in this many of the first no-grad passes made in
    # training mode, then in one such pass in functional_every (0: no more).
    functional_passes: int = field(default=3, metadata=_range(0))
    functional_every: int = field(default=50, metadata=_range(0))


@dataclass
class TrainInEvalModeConfig(RuleConfig):
    # Models that call F.dropout / F.batch_norm with no module of those types:
    # the calls are looked for in this many of the first training passes made in
    # training mode; a module seen with them acting is known to hold them once a
    # no-grad pass in eval mode (an evaluation) sees its calls stop acting. A
    # module drawing random numbers there (DropPath) is run once in eval mode
    # at once: drawing none, it is known to behave as dropout does.
    functional_passes: int = field(default=3, metadata=_range(0))


@dataclass
class BroadcastConfig(RuleConfig):
    severity: SeverityName = "error"
    # A shape bug is there from the first step: audit this many steps, then the
    # check costs nothing; again when a new phase of training begins (a new
    # optimizer, a part of the model replaced, parameters frozen or unfrozen).
    # A layer first given a gradient on a step not audited (a rare task's head)
    # has its loss audited at its next step with a gradient (not with 0).
    audit_steps: int = field(default=3, metadata=_range(0))
    # The first this many evaluation passes of the run, and again of each new
    # phase (and, under ``trainwatch run``, of a dataset first evaluated later: a
    # test set): a whole first validation, whose metric may be taken over the
    # outputs of all its batches. Costs only that evaluation's own loss and
    # metric code, never a training step.
    evaluation_passes: int = field(default=64, metadata=_range(0))
    # A loss changed with no such sign: one step audited again at step
    # ``recheck_from``, then at intervals that double up to ``recheck_every``
    # (100, 200, 400, 800, 1600, 3200, 4800...). 0: never.
    recheck_from: int = field(default=100, metadata=_range(0))
    recheck_every: int = field(default=1600, metadata=_range(1))
    # A loss changed with no such sign is also found by its kind (the types of the
    # autograd ops from it back to the model's output), read on the class target
    # look's sampled steps, at least every this many steps: a new kind has the
    # audit follow the next steps until one with it (at most 8 times a run).
    # 0: never.
    loss_kind_every: int = field(default=10, metadata=_range(0))


@dataclass
class LossInputConfig(RuleConfig):
    # Looked at on the broadcast audit's steps (its audit_steps and rechecks).
    pass


@dataclass
class UnshuffledDataConfig(RuleConfig):
    # The loss's class targets are counted at step 0 and every ``every``-th step
    # after (one bincount joining the step's readback); other steps pay nothing. With
    # loss_on_padding on, the look comes at the more frequent of the two cadences.
    every: int = field(default=5, metadata=_range(1))
    # Sampled batches compared with the run's targets, and how many it takes.
    window: int = field(default=8, metadata=_range(2))
    min_batches: int = field(default=4, metadata=_range(2))
    # Batches holding at most this fraction of the classes that batches drawn
    # at random from the run's targets would hold.
    ratio: float = field(default=0.5, metadata=_range(0.0, 1.0))
    # More outputs than this are tokens or items, not classes: not counted.
    max_classes: int = field(default=1000, metadata=_range(2))


@dataclass
class LossOnPaddingConfig(RuleConfig):
    # The labels a token loss receives are looked at at step 0 and every
    # ``every``-th step after (the class target look's sampled steps: with
    # unshuffled_data on, the more frequent of the two cadences), slowing down
    # to 16 x ``every`` (or broadcast.loss_kind_every) while nothing is found,
    # and at the first step of a new pass over the data or of a new optimizer;
    # other steps pay nothing.
    every: int = field(default=5, metadata=_range(1))


@dataclass
class UnusedParameterConfig(RuleConfig):
    # A note on one device, where a branch used on some steps is harmless (a
    # mixture-of-experts router, stochastic depth, a head trained every k steps);
    # under DDP (a DistributedDataParallel model or a process group) at least a
    # warning, since the reducer waits for every parameter's gradient.
    severity: SeverityName = "info"


@dataclass
class ExplodingGradientConfig(RuleConfig):
    # No verdicts in the first steps: gradients settle from the initialisation.
    warmup: int = field(default=50, metadata=_range(0))
    # A layer's norm above ``factor`` times its recent typical norm (an
    # exponential average of log norms over about ``window`` steps).
    factor: float = field(default=50.0, metadata=_range(1.0))
    window: int = field(default=50, metadata=_range(2))
    # An absolute bound on any layer's norm; null: none.
    max_norm: float | None = field(default=None, metadata=_range(0.0))


@dataclass
class VanishingGradientConfig(RuleConfig):
    warmup: int = field(default=50, metadata=_range(0))
    # A layer's norm below ``ratio`` times the median layer norm of the step,
    # for ``patience`` steps in a row.
    ratio: float = field(default=1e-4, metadata=_range(0.0, 1.0))
    patience: int = field(default=20, metadata=_range(1))


@dataclass
class StalledTrainingConfig(RuleConfig):
    # The model is re-run on a few rows of its phase's first batch every
    # ``every`` steps (one eval forward without gradients, and a copy of the
    # weights before that step's update); never on the steps in between.
    every: int = field(default=100, metadata=_range(1))
    rows: int = field(default=16, metadata=_range(1))
    # No verdict before this many steps of a phase.
    warmup: int = field(default=200, metadata=_range(1))
    # Stalled: the output's RMS move on the first batch stays below
    # ``min_change`` of the output's spread past the warm-up. Healthy runs
    # (fine-tunes at lr 1e-5 included) move it 3e-2 or more, at lr 1e-6 3e-3,
    # a learning rate of 1e-12 or adapters on a module scaled by 1e-6 2e-7 or
    # less (benchmarks/tune_stalled_training.py) ...
    min_change: float = field(default=1e-5, metadata=_range(0.0))
    # ... while the loss is flat: its mean over the latest ``loss_window``
    # steps within ``loss_change`` (relative) or batch noise of the first ones.
    loss_window: int = field(default=20, metadata=_range(2))
    loss_change: float = field(default=0.05, metadata=_range(0.0))
    # Stalled too: the updates stopped after the first steps had moved the
    # output (a per-epoch scheduler stepped every batch). Every layer's
    # update-to-weight ratio ||dW||/||W|| below ``min_update_ratio`` at two
    # sampled steps in a row past the warm-up, stopped for at least as many
    # steps as the phase ran before, the loss flat as above since the first
    # of those sampled steps (the steps before it may have trained). Healthy
    # runs stay at 5.7e-6 or more two sampled steps in a row (a fine-tune at
    # lr 1e-6; 3e-4 or more through 400-step cosine-to-0, warm-up+cosine,
    # OneCycleLR and ReduceLROnPlateau schedules, whose last sampled step
    # alone falls to 1e-9..7e-8); StepLR(3, 0.1) and ExponentialLR(0.8)
    # stepped every batch leave the weights bit for bit as they were, 0
    # (benchmarks/tune_stalled_training.py). A sampled step whose gradients
    # hold NaN/Inf (a GradScaler's skipped step) starts the count over.
    min_update_ratio: float = field(default=1e-8, metadata=_range(0.0))
    # Stalled too, and told early: every param group of an optimizer has a
    # learning rate below 1e-6 of that group's own peak so far (a peak above 0:
    # a warm-up from 0 and a rising range test never count) while the optimizer
    # kept stepping there this many steps (and 1% of the steps its rate took
    # to fall that far). The rates are read every 10 steps, off the healthy
    # step. Per-batch-stepped ExponentialLR(0.9) falls that far in 131 steps,
    # StepLR(30, 0.1) in 210; cosine to 0 spends 6.4e-4 of its decay there,
    # OneCycleLR ends at 4e-6 of its peak, linear decay to 0 at 1/steps.
    lr_collapse_steps: int = field(default=20, metadata=_range(1))


@dataclass
class GradNormsConfig:
    enabled: bool = True


@dataclass
class ConsoleConfig:
    summary: bool = True
    top_layers: int = field(default=5, metadata=_range(0))


@dataclass
class TensorBoardConfig:
    """Event files in ``log_dir`` (or the Lightning logger's): norms, alerts, the tab."""

    enabled: bool = True
    # Per-layer gradient norms are written every `every` steps; alerts and the
    # first step of a NaN/Inf or all-zero streak are written whatever the cadence.
    every: int = field(default=1, metadata=_range(1))
    # A histogram of the per-layer norms: histograms are what a TensorBoard sink pays for.
    histograms: bool = False
    histogram_every: int = field(default=100, metadata=_range(1))
    # Seconds, so a live TensorBoard shows a run while it trains.
    flush_secs: float = field(default=5.0, metadata=_range(0.1))


@dataclass
class DistributedConfig:
    # Under DDP, alerts raised on other ranks reach rank zero every
    # `gather_every` steps: the Lightning callback gathers them (one small
    # object gather, also at each epoch end and when training ends); tw.watch
    # and `trainwatch run` read them from the process group's store on rank
    # zero (also at a halt and at close). 0 keeps only the ends.
    # Under FSDP2, the whole-layer gradient norms are summed across ranks every
    # `gather_every` steps too (one all-reduce of one vector); 0: never.
    gather_every: int = field(default=50, metadata=_range(0))
    # tw.watch and `trainwatch run` under a process group of more than one
    # rank: rank zero alone writes and prints, the other ranks post their
    # alerts to it. False: every rank writes its own sinks (alerts still carry
    # data["rank"]).
    relay: bool = True
    # At close, rank zero waits up to this many seconds for the other ranks
    # to close and post their last alerts (and, with --fail-on, every rank
    # for every rank's worst severity).
    close_wait_s: float = field(default=3.0, metadata=_range(0.0))
    # With halt_on, every rank checks every `halt_check_every` steps whether any
    # rank halted (one one-number all-reduce) and all stop together; a rank
    # that fired keeps stepping until the next check.
    halt_check_every: int = field(default=1, metadata=_range(1))


@dataclass
class Config:
    """Everything a Monitor can be told; ``Config()`` is the default preset."""

    halt_on: list[str] = field(default_factory=list)
    # When per-step numbers are read back to the host: "sync" at the step,
    # "lagged" one step later without blocking (CUDA), "auto" picks per device.
    readback: Literal["auto", "sync", "lagged"] = "auto"
    grad_norms: GradNormsConfig = field(default_factory=GradNormsConfig)
    zero_gradient: ZeroGradientConfig = field(default_factory=ZeroGradientConfig)
    accumulated_gradient: AccumulatedGradientConfig = field(
        default_factory=AccumulatedGradientConfig
    )
    frozen_in_optimizer: FrozenInOptimizerConfig = field(default_factory=FrozenInOptimizerConfig)
    not_optimized: NotOptimizedConfig = field(default_factory=NotOptimizedConfig)
    nonfinite_forward: NonfiniteForwardConfig = field(default_factory=NonfiniteForwardConfig)
    nonfinite_backward: NonfiniteConfig = field(default_factory=NonfiniteConfig)
    nonfinite_loss: NonfiniteConfig = field(default_factory=NonfiniteConfig)
    nonfinite_parameter: NonfiniteParameterConfig = field(default_factory=NonfiniteParameterConfig)
    amp_skipped_steps: AmpSkippedStepsConfig = field(default_factory=AmpSkippedStepsConfig)
    constant_output: ConstantOutputConfig = field(default_factory=ConstantOutputConfig)
    dead_units: DeadUnitsConfig = field(default_factory=DeadUnitsConfig)
    eval_in_train_mode: EvalInTrainModeConfig = field(default_factory=EvalInTrainModeConfig)
    train_in_eval_mode: TrainInEvalModeConfig = field(default_factory=TrainInEvalModeConfig)
    broadcast: BroadcastConfig = field(default_factory=BroadcastConfig)
    loss_input: LossInputConfig = field(default_factory=LossInputConfig)
    unused_parameter: UnusedParameterConfig = field(default_factory=UnusedParameterConfig)
    exploding_gradient: ExplodingGradientConfig = field(default_factory=ExplodingGradientConfig)
    vanishing_gradient: VanishingGradientConfig = field(default_factory=VanishingGradientConfig)
    trainable_parameters: TrainableParametersConfig = field(
        default_factory=TrainableParametersConfig
    )
    unshuffled_data: UnshuffledDataConfig = field(default_factory=UnshuffledDataConfig)
    loss_on_padding: LossOnPaddingConfig = field(default_factory=LossOnPaddingConfig)
    stalled_training: StalledTrainingConfig = field(default_factory=StalledTrainingConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Config:
        from trainwatch.rules import RULE_IDS  # the rules import this module

        config = _build(cls, values, "")
        unknown = [rule for rule in config.halt_on if rule not in RULE_IDS]
        if unknown:
            raise ConfigError(
                f"halt_on: unknown rule id {unknown[0]!r}; allowed: {', '.join(RULE_IDS)}"
            )
        return config

    def rule(self, rule_id: str) -> RuleConfig | None:
        section = getattr(self, rule_id, None)
        return section if isinstance(section, RuleConfig) else None


def load_config(
    config: Config | dict[str, Any] | str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Resolve ``tw.watch``'s ``config`` argument and ``**overrides`` into a Config.

    Overrides accept a section as a dict (``zero_gradient={"patience": 5}``),
    ``False``/``True`` for a section's ``enabled`` switch, and dotted or
    double-underscore keys for single values (``zero_gradient__patience=5``).
    """
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, Config):
        base = config.to_dict()
    elif isinstance(config, dict):
        base = _deep_copy(config)
    elif isinstance(config, (str, os.PathLike)):
        base = _read_yaml(Path(config))
    else:
        raise ConfigError(
            f"config: expected a path, a dict or a trainwatch.Config, got {type(config).__name__}"
        )
    for key, value in (overrides or {}).items():
        _apply_override(base, key, value)
    return Config.from_dict(base)


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"config: no such file {str(path)!r}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: {path} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {path} must hold a mapping at the top level")
    return loaded


def _apply_override(target: dict[str, Any], key: str, value: Any) -> None:
    path = key.replace("__", ".").split(".")
    node = target
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    last = path[-1]
    section_type = _field_types(Config).get(last) if len(path) == 1 else None
    is_section = dataclasses.is_dataclass(section_type)
    if is_section and isinstance(value, bool):
        node.setdefault(last, {})
        if not isinstance(node[last], dict):
            node[last] = {}
        node[last]["enabled"] = value
    elif is_section and isinstance(value, dict):
        merged = dict(node.get(last) or {})
        merged.update(value)
        node[last] = merged
    else:
        node[last] = value


def _deep_copy(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in values.items()}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, values: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(values).__name__}")
    types_by_name = _field_types(cls)
    fields_by_name = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in types_by_name]
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown key; allowed keys"
            f"{' in ' + where if prefix else ''}: {', '.join(types_by_name)}"
        )
    kwargs = {}
    for name, value in values.items():
        kwargs[name] = _coerce(
            types_by_name[name], value, f"{prefix}{name}", fields_by_name[name].metadata
        )
    return cls(**kwargs)


def _coerce(annotation: Any, value: Any, key: str, metadata: Any) -> Any:
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, bool):
            return annotation(enabled=value) if "enabled" in _field_types(annotation) else None
        return _build(annotation, value, key + ".")
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(
                f"{key}: {value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}"
            )
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key, metadata)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item_type,) = typing.get_args(annotation)
        return [_coerce(item_type, item, f"{key}[{i}]", {}) for i, item in enumerate(value)]
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if annotation is int and not float(value).is_integer():
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        value = annotation(value)
        low, high = metadata.get("min"), metadata.get("max")
        if low is not None and value < low:
            raise ConfigError(f"{key}: {value} is below the minimum {low}")
        if high is not None and value > high:
            raise ConfigError(f"{key}: {value} is above the maximum {high}")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {annotation!r}")  # pragma: no cover
