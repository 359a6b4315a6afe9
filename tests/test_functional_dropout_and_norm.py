"""eval_in_train_mode for models that call dropout and batch norm as functions.

``F.dropout(x, p, training=self.training)`` and ``F.batch_norm(...,
training=self.training)`` leave no ``Dropout`` or ``BatchNorm`` module to
look for: the calls themselves are seen, on sampled no-grad passes made in
training mode, and the module that made them is named.
"""

from __future__ import annotations

import io
import json

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.data import DataLoader

from tests.conftest import rules_of
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script


class GraphConv(nn.Module):
    def __init__(self, width: int, p: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.p = p

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.relu(adj @ self.lin(x)), self.p, training=self.training)


class GraphNet(nn.Module):
    """A GCN in the usual research style: dropout only through ``F.dropout``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.conv1 = GraphConv(width)
        self.conv2 = GraphConv(width)
        self.head = nn.Linear(width, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, adj = batch
        return self.head(self.conv2(self.conv1(x, adj), adj))


class FunctionalNorm(nn.Module):
    """Batch norm kept in buffers and applied with ``F.batch_norm``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            x, self.running_mean, self.running_var, training=self.training, momentum=0.1
        )


class FunctionalCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), FunctionalNorm(8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stem(x).mean(dim=(2, 3)))


class Attention(nn.Module):
    """nanoGPT-style attention: the dropout is an argument of the attention call."""

    def __init__(self, width: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 20, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = Attention(width)
        self.head = nn.Linear(width, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(tokens)).mean(dim=1))


class PlainMLP(nn.Module):
    """No dropout and no batch norm at all, of any kind."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, _ = batch
        return self.head(F.gelu(self.fc(x)))


def _graphs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    adj = torch.eye(10) + (torch.rand(10, 10, generator=gen) > 0.7).float()
    for _ in range(n):
        x = torch.randn(10, 8, generator=gen)
        yield (x, adj / adj.sum(dim=1, keepdim=True)), x[:, :1].sin()


def _images(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(4, 3, 6, 6, generator=gen)
        yield x, x.mean(dim=(1, 2, 3))[:, None]


def _sequences(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        tokens = torch.randint(0, 20, (4, 8), generator=gen)
        yield tokens, tokens.float().mean(dim=1, keepdim=True) / 20


# model, its data, the module that calls the function, the function
CASES = {
    "gcn_dropout": (GraphNet, _graphs, "conv1", "F.dropout"),
    "cnn_batch_norm": (FunctionalCNN, _images, "stem.1", "F.batch_norm"),
    "gpt_attention_dropout": (
        TinyGPT,
        _sequences,
        "attn",
        "F.scaled_dot_product_attention(dropout_p)",
    ),
}
ALL = sorted(CASES)


def _setup(quiet_watch, case: str, **config):
    build, data, *_ = CASES[case] if case in CASES else (PlainMLP, _graphs)
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, data, quiet_watch(model, opt, **config)


def _step(model, opt, batch) -> None:
    x, y = batch
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _train(model, opt, data, steps: int, seed: int = 0) -> None:
    for batch in data(steps, seed):
        _step(model, opt, batch)


def _evaluate(model, data, passes: int = 3) -> None:
    with torch.no_grad():
        for x, _ in data(passes, seed=7):
            model(x)


@pytest.mark.parametrize("case", ALL)
def test_evaluation_in_training_mode_is_reported_at_the_module_that_calls_the_function(
    quiet_watch, case
):
    _, _, caller, function = CASES[case]
    model, opt, data, monitor = _setup(quiet_watch, case)
    _train(model, opt, data, 3)
    _evaluate(model, data)  # model.eval() forgotten
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (3, caller)
    assert alert.data["kinds"][0] == function
    assert function in alert.message


def test_every_graph_layer_that_calls_dropout_is_listed_in_call_order(quiet_watch):
    model, opt, data, monitor = _setup(quiet_watch, "gcn_dropout")
    _train(model, opt, data, 2)
    _evaluate(model, data)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.data["modules"] == ["conv1", "conv2"]


@pytest.mark.parametrize("case", [*ALL, "plain_mlp"])
def test_evaluation_after_model_eval_is_silent(quiet_watch, case):
    model, opt, data, monitor = _setup(quiet_watch, case)
    _train(model, opt, data, 3)
    model.eval()
    _evaluate(model, data, 4)
    model.train()
    _train(model, opt, data, 2, seed=1)
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_model_without_any_dropout_evaluated_in_training_mode_is_silent(quiet_watch):
    model, opt, data, monitor = _setup(quiet_watch, "plain_mlp")
    for _ in range(3):
        _train(model, opt, data, 2)
        _evaluate(model, data, 3)  # no eval(), but nothing depends on the mode
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_monte_carlo_dropout_through_functions_is_allowed_but_batch_norm_is_not(quiet_watch):
    for case in ("gcn_dropout", "gpt_attention_dropout"):
        model, opt, data, monitor = _setup(
            quiet_watch, case, eval_in_train_mode={"mc_dropout": True}
        )
        _train(model, opt, data, 2)
        _evaluate(model, data, 4)  # deliberate: dropout on for sampled predictions
        assert rules_of(monitor, ("info", "warning", "error")) == [], case

    model, opt, data, monitor = _setup(
        quiet_watch, "cnn_batch_norm", eval_in_train_mode={"mc_dropout": True}
    )
    _train(model, opt, data, 2)
    _evaluate(model, data)  # batch norm would overwrite its running statistics
    assert [(a.rule, a.module) for a in monitor.alerts] == [("eval_in_train_mode", "stem.1")]


@pytest.mark.parametrize("case", ["gcn_dropout", "cnn_batch_norm"])
def test_samples_drawn_under_no_grad_between_training_passes_every_step_are_silent(
    quiet_watch, case
):
    """A GAN's discriminator step: samples of the generator, in training mode, every step."""
    model, opt, data, monitor = _setup(quiet_watch, case)
    for batch in data(10):
        with torch.no_grad():
            model(batch[0])
        _step(model, opt, batch)
    assert rules_of(monitor, ("info", "warning", "error")) == []


