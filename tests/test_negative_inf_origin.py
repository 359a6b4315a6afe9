"""A -inf made by a faulty op is the origin of the NaN that follows; masks stay silent.

A feature transform with no parameters (its output carries no grad) that
takes the log of a count that can be 0, or divides by a zero standard
deviation, makes -inf; the BatchNorm after it turns that into NaN. The
transform is named, with its op, not the BatchNorm. Masks built with -inf
(or with the dtype's minimum) never lead to a NaN in a healthy model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.collect.op_trace import trace_first_nonfinite_op, trace_negative_inf_maker

CHECKS = ["auto", "step", "deferred"]
FAULT_STEP = 3


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


# -- the faulty feature transforms -------------------------------------------------


class LogCounts(nn.Module):
    """log of raw counts: a count of 0 gives -inf."""

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return torch.log(counts)


class FittedScaler(nn.Module):
    """Standardises raw features with statistics fitted earlier: a feature that
    was constant then has a zero std, and a value below its mean becomes -inf."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((features,), 10.0))
        self.register_buffer("std", torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


FAULTS = {"log": ("aten::log", LogCounts), "div": ("aten::div", lambda: FittedScaler(6))}


def arm(transform: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Plant the fault in this batch: a zero count, or a zero fitted std."""
    if isinstance(transform, FittedScaler):
        transform.std[2] = 0.0  # values there are all below the mean: -inf only
        return x
    x = x.clone()
    x[:, 2] = 0.0
    return x


def features(step: int, transform: nn.Module, gen: torch.Generator, armed: bool) -> torch.Tensor:
    x = torch.randint(1, 9, (16, 6), generator=gen).float()  # counts, or raw features below 10
    return arm(transform, x) if armed and step == FAULT_STEP else x


class TabularMLP(nn.Module):
    def __init__(self, transform: nn.Module) -> None:
        super().__init__()
        self.transform = transform
        self.norm = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.norm(self.transform(x)))))


def plain_loop(fault: str, check: str, armed: bool = True) -> tw.Monitor:
    model = TabularMLP(FAULTS[fault][1]())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(6):
            x = features(step, model.transform, gen, armed)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.randn(16, 1, generator=gen)).backward()
            opt.step()
    return monitor


def lightning_fit(fault: str, tmp_path, armed: bool = True):
    pl = pytest.importorskip("lightning.pytorch")
    from trainwatch.lightning import TrainWatchCallback

    class Tabular(pl.LightningModule):
        """The same transform before a LayerNorm and a GELU MLP, driven by Lightning."""

        def __init__(self) -> None:
            super().__init__()
            self.transform = FAULTS[fault][1]()
            self.norm = nn.LayerNorm(6)
            self.mlp = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.norm(self.transform(x)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            if armed and batch_idx == FAULT_STEP:
                x = arm(self.transform, x)
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self):
            gen = torch.Generator().manual_seed(0)
            x = torch.randint(1, 9, (48, 6), generator=gen).float()
            return DataLoader(TensorDataset(x, torch.randn(48, 1, generator=gen)), batch_size=8)

    callback = TrainWatchCallback(console=False, log_dir=tmp_path)
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=1)
    trainer.fit(Tabular())
    return callback


def first_nonfinite(alerts) -> tw.Alert:
    return next(a for a in alerts if a.rule.startswith("nonfinite"))


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("check", CHECKS)
def test_negative_inf_from_a_feature_transform_is_the_origin_not_the_batchnorm(fault, check):
    monitor = plain_loop(fault, check)
    first = first_nonfinite(monitor.alerts)
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", FAULT_STEP, "transform")
    assert first.data["kind"] == "-inf"
    if check != "deferred":  # the no-sync path names the module only
        assert first.data["op"] == FAULTS[fault][0]
    control = plain_loop(fault, check, armed=False)
    assert control.alerts == []


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_lightning_negative_inf_from_a_feature_transform_is_the_origin(fault, tmp_path):
    callback = lightning_fit(fault, tmp_path / "armed")
    first = first_nonfinite(callback.alerts)
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", FAULT_STEP, "transform")
    assert first.data["op"] == FAULTS[fault][0]
    assert lightning_fit(fault, tmp_path / "control", armed=False).alerts == []


# -- which ops made the -inf: arithmetic or a mask -----------------------------------


class Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


MIN = torch.finfo(torch.float32).min


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda x: torch.log(x.relu()), "aten::log"),
        (lambda x: (x - 5.0) / (x * 0.0).abs(), "aten::div"),
        (lambda x: torch.log(torch.softmax(x * 100.0, dim=-1)), "aten::log"),
        (lambda x: torch.log_softmax(x, dim=-1) * 1e38, "aten::mul"),
        # fp16 log_softmax underflow: -60000 - 60000 is past fp16's range.
        (
            lambda x: torch.log_softmax(((x[:, :2] + 0.5) * 120000.0).half(), dim=-1),
            "aten::_log_softmax",
        ),
    ],
    ids=["log-of-zero", "div-by-zero", "log-of-underflowed-softmax", "mul", "fp16-log_softmax"],
)
def test_arithmetic_that_makes_negative_inf_from_finite_inputs_is_named(fn, op):
    x = torch.tensor([[-1.0, 0.0, 2.0, 3.0]])
    found = trace_negative_inf_maker(Lambda(fn), (x,), {})
    assert found is not None and found.op == op


def test_negative_inf_made_and_turned_into_nan_in_one_module_names_the_op_that_made_it():
    """log of a zero, then standardised in the same module: the log, not the subtraction."""

    def log_then_standardise(x):
        h = torch.log(x.relu())
        return (h - h.mean()) / h.std()

    x = torch.tensor([[-1.0, 0.0, 2.0, 3.0]])
    found = trace_first_nonfinite_op(Lambda(log_then_standardise), (x,), {})
    assert found is not None and found.op == "aten::log"


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.full((4, 4), float("-inf")).triu(1) + x,
        lambda x: x.masked_fill(x > 1.0, float("-inf")),
        lambda x: torch.where(x > 1.0, 0.0, float("-inf")),
        lambda x: torch.log((x > 1.0).float()),
        lambda x: torch.where(x > 1.0, 0.0, MIN) + torch.where(x > 0.5, 0.0, MIN),
    ],
    ids=["full-triu", "masked_fill", "where", "log-of-mask", "two-dtype-min-masks"],
)
def test_masks_made_with_negative_inf_are_not_arithmetic(fn):
    x = torch.tensor([[-1.0, 0.0, 2.0, 3.0]]).expand(4, 4).contiguous()
    assert not bool(torch.isfinite(fn(x)).all())  # each one does make -inf
    assert trace_negative_inf_maker(Lambda(fn), (x,), {}) is None


# -- masks in healthy models: silent -------------------------------------------------


class MaskBuilder(nn.Module):
    """Builds an additive attention mask in one of the usual ways, in a module of its own."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style

    def forward(self, keep: torch.Tensor) -> torch.Tensor:
        # keep: (batch, length) of 0/1 floats; the result broadcasts onto (batch, length, length).
        length = keep.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        if self.style == "full-triu":
            return (
                torch.full((length, length), float("-inf")).triu(1)
                + torch.zeros_like(keep)[:, None, :]
            )
        if self.style == "masked_fill":
            return torch.zeros(keep.shape[0], length, length).masked_fill(
                ~causal | (keep[:, None, :] == 0), float("-inf")
            )
        if self.style == "where":
            return torch.where(causal & (keep[:, None, :] > 0), 0.0, float("-inf"))
        if self.style == "log-of-mask":
            return torch.log((causal & (keep[:, None, :] > 0)).float())
        if self.style == "two-dtype-min-masks":
            low = torch.finfo(keep.dtype).min
            return torch.where(causal, 0.0, low) + ((1 - keep) * low)[:, None, :]
        # Hugging Face's additive mask: (1 - mask[:, None, None, :]) * finfo.min
        return ((1 - keep[:, None, None, :]) * torch.finfo(keep.dtype).min)[:, 0]


class TinyAttentionLM(nn.Module):
    def __init__(self, style: str, vocab: int = 30, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(12, width) * 0.02)
        self.masks = MaskBuilder(style)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.pos[: ids.shape[1]]
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + self.masks(keep)
        return self.head(h + self.attn_out(torch.softmax(scores, dim=-1) @ v))


STYLES = ["full-triu", "masked_fill", "where", "log-of-mask", "two-dtype-min-masks", "hf-additive"]


def train_lm(style: str, check: str, steps: int = 4, keep_fn=None) -> tw.Monitor:
    model = TinyAttentionLM(style)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
        for step in range(steps):
            ids = torch.randint(0, 30, (4, 9))
            keep = torch.ones(4, 9)
            keep[:, 7:] = 0.0  # right padding: the first position is always kept
            if keep_fn is not None:
                keep = keep_fn(step, keep)
            opt.zero_grad()
            logits = model(ids, keep)
            nn.functional.cross_entropy(logits.reshape(-1, 30), ids.reshape(-1)).backward()
            opt.step()
        model.eval()
        with torch.no_grad():  # an evaluation: nothing requires grad there
            model(torch.randint(0, 30, (2, 9)), torch.ones(2, 9))
    return monitor


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("check", CHECKS)
def test_causal_and_padding_masks_of_every_usual_build_are_silent(style, check):
    assert train_lm(style, check).alerts == []


def _no_key_kept(step: int, keep: torch.Tensor) -> torch.Tensor:
    """A batch of nothing but padding at step 2: softmax over all -inf is NaN."""
    return torch.zeros_like(keep) if step == 2 else keep


@pytest.mark.parametrize("style", ["masked_fill", "where", "log-of-mask"])
@pytest.mark.parametrize("check", CHECKS)
def test_nan_after_a_mask_built_in_its_own_module_is_blamed_on_the_softmax(style, check):
    """A mask is never the origin, even when made from finite numbers (log of a 0/1
    mask): a fully masked row's softmax is, in the module that calls it (the root)."""
    monitor = train_lm(style, check, keep_fn=_no_key_kept)
    first = first_nonfinite(monitor.alerts)
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "")
    if check != "deferred":
        assert first.data["op"] == "aten::_softmax"


# -- the -inf made by functional code in a module's own forward ----------------------


class LogInOwnForward(nn.Module):
    """The model takes the log itself, between no modules, before its BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.log(counts)))


class Wrapped(nn.Module):
    """The same body one level down, called on a rescaled copy of the counts."""

    def __init__(self) -> None:
        super().__init__()
        self.body = LogInOwnForward()

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.body(counts * 1.0)


@pytest.mark.parametrize(("cls", "named"), [(LogInOwnForward, ""), (Wrapped, "body")])
@pytest.mark.parametrize("check", ["auto", "step"])
def test_negative_inf_from_functional_code_names_the_module_whose_forward_made_it(
    cls, named, check
):
    """The replay re-runs the innermost module in progress that had finite inputs."""
    for armed in (True, False):
        model = cls()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(0)
        with tw.watch(model, opt, console=False, nonfinite_forward={"check": check}) as monitor:
            for step in range(5):
                counts = features(step, LogCounts(), gen, armed)
                opt.zero_grad()
                nn.functional.mse_loss(model(counts), torch.randn(16, 1, generator=gen)).backward()
                opt.step()
        if not armed:
            assert monitor.alerts == []
            continue
        first = first_nonfinite(monitor.alerts)
        assert (first.step, first.module, first.data["op"]) == (FAULT_STEP, named, "aten::log")


class ScoresWithMask(nn.Module):
    """Takes an additive -inf mask as an input; its own log makes NaN once ``bug`` is on."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.bug = False

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)
        if self.bug:
            scores = torch.log(scores)  # negative scores: NaN
        return torch.softmax(scores + mask, dim=-1)


class MaskedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scores = ScoresWithMask()
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.scores(x, mask))


@pytest.mark.parametrize("masked", [True, False])
def test_inputs_holding_a_mask_are_not_called_finite(masked):
    torch.manual_seed(0)
    model = MaskedModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mask = torch.zeros(6)
    if masked:
        mask[4:] = float("-inf")
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(3):
            model.scores.bug = step == 2
            opt.zero_grad()
            model(torch.randn(8, 6), mask).sum().backward()
            opt.step()
    first = first_nonfinite(monitor.alerts)
    assert (first.rule, first.step, first.module) == ("nonfinite_forward", 2, "scores")
    said = "from inputs finite but for a -inf mask in [-inf," if masked else "from finite inputs in"
    assert said in first.message
