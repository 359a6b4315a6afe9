"""Who owns each parameter: the names every alert and every norm is keyed by.

A *layer* is a module that owns parameters directly. A tied parameter is owned
by the first module that `named_modules()` reaches, so it is reported once,
under a stable name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


EXTERNAL = "<external>"  # owner of optimizer parameters the model does not hold


@dataclass(frozen=True)
class ParamInfo:
    name: str  # qualified parameter name, e.g. "encoder.fc1.weight"
    owner: str  # qualified owning module name, "" for the root
    layer_index: int


class LayerMap:
    """Parameter -> (qualified name, owning layer), built from a model's tree."""

    def __init__(self, model: nn.Module) -> None:
        self.layers: list[str] = []
        self._extra = 0
        self._info: dict[int, ParamInfo] = {}
        self._params: dict[int, nn.Parameter] = {}  # keeps ids valid while mapped
        for module_name, module in model.named_modules():
            for short, param in module.named_parameters(recurse=False):
                if id(param) in self._info:
                    continue
                if not self.layers or self.layers[-1] != module_name:
                    self.layers.append(module_name)
                qualified = f"{module_name}.{short}" if module_name else short
                self._info[id(param)] = ParamInfo(qualified, module_name, len(self.layers) - 1)
                self._params[id(param)] = param

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._info

    def __len__(self) -> int:
        return len(self._info)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params.values())

    def info(self, param: torch.Tensor) -> ParamInfo:
        """Names a parameter; one the model does not own gets a stable placeholder."""
        found = self._info.get(id(param))
        if found is None:
            if EXTERNAL not in self.layers:
                self.layers.append(EXTERNAL)
            self._extra += 1
            found = ParamInfo(
                f"{EXTERNAL}.{self._extra}", EXTERNAL, self.layers.index(EXTERNAL)
            )
            self._info[id(param)] = found
            self._params[id(param)] = param  # type: ignore[assignment]
        return found
