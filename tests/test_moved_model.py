"""A model moved or cast after ``tw.watch`` (``.to()``, ``.double()``, ``.half()``,
``.to_empty()``) stays watched under its own names, in each of PyTorch's three
ways of converting parameters.

- Default: each Parameter keeps its identity (``param.data`` is replaced).
- Swap mode (``torch.__future__.set_swap_module_params_on_conversion(True)``):
  identity kept, contents swapped by ``torch.utils.swap_tensors``, which
  refuses tensors that have a weak reference: trainwatch must hold none.
- Overwrite mode (``set_overwrite_module_params_on_conversion(True)``): new
  Parameter objects, put in place where no registration hook sees them. An
  optimizer built before still holds the old ones and trains nothing: that
  is reported (``not_optimized``), not hidden.

Each planted bug sits beside the same moved model trained healthily.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from tests.conftest import TinyNet, batches, rules_of


@contextmanager
def _future(flag: str, value: bool) -> Iterator[None]:
    """One of torch.__future__'s conversion flags, set for a while, then put back."""
    get = getattr(torch.__future__, f"get_{flag}_module_params_on_conversion")
    put = getattr(torch.__future__, f"set_{flag}_module_params_on_conversion")
    before = get()
    put(value)
    try:
        yield
    finally:
        put(before)


@pytest.fixture(params=["default", "swap"])
def conversion(request) -> Iterator[str]:
    """PyTorch's conversion mode, switched on for the whole test (as a script would)."""
    with _future("swap", request.param == "swap"):
        yield request.param


@pytest.fixture
def swap_mode() -> Iterator[None]:
    with _future("swap", True):
        yield


@pytest.fixture
def overwrite_mode() -> Iterator[None]:
    with _future("overwrite", True):
        yield


def _reinitialise(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()


def _to_empty(model: nn.Module) -> torch.dtype:
    model.to_empty(device="cpu")  # uninitialised memory: re-initialised as users do
    _reinitialise(model)
    return torch.float32


MOVES: dict[str, Callable[[nn.Module], torch.dtype]] = {
    "to_float64": lambda m: (m.to(torch.float64), torch.float64)[1],
    "double": lambda m: (m.double(), torch.float64)[1],
    "half": lambda m: (m.half(), torch.float16)[1],
    "to_bfloat16": lambda m: (m.to(torch.bfloat16), torch.bfloat16)[1],
    "to_empty": _to_empty,
}


def train_as(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    zero_grad: bool = True,
    seed: int = 0,
) -> None:
    for x, y in batches(steps, seed=seed):
        if zero_grad:
            opt.zero_grad()
        out = model(x.to(device=device, dtype=dtype))
        nn.functional.mse_loss(out.float(), y.to(device)).backward()
        opt.step()


def watched(quiet_watch, lr: float = 0.01):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt, quiet_watch(model, opt)


# -- default and swap mode: the same Parameter objects ----------------------------------------


@pytest.mark.parametrize("move", list(MOVES))
def test_healthy_training_after_a_move_is_silent_with_the_same_names(conversion, move, quiet_watch):
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    before = list(model.parameters())
    dtype = MOVES[move](model)
    assert all(a is b for a, b in zip(before, model.parameters()))  # identity kept
    train_as(model, opt, 6, dtype, seed=1)
    assert rules_of(monitor) == []
    assert monitor.step_count == 9
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}


@pytest.mark.parametrize("move", list(MOVES))
def test_detached_layer_after_a_move_is_zero_gradient_named_by_module(
    conversion, move, quiet_watch
):
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    dtype = MOVES[move](model)
    model.detach_fc1 = True
    train_as(model, opt, 4, dtype, seed=1)
    zero = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [(a.module, a.step) for a in zero] == [("fc1", 3)]
    assert zero[0].data["parameters"] == ["fc1.weight", "fc1.bias"]


@pytest.mark.parametrize("move", ["to_float64", "half"])
def test_missing_zero_grad_after_a_move_is_accumulated_gradient(conversion, move, quiet_watch):
    """The per-parameter gradient hooks keep working after the move.

    A swap disconnects every tensor hook of a parameter (PyTorch); trainwatch
    reconnects them at the step that follows, so the first backward after a
    swap goes unseen and the missing zero_grad shows one step later.
    """
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    dtype = MOVES[move](model)
    train_as(model, opt, 4, dtype, zero_grad=False, seed=1)
    (alert,) = [a for a in monitor.alerts if a.rule == "accumulated_gradient"]
    assert alert.step == (4 if conversion == "swap" else 3)


