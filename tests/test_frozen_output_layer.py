"""trainable_parameters: a note when the model's output layer is frozen while what feeds it trains.

A freshly initialised classifier frozen by mistake (``model.classifier
.requires_grad_(False)``, a freeze by name pattern that caught the head too)
with an optimizer built over the trainable parameters only: nothing fails,
and the encoder learns to feed a fixed random projection. Told once, as
``info`` (a frozen output layer is also deliberate), from the setup audit.
Each planted bug runs beside a clean twin, in a plain loop, under the Hugging
Face Trainer, under ``trainwatch run`` and under Lightning; the setups where
a frozen output layer is on purpose (a linear probe's head trains, tied
input and output embeddings, LoRA, prompt tuning, a frozen loss network fed by
a small generator) raise no warning.
"""

from __future__ import annotations

import copy
import io
import json
import textwrap

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.hf_models import Tokens, batch_for, freeze, model_of
from tests.lora_models import TinyEncoder, inject, token_batch
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import run_script

RULE = "trainable_parameters"


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3)
    )


def _notes(alerts) -> list[tuple[str, int, str | None]]:
    return [(a.severity, a.step, a.module) for a in alerts if a.rule == RULE]


def _train(model: nn.Module, steps: int = 4, *, loss=nn.functional.cross_entropy):
    """A plain loop whose optimizer holds the trainable parameters only."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    with tw.watch(model, opt, console=False) as monitor:
        for _ in range(steps):
            opt.zero_grad()
            loss(model(x), y).backward()
            opt.step()
    return monitor


# -- plain loop --------------------------------------------------------------------------
def test_a_frozen_head_in_a_plain_loop_is_told_once_as_a_note_at_the_audit():
    torch.manual_seed(0)
    model = _mlp()
    model[4].requires_grad_(False)  # meant: model[0]
    monitor = _train(model)
    assert [(a.rule, a.severity, a.step, a.module) for a in monitor.alerts] == [
        (RULE, "info", 0, "4")
    ]
    alert = monitor.alerts[0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert alert.message == (
        f"the model's output layer `4` is frozen while {trainable:,} parameters upstream "
        "train: if it was freshly initialised, training cannot adapt it"
    )
    assert alert.data == {
        "finding": "frozen output layer",
        "modules": ["4"],
        "frozen": 32 * 3 + 3,
        "trainable": trainable,
        "frozen_behind": [],
    }


def test_control_the_same_model_with_its_head_training_is_silent():
    torch.manual_seed(0)
    assert _train(_mlp()).alerts == []


def test_a_frozen_head_behind_a_log_softmax_module_is_told():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3), nn.LogSoftmax(-1))
    model[2].requires_grad_(False)
    monitor = _train(model, loss=nn.functional.nll_loss)
    assert _notes(monitor.alerts) == [("info", 0, "2")]


# -- clean setups where part of the model is frozen on purpose -------------------------------
def test_control_a_linear_probe_whose_head_trains_is_silent():
    torch.manual_seed(0)
    model = _mlp()
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    assert _notes(_train(model).alerts) == []


class _Momentum(nn.Module):
    """A momentum encoder registered after the online one, run without gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.online = _mlp()
        self.target = copy.deepcopy(self.online).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            reference = self.target(x)
        return self.online(x) + 0 * reference


class _Teacher(nn.Module):
    """A frozen teacher registered last, its output in the model's with gradients on."""

    def __init__(self) -> None:
        super().__init__()
        self.student = _mlp()
        self.teacher = _mlp().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x) - self.teacher(x)


@pytest.mark.parametrize("make", [_Momentum, _Teacher], ids=["momentum", "teacher"])
def test_control_a_frozen_copy_registered_last_is_not_the_output_layer(make):
    torch.manual_seed(0)
    assert _notes(_train(make()).alerts) == []


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.discriminator(self.generator(z))


