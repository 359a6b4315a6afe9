"""A part of the model frozen whole inside the optimizer is one ``frozen_in_optimizer``
alert, at the module holding it, and its unfreeze one note.

The usual fine-tuning recipe freezes a backbone (``model.bert.requires_grad_(False)``)
and builds the optimizer over ``model.parameters()`` all the same. That used to be
told once per module: 21 warnings for a two-layer BERT, over a hundred for
bert-base, each a line of alerts.jsonl and of TensorBoard, and as many notes when the
backbone was unfrozen. Now the modules frozen together in one optimizer at one step
are one warning at the innermost module holding them all (``bert``, ``backbone``,
``""`` for the whole model), ``data.modules`` listing them; a frozen part that is no
one subtree (frozen embeddings and a frozen classifier, the encoder trained between
them) stays one alert per frozen subtree. A freeze undone for some of a part's
modules only (gradual unfreezing) is a note that takes nothing back: the part's
warning stands for the rest until they train too.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

import trainwatch as tw
from tests.hf_models import batch_for, model_of
from trainwatch.alert import Alert, standing_worst

RULE = "frozen_in_optimizer"


class _Backbone(nn.Module):
    """A small network whose backbone is many modules, frozen as one."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.ReLU()) for _ in range(4)]
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _net_loss(model: nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
    return nn.functional.mse_loss(model(x), x[:, :1])


def _bert_loss(model: nn.Module, step: int) -> torch.Tensor:
    return model(**batch_for("bert", step)).loss


def _train(model, frozen, loss_of, tmp_path, *, only_trainable=False, unfreeze=(), steps=10):
    """Freeze ``frozen`` (modules), build AdamW over every parameter (or the trainable
    ones only, the healthy twin), train; ``unfreeze``: (step, module) pairs."""
    for module in frozen:
        module.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad or not only_trainable]
    opt = torch.optim.AdamW(params, lr=1e-3)
    with tw.watch(model, opt, log_dir=tmp_path, console=io.StringIO()) as monitor:
        for step in range(steps):
            for at, module in unfreeze:
                if at == step:
                    module.requires_grad_(True)
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
    lines = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    return monitor, [a for a in lines if a["rule"] == RULE]


def _told(found):
    return [(a["severity"], a["step"], a["module"], a["data"].get("withdraws")) for a in found]


def _net():
    torch.manual_seed(0)
    return _Backbone()


def _bert():
    return model_of("bert")


@pytest.mark.parametrize(
    ("build", "part", "loss_of", "where", "modules", "params"),
    [
        (_net, "backbone", _net_loss, "backbone", 8, 16),
        (_bert, "bert", _bert_loss, "bert", 21, 39),
    ],
)
def test_a_backbone_frozen_whole_is_one_alert_at_the_backbone(
    tmp_path, build, part, loss_of, where, modules, params
):
    model = build()
    _, found = _train(model, [model.get_submodule(part)], loss_of, tmp_path)
    assert _told(found) == [("warning", 0, where, None)]
    (alert,) = found
    assert len(alert["data"]["modules"]) == modules
    assert all(m.startswith(where + ".") for m in alert["data"]["modules"])
    assert len(alert["data"]["parameters"]) == alert["data"]["frozen"] == params
    assert alert["data"]["trainable"] == 0


@pytest.mark.parametrize(
    ("build", "part", "loss_of"),
    [(_net, "backbone", _net_loss), (_bert, "bert", _bert_loss)],
)
def test_its_unfreeze_is_one_note_at_the_backbone_that_withdraws_it(tmp_path, build, part, loss_of):
    model = build()
    backbone = model.get_submodule(part)
    _, found = _train(model, [backbone], loss_of, tmp_path, unfreeze=[(5, backbone)])
    assert _told(found) == [("warning", 0, part, None), ("info", 5, part, True)]
    warned, undone = found
    assert undone["data"]["modules"] == warned["data"]["modules"]
    assert sorted(undone["data"]["parameters"]) == sorted(warned["data"]["parameters"])


@pytest.mark.parametrize(
    ("build", "part", "loss_of"),
    [(_net, "backbone", _net_loss), (_bert, "bert", _bert_loss)],
)
def test_control_an_optimizer_over_the_trainable_parameters_only_is_silent(
    tmp_path, build, part, loss_of
):
    model = build()
    _, found = _train(model, [model.get_submodule(part)], loss_of, tmp_path, only_trainable=True)
    assert found == []


