"""trainwatch's function modes leave the stack in any order, and take nobody else's with them."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from tests.test_missing_zero_grad_with_hand_written_updates import GAN
from trainwatch.collect.mode_stack import leave
from trainwatch.runner import run_script


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_mode_under_another_of_ours_waits_and_is_taken_along():
    lower, upper = _PassThrough(), _PassThrough()
    lower.__enter__()
    upper.__enter__()
    assert leave(lower) is False  # the upper one is still on top
    assert leave(upper) is True
    assert _get_current_function_mode_stack() == []
    assert leave(lower) is True  # its owner learns it is off


def test_a_mode_of_the_user_above_ours_is_never_popped():
    ours, users = _PassThrough(), _PassThrough()
    ours.__enter__()
    with users:
        assert leave(ours) is False
        assert _get_current_function_mode_stack() == [ours, users]
    assert leave(ours) is True
    assert _get_current_function_mode_stack() == []


def test_a_mode_asked_to_leave_inside_its_own_handler_stays_until_it_can():
    """Inside a mode's handler torch pops it for the while: that is no leaving."""
    asked = []

    class Asking(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            asked.append(leave(self))
            return func(*args, **(kwargs or {}))

    mode = Asking()
    with mode:
        torch.ones(2).sum()
        assert _get_current_function_mode_stack() == [mode]
    assert asked and not any(asked)


def test_two_models_auditing_their_losses_leave_no_mode_behind(tmp_path, monkeypatch):
    # The generator's loss audit sat under the discriminator's: it stayed on the
    # stack once its monitor had closed, for as long as the monitor lived (here:
    # the watcher is kept), and every later op in the process passed through it.
    from trainwatch import autowatch

    kept = []
    made = autowatch.AutoWatch.__init__

    def keeping(self, *args, **kwargs):
        made(self, *args, **kwargs)
        kept.append(self)

    monkeypatch.setattr(autowatch.AutoWatch, "__init__", keeping)
    script = tmp_path / "gan.py"
    script.write_text(GAN)
    run_script(script, ["missing"], log_dir=tmp_path / "log", console=False)
    assert kept and _get_current_function_mode_stack() == []


def test_two_watched_models_closed_in_any_order_leave_no_mode_behind():
    """The generator's loss audit sits under the discriminator's while D judges G's
    fakes; closed first, it could not leave, and stayed for good while its monitor
    lived (every later op of the process passed through it)."""
    from torch import nn

    import trainwatch as tw

    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
    disc = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    g_mon = tw.watch(gen, console=False)
    d_mon = tw.watch(disc, console=False)
    for _ in range(3):
        fake = gen(torch.randn(16, 2))
        d_loss = nn.functional.softplus(-disc(torch.randn(16, 2) + 3)).mean()
        d_loss = d_loss + nn.functional.softplus(disc(fake.detach())).mean()
        disc.zero_grad()
        d_loss.backward()
        d_mon.step()
        gen.zero_grad()
        nn.functional.softplus(-disc(fake)).mean().backward()
        g_mon.step()
    g_mon.close()
    d_mon.close()
    assert _get_current_function_mode_stack() == []
    assert g_mon.closed and d_mon.closed  # both still alive: no finalizer helped
