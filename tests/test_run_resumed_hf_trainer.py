"""``trainwatch run`` on a Hugging Face Trainer resumed from a checkpoint: steps go on from it.

The Trainer's callback dates alerts by ``state.global_step``, which a resumed
run takes from its checkpoint; under ``trainwatch run`` the model's monitor,
new in the second process, counted from 0, so a NaN loss planted at global
step 40 was told at step 10.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.resumed_runs import warnings_of_both_runs
from trainwatch.runner import run_script

SCRIPT = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

phase, bug, folder = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
config = GPT2Config(
    vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class NanFromForty(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss = super().compute_loss(model, inputs, return_outputs, **kwargs)
        if bug == "nan_loss" and self.state.global_step >= 40:
            loss = loss * float("nan")
        return loss


args = TrainingArguments(
    output_dir=folder, max_steps=30 if phase == "first" else 60, save_steps=30,
    per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=1000, report_to=[],
    use_cpu=True, disable_tqdm=True,
)
trainer = NanFromForty(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
trainer.train(resume_from_checkpoint=phase == "resumed" or None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("bug", ["nan_loss", "healthy"])
def test_a_resumed_trainer_dates_its_alerts_by_the_checkpoints_global_step(tmp_path, bug):
    first, resumed = warnings_of_both_runs(tmp_path, SCRIPT, bug)
    assert first == []
    assert resumed == ([("nonfinite_loss", 40)] if bug == "nan_loss" else [])


PLAIN_LOOP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(5):
    x = torch.randn(32, 8)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), x[:, :1]).backward()
    opt.step()
"""


class _Gone:
    pass


def test_the_trainer_search_passes_over_dead_weak_proxies(tmp_path):
    """The search for a Trainer among live objects meets whatever the process holds:
    a weak proxy whose object is gone raises on any question but its type."""
    import weakref

    import transformers.trainer  # noqa: F401  (the search runs while it is imported)

    target = _Gone()
    dead = [weakref.proxy(target)]
    del target
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_LOOP)
    run_script(script, [], log_dir=tmp_path / "log", console=False)
    assert dead and (tmp_path / "log" / "alerts.jsonl").read_text() == ""
