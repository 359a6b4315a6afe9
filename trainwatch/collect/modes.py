"""Which modules behave differently in training and in eval mode, and in which mode they are.

Pure Python over ``.training`` flags of a cached list of modules: no tensor is
touched, so a check costs a few microseconds per forward pass of the model.
"""

from __future__ import annotations

import weakref

from torch import nn

from trainwatch.compiled import user_name
from trainwatch.record import ModeReport

_DROPOUT: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
)


def mode_kind(module: nn.Module) -> str | None:
    """ "dropout" or "norm" when the module's output depends on ``.training``; else None.

    Dropout with p=0 and norms without running statistics behave the same in
    both modes, so they do not count.
    """
    if isinstance(module, _DROPOUT):
        return "dropout" if getattr(module, "p", 0.0) > 0.0 else None
    if isinstance(module, _NORMS):
        return "norm" if getattr(module, "track_running_stats", False) else None
    if isinstance(module, nn.MultiheadAttention):
        return "dropout" if module.dropout > 0.0 else None
    if isinstance(module, nn.RNNBase):
        return "dropout" if module.dropout > 0.0 and module.num_layers > 1 else None
    return None


class ModeWatch:
    def __init__(self, model: nn.Module) -> None:
        self._root = weakref.ref(model)
        self._modules: list[tuple[str, str, weakref.ref[nn.Module]]] = []
        self.refresh()

    def refresh(self) -> None:
        """Rebuild the cache (the model's tree changed)."""
        model = self._root()
        self._modules = []
        if model is None:
            return
        for name, module in model.named_modules():
            kind = mode_kind(module)
            if kind is not None:
                self._modules.append((user_name(name), kind, weakref.ref(module)))

    def __len__(self) -> int:
        return len(self._modules)

    def in_mode(self, training: bool, skip_dropout: bool = False) -> ModeReport | None:
        """The mode-dependent modules whose ``.training`` equals ``training``, if any."""
        names: list[str] = []
        kinds: list[str] = []
        for name, kind, ref in self._modules:
            module = ref()
            if module is None or module.training != training:
                continue
            if skip_dropout and kind == "dropout":
                continue
            names.append(name)
            kinds.append(type(module).__name__)
        if not names:
            return None
        root = self._root()
        whole = root is not None and root.training == training
        return ModeReport(names, kinds, whole, len(self._modules))
