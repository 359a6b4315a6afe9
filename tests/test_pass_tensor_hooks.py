"""hook_pass_tensor: a hook on a tensor a pass made, without torch's removable handle."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from trainwatch.hooks import hook_pass_tensor


def _output() -> tuple[nn.Linear, torch.Tensor]:
    layer = nn.Linear(3, 2)
    return layer, layer(torch.randn(4, 3))


def test_the_hook_sees_the_gradient_reaching_the_tensor_once_per_backward():
    _, out = _output()
    seen = []
    hook_pass_tensor(out, lambda grad: seen.append(grad.clone()))
    (out * 3).sum().backward()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((4, 2), 3.0))


def test_several_hooks_and_a_users_own_hook_all_run_and_the_users_can_be_removed():
    _, out = _output()
    calls = []
    users = out.register_hook(lambda grad: calls.append("user"))
    hook_pass_tensor(out, lambda grad: calls.append("first"))
    hook_pass_tensor(out, lambda grad: calls.append("second"))
    users.remove()  # the user's handle takes its own hook only
    out.sum().backward()
    assert calls == ["first", "second"]


def test_a_hook_added_after_a_users_hook_joins_the_same_table():
    _, out = _output()
    calls = []
    out.register_hook(lambda grad: calls.append("user"))
    hook_pass_tensor(out, lambda grad: calls.append("ours"))
    out.sum().backward()
    assert calls == ["user", "ours"]


class _Hook:
    def __call__(self, grad: torch.Tensor) -> None:
        return None


def test_the_hook_goes_with_the_pass_graph():
    layer, out = _output()
    hook = _Hook()
    hook_pass_tensor(out, hook)
    kept = weakref.ref(hook)
    del hook
    out.sum().backward()
    del out
    gc.collect()
    assert kept() is None
    assert layer.weight._backward_hooks is None  # nothing left on the parameters


def test_a_parameter_returned_as_is_gets_torchs_own_hook_and_the_gradient_is_unchanged():
    """Control: a leaf has no graph to go with; torch's register_hook takes it."""
    param = nn.Parameter(torch.ones(2))
    seen = []
    hook_pass_tensor(param, lambda grad: seen.append(1))
    (param * 2).sum().backward()
    assert seen == [1] and torch.equal(param.grad, torch.full((2,), 2.0))


def test_under_a_function_mode_the_hook_goes_through_register_hook_and_still_fires():
    from torch.overrides import TorchFunctionMode

    seen_by_mode: list[str] = []

    class Listening(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen_by_mode.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    _, out = _output()
    calls = []
    with Listening():
        hook_pass_tensor(out, lambda grad: calls.append(1))
    assert "register_hook" in seen_by_mode  # the mode saw it, as with register_hook
    out.sum().backward()
    assert calls == [1]
