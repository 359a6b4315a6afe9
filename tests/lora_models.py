"""Hand-made LoRA, as people write it without PEFT: two layouts, tiny random models.

``inject`` follows PEFT's ``target_modules``: every module whose name ends with
a target is wrapped (``base_layer`` frozen, ``lora_A.default``/``lora_B.default``
trained). ``LoraLinear`` is loralib's layout: the frozen weight in the module
itself, ``lora_A``/``lora_B`` as bare parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class PeftStyleLora(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        nn.init.zeros_(self.lora_B["default"].weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scaling * self.lora_B["default"](self.lora_A["default"](x))


class LoraLinear(nn.Linear):
    """loralib's ``lora.Linear``: frozen ``weight``; ``lora_A (r, in)``, ``lora_B (out, r)``."""

    def __init__(self, inputs: int, outputs: int, rank: int = 4) -> None:
        super().__init__(inputs, outputs)
        self.lora_A = nn.Parameter(torch.randn(rank, inputs) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(outputs, rank))
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.lora_A.T @ self.lora_B.T


def inject(model: nn.Module, targets: list[str], rank: int = 4) -> nn.Module:
    """``get_peft_model``: freeze everything, wrap the targets, enable input grads."""
    for param in model.parameters():
        param.requires_grad_(False)
    chosen = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(name.split(".")[-1] == t for t in targets)
    ]
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, PeftStyleLora(getattr(parent, child), rank))
    first = next(m for m in model.modules() if isinstance(m, nn.Embedding | nn.Conv2d))
    # transformers' enable_input_require_grads(), which PEFT calls for
    # gradient checkpointing: the frozen first layer's output carries grad.
    first.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    return model


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scores = self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5
        return self.o(scores.softmax(-1) @ self.v(h))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = Attention(dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h + self.attn(h))
        return h + self.down(torch.relu(self.up(h)))


class TinyEncoder(nn.Module):
    """Token classifier; ``pooler`` makes a sentence embedding the loss never uses."""

    def __init__(self, vocab: int = 50, dim: int = 16, blocks: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, classes)
        self.sentence: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        self.sentence = torch.tanh(self.pooler(h.mean(1)))  # kept for retrieval, not trained on
        return self.classifier(h)


def token_batch(step: int, batch: int = 8, length: int = 6, vocab: int = 50):
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    return tokens, tokens % 3


class TinyCNN(nn.Module):
    """Image classifier with an auxiliary head whose logits are only logged."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, classes)
        self.aux_head = nn.Linear(16, classes)
        self.aux_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.conv2(h)).mean((2, 3))
        self.aux_logits = self.aux_head(h)  # logged only
        return self.head(torch.relu(self.fc(h)))


def image_batch(step: int, batch: int = 8, classes: int = 4):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(
        0, classes, (batch,), generator=gen
    )