def test_a_swap_leaves_the_users_own_parameter_hooks_working(swap_mode, quiet_watch):
    """Reconnecting the hooks after a swap reconnects the user's too, handles intact."""
    model, opt, _ = watched(quiet_watch)
    seen = []
    handle = model.head.weight.register_hook(lambda grad: seen.append(grad.dtype))
    train_as(model, opt, 2)
    model.double()
    train_as(model, opt, 3, torch.float64, seed=1)
    handle.remove()
    train_as(model, opt, 1, torch.float64, seed=2)
    # The backward right after the swap is the one PyTorch leaves unhooked.
    assert seen == [torch.float32] * 2 + [torch.float64] * 2


def test_a_move_with_gradients_still_in_place_works_in_swap_mode(swap_mode, quiet_watch):
    """swap_tensors refuses any tensor with a weak reference: the parameters and the
    gradients the last step used must carry none of trainwatch's."""
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 2)  # no zero_grad after the last step: .grad is set
    assert all(p.grad is not None for p in model.parameters())
    model.double()
    train_as(model, opt, 3, torch.float64, seed=1)
    assert rules_of(monitor) == []


# -- overwrite mode: new Parameter objects -------------------------------------------------------


def test_overwrite_mode_with_the_old_optimizer_is_not_optimized_layer_by_layer(
    overwrite_mode, quiet_watch
):
    """The optimizer still updates the old Parameters; the model trains with new ones."""
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    old = list(model.parameters())
    model.double()
    assert not any(a is b for a, b in zip(old, model.parameters()))
    train_as(model, opt, 3, torch.float64, seed=1)
    found = {(a.rule, a.module, a.step) for a in monitor.alerts if a.severity != "info"}
    # The setup audit says the same of the whole model: no optimizer holds any
    # of its trainable parameters now.
    assert found == {("not_optimized", name, 3) for name in ("fc1", "fc2", "head")} | {
        ("trainable_parameters", "", 3)
    }
    alert = next(a for a in monitor.alerts if a.rule == "not_optimized")
    assert "overwrite" in alert.hint


def test_overwrite_mode_with_a_new_optimizer_is_silent_under_the_same_names(
    overwrite_mode, quiet_watch
):
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    model.double()
    fresh = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor.add_optimizer(fresh)
    train_as(model, fresh, 4, torch.float64, seed=1)
    assert rules_of(monitor) == []
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}


def test_overwrite_mode_with_a_new_optimizer_still_finds_a_detached_layer(
    overwrite_mode, quiet_watch
):
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    model.double()
    fresh = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor.add_optimizer(fresh)
    model.detach_fc1 = True
    train_as(model, fresh, 4, torch.float64, seed=1)
    zero = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [(a.module, a.step) for a in zero] == [("fc1", 3)]
    assert zero[0].data["parameters"] == ["fc1.weight", "fc1.bias"]


def test_overwrite_mode_without_an_optimizer_keeps_naming_layers(overwrite_mode, quiet_watch):
    """Hand-written updates: monitor.step() over the model's current parameters."""
    torch.manual_seed(0)
    model = TinyNet()
    monitor = quiet_watch(model)
    model.double()
    model.detach_fc1 = True
    for x, y in batches(4):
        model.zero_grad()
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.01 * p.grad
        monitor.step()
    zero = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [(a.module, a.step) for a in zero] == [("fc1", 0)]
    assert set(monitor.grad_norms()) == {"fc2", "head"}


# -- a real device move -----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_moved_to_cuda_after_watching_stays_watched(conversion, quiet_watch):
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 3)
    model.to("cuda")
    train_as(model, opt, 4, device="cuda", seed=1)
    assert rules_of(monitor) == []
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}
    model.detach_fc1 = True
    train_as(model, opt, 4, device="cuda", seed=2)
    zero = [a for a in monitor.alerts if a.rule == "zero_gradient"]
    assert [(a.module, a.step) for a in zero] == [("fc1", 7)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nan_after_a_move_to_cuda_is_located_from_the_device_sums(quiet_watch):
    """On CUDA the per-module sums are read back with the step (no replay)."""
    model, opt, monitor = watched(quiet_watch)
    train_as(model, opt, 2)
    model.to("cuda")
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")
    train_as(model, opt, 2, device="cuda", seed=1)
    first = next(a for a in monitor.alerts if a.rule.startswith("nonfinite"))
    assert first.module == "fc2"