@pytest.mark.parametrize("case", ["gcn_dropout", "gpt_attention_dropout"])
def test_one_evaluation_pass_now_and_then_is_reported_at_its_step(quiet_watch, case):
    model, opt, data, monitor = _setup(quiet_watch, case)
    for step, batch in enumerate(data(9)):
        if step % 4 == 3:
            _evaluate(model, data, passes=1)
        _step(model, opt, batch)
    alerts = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert [(a.step, a.module) for a in alerts] == [(3, CASES[case][2])]


class _ModeDepth(nn.Module):
    """Records, inside each forward, whether a function mode is looking at the calls."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.looked: list[tuple[bool, bool]] = []  # (grad enabled, looked at)

    def forward(self, batch):
        looked = torch._C._len_torch_function_stack() > 0
        self.looked.append((torch.is_grad_enabled(), looked))
        return self.inner(batch)


def test_only_sampled_no_grad_passes_in_training_mode_are_looked_at(quiet_watch):
    torch.manual_seed(0)
    model = _ModeDepth(PlainMLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    quiet_watch(
        model,
        opt,
        eval_in_train_mode={"functional_passes": 2, "functional_every": 5},
        train_in_eval_mode={"functional_passes": 2},
        # Its re-run of the first batch is one more no-grad pass the model's own
        # record would list; this test counts the user's passes only.
        stalled_training={"enabled": False},
    )
    for batch in _graphs(5):
        _step(model, opt, batch)
    _evaluate(model, _graphs, 11)
    model.eval()
    _evaluate(model, _graphs, 2)
    training = [looked for grad, looked in model.looked if grad]
    no_grad = [looked for grad, looked in model.looked if not grad]
    # train_in_eval_mode's look at the first training passes, then none
    assert training == [True, True, False, False, False]
    # the first two candidates, then one in five; none once in eval mode
    assert (
        no_grad
        == [True, True, False, False, False, True, False, False, False, False, True] + [False] * 2
    )


def test_a_look_leaves_no_hook_and_no_mode_behind(quiet_watch):
    model, opt, data, monitor = _setup(quiet_watch, "gcn_dropout")
    _train(model, opt, data, 2)
    _evaluate(model, data)
    assert not module_hooks._global_forward_hooks
    assert not module_hooks._global_forward_pre_hooks
    # No mode of the look's: the one left follows what the evaluation computed
    # (the broadcast audit of evaluations), until the next pass of the model.
    follower = monitor._pipeline.behaviour.evaluations.follower
    depth = torch._C._len_torch_function_stack()
    assert [torch._C._get_function_stack_at(i) for i in range(depth)] == [follower._mode]
    _train(model, opt, data, 2, seed=1)
    assert torch._C._len_torch_function_stack() == 0
    assert [a.rule for a in monitor.alerts] == ["eval_in_train_mode"]


def test_the_looks_are_a_config_key_with_a_clear_error(quiet_watch):
    import trainwatch as tw

    with pytest.raises(tw.ConfigError, match="functional_every"):
        tw.Config.from_dict({"eval_in_train_mode": {"functional_every": -1}})


# -- the same pattern through Lightning and `trainwatch run` -------------------------


class GraphLightning(pl.LightningModule):
    """A GCN that scores held-out graphs at epoch end itself, where Lightning keeps train mode."""

    def __init__(self, forget_eval: bool) -> None:
        super().__init__()
        self.net = GraphNet()
        self.forget_eval = forget_eval

    def forward(self, batch):
        return self.net(batch)

    def training_step(self, batch, batch_idx):
        x, adj, y = batch
        return F.mse_loss(self((x[0], adj[0])), y[0])

    def validation_step(self, batch, batch_idx):  # Lightning's own loop: eval mode
        x, adj, y = batch
        self.log("val_loss", F.mse_loss(self((x[0], adj[0])), y[0]))

    def on_train_epoch_end(self) -> None:
        if not self.forget_eval:
            self.eval()
        with torch.no_grad():
            for (x, adj), _ in _graphs(2, seed=5):
                self((x, adj))
        self.train()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def _loader(self, n: int, seed: int):
        graphs = [(x, adj, y) for (x, adj), y in _graphs(n, seed)]
        return DataLoader(graphs, batch_size=1)

    def train_dataloader(self):
        return self._loader(3, 0)

    def val_dataloader(self):
        return self._loader(2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("forget_eval", [True, False], ids=["forgotten", "control"])
def test_lightning_epoch_end_evaluation_in_training_mode_names_the_graph_layer(
    tmp_path, forget_eval
):
    callback = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=2, num_sanity_val_steps=1)
    trainer.fit(GraphLightning(forget_eval))
    found = [(a.rule, a.step, a.module) for a in callback.alerts if a.severity != "info"]
    if forget_eval:
        assert found == [("eval_in_train_mode", 3, "net.conv1")]
    else:
        assert found == []


GCN_SCRIPT = """
import sys
import torch
import torch.nn.functional as F
from torch import nn


