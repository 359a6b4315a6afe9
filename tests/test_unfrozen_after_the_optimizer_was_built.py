"""not_optimized for parameters frozen when the optimizer was built and unfrozen later.

A staged fine-tune (a linear probe, then the backbone trained) that unfreezes the
backbone but keeps the first phase's optimizer, built over the head only: the
finding names that cause (``data.cause: unfrozen_after_optimizer``), once for the
whole part unfrozen together, at the module holding it, with the fix
(``add_param_group`` or a new optimizer). Its healthy twins, the backbone added to
the optimizer or a new optimizer handed to the monitor, stay silent; the other
causes (a head replaced, an optimizer built over part of the model) are told as
before.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from trainwatch.runner import run_script


def _probe_then_finetune() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.backbone = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
    model.head = nn.Linear(16, 3)
    return model


def _fit(model, opt, monitor, steps, at=None, seed=0):
    """A plain loop; ``at``: {step: callable run before that step's forward}."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if at and step in at:
            opt = at[step](opt) or opt
        x = torch.randn(16, 8, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    monitor.close()
    return [a for a in monitor.alerts if a.severity != "info"]


def _staged(phase2, tmp_path=None):
    model = _probe_then_finetune()
    model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    log_dir = str(tmp_path) if tmp_path is not None else None
    monitor = tw.watch(model, opt, console=io.StringIO(), log_dir=log_dir)

    def unfreeze(opt):
        model.backbone.requires_grad_(True)
        return phase2(model, opt, monitor)

    return _fit(model, opt, monitor, 12, at={5: unfreeze})


def test_backbone_unfrozen_after_the_optimizer_is_one_alert_naming_that_cause(tmp_path):
    alerts = _staged(lambda model, opt, monitor: None, tmp_path)
    assert [(a.rule, a.step, a.module) for a in alerts] == [("not_optimized", 5, "backbone")]
    alert = alerts[0]
    assert alert.data["cause"] == "unfrozen_after_optimizer"
    assert alert.data["modules"] == ["backbone.0", "backbone.2"]
    assert alert.data["parameters"] == [
        "backbone.0.weight",
        "backbone.0.bias",
        "backbone.2.weight",
        "backbone.2.bias",
    ]
    assert "frozen (requires_grad=False) when the optimizer was built" in alert.message
    assert "from step 5" in alert.message
    assert "model.backbone.parameters()" in alert.hint
    assert "add_param_group" in alert.hint
    # Not the advice for other causes.
    assert "only part of the model" not in alert.hint and ".to()" not in alert.hint
    # One line in the alert log too, not one per module.
    lines = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [(a["rule"], a["module"]) for a in lines if a["severity"] != "info"] == [
        ("not_optimized", "backbone")
    ]


def test_control_backbone_added_with_add_param_group_is_silent():
    def add(model, opt, monitor):
        opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 1e-3})

    assert _staged(add) == []


def test_control_new_optimizer_handed_to_the_monitor_is_silent():
    def rebuild(model, opt, monitor):
        fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor.add_optimizer(fresh)
        return fresh

    assert _staged(rebuild) == []


