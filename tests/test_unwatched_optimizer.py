"""A model trained on by an optimizer its monitor was never given.

Under ``tw.watch(model, opt)`` a loop that builds a new optimizer for a second
phase (a new task, a new head) and forgets ``monitor.add_optimizer`` trains
on unwatched: the summary said 96 steps watched out of 224, and the second
phase's bugs were never seen. The weights moving while backward passes go by
with no watched step is told once (``not_optimized``), and the optimizer
found at its next step is watched from then on. Gradient accumulation, an
attribution phase, an evaluation, a GAN's less frequent generator step,
L-BFGS and the same phase change handed over stay silent, and so do a
move that changes no value (a state dict loaded again, a clamp that clamps
nothing), an embedding's ``max_norm`` renormalising rows in its own forward,
and Reptile's inner SGD steps between the watched outer optimizer's steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_pre_hooks

import trainwatch as tw
from trainwatch.collect.unwatched_updates import BEFORE_FIRST_STEP

PHASE_A = 60
PHASE_B = 90


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
    return x, x[:, :4].argmax(1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _told(monitor: tw.Monitor) -> list[tuple[str, str | None, str | None]]:
    return [(a.rule, a.module, a.data.get("kind")) for a in monitor.alerts if a.severity != "info"]


@pytest.mark.parametrize("handed_over", [False, True], ids=["forgotten", "add_optimizer"])
def test_a_second_phase_optimizer_never_handed_over_is_told_and_watched(quiet_watch, handed_over):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    second = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if handed_over:
        monitor.add_optimizer(second)
    _train(model, second, PHASE_B, start=PHASE_A)
    if handed_over:
        assert _told(monitor) == []
        assert monitor.step_count == PHASE_A + PHASE_B
        return
    (alert,) = monitor.alerts
    assert (alert.rule, alert.severity, alert.step) == ("not_optimized", "warning", PHASE_A)
    assert alert.data["kind"] == "unwatched_optimizer"
    assert alert.data["optimizer_class"] == "AdamW"
    assert alert.data["last_step"] == PHASE_A - 1
    assert "AdamW" in alert.message and "monitor.add_optimizer" in alert.hint
    # Watched from the step it was found at: the rest of the phase is counted.
    assert any(o is second for o in monitor.optimizers)
    assert PHASE_A + PHASE_B - 40 < monitor.step_count < PHASE_A + PHASE_B
    # The hook that found it is gone (taken off at the next pass).
    assert not _global_optimizer_pre_hooks
    assert "unwatched updates" not in monitor._pipeline.passes.listener_names()


def test_a_new_head_left_out_of_the_unwatched_optimizer_is_caught_once_it_is_found(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    second = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[2] = nn.Linear(32, 4)  # the new head, put on after the optimizer was built
    _train(model, second, PHASE_B, start=PHASE_A)
    assert _told(monitor) == [
        ("not_optimized", "", "unwatched_optimizer"),
        ("not_optimized", "2", None),
    ]


def test_a_watched_optimizer_that_never_steps_while_another_trains_is_told(quiet_watch):
    model = _model()
    given = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, given)
    used = torch.optim.SGD(model.parameters(), lr=0.05)  # the loop builds its own
    # Before any watched step the looks wait (an inner loop may come first).
    _train(model, used, BEFORE_FIRST_STEP - 10)
    assert monitor.alerts == []
    _train(model, used, PHASE_B, start=BEFORE_FIRST_STEP - 10)
    (alert,) = monitor.alerts
    assert alert.data["kind"] == "unwatched_optimizer"
    assert alert.data["last_step"] is None and "since watching began" in alert.message
    assert any(o is used for o in monitor.optimizers)


def _hand_written_steps(model: nn.Module, steps: int, start: int) -> None:
    for step in range(start, start + steps):
        x, y = _batch(step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)


@pytest.mark.parametrize("through_data", [False, True], ids=["no_grad_update", "data_update"])
def test_weights_written_by_hand_after_the_optimizer_stopped_are_told(quiet_watch, through_data):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    if through_data:
        for step in range(PHASE_A, PHASE_A + PHASE_B):
            x, y = _batch(step)
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.05)  # no version counter moves
    else:
        _hand_written_steps(model, PHASE_B, PHASE_A)
    (alert,) = monitor.alerts
    assert alert.data["kind"] == "unwatched_updates"
    assert alert.data["optimizer_class"] is None
    assert "monitor.step()" in alert.hint
    assert monitor.optimizers == [opt]


def test_the_look_for_the_optimizer_ends_when_the_watched_one_steps_again(quiet_watch):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = quiet_watch(model, opt)
    _train(model, opt, PHASE_A)
    # Long enough to be found moving once (the hook goes on), too short for the
    # second finding that would tell it.
    _hand_written_steps(model, 35, PHASE_A)
    assert _global_optimizer_pre_hooks
    _train(model, opt, 20, start=PHASE_A + 35)
    assert _told(monitor) == []
    assert not _global_optimizer_pre_hooks
    assert monitor.optimizers == [opt] and monitor.step_count == PHASE_A + 20


# -- controls: no watched step for a while, nothing else moving the weights ------


def _evaluation_after_training(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)
    model.eval()
    for step in range(PHASE_B):
        x, _ = _batch(step)
        model(x)  # with gradients on: no backward all the same
        with torch.no_grad():
            model(x)


def _attribution_after_training(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)
    for step in range(PHASE_B):
        x, _ = _batch(step)
        x.requires_grad_(True)
        model.zero_grad()
        model(x).max(1).values.sum().backward()  # a saliency map: no update
        x.grad.abs().amax(0)


def _training_that_stops(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)


def _accumulation(micro: int):
    def loop(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        for step in range(3):
            opt.zero_grad()
            for part in range(micro):
                x, y = _batch(step * micro + part)
                (nn.functional.cross_entropy(model(x), y) / micro).backward()
            opt.step()

    return loop


def _state_dict_loaded_before_each_example(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)
    trained = copy.deepcopy(model.state_dict())
    for step in range(PHASE_B):
        model.load_state_dict(trained)  # copied in place: versions move, values do not
        x, y = _batch(step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()


def _weights_clamped_in_range_each_pass(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    _train(model, opt, PHASE_A)
    for step in range(PHASE_B):
        x, _ = _batch(step)
        x.requires_grad_(True)
        model.zero_grad()
        model(x).max(1).values.sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-10.0, 10.0)  # a constraint the weights already meet


def _lbfgs(model: nn.Module, lbfgs: torch.optim.Optimizer) -> None:
    for step in range(8):
        x, y = _batch(step)

        def closure(x=x, y=y):
            lbfgs.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        lbfgs.step(closure)  # 20 evaluations, the weights moved between them


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _lbfgs_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=20)


LOOPS = {
    "evaluation_after_training": (_sgd, _evaluation_after_training),
    "attribution_after_training": (_sgd, _attribution_after_training),
    "training_that_stops": (_sgd, _training_that_stops),
    "accumulation_of_64": (_sgd, _accumulation(64)),
    "accumulation_of_100": (_sgd, _accumulation(100)),
    "lbfgs": (_lbfgs_optimizer, _lbfgs),
    "state_dict_loaded_before_each_example": (_sgd, _state_dict_loaded_before_each_example),
    "weights_clamped_in_range_each_pass": (_sgd, _weights_clamped_in_range_each_pass),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_backward_passes_without_a_watched_step_that_move_no_weight_stay_silent(quiet_watch, name):
    make, loop = LOOPS[name]
    model = _model()
    opt = make(model)
    monitor = quiet_watch(model, opt)
    loop(model, opt)
    assert [told for told in _told(monitor) if told[0] == "not_optimized"] == []
    assert monitor.optimizers == [opt]


@pytest.mark.parametrize("clip", [None, 0.01], ids=["wgan_gp_style", "weight_clipping"])
@pytest.mark.parametrize("critic_steps_first", [5, 100])
def test_a_generator_whose_optimizer_steps_less_often_stays_silent(
    quiet_watch, critic_steps_first, clip
):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 8))
    critic = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-4, betas=(0.0, 0.9))
    opt_c = torch.optim.Adam(critic.parameters(), 1e-4, betas=(0.0, 0.9))
    g_monitor = quiet_watch(gen, opt_g)
    c_monitor = quiet_watch(critic, opt_c)
    for it in range(40):
        # 5 critic steps per generator step (WGAN's schedule starts with 100); the
        # critic's loss reaches the generator too (its fake is not detached).
        for _ in range(critic_steps_first if it < 2 else 5):
            real = torch.randn(32, 8) + 2
            fake = gen(torch.randn(32, 4))
            opt_c.zero_grad()
            (critic(fake).mean() - critic(real).mean()).backward()
            opt_c.step()
            if clip is not None:  # WGAN's clipping: a write by hand after each watched step
                with torch.no_grad():
                    for p in critic.parameters():
                        p.clamp_(-clip, clip)
        opt_g.zero_grad()
        (-critic(gen(torch.randn(32, 4))).mean()).backward()
        opt_g.step()
    told = _told(g_monitor) + _told(c_monitor)
    assert [kind for _, _, kind in told if kind and kind.startswith("unwatched")] == []
    if critic_steps_first == 5 and clip is None:
        assert told == []  # clipped, the critic's output is near constant: told as such
    assert g_monitor.optimizers == [opt_g] and c_monitor.optimizers == [opt_c]
    assert g_monitor.step_count == 40


# -- weights the model's own forward writes: nn.Embedding(max_norm=...) ------------


class _BagOfWords(nn.Module):
    """A text classifier whose embedding renormalises the rows it looks up, in place,
    in every forward (``embedding_renorm_``): versions move at every pass, and a
    row's values change the first time it is looked up after a step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(500, 32, max_norm=1.0)
        self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens).mean(1))


