"""What one training step looked like, as plain host-side data.

Collectors fill it, the readback turns its device tensors into floats, rules
read it. Rules never see a model, so each can be tested with a hand-built
record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainwatch.layers import ParamInfo


@dataclass
class StepRecord:
    step: int
    # "optimizer": an optimizer's step() ended it; "manual": monitor.step();
    # "attach": the audit made when the monitor attaches (no gradients yet).
    source: str = "optimizer"
    optimizer: int | None = None
    # Trainable parameters the step used, and the L2 norm of each one's gradient.
    present: list[ParamInfo] = field(default_factory=list)
    param_norms: list[float] = field(default_factory=list)
    # Trainable parameters the step should have used but whose .grad is None.
    missing: list[ParamInfo] = field(default_factory=list)
    # requires_grad=False parameters inside the optimizer's param groups, and
    # how many trainable parameters each owning module has in the optimizer.
    frozen: list[ParamInfo] = field(default_factory=list)
    trainable_by_module: dict[str, int] = field(default_factory=dict)
    # Parameters that got a gradient although no watched optimizer holds them.
    not_optimized: list[ParamInfo] = field(default_factory=list)
    # Parameters whose gradient still held the previous step's values when
    # backward added onto it, and how that was established.
    accumulated: list[ParamInfo] = field(default_factory=list)
    accumulation_method: str | None = None
    layer_norms: dict[str, float] = field(default_factory=dict)
    total_norm: float | None = None
    loss: float | None = None
