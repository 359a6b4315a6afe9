"""A healthy step costs the same at any depth: counted ops and calls, never timed.

``benchmarks/opcount.py`` counts the aten ops trainwatch adds to one healthy
step (past the first-steps audits, off the sampled steps) and the Python
calls into the ``trainwatch`` package, on a residual stack 4 and 64 blocks
deep. Counting is deterministic, so it can gate CI where a time could not.
Over a window of steps (``window_bytecodes``) the sampled and audit steps are
counted too, and those grow with depth only by what their design samples.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import fmean

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from opcount import count, residual_stack, window_bytecodes
from torch import nn

# Slack for a constant or two that depends on the step's shape, never on depth.
SAME = 2


@pytest.fixture(scope="module")
def counts():
    return count(4), count(64)


def test_ops_trainwatch_adds_do_not_grow_with_depth(counts):
    shallow, deep = counts
    assert deep.plain_ops > 10 * shallow.plain_ops / 2  # the deep model does much more
    assert abs(deep.added_ops - shallow.added_ops) <= SAME
    assert deep.added_ops < 10


def test_python_calls_into_trainwatch_do_not_grow_with_depth(counts):
    shallow, deep = counts
    assert abs(deep.python_calls - shallow.python_calls) <= SAME
    assert deep.python_calls < 100


def test_default_config_counts_are_what_the_benchmark_prints(capsys):
    from opcount import main

    assert main(["--depths", "2"]) == 0
    out = capsys.readouterr().out
    assert "ops added" in out and "python calls" in out


@pytest.mark.parametrize(
    "disabled",
    [
        {"accumulated_gradient": False},
        {"constant_output": False, "dead_units": False},
        {"broadcast": False, "constant_output": False},
        {
            "nonfinite_forward": False,
            "nonfinite_backward": False,
            "nonfinite_loss": False,
            "nonfinite_parameter": False,
            "amp_skipped_steps": False,
        },
    ],
    ids=["accumulation", "activations", "broadcast", "nonfinite"],
)
def test_a_disabled_rule_costs_nothing(counts, disabled):
    """Switching rules off never adds ops or calls to a healthy step."""
    default = counts[0]
    off = count(4, disabled)
    assert off.added_ops <= default.added_ops
    assert off.python_calls <= default.python_calls


def test_trainwatchs_own_bytecode_does_not_grow_with_depth(counts):
    """No Python loop over layers, modules or parameters on a healthy step: the
    instructions trainwatch's own code runs are the same at depth 4 and 64 (a
    loop that calls nothing the profiler sees still shows here)."""
    shallow, deep = counts
    assert deep.bytecodes == shallow.bytecodes


def test_every_call_the_interpreter_makes_does_not_grow_with_depth(counts):
    """Every call the profiler sees, any code's: the per-layer norms and every rule's
    per-layer checks run in C loops (exploding_gradient moves its averages in
    them too), so a deep step adds what a shallow one does."""
    shallow, deep = counts
    assert abs(deep.interpreter_calls - shallow.interpreter_calls) <= SAME


def test_a_layer_near_a_jump_still_gets_the_per_layer_look():
    """Control: with a bound every step crosses, exploding_gradient takes the Python
    loop, and the deep step adds more calls than the shallow one."""
    bound = {"exploding_gradient": {"max_norm": 1e-12}}
    shallow, deep = count(4, bound), count(64, bound)
    assert deep.interpreter_calls > shallow.interpreter_calls + 60
    assert deep.bytecodes > shallow.bytecodes + 1000


def _stack_with_dropout(depth: int) -> nn.Module:
    """The residual stack with a dropout after every block, as transformers have."""
    blocks = list(residual_stack(depth))
    return nn.Sequential(*(m for b in blocks[:-1] for m in (b, nn.Dropout(0.1))), blocks[-1])


def test_the_mode_check_of_every_pass_does_not_grow_with_the_dropouts():
    """train_in_eval_mode looks at every dropout's mode at every pass, in C loops."""
    shallow = count(4, model=_stack_with_dropout)
    deep = count(64, model=_stack_with_dropout)
    assert deep.bytecodes == shallow.bytecodes
    assert abs(deep.python_calls - shallow.python_calls) <= SAME


# Steps 50 to 200 take every kind of sampled step: the activation sampler's
# (every 25), stalled_training's re-run (at 100 and 200) and the steps whose
# loss it reads, the broadcast recheck (101). There the average step at depth
# 64 measured 789 bytecodes above depth 4's: the sampler measures 32 modules
# of the deep stack against all 17 of the shallow one. A loop naming every
# parameter on the sampler's steps alone (about 4,500 bytecodes each at depth
# 64) adds about 170; the stall re-run's per-module saves and restores, the
# broadcast recheck's mode over every gradient read and the update ratios'
# per-parameter Python added about 2,000 before they went into C loops. The
# re-run's write guard (a dispatch mode that puts back what the forward writes
# into the model's state) looks up each op of the forward it re-runs, about 12
# bytecodes an op: 3,600 more a re-run at depth 64, 891 above depth 4 in all.
# The bound leaves room for less than one such loop more (the control below
# crosses it at about 1,320).
WINDOW_GROWTH = 1000


@pytest.fixture(scope="module")
def windows():
    return window_bytecodes(4), window_bytecodes(64)


def test_sampled_steps_grow_little_with_depth(windows, counts):
    """Sampled and audit steps may cost more at depth (a sampler measures up to 32
    modules), but trainwatch's Python on them must not loop over every module or
    parameter: the window's average at depth 64 stays near depth 4's."""
    shallow, deep = windows
    healthy = counts[0].bytecodes
    assert sum(steps > healthy + 1000 for steps in deep) >= 7  # the sampled steps are in it
    assert fmean(deep) - fmean(shallow) <= WINDOW_GROWTH


def test_a_loop_over_every_parameter_on_sampled_steps_shows_in_the_window():
    """Control: nonfinite_parameter's check every 25 steps names each weight it
    checks in Python; over the window the deep stack's average then grows past
    the bound."""
    every = {"nonfinite_parameter": {"check_every": 25}}
    shallow, deep = window_bytecodes(4, config=every), window_bytecodes(64, config=every)
    assert fmean(deep) - fmean(shallow) > WINDOW_GROWTH