def test_gradual_unfreezing_tells_each_stage_unfrozen_together_once():
    """Top block first, then the one below (ULMFiT's gradual unfreezing), the
    optimizer never told: one alert per stage, at that stage's module."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.stem = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
    model.block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    model.head = nn.Linear(16, 3)
    model.stem.requires_grad_(False)
    model.block.requires_grad_(False)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.05)
    monitor = tw.watch(model, opt, console=io.StringIO())
    alerts = _fit(
        model,
        opt,
        monitor,
        12,
        at={
            3: lambda _: model.block.requires_grad_(True) and None,
            7: lambda _: model.stem.requires_grad_(True) and None,
        },
    )
    assert [(a.rule, a.step, a.module, a.data["modules"]) for a in alerts] == [
        ("not_optimized", 3, "block", ["block.0", "block.2"]),
        ("not_optimized", 7, "stem", ["stem.0", "stem.2"]),
    ]
    assert {a.data["cause"] for a in alerts} == {"unfrozen_after_optimizer"}


def test_layers_at_the_models_root_are_told_at_the_whole_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    opt = torch.optim.SGD(model[4].parameters(), lr=0.05)
    monitor = tw.watch(model, opt, console=io.StringIO())
    alerts = _fit(model, opt, monitor, 6, at={2: lambda _: model.requires_grad_(True) and None})
    assert [(a.rule, a.step, a.module, a.data["modules"]) for a in alerts] == [
        ("not_optimized", 2, "", ["0", "2"])
    ]
    assert "model.parameters()" in alerts[0].hint


def test_other_causes_keep_their_finding_beside_it():
    """A new head put in at the unfreeze (never frozen) is the usual per-module
    finding; the unfrozen backbone, the new one."""
    model = _probe_then_finetune()
    model.backbone.requires_grad_(False)
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    monitor = tw.watch(model, opt, console=io.StringIO())

    def new_task(opt):
        model.backbone.requires_grad_(True)
        model.head = nn.Linear(16, 3)

    alerts = [
        a for a in _fit(model, opt, monitor, 8, at={4: new_task}) if a.rule == "not_optimized"
    ]
    found = sorted((a.module, a.step, a.data.get("cause")) for a in alerts)
    assert found == [("backbone", 4, "unfrozen_after_optimizer"), ("head", 4, None)]
    (head,) = [a for a in alerts if a.module == "head"]
    assert "replaced after the optimizer was built" in head.hint


def test_optimizer_over_part_of_a_trainable_model_is_told_per_module_as_before():
    """Never frozen: the optimizer was built over part of the model, not before an
    unfreeze."""
    model = _probe_then_finetune()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    monitor = tw.watch(model, opt, console=io.StringIO())
    alerts = _fit(model, opt, monitor, 4)
    assert [(a.module, a.step, a.data.get("cause")) for a in alerts] == [
        ("backbone.0", 0, None),
        ("backbone.2", 0, None),
    ]
    assert all("only part of the model" in a.hint for a in alerts)


# -- Lightning: BaseFinetuning's unfreeze, with and without the param group ------------

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import BaseFinetuning  # noqa: E402

from tests.lightning_models import quiet_trainer  # noqa: E402
from trainwatch.lightning import TrainWatchCallback  # noqa: E402


class _Probe(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        data = torch.utils.data.TensorDataset(x, x[:, :1].sin())
        return torch.utils.data.DataLoader(data, batch_size=8)


class _UnfreezeAtEpoch(BaseFinetuning):
    def __init__(self, add: bool) -> None:
        super().__init__()
        self.add = add

    def freeze_before_training(self, pl_module) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer) -> None:
        if epoch != 1:
            return
        if self.add:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer)
        else:
            self.make_trainable(pl_module.backbone)  # the optimizer never told


@pytest.mark.parametrize("add", [False, True], ids=["forgot", "control_added"])
def test_lightning_finetuning_callback(tmp_path, add):
    torch.manual_seed(0)
    watch = TrainWatchCallback(console=io.StringIO())
    trainer = quiet_trainer(tmp_path, [_UnfreezeAtEpoch(add), watch], max_epochs=3)
    trainer.fit(_Probe())
    alerts = [a for a in watch.monitor.alerts if a.severity != "info"]
    if add:
        assert alerts == []
        return
    assert [(a.rule, a.step, a.module, a.data["cause"]) for a in alerts] == [
        ("not_optimized", 8, "backbone", "unfrozen_after_optimizer")
    ]
    assert alerts[0].data["modules"] == ["backbone.0", "backbone.2"]


# -- HF Trainer: the optimizer built at train() from the trainable parameters ---------

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from tests.hf_models import Tokens, model_of  # noqa: E402
from trainwatch.hf import TrainWatchCallback as HFTrainWatchCallback  # noqa: E402


class _UnfreezeEncoder(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at:
            model.bert.requires_grad_(True)


@pytest.mark.parametrize("own_optimizer", [False, True], ids=["forgot", "control_own_optimizer"])
def test_hf_trainer_callback_unfreezing_the_encoder(tmp_path, own_optimizer):
    """The Trainer builds its optimizer from the trainable parameters as train()
    starts; the healthy twin passes one over every parameter, frozen ones included
    (its frozen_in_optimizer warning, withdrawn at the unfreeze, is that rule's)."""
    model = model_of("bert")
    model.bert.requires_grad_(False)
    watch = HFTrainWatchCallback(console=io.StringIO())
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    optimizers = (None, None)
    if own_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens("bert"),
        callbacks=[_UnfreezeEncoder(3), watch],
        optimizers=optimizers,
    )
    trainer.train()
    alerts = [a for a in watch.alerts if a.rule == "not_optimized"]
    if own_optimizer:
        assert alerts == []
        return
    assert [(a.rule, a.step, a.module, a.data["cause"]) for a in alerts] == [
        ("not_optimized", 3, "bert", "unfrozen_after_optimizer")
    ]
    modules = alerts[0].data["modules"]
    assert "bert.embeddings.word_embeddings" in modules and "bert.pooler.dense" in modules
    assert len(modules) == len({p.rsplit(".", 1)[0] for p in alerts[0].data["parameters"]})
    assert [a.rule for a in watch.alerts if a.severity != "info"] == ["not_optimized"]


# -- trainwatch run: a script that knows nothing of trainwatch -------------------------

TWO_PHASES = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential()
model.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
model.classifier = nn.Linear(16, 3)
model.encoder.requires_grad_(False)
opt = torch.optim.SGD(model.classifier.parameters(), lr=0.05)
for step in range(10):
    if step == 6:
        model.encoder.requires_grad_(True)
        if sys.argv[1] == "new_optimizer":
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.mark.parametrize("phase2", ["forgot", "new_optimizer"])
def test_under_trainwatch_run(tmp_path, phase2):
    script = tmp_path / "two_phases.py"
    script.write_text(TWO_PHASES)
    run_script(script, [phase2], log_dir=tmp_path / "log", console=False)
    lines = (tmp_path / "log" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["severity"] != "info"]
    if phase2 == "new_optimizer":  # found by trainwatch run, watched from its first step
        assert found == []
        return
    assert [(a["rule"], a["step"], a["module"], a["data"]["cause"]) for a in found] == [
        ("not_optimized", 6, "encoder", "unfrozen_after_optimizer")
    ]
    # trainwatch run finds new optimizers itself: nothing to hand over.
    assert "monitor.add_optimizer" not in found[0]["hint"]
