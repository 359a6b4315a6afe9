"""Pure decisions: a step record in, alerts out. Each rule owns its state."""

from __future__ import annotations

from trainwatch.config import Config
from trainwatch.rules.accumulation import AccumulatedGradientRule
from trainwatch.rules.activations import ConstantOutputRule, DeadUnitsRule
from trainwatch.rules.base import Rule
from trainwatch.rules.broadcast import BroadcastRule
from trainwatch.rules.gradient_scale import ExplodingGradientRule, VanishingGradientRule
from trainwatch.rules.modes import EvalInTrainModeRule, TrainInEvalModeRule
from trainwatch.rules.nonfinite import (
    NonfiniteBackwardRule,
    NonfiniteForwardRule,
    NonfiniteLossRule,
    NonfiniteParameterRule,
    SkippedStepsRule,
)
from trainwatch.rules.optimizer_membership import FrozenInOptimizerRule, NotOptimizedRule
from trainwatch.rules.unused import UnusedParameterRule
from trainwatch.rules.zero_gradient import ZeroGradientRule

RULE_CLASSES: tuple[type[Rule], ...] = (
    NonfiniteForwardRule,
    NonfiniteBackwardRule,
    NonfiniteLossRule,
    NonfiniteParameterRule,
    SkippedStepsRule,
    ZeroGradientRule,
    AccumulatedGradientRule,
    FrozenInOptimizerRule,
    NotOptimizedRule,
    UnusedParameterRule,
    ExplodingGradientRule,
    VanishingGradientRule,
    EvalInTrainModeRule,
    TrainInEvalModeRule,
    BroadcastRule,
    ConstantOutputRule,
    DeadUnitsRule,
)


def build_rules(config: Config) -> list[Rule]:
    """The enabled rules, each with its own section of the config."""
    rules = []
    for cls in RULE_CLASSES:
        section = config.rule(cls.id)
        if section is not None and section.enabled:
            rules.append(cls(section))  # type: ignore[arg-type]
    return rules


__all__ = ["Rule", "build_rules", "RULE_CLASSES"]
