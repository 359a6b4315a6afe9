"""trainable_parameters: the setup table, and a fine-tune that cannot change the model.

The table (trainable and frozen counts by location, adapters with the modules
they wrap, which optimizer holds what) is not an alert: a healthy run keeps
``monitor.alerts`` empty. Two setups warn: no optimizer holds a trainable
parameter, and no trainable parameter gets a gradient in the first step.
Each planted bug runs in two script shapes beside a clean control.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
import trainwatch.setup_watch as setup_watch_module
from tests.lora_models import (
    LoraLinear,
    TinyCNN,
    TinyEncoder,
    image_batch,
    inject,
    token_batch,
)
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script
from trainwatch.setup_audit import build_audit
from trainwatch.tensorboard_plugin import metadata

RULE = "trainable_parameters"


def _train_tokens(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        tokens, labels = token_batch(step)
        opt.zero_grad()
        logits = model(tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        opt.step()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _found(alerts) -> list[tuple[str, int, str | None]]:
    return [(a.severity, a.step, a.module) for a in alerts if a.rule == RULE]


# -- plain loop, a small transformer encoder -----------------------------------------
def test_adapters_on_attention_are_listed_with_the_modules_they_wrap_and_nothing_fires(tmp_path):
    torch.manual_seed(0)
    model = inject(TinyEncoder(), ["q", "v"])
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
    console = io.StringIO()
    with tw.watch(model, opt, log_dir=tmp_path, console=console) as monitor:
        _train_tokens(model, opt, 6)
    assert monitor.alerts == []
    audit = monitor.setup_audit
    assert audit is not None
    assert audit.trainable == sum(p.numel() for p in _trainable(model))
    assert audit.frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert {(a.module, a.wraps, a.rank, a.modules) for a in audit.adapters} == {
        ("blocks.*.attn.q", "blocks.*.attn.q.base_layer", 4, 2),
        ("blocks.*.attn.v", "blocks.*.attn.v.base_layer", 4, 2),
    }
    trainable_rows = {r.module: r for r in audit.locations if r.section == "trainable"}
    assert set(trainable_rows) == {"blocks.*.attn.q", "blocks.*.attn.v"}
    assert trainable_rows["blocks.*.attn.q"].optimizers == [0]
    assert trainable_rows["blocks.*.attn.q"].frozen == 2 * (16 * 16 + 16)  # the base layers
    written = json.loads((tmp_path / "setup.json").read_text())
    assert written["audits"] == [json.loads(json.dumps(audit.to_dict()))]
    shown = console.getvalue()
    assert shown.count("trainwatch setup") == 1
    assert "trainable params: " in shown and "blocks.*.attn.q (x2)" in shown


def test_adapters_on_a_module_the_loss_never_uses_warn_at_the_first_step_naming_it(tmp_path):
    torch.manual_seed(0)
    model = inject(TinyEncoder(), ["pooler"])  # meant: ["q", "v"]
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
    with tw.watch(model, opt, log_dir=tmp_path, console=False) as monitor:
        _train_tokens(model, opt, 4)
    assert _found(monitor.alerts) == [("warning", 0, "pooler")]
    alert = next(a for a in monitor.alerts if a.rule == RULE)
    assert alert.data["parameters"] == [
        "pooler.lora_A.default.weight",
        "pooler.lora_B.default.weight",
    ]
    assert "first step" in alert.message
    assert monitor.setup_audit.adapters[0].wraps == "pooler.base_layer"


def test_an_optimizer_built_before_the_adapters_were_added_warns_at_attach():
    torch.manual_seed(0)
    model = TinyEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before get_peft_model
    inject(model, ["q", "v"])
    with tw.watch(model, opt, console=False) as monitor:
        assert _found(monitor.alerts) == [("warning", 0, "")]
        _train_tokens(model, opt, 2)
    alert = next(a for a in monitor.alerts if a.rule == RULE)
    assert alert.data["modules"] == ["blocks.*.attn.q", "blocks.*.attn.v"]
    assert monitor.setup_audit.optimizers[0].trainable == 0
    assert monitor.setup_audit.unheld == monitor.setup_audit.trainable


# -- plain loop, a CNN: two more setups --------------------------------------------------
def _train_images(model: nn.Module, opt: torch.optim.Optimizer, steps: int, **kw) -> None:
    accumulate = kw.get("accumulate", 1)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = image_batch(step * accumulate + micro)
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_a_model_left_wholly_frozen_warns_and_a_frozen_backbone_with_a_trained_head_does_not():
    torch.manual_seed(0)
    frozen = TinyCNN()
    opt = torch.optim.SGD(frozen.parameters(), lr=0.01)
    frozen.requires_grad_(False)  # the head was meant to be unfrozen after this
    with tw.watch(frozen, opt, console=False) as monitor:
        pass
    assert _found(monitor.alerts) == [("warning", 0, "")]
    assert "requires_grad=False" in monitor.alerts[0].message

    tuned = TinyCNN()
    tuned.requires_grad_(False)
    tuned.head.requires_grad_(True)
    tuned.bn1.eval()  # frozen batch norm, as fine-tuning does
    opt = torch.optim.SGD(tuned.head.parameters(), lr=0.01)
    with tw.watch(tuned, opt, console=False) as monitor:
        _train_images(tuned, opt, 4)
    assert [a for a in monitor.alerts if a.severity != "info"] == []
    assert [r.module for r in monitor.setup_audit.locations if r.section == "trainable"] == []
    assert {r.module: r.trainable for r in monitor.setup_audit.locations}["head"] == 16 * 4 + 4


# -- Lightning -----------------------------------------------------------------------------
class LoraCNN(pl.LightningModule):
    def __init__(self, target: str) -> None:
        super().__init__()
        self.net = inject(TinyCNN(), [target])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(32, 3, 8, 8, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, 4, (32,), generator=gen)), 8)


def _fit(module: pl.LightningModule, tmp_path: Path) -> TrainWatchCallback:
    callback = TrainWatchCallback(console=False)
    trainer = pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=TensorBoardLogger(str(tmp_path)),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return callback


@pytest.mark.slow
def test_lightning_lora_on_an_unused_head_warns_and_the_audit_reaches_tensorboard(tmp_path):
    torch.manual_seed(0)
    wrong = _fit(LoraCNN("aux_head"), tmp_path / "wrong")
    assert _found(wrong.alerts) == [("warning", 0, "net.aux_head")]

    torch.manual_seed(0)
    right = _fit(LoraCNN("fc"), tmp_path / "right")
    assert [a for a in right.alerts if a.severity != "info"] == []
    log_dir = tmp_path / "right" / "lightning_logs" / "version_0"
    audits = json.loads((log_dir / "setup.json").read_text())["audits"]
    assert [(a["module"], a["wraps"]) for a in audits[0]["adapters"]] == [
        ("net.fc", "net.fc.base_layer")
    ]
    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    tag = next(t for t in events.Tags()["tensors"] if t.startswith(metadata.SETUP_TAG))
    text = tensor_util.make_ndarray(events.Tensors(tag)[0].tensor_proto).item().decode()
    assert "| net.fc | " in text and "net.fc.base_layer" in text


# -- trainwatch run, unmodified scripts ------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn


class Lora(nn.Module):
    def __init__(self, base, r=4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


torch.manual_seed(0)
model = Net()
late = sys.argv[1] == "late"
if late:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # before the adapters
for p in model.parameters():
    p.requires_grad_(False)
model.fc2 = Lora(model.fc2)
model.fc1.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
if not late:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
for step in range(6):
    x = torch.randn(16, 8)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), x[:, :1].sin()).backward()
    opt.step()
print("done")
"""