def test_frozen_parts_apart_stay_apart(tmp_path):
    """Embeddings and classifier frozen, the encoder trained between them: two frozen
    subtrees, two alerts, neither at ``bert`` nor at the root."""
    model = _bert()
    frozen = [model.bert.embeddings, model.classifier]
    _, found = _train(model, frozen, _bert_loss, tmp_path)
    assert _told(found) == [
        ("warning", 0, "bert.embeddings", None),
        ("warning", 0, "classifier", None),
    ]
    embeddings, classifier = found
    assert embeddings["data"]["modules"] == [
        "bert.embeddings.word_embeddings",
        "bert.embeddings.position_embeddings",
        "bert.embeddings.token_type_embeddings",
        "bert.embeddings.LayerNorm",
    ]
    assert "modules" not in classifier["data"]  # one layer: told as before


def test_layers_frozen_apart_in_one_optimizer_trained_by_another_stay_apart(tmp_path):
    """The layer between two frozen ones trains in a second optimizer: no frozen
    subtree holds both, so each is told on its own."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    model[0].requires_grad_(False)
    model[4].requires_grad_(False)
    frozen_opt = torch.optim.SGD([*model[0].parameters(), *model[4].parameters()], lr=0.01)
    opt = torch.optim.SGD(model[2].parameters(), lr=0.01)
    with tw.watch(model, [frozen_opt, opt], console=io.StringIO()) as monitor:
        for _ in range(6):
            x = torch.randn(16, 8)
            frozen_opt.zero_grad()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x[:, :1]).backward()
            frozen_opt.step()
            opt.step()
    assert [(a.module, a.step) for a in monitor.alerts if a.rule == RULE] == [("0", 0), ("4", 0)]


def test_a_model_frozen_whole_is_told_at_the_root(tmp_path):
    """An input optimised through a frozen network, the optimizer built over the
    network's parameters too: one alert for the whole model (``""``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model.requires_grad_(False)
    x = torch.randn(4, 8, requires_grad=True)
    opt = torch.optim.Adam([x, *model.parameters()], lr=0.1)
    with tw.watch(model, opt, console=io.StringIO()) as monitor:
        for _ in range(5):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == RULE]
    assert (alert.module, alert.data["modules"]) == ("", ["0", "2"])


def test_a_gradual_unfreeze_withdraws_the_warning_once_all_of_it_trains(tmp_path):
    """Top layers first (ULMFiT's gradual unfreezing): each stage is a note at the
    layers unfrozen that takes nothing back; the last one withdraws the warning."""

    def gradually(last: int | None, log_dir):
        model = _net()
        blocks = model.backbone
        stages = [(3, blocks[3]), (5, blocks[2]), (7, blocks[1])]
        if last is not None:
            stages.append((last, blocks[0]))
        return _train(model, [blocks], _net_loss, log_dir, unfreeze=stages)[1]

    partly = gradually(None, tmp_path / "partly")
    assert _told(partly) == [
        ("warning", 0, "backbone", None),
        ("info", 3, "backbone.3", False),
        ("info", 5, "backbone.2", False),
        ("info", 7, "backbone.1", False),
    ]
    assert partly[-1]["data"]["still_frozen"] == ["backbone.0.0", "backbone.0.1"]
    assert _standing(partly) == "warning"  # backbone.0 is frozen still

    wholly = gradually(8, tmp_path / "wholly")
    assert _told(wholly)[-1] == ("info", 8, "backbone", True)
    assert _standing(wholly) == "info"


def _standing(found) -> str | None:
    return standing_worst(
        (Alert(a["rule"], a["severity"], a["step"], a["module"], "", "", a["data"]), a["step"])
        for a in found
    )


def test_under_the_hf_trainer_with_the_users_own_optimizer(tmp_path):
    """The sweep's case: the Trainer handed an AdamW over every parameter, the encoder
    frozen for the first steps and unfrozen by a callback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tests.hf_models import Tokens
    from trainwatch.hf import TrainWatchCallback

    model = _bert()
    model.bert.requires_grad_(False)

    class Unfreeze(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3:
                model.bert.requires_grad_(True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    watch = TrainWatchCallback(log_dir=tmp_path / "tw", console=io.StringIO())
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens("bert"),
        callbacks=[watch, Unfreeze()],
        optimizers=(opt, None),
    )
    trainer.train()
    lines = (tmp_path / "tw" / "alerts.jsonl").read_text().splitlines()
    found = [a for a in map(json.loads, lines) if a["rule"] == RULE]
    assert _told(found) == [("warning", 0, "bert", None), ("info", 3, "bert", True)]
