"""Per-layer gradient norms match a naive per-parameter reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.conftest import TinyNet, batches
from trainwatch.collect.small_norms import SMALL as SMALL_NORMS_SMALL


def naive_layer_norms(model: nn.Module) -> dict[str, float]:
    out = {}
    for name, module in model.named_modules():
        grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        if grads:
            out[name] = math.sqrt(sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads))
    return out


def test_layer_norms_equal_naive_vector_norm_loop(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for x, y in batches(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        expected = naive_layer_norms(model)
        opt.step()
        got = monitor.grad_norms()
        assert got.keys() == expected.keys() == {"fc1", "fc2", "head"}
        for name in expected:
            assert got[name] == pytest.approx(expected[name], rel=1e-5)
        total = math.sqrt(sum(v * v for v in expected.values()))
        assert monitor.total_grad_norm == pytest.approx(total, rel=1e-5)


def test_tied_weight_is_counted_once_under_its_first_owner(quiet_watch):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(idx))

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = quiet_watch(model, opt)
    opt.zero_grad()
    model(torch.arange(10)).logsumexp(-1).mean().backward()
    expected = float(torch.linalg.vector_norm(model.embed.weight.grad))
    opt.step()
    assert monitor.grad_norms() == {"embed": pytest.approx(expected, rel=1e-5)}


def test_norms_with_grad_scaler_are_of_unscaled_gradients(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    reference = TinyNet()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    monitor = quiet_watch(model, opt)
    x, y = next(batches(1))
    opt.zero_grad()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    nn.functional.mse_loss(reference(x), y).backward()
    expected = naive_layer_norms(reference)
    for name, value in expected.items():
        assert monitor.grad_norms()[name] == pytest.approx(value, rel=1e-4)


def test_norms_of_two_optimizers_merge_into_one_view(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    body = torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.01)
    head = torch.optim.Adam(model.head.parameters(), lr=0.01)
    monitor = quiet_watch(model, [body, head])
    x, y = next(batches(1))
    body.zero_grad()
    head.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    expected = naive_layer_norms(model)
    body.step()
    head.step()
    assert monitor.step_count == 2
    assert monitor.grad_norms() == pytest.approx(expected, rel=1e-5)


def test_one_readback_per_step_not_one_per_parameter(model, quiet_watch, monkeypatch):
    """A step's numbers reach the host in one staged transfer, whatever the layer count."""
    from trainwatch.frame import StepFrame

    staged = []
    real = StepFrame.read

    def counting(frame, non_blocking=False):
        staged.append(len(frame))
        return real(frame, non_blocking)

    monkeypatch.setattr(StepFrame, "read", counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(model, opt)
    for x, y in batches(4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert len(staged) == 4  # one transfer per step
    assert max(staged) <= 6  # a few concatenated pieces, not one per parameter or module


def test_lagged_readback_reports_the_step_where_it_happened(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, readback="lagged")
    from tests.conftest import train

    train(model, opt, 3, zero_grad_until=2)
    # Step 2's numbers are still in flight; reading the alerts lands them.
    (alert,) = monitor.alerts
    assert (alert.rule, alert.step) == ("accumulated_gradient", 2)
    assert set(monitor.grad_norms()) == {"fc1", "fc2", "head"}


def test_lagged_readback_halts_one_step_later_with_the_right_step(model, quiet_watch):
    import trainwatch as tw
    from tests.conftest import train

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt, readback="lagged", halt_on=["accumulated_gradient"])
    with pytest.raises(tw.TrainingHealthError) as caught:
        train(model, opt, 10, zero_grad_until=2)
    assert caught.value.alert.step == 2
    assert monitor.step_count == 4


def test_a_layer_without_gradient_in_the_latest_step_is_not_reported_stale(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    for step, (x, y) in enumerate(batches(2)):
        model.detach_fc1 = step == 1
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert set(monitor.grad_norms()) == {"fc2", "head"}


def _deep_stack(depth: int = 8) -> nn.Module:
    """Many small layers of a few shapes: their gradients are stacked by shape on CPU."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(16, 1))


def test_gradients_stacked_by_shape_give_each_layer_its_own_norm(quiet_watch):
    model = _deep_stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        expected = naive_layer_norms(model)
        opt.step()
        got = monitor.grad_norms()
        assert got.keys() == expected.keys()
        for name in expected:
            assert got[name] == pytest.approx(expected[name], rel=1e-5), name


@pytest.mark.parametrize(
    "replaced",
    [(0,), tuple(range(6))],
    ids=["one, the group no longer stacks", "all, still stacking, one dimension more"],
)
def test_a_parameter_given_new_data_of_another_shape_is_still_measured(quiet_watch, replaced):
    """The kept plan no longer fits the gradients (a parameter's ``.data`` replaced
    by one of another shape, as pruning code does): it is made again."""

    class Offsets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.offsets = nn.ParameterList(nn.Parameter(torch.ones(16)) for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + sum(p.square().sum() for p in self.offsets)

    model = Offsets()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    x = torch.randn(4, 1)
    for step in range(3):
        if step == 2:
            shape = (8,) if len(replaced) == 1 else (4, 4)
            for index in replaced:
                model.offsets[index].data = torch.ones(shape)
        opt.zero_grad()
        model(x).sum().backward()
        expected = naive_layer_norms(model)
        opt.step()
        assert monitor.grad_norms() == {"offsets": pytest.approx(expected["offsets"], rel=1e-5)}
    assert not monitor.alerts


class _Wide(nn.Module):
    """Two weights past the size stacked by shape, and small ones beside."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(784, 256)
        self.hidden = nn.Linear(256, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(torch.relu(self.inp(x)))))


def test_large_gradients_beside_small_ones_give_each_layer_its_own_norm(quiet_watch):
    model = _Wide()
    assert model.inp.weight.numel() > SMALL_NORMS_SMALL
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    for _ in range(3):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        expected = naive_layer_norms(model)
        opt.step()
        got = monitor.grad_norms()
        assert got.keys() == expected.keys() == {"inp", "hidden", "head"}
        for name in expected:
            assert got[name] == pytest.approx(expected[name], rel=1e-5), name
    assert not monitor.alerts


def test_an_infinite_element_in_a_large_gradient_is_still_reported(quiet_watch):
    model = _Wide()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = quiet_watch(model, opt)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    model.hidden.weight.grad[3, 7] = float("inf")
    opt.step()
    assert monitor.grad_norms()["hidden"] == math.inf
    found = [a for a in monitor.alerts if a.rule == "nonfinite_backward"]
    assert found and found[0].step == 0
