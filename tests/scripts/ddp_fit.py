"""A real two-process DDP fit on CPU (gloo), run by tests/test_ddp.py.

Lightning's DDP launcher re-runs this very command for rank 1, so it is a
script rather than a test. Rank 1 forgets zero_grad (manual optimisation);
each rank writes what its callback reported to ``OUT/rank<r>.json``.
``ddp_fit.py OUT halt``: with ``halt_on: [accumulated_gradient]``, and each
rank writes the halt it raised (if any) and the batches it ran too.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from tests.lightning_models import ManualNet
from trainwatch.errors import TrainingHealthError
from trainwatch.lightning import TrainWatchCallback


class SeenAfterBatch(Callback):
    """Which ranks' alerts the trainwatch callback holds after each batch."""

    def __init__(self, watch: TrainWatchCallback) -> None:
        self.watch = watch
        self.seen: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
        self.seen.append(sorted({a.data["rank"] for a in self.watch.alerts}))


def main(out: Path, halt: bool = False) -> None:
    overrides = {"halt_on": ["accumulated_gradient"]} if halt else {}
    watch = TrainWatchCallback(distributed={"gather_every": 2}, **overrides)
    spy = SeenAfterBatch(watch)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=8 if halt else 4,
        logger=TensorBoardLogger(str(out), name="ddp"),
        callbacks=[watch, spy],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    raised = None
    started = time.monotonic()
    try:
        trainer.fit(ManualNet(forget_zero_grad_on_rank=1))
    except TrainingHealthError as exc:
        raised = exc.alert.to_dict()
    result = {
        "raised": raised,
        "batches": len(spy.seen),
        "seconds": time.monotonic() - started,
        "rank": trainer.global_rank,
        "alerts": [a.to_dict() for a in watch.alerts],
        "seen_after_batch": spy.seen,
        "steps": watch.monitor.step_count if watch.monitor else None,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), halt=sys.argv[2:] == ["halt"])