class GraphConv(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x, adj):
        return F.dropout(torch.relu(adj @ self.lin(x)), 0.5, training=self.training)


class GCN(nn.Module):
    def __init__(self):
        super().__init__()
        self.gc1 = GraphConv(8)
        self.gc2 = GraphConv(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x, adj):
        return self.out(self.gc2(self.gc1(x, adj), adj))


torch.manual_seed(0)
model = GCN()
opt = torch.optim.Adam(model.parameters(), lr=0.01)
adj = torch.eye(12)
for epoch in range(4):
    x = torch.randn(12, 8)
    opt.zero_grad()
    F.mse_loss(model(x, adj), x[:, :1]).backward()
    opt.step()
    if sys.argv[1] == "eval":
        model.eval()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(12, 8), adj)
    model.train()
print("done")
"""


@pytest.mark.parametrize("mode", ["forgotten", "eval"])
def test_trainwatch_run_names_the_graph_layer_of_an_unmodified_script(tmp_path, capsys, mode):
    script = tmp_path / "gcn.py"
    script.write_text(GCN_SCRIPT)
    assert run_script(script, [mode], log_dir=tmp_path / "log") == 0
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [(a["rule"], a["step"], a["module"]) for a in map(json.loads, lines)]
    if mode == "forgotten":
        assert found == [("eval_in_train_mode", 1, "gc1")]
    else:
        assert found == []
    assert "done" in capsys.readouterr().out
