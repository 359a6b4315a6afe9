"""eval_in_train_mode / train_in_eval_mode: dropout and batch norm in the wrong mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import TinyNet, batches, rules_of


class DropNet(nn.Module):
    def __init__(self, dropout: bool = True, norm: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.drop = nn.Dropout(0.2) if dropout else nn.Identity()
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _train(model, opt, steps: int, seed: int = 0) -> None:
    for x, y in batches(steps, seed=seed):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _evaluate(model, passes: int = 3) -> None:
    with torch.no_grad():
        for x, _ in batches(passes, seed=9):
            model(x)


def _setup(quiet_watch, **config):
    torch.manual_seed(0)
    model = DropNet(**{k: config.pop(k) for k in ("dropout", "norm") if k in config})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, quiet_watch(model, opt, **config)


def test_evaluation_in_training_mode_fires_at_the_pass_without_a_later_step(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 3)
    _evaluate(model)  # forgot model.eval(); no optimizer step follows
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (3, "bn")  # the first mode-dependent module
    assert alert.data["modules"] == ["bn", "drop"]
    assert "model.eval()" in alert.hint
    assert monitor.alert_counts[("eval_in_train_mode", "bn")] == 3  # each pass counted


def test_evaluation_after_model_eval_is_silent(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 3)
    model.eval()
    _evaluate(model)
    model.train()
    _train(model, opt, 2)
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_model_without_dropout_or_norm_evaluated_without_eval_is_silent(model, quiet_watch):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 3)
    _evaluate(model)  # TinyNet: no mode-dependent module, so the mode does not matter
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_monte_carlo_dropout_with_the_opt_out_is_silent_but_batch_norm_is_not(quiet_watch):
    model, opt, monitor = _setup(quiet_watch, norm=False, eval_in_train_mode={"mc_dropout": True})
    _train(model, opt, 2)
    model.eval()
    model.drop.train()  # deliberate: sample predictions with dropout on
    _evaluate(model, 5)
    assert rules_of(monitor) == []

    model, opt, monitor = _setup(quiet_watch, eval_in_train_mode={"mc_dropout": True})
    _train(model, opt, 2)
    _evaluate(model)  # batch norm in training mode would overwrite its running stats
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.module == "bn" and alert.data["modules"] == ["bn"]


def _dropouts_on(model: nn.Module) -> None:
    """Monte-Carlo dropout's usual recipe: the model in eval, its dropouts back on."""
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.train()


def test_monte_carlo_dropout_switched_on_alone_after_model_eval_is_silent(quiet_watch):
    """Batch norm stays in eval; only the dropout modules were put back in training."""
    model, opt, monitor = _setup(quiet_watch)
    for _ in range(3):
        _train(model, opt, 4)
        _dropouts_on(model)
        _evaluate(model, 8)  # predictions sampled with dropout on
        model.train()
    monitor.close()
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_monte_carlo_dropout_by_model_train_without_the_opt_out_is_reported(quiet_watch):
    """The whole model left in train() for the sampled passes: dropout on, and so would
    be anything else mode-dependent; the opt-out says it is meant."""
    model, opt, monitor = _setup(quiet_watch, norm=False)
    _train(model, opt, 2)
    _evaluate(model)  # model.train() still on
    assert [(a.rule, a.module) for a in monitor.alerts] == [("eval_in_train_mode", "drop")]


def test_batch_norm_left_in_training_beside_monte_carlo_dropout_is_reported(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 2)
    _dropouts_on(model)
    model.bn.train()  # by mistake: it overwrites its running statistics
    _evaluate(model)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.module == "bn" and alert.data["modules"] == ["bn"]


