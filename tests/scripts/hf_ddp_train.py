"""A ``transformers.Trainer`` on two gloo CPU ranks with trainwatch's callback: run by
tests/test_hf_trainer_ddp.py under ``torchrun --nproc_per_node 2``.

``python hf_ddp_train.py OUT MODE``: MODE ``clean``, ``nan`` (rank 1's
GPT-2 attention makes a NaN from its third step on) or ``nan+halt`` (the same
with ``halt_on: [nonfinite_forward]``). Each rank writes ``OUT/rank<r>.json``:
its callback's alerts and console, and the halt it raised (its alert's rule and
rank, and the step the Trainer reached).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from rank_exit import leave
from transformers import Trainer, TrainerCallback, TrainingArguments

from tests.hf_models import ATTENTION, Tokens, model_of, plant_nan
from trainwatch.errors import TrainingHealthError
from trainwatch.hf import TrainWatchCallback

NAN_FROM = 2


class _PlantOnRankOne(TrainerCallback):
    def __init__(self, model) -> None:
        self.model = model

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == NAN_FROM and dist.get_rank() == 1:
            plant_nan(self.model, ATTENTION["gpt2"])


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=str(out / "out"),
        max_steps=5,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        logging_steps=100,
        dataloader_num_workers=0,
    )
    model = model_of("gpt2")
    console = io.StringIO()
    halt_on = ["nonfinite_forward"] if mode.endswith("+halt") else []
    watch = TrainWatchCallback(console=console, log_dir=out / "tw", halt_on=halt_on)
    extra = [_PlantOnRankOne(model)] if mode.startswith("nan") else []
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens("gpt2"), callbacks=[watch, *extra]
    )
    halted = None
    try:
        trainer.train()
    except TrainingHealthError as halt:
        halted = {
            "rule": halt.alert.rule,
            "rank": halt.alert.data.get("rank"),
            "global_step": trainer.state.global_step,
        }
    rank = dist.get_rank()
    record = {
        "alerts": [a.to_dict() for a in watch.alerts],
        "console": console.getvalue(),
        "halted": halted,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
    leave()  # the callback closed at the end of train(): see rank_exit.py