def test_control_a_discriminator_frozen_for_the_generators_phase_is_silent():
    """Watched during the generator's phase, the discriminator frozen: its optimizer
    holds it, and it trains at its own steps."""
    torch.manual_seed(0)
    gan = _GAN()
    opt_g = torch.optim.Adam(gan.generator.parameters(), 2e-4)
    opt_d = torch.optim.Adam(gan.discriminator.parameters(), 2e-4)
    bce = nn.functional.binary_cross_entropy_with_logits
    monitor = None
    for _ in range(4):
        gan.discriminator.requires_grad_(False)  # the generator's phase
        if monitor is None:
            monitor = tw.watch(gan, [opt_g, opt_d], console=False)
        opt_g.zero_grad()
        bce(gan(torch.randn(32, 8)), torch.ones(32, 1)).backward()
        opt_g.step()
        gan.discriminator.requires_grad_(True)
        fake = gan.generator(torch.randn(32, 8)).detach()
        opt_d.zero_grad()
        real = gan.discriminator(torch.randn(32, 16))
        (bce(real, torch.ones(32, 1)) + bce(gan.discriminator(fake), torch.zeros(32, 1))).backward()
        opt_d.step()
    monitor.close()
    assert _notes(monitor.alerts) == []


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 8)
        self.body = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.body(x)))


@pytest.mark.parametrize("embedding_frozen", [False, True])
def test_control_an_output_layer_tied_to_the_input_embedding_is_silent(embedding_frozen):
    torch.manual_seed(0)
    model = _Tied()
    model.embed.requires_grad_(not embedding_frozen)
    assert _notes(_train(model).alerts) == []


class _PerceptualLoss(nn.Module):
    """A generator whose output a frozen feature network (a loss network) reads."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.features = nn.Sequential(
            nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
        ).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(self.generator(x))


def test_control_a_frozen_network_larger_than_what_feeds_it_is_its_design():
    torch.manual_seed(0)
    assert _notes(_train(_PerceptualLoss()).alerts) == []


def _train_lm(model: nn.Module, steps: int = 3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(steps):
            out = model(**batch_for("gpt2", step))
            opt.zero_grad()
            out.loss.backward()
            opt.step()
    return monitor


@pytest.mark.parametrize("embedding_frozen", [False, True])
def test_control_a_tiny_gpt2_with_its_lm_head_tied_is_silent(embedding_frozen):
    model = model_of("gpt2")
    if embedding_frozen:
        freeze(model, "transformer.wte")  # the tied lm_head with it
    assert _notes(_train_lm(model).alerts) == []


def test_control_lora_on_a_frozen_encoder_is_silent():
    torch.manual_seed(0)
    model = inject(TinyEncoder(), ["q", "v"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with tw.watch(model, opt, console=False) as monitor:
        for step in range(4):
            tokens, labels = token_batch(step)
            opt.zero_grad()
            logits = model(tokens)
            nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            opt.step()
    assert monitor.alerts == []


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prompt_tuning_raises_no_warning(family):
    peft = pytest.importorskip("peft")
    config = peft.PromptTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4)
    model = peft.get_peft_model(model_of(family), config)
    monitor = _train_lm(model)
    assert [a for a in monitor.alerts if a.severity != "info"] == []
    # GPT-2's lm_head is tied to its embedding: nothing to tell; Llama's is not,
    # and the frozen model's head may be told as a note.
    assert {module for _, _, module in _notes(monitor.alerts)} <= {"base_model.lm_head"}
    if family == "gpt2":
        assert _notes(monitor.alerts) == []


# -- the Hugging Face Trainer ------------------------------------------------------------------
def _trainer_fit(tmp_path, model: nn.Module):
    transformers = pytest.importorskip("transformers")
    from trainwatch.hf import TrainWatchCallback as HFCallback

    watch = HFCallback(console=io.StringIO())
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    transformers.Trainer(
        model=model, args=args, train_dataset=Tokens("bert"), callbacks=[watch]
    ).train()
    return watch


@pytest.mark.slow
def test_a_frozen_classifier_under_the_trainer_is_told_and_a_trained_one_is_not(tmp_path):
    wrong = model_of("bert")
    wrong.classifier.requires_grad_(False)  # meant: wrong.bert.embeddings
    watch = _trainer_fit(tmp_path / "wrong", wrong)
    assert [(a.rule, a.severity, a.step, a.module) for a in watch.alerts] == [
        (RULE, "info", 0, "classifier")
    ]
    assert watch.alerts[0].data["trainable"] == sum(
        p.numel() for p in wrong.parameters() if p.requires_grad
    )

    right = model_of("bert")
    freeze(right, "bert.embeddings")
    assert _trainer_fit(tmp_path / "right", right).alerts == []


@pytest.mark.slow
def test_a_name_pattern_that_also_froze_the_head_under_the_trainer_is_told(tmp_path):
    model = model_of("bert")
    for name, param in model.named_parameters():
        if "layer.1." not in name:  # meant: train the last block and the head
            param.requires_grad_(False)
    watch = _trainer_fit(tmp_path, model)
    assert _notes(watch.alerts) == [("info", 0, "classifier")]


# -- trainwatch run ----------------------------------------------------------------------------
SCRIPT = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
if sys.argv[1] == "frozen":
    for name, param in model.named_parameters():
        if name.startswith(("0.", "4.")):  # meant: the first layer only
            param.requires_grad_(False)
opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
for step in range(5):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


PHASES = """
import sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))


