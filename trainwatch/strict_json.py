"""Strict JSON for every file trainwatch writes: a NaN or an Inf as a string.

The alerts that matter most carry non-finite numbers (a loss of ``inf``, a
norm of ``nan``). Python's ``json`` writes them as ``NaN`` and ``Infinity``,
which no other JSON reader accepts (``jq``, ``JSON.parse``, Go, serde): the
line with the finding would be the one that breaks the tooling reading it.
So a number that is not finite is written as the string ``"nan"``, ``"inf"``
or ``"-inf"`` (what ``str`` gives and ``float`` reads back; the TensorBoard
tab's data writes them so too), and every other number stays a number.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any


def nonfinite_name(value: float) -> str:
    """``"nan"``, ``"inf"`` or ``"-inf"``: how a number that is not finite is written."""
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def jsonable(value: Any) -> Any:
    """``value`` as strict JSON can hold it: NaN/Inf as their names, numpy scalars as
    numbers, what JSON has no type for (a dtype, a tensor) as its ``str``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else nonfinite_name(value)
    if isinstance(value, dict):
        return {_key(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, numbers.Integral):  # a numpy integer
        return int(value)
    if isinstance(value, numbers.Real):  # a numpy float
        return jsonable(float(value))
    return str(value)


def _key(key: Any) -> Any:
    """A key as ``json`` writes it itself, but a non-finite float's in its name."""
    if key is None or isinstance(key, (str, bool, int)):
        return key
    if isinstance(key, float) and math.isfinite(key):
        return key
    return str(jsonable(key))


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps`` of ``value`` as strict JSON (``allow_nan=False`` holds)."""
    return json.dumps(jsonable(value), allow_nan=False, **options)