def _tokens(step: int, rows: int = 16, vocab: int = 500) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    y = torch.randint(0, 3, (rows,), generator=gen)
    tokens = torch.randint(0, vocab, (rows, 12), generator=gen)
    third = vocab // 3
    tokens[:, :4] = y[:, None] * third + torch.randint(0, third, (rows, 4), generator=gen)
    return tokens, y


def _accumulated_steps(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, micro: int, vocab: int = 500
) -> None:
    for step in range(steps):
        opt.zero_grad()
        for part in range(micro):
            tokens, y = _tokens(step * micro + part, vocab=vocab)
            (nn.functional.cross_entropy(model(tokens), y) / micro).backward()
        opt.step()


def _per_example_gradient_norms(model: nn.Module, examples: int) -> None:
    """GraNd scores of tokens training never saw: one backward per example, no step.
    Each example looks up 4 rows for the first time, so every window between two
    looks renormalises fresh rows (their values change, by the forward)."""
    for step in range(examples):
        tokens = torch.arange(100 + 4 * step, 112 + 4 * step)[None]
        y = tokens[:, 0] % 3
        model.zero_grad()
        nn.functional.cross_entropy(model(tokens), y).backward()
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("phase", ["accumulation_of_64", "per_example_norms_after_training"])
def test_an_embedding_renormalising_rows_in_its_forward_is_no_unwatched_update(quiet_watch, phase):
    model = _BagOfWords()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    if phase == "accumulation_of_64":
        _accumulated_steps(model, opt, 4, 64)
    else:
        _accumulated_steps(model, opt, 30, 1, vocab=100)  # the first 100 tokens only
        _per_example_gradient_norms(model, 90)
    assert [told for told in _told(monitor) if told[0] == "not_optimized"] == []
    assert monitor.optimizers == [opt]