def fit(steps):
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


fit(3)
model[0].requires_grad_(False)
if sys.argv[1] == "frozen":
    model[4].requires_grad_(False)  # meant: the first layer only
fit(3)
"""


def _run(tmp_path, source: str, setup: str) -> list[tuple[str, str, int, str | None]]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    log_dir = tmp_path / "log"
    status = run_script(script, [setup], log_dir=log_dir, fail_on="warning", console=False)
    assert status == 0  # a note does not fail the gate
    lines = [json.loads(line) for line in (log_dir / "alerts.jsonl").read_text().splitlines()]
    return [(a["rule"], a["severity"], a["step"], a["module"]) for a in lines]


@pytest.mark.parametrize("setup", ["frozen", "clean"])
def test_trainwatch_run_tells_a_frozen_head_and_its_gate_lets_the_note_pass(tmp_path, setup):
    found = _run(tmp_path, SCRIPT, setup)
    assert found == ([(RULE, "info", 0, "4")] if setup == "frozen" else [])


@pytest.mark.parametrize("setup", ["frozen", "clean"])
def test_a_head_frozen_for_a_second_phase_is_told_at_the_audit_of_that_phase(tmp_path, setup):
    # The second phase's optimizer holds what trains then; the first one is dropped.
    found = _run(tmp_path, PHASES, setup)
    assert found == ([(RULE, "info", 3, "4")] if setup == "frozen" else [])


# -- Lightning: the head called by training_step itself ----------------------------------------
class _Classifier(pl.LightningModule):
    def __init__(self, frozen_head: bool, through_forward: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.classifier = nn.Linear(32, 3)
        if frozen_head:
            self.classifier.requires_grad_(False)
        self.through_forward = through_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x) if self.through_forward else self.classifier(self.encoder(x))
        return nn.functional.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=gen)
        return DataLoader(TensorDataset(x, torch.randint(0, 3, (64,), generator=gen)), 8)


def _lightning_fit(module: pl.LightningModule) -> TrainWatchCallback:
    callback = TrainWatchCallback(console=False)
    pl.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module)
    return callback


@pytest.mark.slow
@pytest.mark.parametrize("through_forward", [True, False], ids=["forward", "parts"])
def test_lightning_frozen_head_is_told_and_a_trained_one_is_not(through_forward):
    torch.manual_seed(0)
    wrong = _lightning_fit(_Classifier(True, through_forward))
    # (Parts called on their own are followed as passes from the second step; the
    # note is dated at the audit all the same.)
    assert _notes(wrong.alerts) == [("info", 0, "classifier")]
    torch.manual_seed(0)
    assert _lightning_fit(_Classifier(False, through_forward)).alerts == []
