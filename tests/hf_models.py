"""Tiny random-initialised Hugging Face models built from configs (never downloaded),
synthetic token data and the planted bugs the Hugging Face tests share."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

transformers.logging.set_verbosity_error()

VOCAB = 128
SEQ = 16


def gpt2() -> GPT2LMHeadModel:
    """Tied input and output embeddings, a dozen Dropouts, Conv1D layers."""
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64)
    config.bos_token_id = config.eos_token_id = 0
    return GPT2LMHeadModel(config)


def llama() -> LlamaForCausalLM:
    """Rotary positions, RMSNorm, no dropout, a dtype-minimum causal mask."""
    return LlamaForCausalLM(
        LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def bert(num_labels: int = 3) -> BertForSequenceClassification:
    """Sequence classification (``num_labels=1``: a regression head, logits ``(N, 1)``)."""
    return BertForSequenceClassification(
        BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            num_labels=num_labels,
        )
    )


def t5() -> T5ForConditionalGeneration:
    """An encoder-decoder: two stacks, relative positions, a shared embedding."""
    return T5ForConditionalGeneration(
        T5Config(
            num_layers=2,
            num_decoder_layers=2,
            d_model=64,
            d_ff=128,
            d_kv=32,
            num_heads=2,
            vocab_size=VOCAB,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
    )


FAMILIES = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5}


def model_of(family: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family]()


def batch_for(family: str, step: int, batch: int = 8) -> dict[str, torch.Tensor]:
    """Synthetic tokens with padding masked out; labels make the model compute its loss."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(2, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[: batch // 2, -4:] = 0  # a padded half: masks filled with the dtype's minimum
    if family == "bert":
        labels = torch.randint(0, 3, (batch,), generator=gen)
    elif family == "t5":
        labels = torch.randint(2, VOCAB, (batch, SEQ // 2), generator=gen)
    else:
        labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def eval_batch_for(family: str, step: int) -> dict[str, torch.Tensor]:
    """An evaluation batch: no labels (T5 gets decoder ids instead)."""
    inputs = batch_for(family, step)
    labels = inputs.pop("labels")
    if family == "t5":
        inputs["decoder_input_ids"] = labels
    return inputs


class Tokens(Dataset):
    """A fixed synthetic dataset of one model family's batches, row by row."""

    def __init__(self, family: str, n: int = 64, seed: int = 0) -> None:
        self.rows = []
        for step in range(n // 8):
            inputs = batch_for(family, step + seed * 100)
            for i in range(8):
                self.rows.append({k: v[i] for k, v in inputs.items()})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


# -- planted bugs ----------------------------------------------------------------
ATTENTION = {
    "gpt2": "transformer.h.1.attn.c_attn",
    "llama": "model.layers.1.self_attn.q_proj",
    "bert": "bert.encoder.layer.1.attention.self.query",
    "t5": "decoder.block.1.layer.0.SelfAttention.q",
}


def plant_nan(model: nn.Module, name: str) -> None:
    """The module's own arithmetic makes a NaN: the log of values that go negative."""
    module = model.get_submodule(name)
    original = module.forward

    def forward(*args, **kwargs):
        return torch.log(original(*args, **kwargs) - 100.0)

    module.forward = forward


def unplant(model: nn.Module, name: str) -> None:
    module = model.get_submodule(name)
    if "forward" in module.__dict__:
        del module.forward


def freeze(model: nn.Module, name: str) -> None:
    for param in model.get_submodule(name).parameters():
        param.requires_grad_(False)
