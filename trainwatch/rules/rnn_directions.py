"""An ``nn.RNN``/``nn.LSTM``/``nn.GRU`` some of whose layer-directions get no gradient
while the others do: only part of the module's output reaches the loss.

Each layer and direction of such a module has its own weights, named by torch
``weight_ih_l{k}``, ``weight_hh_l{k}``, ``bias_ih_l{k}``, ``bias_hh_l{k}`` (and
``weight_hr_l{k}`` with ``proj_size``), ``_reverse`` appended for the reverse
direction. Dead units or a zero mask do not silence exactly such a set while the
rest learns; reading the wrong slice of ``h_n`` does (``h_n[-1]`` of a
bidirectional RNN is the last layer's reverse direction only), so the alert
names that slice instead of the dead-ReLU story.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from trainwatch.layers import ParamInfo

_RNN_PARAMETER = re.compile(r"(?:weight|bias)_(?:ih|hh|hr)_l(\d+)(_reverse)?")

_LAST_FORWARD_HINT = (
    "h_n[-1] of a bidirectional RNN is its last layer's reverse direction only (h_n "
    "holds num_layers * 2 final states, layer by layer, forward before reverse), so the "
    "last layer's forward direction reaches nothing. Read both: torch.cat([h_n[-2], "
    "h_n[-1]], dim=1) (the head's in_features doubled), or pool over output "
    "(output.mean(dim=1)), which holds both directions at every step. If one direction "
    "is all the task needs, a unidirectional RNN does it for half the cost."
)
_LAST_REVERSE_HINT = (
    "only the last layer's forward direction reaches the loss: h_n[-2] read alone, or "
    "output's first hidden_size features (output holds the forward direction's "
    "features first, then the reverse's). Read both: torch.cat([h_n[-2], h_n[-1]], "
    "dim=1), or all of output's features. If one direction is all the task needs, a "
    "unidirectional RNN does it for half the cost."
)
_LOWER_LAYER_HINT = (
    "the state read is a lower layer's, not the last one's: h_n holds the final states "
    "layer by layer from the first (num_layers * num_directions of them), so h_n[0] is "
    "the first layer's; the last layer's is h_n[-1] (both directions, when "
    "bidirectional: torch.cat([h_n[-2], h_n[-1]], dim=1)), and output holds the last "
    "layer's states only. The layers above the one read learn nothing and only cost time."
)
_PART_HINT = (
    "only part of the RNN's output reaches the loss. h_n holds the final states layer "
    "by layer from the first, forward before reverse within a layer (h_n[-1] of a "
    "bidirectional RNN is its last layer's reverse direction only); output holds the "
    "last layer's states, the forward direction's features first. A layer-direction "
    "whose states reach the loss neither directly nor through a layer above it learns "
    "nothing: read the last layer's, both directions when bidirectional "
    "(torch.cat([h_n[-2], h_n[-1]], dim=1), or a pool over output)."
)


@dataclass(frozen=True)
class UnusedDirections:
    """The layer-directions of one RNN module that got no gradient, the others some."""

    silent: tuple[tuple[int, bool], ...]  # (layer, reverse), in the module's order
    num_layers: int
    bidirectional: bool

    def names(self) -> list[str]:
        """As torch suffixes their weights: ``l1``, ``l1_reverse``."""
        return [f"l{layer}{'_reverse' if reverse else ''}" for layer, reverse in self.silent]

    def said(self) -> str:
        """The silent layer-directions in words, with where their final state lies in h_n."""
        directions = 2 if self.bidirectional else 1
        parts = []
        layers = sorted({layer for layer, _ in self.silent})
        for layer in layers:
            sides = [reverse for at, reverse in self.silent if at == layer]
            if not self.bidirectional:
                parts.append(f"layer {layer} (h_n[{self._h_n(layer, False)}])")
            elif len(sides) == directions:
                first, second = self._h_n(layer, False), self._h_n(layer, True)
                parts.append(f"layer {layer} in both directions (h_n[{first}], h_n[{second}])")
            else:
                side = "reverse" if sides[0] else "forward"
                parts.append(
                    f"layer {layer}'s {side} direction (h_n[{self._h_n(layer, sides[0])}])"
                )
        kind = "bidirectional " if self.bidirectional else ""
        listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
        return f"{listed} of this {self.num_layers}-layer {kind}RNN"

    def hint(self) -> str:
        top = self.num_layers - 1
        silent = set(self.silent)
        if self.bidirectional and silent == {(top, False)}:
            return _LAST_FORWARD_HINT
        if self.bidirectional and silent == {(top, True)}:
            return _LAST_REVERSE_HINT
        lowest = min(layer for layer, _ in silent)
        sides = (False, True) if self.bidirectional else (False,)
        if silent == {(layer, side) for layer in range(lowest, top + 1) for side in sides}:
            return _LOWER_LAYER_HINT
        return _PART_HINT

    def _h_n(self, layer: int, reverse: bool) -> int:
        """Where the layer-direction's final state lies in h_n: counted from the end
        for the last layer (h_n[-1], h_n[-2]), from the start for the others."""
        directions = 2 if self.bidirectional else 1
        at = layer * directions + int(reverse)
        return at - self.num_layers * directions if layer == self.num_layers - 1 else at


def unused_directions(
    owner: str,
    present: Sequence[ParamInfo],
    norms: Sequence[float],
    missing: Sequence[ParamInfo],
) -> UnusedDirections | None:
    """The layer-directions of ``owner`` without a gradient (None or exactly zero) this
    step, where ``owner`` is an RNN (every parameter of it named as torch names an RNN's)
    and they are whole layer-directions while others got a non-zero gradient; None
    otherwise. Asked as a zero-gradient alert is built, never on the healthy step."""
    silent_of: dict[tuple[int, bool], set[bool]] = {}
    for info, silent in (
        *((info, norm == 0.0) for info, norm in zip(present, norms) if info.owner == owner),
        *((info, True) for info in missing if info.owner == owner and info.in_model),
    ):
        found = _RNN_PARAMETER.fullmatch(info.name.rpartition(".")[2])
        if found is None:
            return None  # not an RNN's own parameter: a module of another kind
        key = (int(found[1]), found[2] is not None)
        silent_of.setdefault(key, set()).add(silent)
    if any(len(states) != 1 for states in silent_of.values()):
        return None  # a layer-direction partly silent: not the slice read
    silent = sorted(key for key, states in silent_of.items() if True in states)
    if not silent or len(silent) == len(silent_of):
        return None  # the whole module silent (a cut before it), or none of it
    return UnusedDirections(
        silent=tuple(silent),
        num_layers=max(layer for layer, _ in silent_of) + 1,
        bidirectional=any(reverse for _, reverse in silent_of),
    )
