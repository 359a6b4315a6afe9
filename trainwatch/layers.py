"""Who owns each parameter: the names every alert and every norm is keyed by.

A *layer* is a module that owns parameters directly. A tied parameter is owned
by the first module that `named_modules()` reaches, so it is reported once,
under a stable name.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from trainwatch.compiled import unwrap, user_name

_TABLES = (nn.Embedding, nn.EmbeddingBag)

# torch's layers whose own forward adds ``self.bias`` to the output at every call
# (when it is not None), and the methods a subclass must keep for that to hold.
_SHIFT_LAYERS: tuple[tuple[type[nn.Module], tuple[str, ...]], ...] = (
    (nn.Linear, ("forward",)),
    (nn.Bilinear, ("forward",)),
    (nn.modules.conv._ConvNd, ("forward", "_conv_forward")),
    (nn.LayerNorm, ("forward",)),
    (nn.GroupNorm, ("forward",)),
    (nn.modules.batchnorm._BatchNorm, ("forward",)),
    (nn.modules.instancenorm._InstanceNorm, ("forward",)),
)
# Where torch's own layer classes live (nn.Linear's module, nn.Conv2d's, ...).
_TORCH_LAYERS = "torch.nn.modules."


def _adds_its_bias(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch's layers that adds its bias to the output
    whenever it runs, that forward kept: a subclass of the user's own (or another
    library's) that redefines it may leave the bias out. Asked once per layer, as
    the map is built."""
    kind = type(module)
    for layer, methods in _SHIFT_LAYERS:
        if isinstance(module, layer):
            # The nearest of torch's layer classes it derives from (itself, for
            # torch's own; a parametrized copy's base, for weight norm's).
            torch_own = next(c for c in kind.__mro__ if c.__module__.startswith(_TORCH_LAYERS))
            return all(getattr(kind, name) is getattr(torch_own, name) for name in methods)
    return False


# The layer that gathers optimizer parameters the model does not hold.
EXTERNAL = "<outside the model>"


def _parametrized_owner(name: str, module: nn.Module, lists: dict[str, str]) -> str:
    """The layer a parametrization's parameters belong to: ``fc.parametrizations.weight``
    holds fc's weight (spectral/weight norm), and a module inside it holds
    parameters of fc's weight too (a LoRA adapter registered as a parametrization:
    its ``lora_A``, ``lora_B``): fc owns them all. ``lists`` gathers the
    ParametrizationLists met so far (their names, each with its layer's), the
    modules reached in ``named_modules()`` order, outer first."""
    if isinstance(module, parametrize.ParametrizationList):
        owner = name.rsplit(".parametrizations.", 1)[0] if ".parametrizations." in name else ""
        lists.setdefault(name, owner)
        return owner
    for held, owner in lists.items():
        if name.startswith(held + "."):
            return owner
    return name


# Holders of parameters that are never called themselves: the module holding
# one uses its weights in its own forward (a vmap ensemble's stacked weights,
# per-layer matrices used as ``x @ self.ws[i]``).
_PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)


