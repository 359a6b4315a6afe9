"""A model fine-tuned through adapters, its optimizer built over ``model.parameters()``,
is one ``frozen_in_optimizer`` note, at the root.

LoRA written by hand wraps each attention and MLP ``nn.Linear`` in a module holding
the frozen base layer beside a trainable low-rank pair (``lora_B`` zero at first), and
``torch.optim.AdamW(model.parameters())`` is the common way to build its optimizer:
the frozen base gets no gradient and AdamW skips it. That used to be told as one
warning per frozen base layer (35 for a four-block model), since trainable adapters
inside every block leave the frozen parts apart. Now frozen parts apart, three or
more, are one alert at the module holding them all, ``data.parts`` naming them with
numbered blocks folded (``blocks.*.q.base (x4)``). Where the trainable parameters are
adapters (small trainable additions inside the frozen blocks, beside a base many times
their size) it is an ``info`` note (``data.kind: adapters``, ``data.adapted``): a base
frozen on purpose, which no forgotten unfreeze looks like, and the hint says an
optimizer over the trainable parameters spares it the frozen base. Other freezes
throughout the model (BatchNorm frozen in every block of a fine-tune) and a prompt
tuned beside a frozen model stay a warning, one; a layer frozen by mistake in a
trained model is told alone at that layer, as before; an unfreeze withdraws the note.
"""

from __future__ import annotations

import io
import json
import math
import textwrap

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import trainwatch as tw
from tests.lightning_models import quiet_trainer
from trainwatch.lightning import TrainWatchCallback
from trainwatch.runner import EXIT_ALERTS, run_script

RULE = "frozen_in_optimizer"
WRAPPED = ("q", "k", "v", "o", "fc1", "fc2")
VOCAB, WIDTH = 50, 32


class LoRALinear(nn.Module):
    """A frozen base layer and a trainable low-rank pair, B zero at first."""

    def __init__(self, base: nn.Linear, rank: int = 4, pair_as_layers: bool = False) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.pair_as_layers = pair_as_layers
        if pair_as_layers:  # PEFT's layout: the halves as layers of their own
            self.lora_A = nn.Linear(base.in_features, rank, bias=False)
            self.lora_B = nn.Linear(rank, base.out_features, bias=False)
            nn.init.zeros_(self.lora_B.weight)
        else:
            scale = 1 / math.sqrt(base.in_features)
            self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) * scale)
            self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pair_as_layers:
            return self.base(x) + 2.0 * self.lora_B(self.lora_A(x))
        return self.base(x) + 2.0 * (x @ self.lora_A.T @ self.lora_B.T)


class LoRALibLinear(nn.Linear):
    """loralib's layout: the frozen weight and the pair on one layer."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__(base.in_features, base.out_features)
        self.load_state_dict(base.state_dict())
        self.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, self.in_features) / 8)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 2.0 * (x @ self.lora_A.T @ self.lora_B.T)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        x = x + self.o(F.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))[:, -tokens.shape[1] :]


def lora_model(layout: str = "wrapper") -> TinyLM:
    """Every attention and MLP layer adapted, everything else frozen."""
    torch.manual_seed(0)
    model = TinyLM().requires_grad_(False)
    for block in model.blocks:
        for name in WRAPPED:
            base = getattr(block, name)
            if layout == "loralib":
                setattr(block, name, LoRALibLinear(base))
            else:
                setattr(block, name, LoRALinear(base, pair_as_layers=layout == "layers"))
    return model


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(step))
    return x, torch.roll(x, -1, 1)


def _lm_loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = tokens(step)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _watched(model, params, tmp_path, *, steps=12, unfreeze_at=None, loss=_lm_loss):
    opt = torch.optim.AdamW(params, lr=1e-3)
    with tw.watch(model, opt, log_dir=tmp_path, console=io.StringIO()):
        for step in range(steps):
            if step == unfreeze_at:
                model.requires_grad_(True)
            opt.zero_grad()
            loss(model, step).backward()
            opt.step()
    return _found(tmp_path)


def _found(log_dir) -> list[dict]:
    lines = (log_dir / "alerts.jsonl").read_text().splitlines()
    return [a for a in map(json.loads, lines) if a["rule"] == RULE]


def _told(found):
    return [(a["severity"], a["step"], a["module"], a["data"].get("kind")) for a in found]


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# -- LoRA written by hand ---------------------------------------------------------------


def test_hand_written_lora_is_one_note_at_the_root(tmp_path):
    model = lora_model()
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("info", 0, "", "adapters")]
    (alert,) = found
    data = alert["data"]
    assert data["parts"] == [
        "emb",
        "blocks.*.ln1 (x4)",
        "blocks.*.ln2 (x4)",
        *[f"blocks.*.{name}.base (x4)" for name in WRAPPED],
        "ln_f",
        "head",
    ]
    assert data["adapted"] == [f"blocks.*.{name} (x4)" for name in WRAPPED]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert sorted(data["parameters"]) == sorted(frozen)
    assert len(data["modules"]) == 35
    assert "adapters" in alert["message"]
    assert "p.requires_grad" in alert["hint"]
    assert "weight decay" in alert["hint"]


def test_control_hand_written_lora_with_the_trainable_parameters_only_is_silent(tmp_path):
    model = lora_model()
    assert _watched(model, _trainable(model), tmp_path) == []


def test_adapter_halves_as_layers_of_their_own_are_one_note_too(tmp_path):
    model = lora_model("layers")
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("info", 0, "", "adapters")]
    assert found[0]["data"]["adapted"] == [f"blocks.*.{name} (x4)" for name in WRAPPED]


def test_loralib_layout_the_pair_on_the_frozen_layer_itself_is_one_note(tmp_path):
    model = lora_model("loralib")
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("info", 0, "", "adapters")]
    assert "blocks.*.q (x4)" in found[0]["data"]["parts"]


def test_the_base_unfrozen_later_withdraws_the_note(tmp_path):
    model = lora_model()
    found = _watched(model, model.parameters(), tmp_path, unfreeze_at=5)
    assert _told(found) == [("info", 0, "", "adapters"), ("info", 5, "", "unfrozen")]
    assert found[1]["data"]["withdraws"] is True


LORA_SCRIPT = """
import torch