def test_a_forgotten_optimizer_beside_an_embedding_renormalising_rows_is_still_told(
    quiet_watch,
):
    model = _BagOfWords()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = quiet_watch(model, opt)
    _accumulated_steps(model, opt, 8, 4)
    second = torch.optim.SGD(model.parameters(), lr=0.05)  # never handed over
    _accumulated_steps(model, second, 100, 1)
    assert _told(monitor) == [("not_optimized", "", "unwatched_optimizer")]
    assert any(o is second for o in monitor.optimizers)


# -- an inner optimizer of the loop's own between watched steps: Reptile ---------


@pytest.mark.parametrize("inner_steps", [32, 100])
def test_reptile_inner_sgd_between_watched_outer_steps_stays_silent(quiet_watch, inner_steps):
    """Reptile adapts the weights with an inner SGD for K steps per task, puts them
    back and hands the difference to the watched outer optimizer: the K passes
    before the first outer step are no unwatched training to adopt."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    outer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inner = torch.optim.SGD(model.parameters(), lr=0.02)
    monitor = quiet_watch(model, outer)
    meta_steps = 8
    for task in range(meta_steps):
        gen = torch.Generator().manual_seed(task)
        amplitude, phase = torch.rand(2, generator=gen) * 3 + 0.1
        xs = torch.rand(50, 1, generator=gen) * 10 - 5
        ys = amplitude * torch.sin(xs + phase)
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(inner_steps):
            idx = torch.randint(0, 50, (10,), generator=gen)
            model.zero_grad()
            nn.functional.mse_loss(model(xs[idx]), ys[idx]).backward()
            inner.step()
        for p, b in zip(model.parameters(), before):
            p.grad = b - p.detach()  # the meta-gradient
            p.data.copy_(b)
        outer.step()
    assert _told(monitor) == []
    assert monitor.optimizers == [outer]
    assert monitor.step_count == meta_steps
