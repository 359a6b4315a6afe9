"""Backward added onto gradients an optimizer step had already applied."""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.record import CancelledReport, StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names
from trainwatch.rules.target_copies import copied_model, copy_data, listed_parts

_HINT = (
    "call optimizer.zero_grad() (or model.zero_grad()) once per step, before "
    "backward; with gradient accumulation, after optimizer.step(). Without it "
    "every step re-applies all earlier gradients."
)
_CLOSURE_HINT = (
    "call optimizer.zero_grad() at the start of the closure: an optimizer that "
    "evaluates it several times per step() (LBFGS) needs fresh gradients at each "
    "evaluation, and without the reset each one adds onto the gradients of all before it."
)
_HAND_HINT = (
    "reset each gradient once the update has used it (p.grad = None, p.grad.zero_() "
    "or model.zero_grad()); with gradient accumulation, after the update. Without "
    "it every update re-applies all earlier gradients."
)
_PERTURBATION_HINT = (
    "reset the gradients after they moved the weights and before the backward at the "
    "moved weights (SAM: first_step(zero_grad=True)). Without it the update applies "
    "the gradient at the original weights plus the one at the moved weights, not the "
    "latter alone."
)

_TARGET_HINT = (
    "compute the target under torch.no_grad() (or .detach() it) so that backward "
    "stops there; a target network updated only by the loop is best frozen too "
    "(target.requires_grad_(False)). If the loop does train this copy from its own "
    "gradients (fast weights updated by hand), reset them once the update has used them."
)

_PART_TARGET_HINT = (
    "compute the target under torch.no_grad() (or .detach() it) so that backward "
    "stops there, and freeze the copy, {part}, with requires_grad_(False); adding it to the "
    "optimizer would train the target instead of letting it follow {copied}. Only a "
    "part meant to train on its own (a second head started from the first) belongs in "
    "the optimizer (optimizer.add_param_group())."
)

_CANCELLED_HINT = (
    "detach the generator's output where the discriminator's loss uses it "
    "(D(fake.detach())), or call the generator optimizer's zero_grad() after the "
    "discriminator's step, right before the generator's backward; "
    "backward(retain_graph=True) on the discriminator's loss hides the error torch "
    "would otherwise raise there (trying to backward through the graph a second "
    "time). Outside a GAN: reset these parameters' gradients between the two "
    "backward passes, or detach the input the second loss does not mean to train."
)


def _common_module(owners: list[str]) -> str:
    """The innermost module holding every one of ``owners`` ("" for the root)."""
    parts = [owner.split(".") if owner else [] for owner in owners]
    common: list[str] = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


