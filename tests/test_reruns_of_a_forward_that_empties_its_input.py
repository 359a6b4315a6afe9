"""Re-runs of a pass whose forward empties the container it was handed.

A set encoder reads its ragged items with ``items.pop(0)`` (or a deque's
``popleft()``), a Hugging Face-style forward takes ``batch.pop("labels")``:
once the call returns, the list or dict it was given is empty (or lacks its
labels). Every re-run of the pass (the NaN/Inf replay that names the module
and op, at once on CPU or at the step boundary as on a GPU, the backward
replay, the op trace of a module handed a list by keyword, and
``stalled_training``'s re-run of the first batch) must run it on the
arguments as the call received them, not on what it left behind: else a NaN
made by ``pool``'s division is blamed on the whole model and its weights.

Each planted bug (an empty item, an all-zero row) sits beside its healthy
twin, which stays silent and trains bit for bit as without trainwatch, its
containers emptied by its forward as they would be.
"""

from __future__ import annotations

import textwrap
from collections import deque

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainwatch as tw
from tests.test_run import alerts as logged_alerts
from trainwatch.runner import run_script

BAD_STEP = 3


def _told(alerts) -> list[tw.Alert]:
    return [a for a in alerts if a.severity != "info"]


# -- models ------------------------------------------------------------------------
class Pool(nn.Module):
    """Sums an item's rows over a log of their count: 0/0 for an empty item."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.sum(0) / torch.log1p(torch.tensor(float(h.shape[0])))


class SetEncoder(nn.Module):
    """Reads its items off the container it is handed, one at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32))
        self.pool = Pool()
        self.rho = nn.Linear(32, 2)

    def forward(self, items=None, *, queue=None):
        items = items if items is not None else queue
        outs = []
        while items:
            item = items.popleft() if isinstance(items, deque) else items.pop(0)
            outs.append(self.pool(self.phi(item)))
        return self.rho(torch.stack(outs))


class RowNorm(nn.Module):
    """Each row over its norm: 0/0 for an all-zero row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class Classifier(nn.Module):
    """Hugging Face style: the labels taken out of the batch, the loss made inside."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RowNorm()
        self.fc = nn.Linear(8, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch.pop("labels")
        logits = self.fc(self.norm(batch["x"]))
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


# -- their batches -----------------------------------------------------------------
def _set_batch(step: int, bad: bool, shape: str):
    gen = torch.Generator().manual_seed(step)
    items = [
        torch.randn(int(torch.randint(1, 6, (), generator=gen)), 4, generator=gen) for _ in range(8)
    ]
    y = torch.randint(0, 2, (8,), generator=gen)
    if bad and step == BAD_STEP:
        items[2] = torch.zeros(0, 4)  # an empty item slips through
    if shape == "deque":
        return (), {"queue": deque(items)}, y
    if shape == "list by keyword":
        return (), {"items": items}, y
    return (items,), {}, y


def _set_step(model, step, bad, shape):
    args, kwargs, y = _set_batch(step, bad, shape)
    loss = F.cross_entropy(model(*args, **kwargs), y)
    handed = args[0] if args else next(iter(kwargs.values()))
    return loss, handed


def _dict_step(model, step, bad, shape):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=gen)
    if bad and step == BAD_STEP:
        x[5] = 0.0  # an all-zero row
    batch = {"x": x, "labels": torch.randint(0, 3, (16,), generator=gen)}
    return model(batch)["loss"], batch


SHAPES = {
    # shape: (model, step, module making the NaN)
    "list": (SetEncoder, _set_step, "pool"),
    "deque": (SetEncoder, _set_step, "pool"),
    "list by keyword": (SetEncoder, _set_step, "pool"),
    "dict": (Classifier, _dict_step, "norm"),
}


def _train(shape: str, bad: bool, steps: int = 6, check: str | None = None, lr: float = 1e-2):
    """The losses, the weights after, each step's container after its call, and the
    alerts (None unwatched)."""
    make, step_of, _ = SHAPES[shape]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses, left = [], []
    monitor = None
    if check is not None:
        monitor = tw.watch(model, opt, console=False, nonfinite_forward={"check": check})
    try:
        for step in range(steps):
            loss, handed = step_of(model, step, bad, shape)
            left.append(len(handed))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        if monitor is not None:
            monitor.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return losses, weights, left, None if monitor is None else monitor.alerts


