"""How the findings on a target network fed gradients say what the target copies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainwatch.record import CopiedFrom


def listed_parts(parts: Sequence[str]) -> str:
    """``backbone and projector``; ``a, b and c``."""
    if len(parts) < 2:
        return "".join(parts)
    return f"{', '.join(parts[:-1])} and {parts[-1]}"


def copied_model(copied: CopiedFrom) -> str:
    """The model a target copies, with the parts where it copies only some of it:
    ``Online's backbone and projector``."""
    if not copied.parts:
        return copied.name
    return f"{copied.name}'s {listed_parts(copied.parts)}"


def copy_data(copied: CopiedFrom) -> dict[str, Any]:
    """``data.copy_of``, and ``data.copied_parts`` where the target copies only some
    of it."""
    found: dict[str, Any] = {"copy_of": copied.name}
    if copied.parts:
        found["copied_parts"] = list(copied.parts)
    return found