def own_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The weights ``module``'s own forward uses: those of its ParameterList and
    ParameterDict children too, which no call of their own ever names."""
    own = list(module.parameters(recurse=False))
    containers = [c for c in module.children() if isinstance(c, _PARAMETER_CONTAINERS)]
    if not containers:
        return own
    found = {id(p): p for p in own}
    for container in containers:
        for param in own_parameters(container):
            found.setdefault(id(param), param)
    return list(found.values())


@dataclass(frozen=True)
class ParamInfo:
    name: str  # qualified parameter name, e.g. "encoder.fc1.weight"
    owner: str  # qualified owning module name, "" for the root
    layer_index: int
    # False for parameters an optimizer holds but the model no longer does
    # (a replaced head) or never did.
    in_model: bool = True
    # Owned by an embedding table (nn.Embedding, nn.EmbeddingBag): a batch that
    # looks up only its padding row leaves its gradient exactly zero.
    table: bool = False
    # Its place in the model's own order (modules as named_modules() gives them,
    # then each one's parameters as it registered them): alerts list a layer's
    # parameters so, whatever order a step's gradients came in.
    position: int = 0
    # A bias that one of torch's layers (nn.Linear, a convolution, a norm layer)
    # adds to its output at every call: a constant shift, which a loss built from
    # derivatives of the output alone (torch.autograd.grad with create_graph)
    # never reaches while the layer's weight learns.
    shift: bool = False


class LayerMap:
    """Parameter -> (qualified name, owning layer), built from a model's tree."""

    def __init__(self, model: nn.Module, previous: LayerMap | None = None) -> None:
        self.layers: list[str] = []
        self._extra = 0
        self._info: dict[int, ParamInfo] = {}
        self._params: dict[int, nn.Parameter] = {}  # keeps ids valid while mapped
        self._keep: dict[int, torch.Tensor] = {}
        index: dict[str, int] = {}
        parametrized: dict[str, str] = {}  # ParametrizationList name -> its layer's
        # Where each parameter was found: (its module's parameter table, key).
        self._slots: list[tuple[dict[str, nn.Parameter | None], str, nn.Parameter]] = []
        for raw_name, module in model.named_modules():
            module_name = user_name(raw_name)  # a compiled submodule's _orig_mod dropped
            owner = _parametrized_owner(module_name, module, parametrized)
            for short, param in module.named_parameters(recurse=False):
                if id(param) in self._info:
                    continue
                if owner not in index:
                    index[owner] = len(self.layers)
                    self.layers.append(owner)
                qualified = f"{module_name}.{short}" if module_name else short
                table = isinstance(module, _TABLES)
                shift = short == "bias" and _adds_its_bias(module)
                self._info[id(param)] = ParamInfo(
                    qualified,
                    owner,
                    index[owner],
                    table=table,
                    position=len(self._info),
                    shift=shift,
                )
                self._params[id(param)] = param
                self._slots.append((module._parameters, short, param))
        self._departed: dict[int, ParamInfo] = {}
        if previous is not None:
            # Keep the names of parameters that left the model (a replaced
            # head): an optimizer may still hold them, and alerts should say
            # what they were.
            for key, info in {**previous._info, **previous._departed}.items():
                if key not in self._info:
                    old = previous._params.get(key)
                    self._outside(old if old is not None else previous._keep[key], info)

    def _outside(self, param: torch.Tensor, info: ParamInfo | None) -> ParamInfo:
        if EXTERNAL not in self.layers:
            self.layers.append(EXTERNAL)
        if info is None:
            self._extra += 1
            info = ParamInfo(f"{EXTERNAL}.{self._extra}", EXTERNAL, 0, position=self._extra)
        found = ParamInfo(
            info.name,
            info.owner,
            self.layers.index(EXTERNAL),
            in_model=False,
            position=info.position,
        )
        self._departed[id(param)] = found
        self._keep[id(param)] = param
        return found

    def outdated(self) -> bool:
        """Whether a parameter was replaced where no registration hook sees it.

        ``module.to()``, ``.half()`` and the like put new Parameter objects
        straight into the module's table when
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)``
        is set. One pass over the parameters: called only when a step
        looks wrong (gradients missing, an optimizer that holds none of them).
        """
        return any(_held(table, key) is not param for table, key, param in self._slots)

    def __contains__(self, param: torch.Tensor) -> bool:
        return id(param) in self._info

    def __len__(self) -> int:
        return len(self._info)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params.values())

    def known(self) -> dict[int, ParamInfo]:
        """The model's own parameters' names by ``id``: for loops over every parameter
        of a step, where a call of :meth:`info` per parameter would cost more."""
        return self._info

    def info(self, param: torch.Tensor) -> ParamInfo:
        """Names a parameter; one the model does not own gets a stable placeholder."""
        found = self._info.get(id(param)) or self._departed.get(id(param))
        return found if found is not None else self._outside(param, None)


def names_outside(params: Sequence[torch.Tensor]) -> dict[int, str]:
    """Names, by ``id``, for parameters no watched model holds, as the module holding
    them would give them: ``NTXent.log_t`` for a loss module's learned temperature.

    The outermost module found holding the parameter names it, by its class, then
    the parameter's path inside it. A parameter no module holds (a bare tensor) is
    left out. One scan of the heap: made for a finding only, never on a step.
    """
    wanted = {id(p) for p in params}
    holders: dict[int, tuple[nn.Module, str]] = {}
    parents: dict[int, tuple[nn.Module, str]] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), nn.Module):
            continue
        try:
            for short, param in obj._parameters.items():
                if id(param) in wanted:
                    holders.setdefault(id(param), (obj, short))
            for short, child in obj._modules.items():
                if child is not None:
                    parents.setdefault(id(child), (obj, short))
        except (AttributeError, RuntimeError):
            continue  # a module without the usual tables (TorchScript)
    names = {}
    for key, (module, short) in holders.items():
        path = [short]
        seen = {id(module)}
        up = parents.get(id(module))
        while up is not None and id(up[0]) not in seen:
            module, child_name = up
            seen.add(id(module))
            path.append(child_name)
            up = parents.get(id(module))
        names[key] = f"{type(unwrap(module)).__name__}.{user_name('.'.join(reversed(path)))}"
    return names


def _held(table: Any, key: str) -> Any:
    """``table[key]`` or None; a TorchScript submodule's table has no ``get``."""
    try:
        return table[key]
    except (KeyError, RuntimeError):
        return None