from tests.test_adapters_beside_a_frozen_base_one_note import _trainable, _lm_loss, lora_model

model = lora_model()
params = model.parameters() if TRAINABLE_ONLY == "no" else _trainable(model)
optimizer = torch.optim.AdamW(params, lr=1e-3)
for step in range(30):
    optimizer.zero_grad()
    _lm_loss(model, step).backward()
    optimizer.step()
"""


def _run(tmp_path, trainable_only: str) -> tuple[int, list[dict]]:
    script = tmp_path / "lora.py"
    script.write_text(textwrap.dedent(LORA_SCRIPT).replace("TRAINABLE_ONLY", repr(trainable_only)))
    code = run_script(script, [], log_dir=tmp_path / "log", fail_on="warning", console=False)
    return code, _found(tmp_path / "log")


def test_under_trainwatch_run_hand_written_lora_is_one_note_the_gate_passes(tmp_path):
    code, found = _run(tmp_path, "no")
    assert _told(found) == [("info", 0, "", "adapters")]
    assert code == 0


def test_control_under_trainwatch_run_the_trainable_only_optimizer_is_silent(tmp_path):
    code, found = _run(tmp_path, "yes")
    assert found == []
    assert code == 0


class LoRAModule(pl.LightningModule):
    """A LoRA fine-tune in Lightning, AdamW over ``self.parameters()`` (or the trainable)."""

    def __init__(self, trainable_only: bool) -> None:
        super().__init__()
        self.trainable_only = trainable_only
        self.model = lora_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        params = _trainable(self) if self.trainable_only else self.parameters()
        return torch.optim.AdamW(params, lr=1e-3)


def _fit(tmp_path, trainable_only: bool) -> list:
    x = torch.randint(0, VOCAB, (32, 12), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=8)
    callback = TrainWatchCallback(console=False, log_dir=tmp_path / "log")
    trainer = quiet_trainer(tmp_path, [callback], max_epochs=2, limit_val_batches=0)
    trainer.fit(LoRAModule(trainable_only), data)
    return [a for a in callback.alerts if a.rule == RULE]


def test_a_lightning_lora_fine_tune_is_one_note(tmp_path):
    found = _fit(tmp_path, trainable_only=False)
    assert [(a.severity, a.step, a.module, a.data["kind"]) for a in found] == [
        ("info", 0, "model", "adapters")
    ]


def test_control_a_lightning_lora_optimizer_over_the_trainable_parameters_is_silent(tmp_path):
    assert _fit(tmp_path, trainable_only=True) == []


# -- a prompt tuned beside a frozen model -----------------------------------------------


class PromptOnTheRoot(TinyLM):
    """Prompt tuning: the model frozen, a learned prompt its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)
        self.prompt = nn.Parameter(torch.randn(5, WIDTH) * 0.02)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        prompt = self.prompt.expand(tokens.shape[0], -1, -1)
        return torch.cat([prompt, self.emb(tokens)], 1)