class _Encoder(nn.Module):
    """Dropout inside blocks, as a transformer encoder's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.2)) for _ in range(3))
        )
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _encoder(quiet_watch):
    torch.manual_seed(0)
    model = _Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, quiet_watch(model, opt)


def test_monte_carlo_dropout_deep_in_blocks_is_silent(quiet_watch):
    model, opt, monitor = _encoder(quiet_watch)
    _train(model, opt, 3)
    _dropouts_on(model)
    _evaluate(model, 8)
    model.train()
    _train(model, opt, 2)
    monitor.close()
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_a_block_put_back_in_training_after_model_eval_is_reported(quiet_watch):
    """``model.blocks.train()`` switches whole blocks, not the dropouts alone."""
    model, opt, monitor = _encoder(quiet_watch)
    _train(model, opt, 3)
    model.eval()
    model.blocks.train()
    _evaluate(model)
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert alert.module == "blocks.0.2"
    assert alert.data["modules"] == ["blocks.0.2", "blocks.1.2", "blocks.2.2"]


class _Holder(nn.Module):
    """A model whose part is called on its own (``self.net(x)`` in a LightningModule)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1)
        )


@pytest.mark.parametrize("mc_recipe", [True, False], ids=["mc_dropout", "forgot_eval"])
def test_monte_carlo_dropout_through_a_part_called_on_its_own(quiet_watch, mc_recipe):
    torch.manual_seed(0)
    holder = _Holder()
    opt = torch.optim.SGD(holder.parameters(), lr=0.01)
    monitor = quiet_watch(holder, opt)
    for x, y in batches(4):
        opt.zero_grad()
        nn.functional.mse_loss(holder.net(x), y).backward()
        opt.step()
    if mc_recipe:
        _dropouts_on(holder)
    with torch.no_grad():
        for x, _ in batches(5, seed=9):
            holder.net(x)
    monitor.close()
    told = [(a.rule, a.module) for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert told == ([] if mc_recipe else [("eval_in_train_mode", "net.1")])


def test_training_after_eval_without_train_fires_at_that_step(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 3)
    model.eval()
    _evaluate(model)
    _train(model, opt, 3, seed=1)  # forgot model.train()
    (alert,) = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert (alert.step, alert.module, alert.severity) == (3, "bn", "warning")
    assert alert.data["whole_model"] is True
    assert "model.train()" in alert.hint


def test_frozen_batch_norm_for_fine_tuning_is_one_info_line(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    model.train()
    model.bn.eval()  # the usual idiom: keep the pretrained statistics
    _train(model, opt, 6)
    alerts = [a for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert [(a.severity, a.module, a.step) for a in alerts] == [("info", "bn", 0)]
    assert rules_of(monitor) == []


def _fine_tune_with_validation(quiet_watch, train_again: bool):
    """Batch norm kept in eval on purpose; a validation every 3 steps, after which
    training resumes with ``model.train()`` and the norm put back in eval, or not."""
    model, opt, monitor = _setup(quiet_watch)
    model.bn.eval()
    for step in range(9):
        _train(model, opt, 1, seed=step)
        if step % 3 == 2:
            model.eval()
            _evaluate(model, 1)
            if train_again:
                model.train()
                model.bn.eval()
    return monitor


def test_fine_tuning_that_forgets_model_train_after_validation_warns_past_its_frozen_norm(
    quiet_watch,
):
    """The frozen norm's info line does not stand for the later warning on the same layer."""
    monitor = _fine_tune_with_validation(quiet_watch, train_again=False)
    alerts = [(a.severity, a.step) for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert alerts == [("info", 0), ("warning", 3)]
    (warning,) = [a for a in monitor.alerts if a.severity == "warning"]
    assert warning.data["modules"] == ["bn", "drop"] and "model.train()" in warning.hint


def test_fine_tuning_that_trains_again_after_validation_keeps_its_one_info_line(quiet_watch):
    monitor = _fine_tune_with_validation(quiet_watch, train_again=True)
    alerts = [(a.severity, a.step) for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert alerts == [("info", 0)]
    assert rules_of(monitor) == []


class Probe(nn.Module):
    """A frozen feature extractor with batch norm and dropout, and a trained head."""

    def __init__(self, head_dropout: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2)
        )
        self.drop = nn.Dropout(0.1) if head_dropout else nn.Identity()
        self.head = nn.Linear(16, 1)
        self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.backbone(x)))


def _linear_probe(quiet_watch, model: nn.Module, forget_train: bool):
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    model.backbone.eval()
    for step in range(6):
        _train(model, opt, 1, seed=step)
        if step == 2:
            model.eval()
            _evaluate(model, 1)
            model.train()
            if not forget_train:
                model.backbone.eval()
            else:
                model.drop.eval()  # a hand-written "train()" that missed the head
    return monitor


def test_a_frozen_backbone_kept_in_eval_with_its_dropout_is_one_info_line(quiet_watch):
    torch.manual_seed(0)
    monitor = _linear_probe(quiet_watch, Probe(), forget_train=False)
    alerts = [(a.severity, a.step) for a in monitor.alerts if a.rule == "train_in_eval_mode"]
    assert alerts == [("info", 0)]
    (info,) = monitor.alerts
    assert info.data["in_frozen_parts"] == ["backbone.1", "backbone.3"]
    assert rules_of(monitor) == []


def test_the_trained_head_dropout_left_in_eval_warns_naming_it(quiet_watch):
    torch.manual_seed(0)
    monitor = _linear_probe(quiet_watch, Probe(), forget_train=True)
    (warning,) = [a for a in monitor.alerts if a.severity == "warning"]
    assert (warning.rule, warning.step, warning.module) == ("train_in_eval_mode", 3, "drop")


class Distiller(nn.Module):
    """A student trained against a frozen teacher held inside the same module."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = Probe(head_dropout=False)
        self.teacher.requires_grad_(False)
        self.student = DropNet()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.student(x) - target


def test_a_frozen_teacher_in_eval_inside_the_model_is_no_warning(quiet_watch):
    torch.manual_seed(0)
    model = Distiller()
    opt = torch.optim.SGD(model.student.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    model.teacher.eval()
    _train(model, opt, 6)
    assert rules_of(monitor) == []
    model.eval()  # and now the student too: the bug
    _train(model, opt, 1, seed=7)
    (warning,) = [a for a in monitor.alerts if a.severity == "warning"]
    assert (warning.rule, warning.module) == ("train_in_eval_mode", "student.bn")


def _recalibrate_batch_norm(model: nn.Module, cumulative: bool) -> None:
    """PreciseBN: the running statistics recomputed over a few batches, in training
    mode under no_grad, as a cumulative average (``momentum = None``)."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    kept = [bn.momentum for bn in norms]
    for bn in norms:
        bn.reset_running_stats()
        if cumulative:
            bn.momentum = None
    model.train()
    _evaluate(model, 4)
    for bn, momentum in zip(norms, kept):
        bn.momentum = momentum


@pytest.mark.parametrize("how", ["precise_bn", "swa_update_bn"])
def test_batch_norm_statistics_recomputed_on_purpose_are_silent(quiet_watch, how):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 4)
    if how == "precise_bn":
        _recalibrate_batch_norm(model, cumulative=True)
    else:
        loader = [x for x, _ in batches(4, seed=9)]
        torch.optim.swa_utils.update_bn(loader, model)
    _train(model, opt, 4, seed=1)
    assert rules_of(monitor) == []


def test_the_same_passes_with_the_usual_momentum_are_an_evaluation_in_training_mode(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 4)
    _recalibrate_batch_norm(model, cumulative=False)
    _train(model, opt, 4, seed=1)
    assert [a.rule for a in monitor.alerts if a.severity == "warning"] == ["eval_in_train_mode"]


def test_validation_with_gradients_on_in_eval_mode_is_not_a_training_step(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 2)
    model.eval()
    for x, y in batches(2, seed=5):
        nn.functional.mse_loss(model(x), y)  # no no_grad, but no backward either
    model.train()
    _train(model, opt, 2)
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_mode_cache_follows_a_module_added_after_watching(quiet_watch):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = quiet_watch(model, opt)
    _train(model, opt, 1)
    model.extra = nn.Dropout(0.5)  # registered after tw.watch
    _evaluate(model)
    assert [(a.rule, a.module) for a in monitor.alerts] == [("eval_in_train_mode", "extra")]


def test_no_grad_samples_drawn_between_training_passes_every_step_are_silent(quiet_watch):
    """A GAN's discriminator step: fakes drawn under no_grad, the generator in train mode."""
    generator, g_opt, monitor = _setup(quiet_watch)
    for x, y in batches(12):
        with torch.no_grad():
            generator(x)  # samples for the other model's step
        g_opt.zero_grad()
        nn.functional.mse_loss(generator(x), y).backward()
        g_opt.step()
    assert rules_of(monitor, ("info", "warning", "error")) == []


def test_single_no_grad_pass_now_and_then_is_an_evaluation_reported_at_its_step(quiet_watch):
    """The control: one evaluation batch every 5 steps, model.eval() forgotten."""
    model, opt, monitor = _setup(quiet_watch)
    for step, (x, y) in enumerate(batches(12)):
        if step % 5 == 4:
            _evaluate(model, passes=1)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (4, "bn")


def test_single_no_grad_pass_before_close_is_reported_at_close(quiet_watch):
    model, opt, monitor = _setup(quiet_watch)
    _train(model, opt, 3)
    _evaluate(model, passes=1)  # the final evaluation, model.eval() forgotten
    monitor.close()
    (alert,) = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert (alert.step, alert.module) == (3, "bn")


def test_halt_on_an_evaluation_in_training_mode_stops_it_at_the_pass(quiet_watch):
    """The finding is made where the pass ends, inside the model's own call: the
    halt comes out of that call, and the model's hooks keep working after it."""
    import trainwatch as tw

    model, opt, monitor = _setup(quiet_watch, halt_on=["eval_in_train_mode"])
    _train(model, opt, 3)
    with pytest.raises(tw.TrainingHealthError) as raised:
        _evaluate(model)
    assert (raised.value.alert.rule, raised.value.alert.step) == ("eval_in_train_mode", 3)
    model.eval()
    _evaluate(model)
    model.train()
    _train(model, opt, 2, seed=1)
    assert monitor.step_count == 5
    assert monitor.alert_counts == {("eval_in_train_mode", "bn"): 1}


def test_halt_on_an_evaluation_done_right_never_stops(quiet_watch):
    model, opt, monitor = _setup(quiet_watch, halt_on=["eval_in_train_mode"])
    _train(model, opt, 3)
    model.eval()
    _evaluate(model)
    model.train()
    _train(model, opt, 2, seed=1)
    assert monitor.alerts == []


class _Autoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        self.dec = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def _autoencoder_evaluations(quiet_watch, sample_after: bool, evaluations: int = 2):
    torch.manual_seed(0)
    model = _Autoencoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for _ in range(evaluations):
        for x, _ in batches(3, seed=1):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), x.new_zeros(x.shape[0], 8)).backward()
            opt.step()
        with torch.no_grad():  # forgot model.eval()
            model(torch.randn(4, 8))
            if sample_after:
                model.dec(torch.randn(4, 4))  # samples drawn in the same evaluation
    monitor.close()
    return monitor


@pytest.mark.parametrize("sample_after", [True, False])
def test_a_part_sampled_in_the_same_evaluation_is_not_told_again(quiet_watch, sample_after):
    monitor = _autoencoder_evaluations(quiet_watch, sample_after)
    told = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert [(a.step, a.module) for a in told] == [(3, "enc.2")]
    assert told[0].data["modules"] == ["enc.2", "dec.2"]
    counts = {k: n for k, n in monitor.alert_counts.items() if k[0] == "eval_in_train_mode"}
    assert counts == {("eval_in_train_mode", "enc.2"): 2}  # both evaluations, the decoder's in them


def test_a_part_evaluated_on_its_own_is_still_told(quiet_watch):
    torch.manual_seed(0)
    model = _Autoencoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = quiet_watch(model, opt)
    for x, _ in batches(3, seed=1):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.new_zeros(x.shape[0], 8)).backward()
        opt.step()
    with torch.no_grad():
        model.dec(torch.randn(4, 4))  # only the decoder, no full pass before it
    monitor.close()
    told = [a for a in monitor.alerts if a.rule == "eval_in_train_mode"]
    assert [(a.step, a.module) for a in told] == [(3, "dec.2")]
