"""A fine-tune that cannot change the model: nothing trainable is optimized or reaches the loss."""

from __future__ import annotations

from trainwatch.alert import Alert
from trainwatch.record import FrozenOutput, LooseTraining, SetupCheck, StepRecord
from trainwatch.rules.base import Rule, by_owner, short_names


def common_module(names: list[str]) -> str:
    """The innermost module holding every one of ``names`` (``""``: the root)."""
    if not names:
        return ""
    parts = [name.split(".") if name else [] for name in names]
    shared: list[str] = []
    for pieces in zip(*parts):
        if any(piece != pieces[0] for piece in pieces):
            break
        shared.append(pieces[0])
    return ".".join(shared)


def _listed(names: list[str], limit: int = 4) -> str:
    labels = [name or "<model>" for name in names]
    shown = ", ".join(labels[:limit])
    return shown + (f" and {len(labels) - limit} more" if len(labels) > limit else "")


class TrainableParametersRule(Rule):
    id = "trainable_parameters"
    reads = "setup"

    def evaluate(self, record: StepRecord) -> list[Alert]:
        check = record.setup
        assert check is not None
        step = check.since if check.since is not None else record.step
        if check.unreached:
            return [self._unreached(step, check)]
        if check.outside_grad:
            return [self._outside_grad(step, check)]
        if check.loose is not None:
            return [self._loose(step, check.loose)]
        alerts = []
        # A frozen model whose optimizer trains another (an EMA target put in the
        # online network's optimizer) is no setup that can change nothing.
        unheld = (
            bool(check.optimizers) and check.trainable == check.unheld and not check.trained_outside
        )
        if record.source == "setup" and unheld:
            alerts.append(self._unheld(record.step, check))
        if check.unsynced:
            alerts.append(self._unsynced(record.step, check))
        if check.frozen_after:
            alerts.append(self._frozen_after(record.step, check))
        found = check.frozen_output
        if found is not None and found.tail < found.upstream and not unheld:
            # A head on a model that trains. The output of a frozen network larger than
            # what trains before it is its own design: prompt tuning, adapters, a loss
            # network or a frozen decoder fed by a trainable part. (And where no
            # optimizer holds what trains, what feeds the layer does not train either.)
            alerts.append(self._frozen_output(record.step, found))
        return alerts

    def _unheld(self, step: int, check: SetupCheck) -> Alert:
        where = _listed(check.trainable_owners)
        if check.trainable:
            message = (
                f"none of the model's {check.trainable:,} trainable parameter elements "
                f"(in {where}) sits in "
                + (
                    f"any of the {check.optimizers} watched optimizers"
                    if check.optimizers != 1
                    else "the watched optimizer"
                )
                + ": no step can change the model"
            )
        else:
            message = (
                "every parameter of the model has requires_grad=False: the "
                f"{check.optimizers} watched optimizer{'s' if check.optimizers != 1 else ''} "
                "can change nothing"
            )
        return self.alert(
            step,
            "",
            message,
            "the optimizer was built before the model was frozen or its adapters were "
            "added (get_peft_model after the optimizer?). Build the optimizer after the "
            "last change, from [p for p in model.parameters() if p.requires_grad].",
            {
                "finding": check.revision,
                "trainable": check.trainable,
                "optimizers": check.optimizers,
                "modules": check.trainable_owners,
            },
        )

    def _loose(self, step: int, loose: LooseTraining) -> Alert:
        """Nothing of the model trains: the optimizer's steps move a temperature or a weight."""
        elements = f"{loose.elements:,} element{'s' if loose.elements != 1 else ''}"
        what = []
        if loose.names:
            what.append(f"the model's own {_listed(loose.names)}")
        if loose.outside:
            many = "s" if loose.outside != 1 else ""
            shapes = ", ".join(str(tuple(shape)) for shape in loose.shapes[:4])
            what.append(f"{loose.outside} tensor{many} outside it (shape{many} {shapes})")
        layers = "no layer of the model has" if loose.names else "the model has no"
        return self.alert(
            step,
            "",
            f"{layers} trainable parameter (requires_grad=False on every one), and the "
            f"optimizer holds only {' and '.join(what)}, {elements} in all, which fed none "
            "of the model's layers on the first step: its steps change nothing of the model",
            (
                "no layer of the model has a trainable parameter and the optimizer holds "
                "only tensors outside its layers"
                if loose.names
                else "the model has no trainable parameter and the optimizer holds only "
                "tensors outside it"
            )
            + ": a freeze meant for part of the model (the backbone) caught all "
            "of it (for p in model.parameters() where model.backbone.parameters() was "
            "meant). Unfreeze what should train and build the optimizer after. Fine for "
            "a fixed model on purpose: run it in eval mode or under torch.no_grad().",
            {
                "finding": "only tensors outside the model train",
                "parameters": loose.names,
                "outside": loose.outside,
                "trainable": loose.elements,
            },
        )

    def _unreached(self, step: int, check: SetupCheck) -> Alert:
        owners = list(by_owner(check.unreached))
        module = common_module(owners)
        never = [owner for owner in owners if owner in check.never_called]
        why = (
            f"; {_listed(never)} never ran in a forward pass"
            if never
            else "; their outputs do not reach the loss"
        )
        return self.alert(
            step,
            module,
            f"none of the {len(check.unreached)} trainable parameters the step should "
            f"update ({short_names(check.unreached)}) got a gradient in the first step "
            f"after the setup{why}",
            "the trainable parameters (adapters?) sit in modules with no path to the "
            "loss: wrong target_modules, a branch the forward never uses, or a "
            "detach()/no_grad between them and the loss. Train the modules the loss "
            "depends on.",
            {
                "finding": check.revision,
                "parameters": [info.name for info in check.unreached][:50],
                "modules": owners[:50],
                "never_called": never[:50],
            },
        )

    def _outside_grad(self, step: int, check: SetupCheck) -> Alert:
        """A note, not a finding: the model trains, but not through ``.grad``."""
        count = check.outside_grad
        return self.alert(
            step,
            "",
            f"no parameter holds a gradient in .grad, yet the loop's own update moved "
            f"{count} trainable parameter{'s' if count != 1 else ''}: the model trains "
            "from gradients computed outside .grad (torch.func, torch.autograd.grad) or "
            "from updates of its own, so gradient norms and the checks on gradients are "
            "unavailable for it",
            "fine for per-sample gradients (DP-SGD) or torch.autograd.grad with a "
            "hand-written update; to have the gradients checked, write the gradient "
            "each update applies into p.grad before applying it.",
            {"finding": "outside .grad", "parameters": count},
            severity="info",
        )

    def _unsynced(self, step: int, check: SetupCheck) -> Alert:
        owners = list(dict.fromkeys(_owner(name) for name in check.unsynced))
        counts = f"{check.synced} of the {check.sync_trainable} parameter tensors trainable now"
        if check.unsynced_all:
            what = (
                f"DDP all-reduces only {counts} ({_listed(check.unsynced)} train): its "
                "reducer was built while some were frozen"
            )
        else:
            what = (
                f"{_listed(check.unsynced)}, frozen when DDP was built, "
                f"{'is' if len(check.unsynced) == 1 else 'are'} trainable now and not "
                f"synced by DDP: its reducer all-reduces {counts}"
            )
        return self.alert(
            step,
            common_module(owners),
            what + "; each rank trains its own copy of those left out, and the ranks' weights "
            "drift apart with no error",
            "DistributedDataParallel takes the parameters that require grad when it is "
            "built, once. Wrap the model in DDP again after unfreezing (the optimizer "
            "keeps its parameters), or build DDP while every parameter requires grad "
            "and freeze after it with find_unused_parameters=True, or keep them "
            "trainable and out of the optimizer (or at lr 0) until their stage. "
            "find_unused_parameters and static_graph alone do not add them.",
            {
                "finding": "not synced by DDP",
                "parameters": check.unsynced[:50],
                "modules": owners[:50],
                "synced": check.synced,
                "trainable": check.sync_trainable,
                "find_unused_parameters": check.find_unused,
            },
        )

    def _frozen_after(self, step: int, check: SetupCheck) -> Alert:
        """Told at the audit, before the forward DDP fails at: its error names no parameter."""
        names = check.frozen_after
        owners = list(dict.fromkeys(_owner(name) for name in names))
        waited = check.synced - check.sync_trainable
        counts = (
            f"its reducer holds {check.synced} parameter tensors, "
            f"{check.sync_trainable} trainable now"
        )
        if waited >= len(names):
            what = (
                f"{_listed(names)}, trainable when DDP was built, "
                f"{'is' if len(names) == 1 else 'are'} frozen now (requires_grad=False)"
            )
        else:
            what = (
                f"{waited} of the parameter tensors frozen now ({_listed(names)}) "
                "required grad when DDP was built"
            )
        return self.alert(
            step,
            common_module(owners),
            what + f": DDP (find_unused_parameters=False) still waits for their gradients "
            f'({counts}), so the next forward fails with "Expected to have finished '
            'reduction in the prior iteration"',
            "DistributedDataParallel takes the parameters that require grad when it is "
            "built, once. Freeze the layer before wrapping the model in DDP (or wrap it "
            "again after freezing; the optimizer keeps its parameters), or build DDP with "
            "find_unused_parameters=True.",
            {
                "finding": "frozen after DDP",
                "parameters": names[:50],
                "modules": owners[:50],
                "synced": check.synced,
                "trainable": check.sync_trainable,
                "find_unused_parameters": False,
            },
        )

    def _frozen_output(self, step: int, found: FrozenOutput) -> Alert:
        """A note, not a finding: a frozen output layer is also deliberate."""
        layers = found.layers
        what = (
            f"the model's output layer `{layers[0]}` is"
            if len(layers) == 1
            else f"the layers the model's output comes from ({_listed(layers)}) are"
        )
        return self.alert(
            step,
            common_module(layers),
            f"{what} frozen while {found.upstream:,} parameters upstream train: if "
            f"{'it was' if len(layers) == 1 else 'they were'} freshly initialised, "
            f"training cannot adapt {'it' if len(layers) == 1 else 'them'}",
            "the layers before it learn to feed a fixed random projection. A new head "
            "frozen by mistake (requires_grad_(False) on the wrong module, or "
            "a freeze by name pattern that also caught the head): leave the head "
            "trainable and build the optimizer after. Fine when the layer is fixed on "
            "purpose (prompt or prefix tuning of a frozen model, a fixed classifier).",
            {
                "finding": "frozen output layer",
                "modules": layers[:50],
                "frozen": found.frozen,
                "trainable": found.upstream,
                "frozen_behind": found.behind[:50],
            },
            severity="info",
        )


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""
