"""Dropout and batch norm in the wrong mode: evaluating in training mode, training in eval mode."""

from __future__ import annotations

import dataclasses
import math

from trainwatch.alert import Alert
from trainwatch.collect.eval_passes import generator_sample
from trainwatch.config import EvalInTrainModeConfig, TrainInEvalModeConfig
from trainwatch.record import ModeReport, StepRecord
from trainwatch.rules.base import Rule


def _listing(report: ModeReport, limit: int = 4) -> str:
    shown = [f"{name or '<root>'} ({kind})" for name, kind in zip(report.modules, report.kinds)]
    extra = len(shown) - limit
    return ", ".join(shown[:limit]) + (f" and {extra} more" if extra > 0 else "")


def _data(report: ModeReport) -> dict[str, object]:
    return {
        "modules": report.modules,
        "kinds": report.kinds,
        "whole_model": report.whole_model,
        "mode_dependent": report.total,
        "in_frozen_parts": report.in_frozen_parts,
        "parts_in_eval": report.parts_in_eval,
        "frozen_parts": report.frozen_parts,
    }


def _names(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``: every one named (a hint covers them all)."""
    if len(parts) < 2:
        return "".join(parts)
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _inside(name: str, part: str) -> bool:
    return not part or name == part or name.startswith(part + ".")


def _effect(report: ModeReport) -> str:
    """What a frozen model's modules in training mode do to what it computes."""
    said = []
    if any("norm" not in kind.lower() for kind in report.kinds):
        said.append("its dropout is on, so what it computes for the rest of the model is noisy")
    if any("norm" in kind.lower() for kind in report.kinds):
        said.append(
            "its batch norm normalises with each batch's statistics and keeps "
            "overwriting its running averages"
        )
    return "; ".join(said)


class EvalInTrainModeRule(Rule):
    id = "eval_in_train_mode"
    needs = frozenset({"modes"})
    reads = "eval_in_train"
    config: EvalInTrainModeConfig

    def __init__(self, config: EvalInTrainModeConfig) -> None:
        super().__init__(config)
        # The step of the last evaluation told and the modules it named: a part of
        # the model called on its own after a full pass of the same evaluation (a
        # VAE's decoder sampled) is the same mistake, not a second one.
        self._told_step = -1
        self._told_modules: list[str] = []
        self._told_total = 0  # mode-dependent modules in what that pass ran
        # The step a frozen part in training mode was told at (None: not told, or
        # withdrawn since): only a finding told is withdrawn.
        self._frozen_told_at: int | None = None

    def evaluate(self, record: StepRecord) -> list[Alert]:
        report = record.eval_in_train
        if report is None:
            return []
        if report.during_training:
            if report.trains_now:
                return self._frozen_part_trains(record.step, report)
            self._frozen_told_at = record.step
            return [self._frozen_part(record.step, report)]
        if report.frozen_use:
            return [self._frozen_use(record.step, report)]
        if (
            record.step == self._told_step
            and report.total < self._told_total
            and set(report.modules) <= set(self._told_modules)
        ):
            return []  # a part of what this evaluation's fuller pass named
        self._told_step, self._told_modules, self._told_total = (
            record.step,
            report.modules,
            report.total,
        )
        if generator_sample(report):
            return [self._generator_sample(record.step, report)]
        return [
            self.alert(
                record.step,
                report.modules[0],
                f"a forward pass without gradients (evaluation) ran with "
                f"{len(report.modules)} of {report.total} mode-dependent modules in "
                f"training mode: {_listing(report)}",
                "call model.eval() before evaluating (and model.train() after): in "
                "training mode dropout drops units and batch norm normalises with the "
                "eval batch's statistics and overwrites its running averages with them. "
                "Deliberate Monte-Carlo dropout: switch only the dropout modules back to "
                "train() after model.eval() (recognised, silent), or set "
                "eval_in_train_mode.mc_dropout: true. "
                "(No-grad passes that recur between the training passes of every step, "
                "such as GAN samples, are recognised as training and not reported.)",
                _data(report),
            )
        ]

    def _generator_sample(self, step: int, report: ModeReport) -> Alert:
        """Info: a GAN's progress samples (every N iterations, once an epoch) drawn in
        training mode are what DCGAN does, its generator trained only with batch
        statistics (``eval()`` usually makes its samples worse); but a decoder or
        generator validated that way may be a forgotten ``eval()``."""
        alert = self.alert(
            step,
            report.modules[0],
            f"samples drawn without gradients from a latent vector (a generator's, each "
            f"{math.prod(report.output_shape[1:])} values from "
            f"{math.prod(report.input_shape[1:])}) with batch norm in training mode: "
            f"{_listing(report)}",
            "a GAN generator sampled with batch statistics, as DCGAN does, needs nothing: "
            "it was trained with them. If this is an evaluation of a model whose running "
            "statistics should serve (a VAE's decoder, a generator trained to be used in "
            "eval mode), call model.eval() before it and model.train() after.",
            {**_data(report), "finding": "generator sampled in training mode"},
        )
        return dataclasses.replace(alert, severity="info")

    def _frozen_use(self, step: int, report: ModeReport) -> Alert:
        """A model trained first and then run unchanged under no_grad while another
        trains (a teacher distilled from, a reward model) is no evaluation: the
        advice is to put it in eval mode once, for good."""
        how = (
            "trained here first, then its weights unchanged and no step of its own"
            if report.trained_first
            else "its weights unchanged and no step of its own"
        )
        done = "once its training is over" if report.trained_first else "once, before using it"
        return self.alert(
            step,
            report.modules[0],
            f"a frozen model runs without gradients in training mode while another model "
            f"trains, as a teacher or target ({how}): {len(report.modules)} of "
            f"{report.total} mode-dependent modules in training mode: {_listing(report)}; "
            f"{_effect(report)}",
            f"call teacher.eval() {done}, and no teacher.train() after (not after an "
            "evaluation either): a teacher's or target's outputs should be its "
            "deterministic predictions, with batch norm's running statistics. Nothing "
            "to do if the noise is intended.",
            {
                **_data(report),
                "finding": "frozen model used in training mode",
                "trained_first": report.trained_first,
            },
        )

    def _frozen_part(self, step: int, report: ModeReport) -> Alert:
        """Info: training mode may be the intent (a frozen backbone's batch norm
        adapting its statistics to new data, a mean teacher's dropout), but a frozen
        teacher or feature extractor run with dropout on gives noisy targets or
        features. A part whose parameters still require grad but that no optimizer
        holds and no gradient reaches (a teacher run under ``no_grad``, never
        frozen) trains no more than a frozen one: the same finding, the same
        severity, its message saying so."""
        effect = _effect(report)
        parts = report.frozen_parts
        # Named as .eval() would be called on it: one module, or the frozen modules
        # side by side that make it (a ResNet's stem and stages beside its new fc).
        many = len(parts) > 1
        named = f"{_names(parts)}; " if parts else ""
        them, runs = ("them", "run") if many else ("it", "runs")
        part = (
            f"{'parts' if many else 'a part'} of the model that no optimizer trains "
            f"({named}no optimizer holds {'their' if many else 'its'} parameters and no "
            "update trains them; a reference copy, or an EMA or momentum target moved by "
            "hand, is one)"
            if report.held_by_no_optimizer
            else f"{'frozen parts' if many else 'a frozen part'} of the model "
            f"({named}no parameter of {them} trains)"
        )
        freeze = (
            f" {'Their' if many else 'Its'} parameters still require grad: "
            f"requires_grad_(False) on {them} says {'they are' if many else 'it is'} frozen."
            if report.held_by_no_optimizer
            else ""
        )
        if len(parts) > 1:
            call = f"call .eval() on each of {_names(parts)} after every model.train()"
        elif parts:
            call = f"call {parts[0]}.eval() after every model.train()"
        else:
            call = "call .eval() on it after every model.train()"
        alert = self.alert(
            step,
            report.modules[0],
            f"{part} {runs} in training mode while the rest trains: {_listing(report)}; {effect}",
            "a frozen teacher, backbone or feature extractor is usually kept in eval "
            f"mode: {call} (or override train() "
            f"to keep {them} there). Nothing to do if {'their' if many else 'its'} "
            "training-mode behaviour is the "
            f"intent (batch-norm statistics adapting to new data), or if the freeze is a "
            f"warm-up undone later (a staged fine-tune): this note is withdrawn once "
            f"{them} {'train' if many else 'trains'}.{freeze}",
            {
                **_data(report),
                "finding": "frozen part in training mode",
                "held_by_no_optimizer": report.held_by_no_optimizer,
            },
        )
        return dataclasses.replace(alert, severity="info")

    def _frozen_part_trains(self, step: int, report: ModeReport) -> list[Alert]:
        """The frozen part told of trains now (a staged fine-tune: the backbone
        unfrozen after the head's warm-up): training mode is right for it from
        here on, and the note told earlier is withdrawn, at the module it named."""
        told_at, self._frozen_told_at = self._frozen_told_at, None
        if told_at is None:
            return []
        parts = report.frozen_parts
        many = len(parts) > 1
        named = _names(parts) if parts else "the frozen part"
        how = "handed to an optimizer" if report.held_by_no_optimizer else "unfrozen"
        return [
            self.alert(
                step,
                report.modules[0],
                f"{named}, told at step {told_at} as {'frozen parts' if many else 'a frozen part'} "
                f"running in training mode, {'train' if many else 'trains'} from step {step} "
                f"({how}: a staged fine-tune), so that note no longer stands",
                _TRAINS_NOW_HINT,
                {
                    **_data(report),
                    "kind": "unfrozen",
                    "finding": "frozen part trains",
                    "withdraws": True,  # the note no longer stands (the summaries mark it undone)
                    "told_at": told_at,
                },
                severity="info",
            )
        ]


_TRAINS_NOW_HINT = (
    "nothing to do: a freeze for warm-up or fine-tuning, ended as planned; a part that "
    "trains belongs in training mode, so no .eval() on it now"
)


class TrainInEvalModeRule(Rule):
    """Whole-model eval during training is the bug, and so is a trained part of it in
    eval; frozen batch norm alone, or a frozen part in eval, is an idiom."""

    id = "train_in_eval_mode"
    needs = frozenset({"modes"})
    reads = "train_in_eval"
    config: TrainInEvalModeConfig

    def __init__(self, config: TrainInEvalModeConfig) -> None:
        super().__init__(config)
        self._told_partial = False

    def evaluate(self, record: StepRecord) -> list[Alert]:
        report = record.train_in_eval
        if report is None:
            return []
        frozen = set(report.in_frozen_parts)
        # Kept in eval on purpose: inside a frozen part (a backbone, a teacher, a
        # loss network), or a normalisation layer (frozen statistics) where the
        # model itself trains.
        in_frozen_parts = len(frozen) == len(report.modules)
        norms_only = all(
            "norm" in kind.lower() or name in frozen
            for name, kind in zip(report.modules, report.kinds)
        )
        # A part whose layers train, in eval under a model in training mode
        # (``self.net.eval()`` left on inside a wrapper): its norms are no idiom.
        parts = [] if report.whole_model else report.parts_in_eval
        if not in_frozen_parts and (report.whole_model or not norms_only or parts):
            # Named after the first module outside the frozen parts: what trains
            # (inside the trained part in eval, where there is one).
            trains = [m for m in report.modules if m not in frozen]
            inner = [m for m in trains if any(_inside(m, part) for part in parts)]
            named = (inner or trains or report.modules)[0]
            if parts:
                switched = _names(parts)
                message = (
                    f"a training step ran with {switched} in eval mode while "
                    f"{'its' if len(parts) == 1 else 'their'} layers train and the rest "
                    f"of the model is in training mode: {len(report.modules)} of "
                    f"{report.total} mode-dependent modules in eval mode: {_listing(report)}"
                )
                hint = (
                    f".eval() was called on {switched} (an evaluation, a metrics helper) "
                    "and training resumed without .train(): dropout is off and batch norm "
                    "uses frozen running statistics, so the model trains differently from "
                    f"what you think. Call .train() on {switched} (or model.train()) "
                    "before training resumes. To freeze batch-norm statistics on purpose, "
                    "put only the norm layers in eval."
                )
            else:
                message = (
                    f"a training step ran with {len(report.modules)} of {report.total} "
                    f"mode-dependent modules in eval mode: {_listing(report)}"
                )
                hint = (
                    "an evaluation called model.eval() and training resumed without "
                    "model.train(): dropout is off and batch norm uses frozen running "
                    "statistics, so the model trains differently from what you think. "
                    "Call model.train() at the start of each training epoch."
                )
            return [self.alert(record.step, named, message, hint, _data(report))]
        if self._told_partial:
            return []
        self._told_partial = True
        count = len(report.modules)
        if frozen:
            kept = "module of a frozen part" if count == 1 else "modules of frozen parts"
            finding = "frozen part kept in eval"
        else:
            kept = "normalisation layer" if count == 1 else "normalisation layers"
            finding = "normalisation kept in eval"
        alert = self.alert(
            record.step,
            report.modules[0],
            f"training with {count} {kept} kept in eval mode "
            f"while the rest of the model trains: {_listing(report)}",
            "the usual fine-tuning idiom (frozen batch-norm statistics; a frozen "
            "backbone, teacher or loss network kept in eval); nothing to do if that "
            "is the intent.",
            # A finding of its own: a later step that trains with dropout off too
            # (an evaluation left the model in eval) still warns about the same layer.
            {**_data(report), "finding": finding},
        )
        return [dataclasses.replace(alert, severity="info")]