class PromptModuleBetween(TinyLM):
    """The prompt a table of its own, registered between the embedding and the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.requires_grad_(False)
        blocks, ln_f, head = self.blocks, self.ln_f, self.head
        del self.blocks, self.ln_f, self.head
        self.prompt = nn.Embedding(5, WIDTH)
        self.blocks, self.ln_f, self.head = blocks, ln_f, head

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        prompt = self.prompt.weight.expand(tokens.shape[0], -1, -1)
        return torch.cat([prompt, self.emb(tokens)], 1)


def test_a_prompt_on_the_root_of_a_frozen_model_is_one_warning(tmp_path):
    torch.manual_seed(0)
    model = PromptOnTheRoot()
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("warning", 0, "", None)]
    assert found[0]["data"]["parts"] == ["emb", "blocks", "ln_f", "head"]
    assert "all of the model but its own parameters" in found[0]["message"]


def test_a_prompt_table_between_the_frozen_parts_is_one_warning(tmp_path):
    torch.manual_seed(0)
    model = PromptModuleBetween()
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("warning", 0, "", None)]
    assert found[0]["data"]["parts"] == ["emb", "blocks", "ln_f", "head"]
    assert found[0]["data"]["rest"] == ["prompt"]


def test_a_prompt_outside_the_model_is_one_warning_for_the_frozen_model(tmp_path):
    torch.manual_seed(0)
    model = TinyLM().requires_grad_(False)
    prompt = nn.Parameter(torch.randn(5, WIDTH) * 0.02)
    model.embed = lambda x: torch.cat([prompt.expand(x.shape[0], -1, -1), model.emb(x)], 1)
    found = _watched(model, [prompt, *model.parameters()], tmp_path)
    assert _told(found) == [("warning", 0, "", None)]


def test_control_the_prompt_alone_in_the_optimizer_is_silent(tmp_path):
    torch.manual_seed(0)
    model = PromptModuleBetween()
    assert _watched(model, model.prompt.parameters(), tmp_path) == []


# -- BatchNorm frozen for a fine-tune ---------------------------------------------------


class Basic(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.layer1 = nn.Sequential(Basic(8), Basic(8))
        self.layer2 = nn.Sequential(Basic(8), Basic(8))
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean((2, 3)))


def _images(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(8, 3, 8, 8, generator=generator)
    return F.cross_entropy(model(x), torch.randint(0, 10, (8,), generator=generator))


def _frozen_batch_norm() -> SmallResNet:
    torch.manual_seed(0)
    model = SmallResNet()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.requires_grad_(False)
    return model


def test_batch_norm_frozen_in_every_block_is_one_warning(tmp_path):
    model = _frozen_batch_norm()
    found = _watched(model, model.parameters(), tmp_path, loss=_images)
    assert _told(found) == [("warning", 0, "", None)]
    assert found[0]["data"]["parts"] == [
        "bn1",
        "layer1.*.bn1 (x2)",
        "layer1.*.bn2 (x2)",
        "layer2.*.bn1 (x2)",
        "layer2.*.bn2 (x2)",
    ]
    assert "BatchNorm" in found[0]["hint"]


def test_control_frozen_batch_norm_left_out_of_the_optimizer_is_silent(tmp_path):
    model = _frozen_batch_norm()
    assert _watched(model, _trainable(model), tmp_path, loss=_images) == []


# -- a layer frozen by mistake ----------------------------------------------------------


def test_a_layer_frozen_by_mistake_is_still_told_alone(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    model.blocks[1].fc1.requires_grad_(False)
    found = _watched(model, model.parameters(), tmp_path)
    assert _told(found) == [("warning", 0, "blocks.1.fc1", None)]


def test_two_layers_frozen_by_mistake_are_two_warnings(tmp_path):
    torch.manual_seed(0)
    model = SmallResNet()
    model.layer1[0].conv2.requires_grad_(False)
    model.fc.requires_grad_(False)
    found = _watched(model, model.parameters(), tmp_path, loss=_images)
    assert _told(found) == [
        ("warning", 0, "layer1.0.conv2", None),
        ("warning", 0, "fc", None),
    ]


def test_control_the_model_trained_whole_is_silent(tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    assert _watched(model, model.parameters(), tmp_path) == []


def test_under_trainwatch_run_a_layer_frozen_by_mistake_still_fails_the_gate(tmp_path):
    script = tmp_path / "mistake.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch

            from tests.test_adapters_beside_a_frozen_base_one_note import TinyLM, _lm_loss

            torch.manual_seed(0)
            model = TinyLM()
            model.blocks[2].q.requires_grad_(False)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for step in range(6):
                optimizer.zero_grad()
                _lm_loss(model, step).backward()
                optimizer.step()
            """
        )
    )
    code = run_script(script, [], log_dir=tmp_path / "log", fail_on="warning", console=False)
    assert _told(_found(tmp_path / "log")) == [("warning", 0, "blocks.2.q", None)]
    assert code == EXIT_ALERTS
