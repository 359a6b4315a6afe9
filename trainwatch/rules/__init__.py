"""Pure decisions: a step record in, alerts out. Each rule owns its state."""

from __future__ import annotations

from trainwatch.config import Config
from trainwatch.rules.accumulation import AccumulatedGradientRule
from trainwatch.rules.activations import ConstantOutputRule, DeadUnitsRule
from trainwatch.rules.amp import SkippedStepsRule
from trainwatch.rules.base import Rule
from trainwatch.rules.broadcast import BroadcastRule
from trainwatch.rules.gradient_scale import ExplodingGradientRule, VanishingGradientRule
from trainwatch.rules.loss_input import LossInputRule
from trainwatch.rules.loss_on_padding import LossOnPaddingRule
from trainwatch.rules.modes import EvalInTrainModeRule, TrainInEvalModeRule
from trainwatch.rules.nonfinite import (
    NonfiniteBackwardRule,
    NonfiniteForwardRule,
    NonfiniteLossRule,
    NonfiniteParameterRule,
)
from trainwatch.rules.optimizer_membership import FrozenInOptimizerRule, NotOptimizedRule
from trainwatch.rules.stalled import StalledTrainingRule
from trainwatch.rules.trainable_parameters import TrainableParametersRule
from trainwatch.rules.unshuffled import UnshuffledDataRule
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
    LossInputRule,
    ConstantOutputRule,
    DeadUnitsRule,
    TrainableParametersRule,
    UnshuffledDataRule,
    LossOnPaddingRule,
    StalledTrainingRule,
)


# The one list of rule ids: every rule's, and trainwatch's own failures.
RULE_IDS: tuple[str, ...] = (*(cls.id for cls in RULE_CLASSES), "internal_error")

# What each collector of the model serves (the rules that need it).
COLLECTORS = (
    "nonfinite_probe",
    "accumulation_tracker",
    "call_tracker",
    "modes",
    "broadcast_audit",
    "activation_sampler",
    "class_targets",
    "padded_labels",
    "first_batch",
)


def rules_needing(*collectors: str) -> frozenset[str]:
    """The ids of the rules that need any of ``collectors``."""
    return frozenset(cls.id for cls in RULE_CLASSES if cls.needs & set(collectors))


def build_rules(config: Config) -> list[Rule]:
    """The enabled rules, each with its own section of the config."""
    rules = []
    for cls in RULE_CLASSES:
        section = config.rule(cls.id)
        if section is not None and section.enabled:
            rules.append(cls(section))  # type: ignore[arg-type]
    return rules


__all__ = ["COLLECTORS", "RULE_CLASSES", "RULE_IDS", "Rule", "build_rules", "rules_needing"]