class AccumulatedGradientRule(Rule):
    id = "accumulated_gradient"
    needs = frozenset({"accumulation_tracker"})
    reads = "accumulated"

    def evaluate(self, record: StepRecord) -> list[Alert]:
        if not record.accumulated:
            return []
        cancelled = getattr(record, "cancelled", None)
        if cancelled is not None:
            return [self._cancelled(record, cancelled)]
        if record.copy_part is not None:
            return [self._part_target(record)]
        if record.copy_of is not None:
            return [self._target(record)]
        owners = by_owner(record.accumulated)
        by_hand = record.source == "manual"
        # Under trainwatch run a second boundary confirms what the first found:
        # the alert keeps the first one's step, where backward added onto them.
        step = record.step if record.accumulated_since is None else record.accumulated_since
        in_closure = record.accumulation_method == "closure"
        perturbed = record.accumulation_method == "perturbation"
        if by_hand:
            used = (
                f"an update had already used (the weights changed since step {step - 1}, "
                "their gradients were not reset)"
            )
        elif in_closure:
            used = (
                f"an earlier evaluation of step {step}'s closure had already used "
                "(the optimizer moved the weights in between)"
            )
        elif perturbed:
            used = (
                f"an earlier backward of step {step} had already used to move the weights "
                "(every weight they belong to moved in place between the two backward "
                "passes, as SAM's perturbation does)"
            )
        else:
            used = (
                f"step {record.step - 1 if record.used_at is None else record.used_at} "
                "had already used"
            )
        return [
            self.alert(
                step,
                None,
                f"backward added onto the gradients {used}, in {len(record.accumulated)} "
                f"parameters ({short_names(record.accumulated, 3)}): zero_grad() is missing",
                _HAND_HINT
                if by_hand
                else _CLOSURE_HINT
                if in_closure
                else _PERTURBATION_HINT
                if perturbed
                else _HINT,
                {
                    "parameters": len(record.accumulated),
                    "modules": list(owners),
                    "method": record.accumulation_method,
                    "optimizer": record.optimizer,
                },
            )
        ]

    def _cancelled(self, record: StepRecord, found: CancelledReport) -> Alert:
        """Gradients one backward left while another optimizer stepped, mostly
        cancelled by the next backward before their own optimizer's step: no reset
        missing in the usual place, but a second loss reaching these parameters."""
        owners = list(by_owner(record.accumulated))
        module = _common_module(owners)
        others = " and ".join(found.others) or "another optimizer"
        kept = found.at_step / found.before if found.before > 0 else 0.0
        count = len(record.accumulated)
        return self.alert(
            found.since,
            module,
            f"the gradients of {count} parameter{'s' if count != 1 else ''} "
            f"({short_names(record.accumulated, 3)}) that a backward left while {others} "
            f"stepped were mostly cancelled by the next backward before optimizer "
            f"{found.optimizer} ({record.optimizer_class}) stepped them: their norm fell "
            f"from {found.before:.3g} to {found.at_step:.3g} ({kept:.0%} left) at "
            f"{found.cancelled} of {found.looked} steps. Most likely a GAN whose "
            "discriminator loss uses the generator's output without .detach(): the "
            "generator's step applies the discriminator's gradient plus its own, which "
            "nearly cancel, so it barely learns while both losses still move",
            _CANCELLED_HINT,
            {
                "kind": "other_optimizers_backward",
                "parameters": count,
                "modules": owners,
                "optimizer": found.optimizer,
                "optimizer_class": record.optimizer_class,
                "other_optimizers": list(found.others),
                "norm_before": found.before,
                "norm_at_step": found.at_step,
                "kept": kept,
                "cancelled_steps": found.cancelled,
                "steps_looked": found.looked,
            },
            severity="warning",
        )

    def _target(self, record: StepRecord) -> Alert:
        """A copy of a trained model, which no optimizer holds and the loop moves by
        hand (a Polyak or synced target network), receives gradients: no missing
        reset, but a target computed with gradients, which reach what fed it too."""
        step = record.step if record.accumulated_since is None else record.accumulated_since
        copied = record.copy_of
        assert copied is not None
        return self.alert(
            step,
            None,
            f"backward writes gradients into this model, the copy of {copied_model(copied)} "
            "that no optimizer holds and the loop updates by hand (a target network), in "
            f"{len(record.accumulated)} parameters ({short_names(record.accumulated, 3)}), "
            "where they pile up unreset: its output is used with gradients, most likely "
            "a target computed without torch.no_grad() or .detach(), which also sends "
            "gradients into what trains and feeds the target (SAC's actor and "
            "temperature), for their optimizers to apply",
            _TARGET_HINT,
            {
                "parameters": len(record.accumulated),
                "modules": list(by_owner(record.accumulated)),
                "method": record.accumulation_method,
                "optimizer": record.optimizer,
                "kind": "target_receives_gradients",
                **copy_data(copied),
            },
        )

    def _part_target(self, record: StepRecord) -> Alert:
        """A part of the model that copies another part (a target network held inside
        a LightningModule beside its Q-network) and that no optimizer holds receives
        gradients: a target computed with gradients, not a part left out of the
        optimizer."""
        part, of = record.copy_part, record.copy_of
        assert of is not None
        copied = listed_parts(of.parts) if of.parts else of.name
        count = len(record.accumulated)
        return self.alert(
            record.step,
            part,
            f"backward writes gradients into {part}, a copy of {copied} inside this model "
            f"that no optimizer holds (a target network), in {count} parameter"
            f"{'s' if count != 1 else ''} ({short_names(record.accumulated, 3)}): its output "
            "is used with gradients, most likely a target computed without torch.no_grad() "
            "or .detach(), which also sends gradients into whatever the target was "
            "computed from",
            _PART_TARGET_HINT.format(part=part, copied=copied),
            {
                "parameters": count,
                "modules": list(by_owner(record.accumulated)),
                "optimizer": record.optimizer,
                "kind": "target_receives_gradients",
                "copy": part,
                **copy_data(of),
            },
        )