# -- the NaN replay ----------------------------------------------------------------
@pytest.mark.parametrize("check", ["auto", "step"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_nan_made_in_a_module_is_placed_there_though_the_forward_emptied_its_input(shape, check):
    *_, alerts = _train(shape, bad=True, check=check)
    first = _told(alerts)[0]
    module = SHAPES[shape][2]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, module)
    assert first.data["cause"] == "module"
    assert first.data["op"] == "aten::div"
    assert "weights are non-finite" not in first.message


@pytest.mark.parametrize("shape", list(SHAPES))
def test_control_the_healthy_twin_stays_silent_and_trains_as_without_trainwatch(shape):
    plain_losses, plain_weights, plain_left, _ = _train(shape, bad=False)
    losses, weights, left, alerts = _train(shape, bad=False, check="auto")
    assert _told(alerts) == []
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    # Its forward empties its containers as it would unwatched: none is swapped.
    assert left == plain_left
    assert all(n == (1 if shape == "dict" else 0) for n in left)


def test_a_nan_gradient_made_in_a_module_is_placed_there_though_the_forward_emptied_its_input():
    class SqrtPool(nn.Module):
        """sqrt of a weighted square sum: finite forward, an Inf derivative at 0."""

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h.sum(0) + torch.sqrt(((self.w * h) ** 2).sum())

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pool = SqrtPool()
            self.rho = nn.Linear(4, 2)

        def forward(self, items: list[torch.Tensor]) -> torch.Tensor:
            outs = []
            while items:
                outs.append(self.pool(items.pop(0)))
            return self.rho(torch.stack(outs))

    for bad in (True, False):
        torch.manual_seed(0)
        model = Encoder()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with tw.watch(model, opt, console=False) as monitor:
            for step in range(5):
                items = [torch.randn(3, 4) for _ in range(6)]
                if bad and step == BAD_STEP:
                    items[2] = torch.zeros(3, 4)
                loss = F.cross_entropy(model(items), torch.randint(0, 2, (6,)))
                opt.zero_grad()
                loss.backward()
                opt.step()
        told = _told(monitor.alerts)
        if not bad:
            assert told == []
            continue
        first = told[0]
        assert (first.rule, first.step, first.module) == ("nonfinite_backward", BAD_STEP, "pool")
        assert first.data["cause"] == "module" and first.data["op"] == "aten::sqrt"


# -- a part handed a list by keyword -------------------------------------------------
class Gather(nn.Module):
    """A part reading a list handed by keyword, dividing in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, items=None):
        outs = []
        while items:
            h = self.w(items.pop(0))
            outs.append(h.sum(0) / torch.log1p(torch.tensor(float(h.shape[0]))))
        return torch.stack(outs)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gather = Gather()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return self.head(self.gather(items=list(x.split(sizes))))


def _outer_alerts(plant: str) -> list[tw.Alert]:
    torch.manual_seed(0)
    model = Outer()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(5):
            sizes = [3, 2, 4, 1]
            if plant == "empty part" and step == BAD_STEP:
                sizes = [3, 2, 0, 4, 1]
            x = torch.randn(sum(sizes), 4)
            if plant == "nan data" and step == BAD_STEP:
                x[4, 1] = float("nan")
            loss = F.cross_entropy(model(x, sizes), torch.randint(0, 2, (len(sizes),)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return _told(monitor.alerts)


def test_a_part_that_empties_a_list_handed_by_keyword_is_traced_on_the_list_it_was_given():
    first = _outer_alerts("empty part")[0]
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", BAD_STEP, "gather")
    assert first.data["op"] == "aten::div"


def test_nan_data_in_a_list_handed_by_keyword_is_the_data_not_the_part_that_emptied_it():
    first = _outer_alerts("nan data")[0]
    assert (first.rule, first.step) == ("nonfinite_forward", BAD_STEP)
    assert first.data["cause"] == "input"
    assert first.module != "gather"


def test_control_the_part_handed_a_list_by_keyword_stays_silent_when_healthy():
    assert _outer_alerts("none") == []


# -- trainwatch run --------------------------------------------------------------------
SCRIPT = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)

class Pool(nn.Module):
    def forward(self, h):
        return h.sum(0) / torch.log1p(torch.tensor(float(h.shape[0])))

class SetEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.phi = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32))
        self.pool = Pool()
        self.rho = nn.Linear(32, 2)
    def forward(self, items):
        outs = []
        while items:
            outs.append(self.pool(self.phi(items.pop(0))))
        return self.rho(torch.stack(outs))

model = SetEncoder()
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
for step in range(8):
    items = [torch.randn(int(torch.randint(1, 9, ()).item()), 4) for _ in range(16)]
    y = torch.tensor([int(t[:, 0].sum() > 0) for t in items])
    if step == 5 and BAD:
        items[3] = torch.zeros(0, 4)
    loss = F.cross_entropy(model(items), y)
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.mark.parametrize("bad", [True, False])
def test_trainwatch_run_places_the_nan_of_a_set_encoder_that_pops_its_items(tmp_path, bad):
    script = tmp_path / "set_encoder.py"
    script.write_text(textwrap.dedent(SCRIPT).replace("BAD", str(bad)))
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    told = [a for a in logged_alerts(tmp_path / "log") if a["severity"] != "info"]
    if not bad:
        assert told == []
        return
    first = told[0]
    assert (first["rule"], first["step"], first["module"]) == ("nonfinite_forward", 5, "pool")
    assert first["data"]["cause"] == "module" and first["data"]["op"] == "aten::div"


# -- stalled_training's re-run of the first batch ----------------------------------------
SHORT = {"stalled_training": {"every": 20, "warmup": 40, "loss_window": 10}}


@pytest.mark.parametrize("shape", ["list", "dict"])
@pytest.mark.parametrize("lr, stalled", [(1e-12, True), (1e-3, False)])
def test_the_first_batch_is_re_run_as_its_call_received_it(shape, lr, stalled):
    make, step_of, _ = SHAPES[shape]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    with tw.watch(model, opt, console=False, **SHORT) as monitor:
        for step in range(45):
            loss, _ = step_of(model, step, False, shape)
            opt.zero_grad()
            loss.backward()
            opt.step()
    stalls = [a for a in monitor.alerts if a.rule == "stalled_training"]
    if not stalled:
        assert _told(monitor.alerts) == []
        return
    (alert,) = stalls
    # The output's move was measured on the first batch: its re-run ran.
    assert alert.data["change"] is not None and alert.data["change"] < 1e-5