def _run(tmp_path: Path, when: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A real ``trainwatch run`` process on the script."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log_dir = tmp_path / when
    done = subprocess.run(
        [sys.executable, "-m", "trainwatch", "run", "--log-dir", str(log_dir), str(script), when],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return done, log_dir


@pytest.mark.slow
def test_trainwatch_run_finds_an_optimizer_built_before_the_adapters(tmp_path):
    done, log_dir = _run(tmp_path, "late")
    lines = [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]
    found = [(a["rule"], a["severity"], a["step"], a["module"]) for a in lines]
    assert (RULE, "warning", 0, "") in found
    assert next(a for a in lines if a["rule"] == RULE)["data"]["model"] == "Net"
    assert "trainwatch setup of Net" in done.stderr


def test_trainwatch_run_is_silent_on_an_optimizer_built_after_the_adapters(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    log_dir = tmp_path / "log"
    assert run_script(script, ["early"], log_dir=log_dir, fail_on="warning") == 0
    assert (log_dir / "alerts.jsonl").read_text() == ""
    assert "trainwatch setup of Net" in capsys.readouterr().err
    audits = json.loads((log_dir / "setup.json").read_text())["audits"]
    assert [a["model"] for a in audits] == ["Net"]
    assert [(a["module"], a["wraps"]) for a in audits[0]["adapters"]] == [("fc2", "fc2.base_layer")]


# -- a setup that changes -------------------------------------------------------------
def test_each_change_of_the_setup_is_audited_and_a_warning_again_is_its_own_finding(tmp_path):
    torch.manual_seed(0)
    model = TinyCNN()
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01)
    with tw.watch(model, opt, log_dir=tmp_path, console=False) as monitor:
        for phase in range(4):
            # Odd phases mean to tune the backbone but never give it to the optimizer.
            backbone = phase % 2 == 1
            model.requires_grad_(False)
            (model.conv2 if backbone else model.head).requires_grad_(True)
            _train_images(model, opt, 2)
    found = [a for a in monitor.alerts if a.rule == RULE]
    assert [(a.step, a.module, a.data["finding"]) for a in found] == [(2, "", 1), (6, "", 3)]
    audits = json.loads((tmp_path / "setup.json").read_text())["audits"]
    assert [(a["revision"], a["step"]) for a in audits] == [(0, 0), (1, 2), (2, 4), (3, 6)]
    assert monitor.setup_audit.revision == 3


def test_unfreezing_into_a_new_param_group_is_audited_again_without_a_warning():
    torch.manual_seed(0)
    model = TinyCNN()
    model.requires_grad_(False)
    model.head.requires_grad_(True)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        _train_images(model, opt, 3)
        model.conv2.requires_grad_(True)
        opt.add_param_group({"params": list(model.conv2.parameters()), "lr": 1e-3})
        _train_images(model, opt, 3)
    assert [a for a in monitor.alerts if a.severity != "info"] == []
    audit = monitor.setup_audit
    assert (audit.revision, audit.step) == (1, 3)
    assert audit.optimizers[0].groups == 2
    assert {r.module: r.optimizers for r in audit.locations}["conv2"] == [0]


# -- healthy training stays silent, and costs no audit per step --------------------------
class Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _gan(steps: int) -> tw.Monitor:
    model = Gan()
    g_opt = torch.optim.Adam(model.generator.parameters(), lr=1e-3)
    d_opt = torch.optim.Adam(model.discriminator.parameters(), lr=1e-3)
    monitor = tw.watch(model, [g_opt, d_opt], console=False)
    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(steps):
        real = torch.randn(16, 8)
        fake = model.generator(torch.randn(16, 4))
        d_opt.zero_grad()
        d_loss = bce(model.discriminator(real), torch.ones(16, 1)) + bce(
            model.discriminator(fake.detach()), torch.zeros(16, 1)
        )
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        bce(model.discriminator(fake), torch.ones(16, 1)).backward()
        g_opt.step()
    return monitor


def _checkpointed(steps: int) -> tw.Monitor:
    model = inject(TinyEncoder(), ["q", "v"])
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
    monitor = tw.watch(model, opt, console=False)
    for step in range(steps):
        tokens, labels = token_batch(step)
        opt.zero_grad()
        h = model.embed(tokens)
        for block in model.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        loss = nn.functional.cross_entropy(model.classifier(h).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
    return monitor


def _scaled(steps: int) -> tw.Monitor:
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # skips its first steps
    monitor = tw.watch(model, opt, console=False, scaler=scaler)
    for step in range(steps):
        x, y = image_batch(step)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return monitor


def _accumulated(steps: int) -> tw.Monitor:
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = tw.watch(model, opt, console=False)
    _train_images(model, opt, steps, accumulate=3)
    return monitor


def _stepped_before_any_backward(steps: int) -> tw.Monitor:
    model = inject(TinyEncoder(), ["q"])
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
    monitor = tw.watch(model, opt, console=False)
    opt.step()  # a warm-up idiom that silences the LR-scheduler order warning
    _train_tokens(model, opt, steps)
    return monitor


def _hand_sgd(steps: int) -> tw.Monitor:
    model = inject(TinyEncoder(), ["q", "v"])
    monitor = tw.watch(model, console=False)
    for step in range(steps):
        tokens, labels = token_batch(step)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        with torch.no_grad():
            for p in _trainable(model):
                p -= 0.01 * p.grad
                p.grad = None
        monitor.step(loss=loss)
    return monitor


HEALTHY = {
    "gan_two_optimizers": _gan,
    "lora_gradient_checkpointing": _checkpointed,
    "amp_grad_scaler_skips": _scaled,
    "gradient_accumulation": _accumulated,
    "optimizer_step_before_any_backward": _stepped_before_any_backward,
    "hand_written_sgd_without_optimizer": _hand_sgd,
}


@pytest.mark.parametrize("loop", list(HEALTHY), ids=list(HEALTHY))
def test_healthy_training_is_silent_and_audited_once(loop, monkeypatch):
    built = []

    def counting(*args, **kwargs):
        built.append(kwargs.get("revision"))
        return build_audit(*args, **kwargs)

    monkeypatch.setattr(setup_watch_module, "build_audit", counting)
    torch.manual_seed(0)
    monitor = HEALTHY[loop](12)
    monitor.close()
    assert _found(monitor.alerts) == []
    assert built == [0]  # one audit, never one per step


# -- the table itself --------------------------------------------------------------------
def test_loralib_layout_is_an_adapter_and_a_trained_factorisation_is_not():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.adapted = LoraLinear(16, 16, rank=2)
            # A trainable low-rank factorisation (ALBERT's embedding): no frozen base.
            self.factor_in = nn.Linear(32, 4, bias=False)
            self.factor_out = nn.Linear(4, 32, bias=False)

    audit = build_audit(Model(), [])
    assert [(a.module, a.wraps, a.rank, a.trainable) for a in audit.adapters] == [
        ("adapted", "adapted", 2, 2 * 16 * 2)
    ]
    assert audit.headline() == (
        f"trainable params: {audit.trainable:,} || all params: "
        f"{audit.trainable + audit.frozen:,} || trainable%: {100 * audit.share:.4f}"
    )
    json.dumps(audit.to_dict())


def test_a_long_sequential_shares_rows_between_numbered_children():
    layers = [nn.Linear(4, 4) for _ in range(40)]
    model = nn.Sequential(*layers, nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    audit = build_audit(model, [opt])
    top = [(r.module, r.modules, r.trainable, r.frozen) for r in audit.locations]
    assert top[0] == ("*", 41, 39 * 20 + 10, 20)
    assert top[1] == ("*", 40, 39 * 20 + 10, 0)
    assert len(audit.locations) == 2  # then where the trainable ones sit: "*" again
    json.dumps(audit.to_dict())


def test_the_table_can_be_turned_off_while_the_warnings_stay(tmp_path):
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model.requires_grad_(False)
    console = io.StringIO()
    with tw.watch(
        model, opt, log_dir=tmp_path, console=console, trainable_parameters={"table": False}
    ) as monitor:
        pass
    assert _found(monitor.alerts) == [("warning", 0, "")]
    assert "trainwatch setup" not in console.getvalue()
    assert not (tmp_path / "setup.json").exists()
    with pytest.raises(tw.ConfigError, match=r"trainable_parameters\.table"):
        tw.watch(model, opt, trainable_parameters__table="yes")


def test_a_failing_audit_is_reported_once_and_training_goes_on(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("audit broke")

    monkeypatch.setattr(setup_watch_module, "build_audit", broken)
    model = TinyCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tw.watch(model, opt, console=False) as monitor:
        _train_images(model, opt, 3)
        model.conv1.requires_grad_(False)  # a change: the audit is not tried again
        _train_images(model, opt, 3)
    failures = [a for a in monitor.alerts if a.rule == "internal_error"]
    assert [a.data["component"] for a in failures] == ["setup audit"]
    assert monitor.step_count == 6 and monitor.grad_norms()


def test_real_peft_models_built_after_and_before_their_optimizer():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=3,
    )  # fmt: skip
    for optimizer_first, expected in ((False, []), (True, [("warning", 0, "")])):
        torch.manual_seed(0)
        base = transformers.BertForTokenClassification(config)
        opt = torch.optim.AdamW(base.parameters(), lr=1e-3) if optimizer_first else None
        lora = peft.LoraConfig(r=4, target_modules=["query", "value"])
        model = peft.get_peft_model(base, lora)
        opt = opt or torch.optim.AdamW(_trainable(model), lr=1e-3)
        with tw.watch(model, opt, console=False) as monitor:
            tokens, labels = token_batch(0)
            model(input_ids=tokens, labels=labels).loss.backward()
            opt.step()
        assert _found(monitor.alerts) == expected
        wrapped = {a.wraps.rsplit(".", 1)[-1] for a in monitor.setup_audit.adapters}
        assert wrapped == {"base_layer"}
