"""Makers for the dataclasses built at every step: each field at its default, in
straight-line code.

A dataclass's own ``__init__`` takes every field as a keyword and checks, for
each field with a default factory, whether one was given: for a record of
forty fields that is about 200 bytecode instructions, made at every step.
The maker generated here takes only the fields without a default, in order,
and sets the rest from constants (``[]``, ``{}`` and ``set()`` written out):
about a third fewer. A class without ``__slots__`` keeps each plain default as
a class attribute, which an instance reads until it sets its own: its maker
sets only the fields without a default and those with a factory (a record of
sixty fields, fifteen of them lists and dicts: a quarter of the stores). What
it makes equals what the class's own ``__init__`` makes from the same
arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_LITERALS: dict[Any, str] = {list: "[]", dict: "{}", set: "set()"}


def fresh_maker(cls: type[T]) -> Callable[..., T]:
    """``maker(*required)``: a new ``cls`` with its fields without a default set from
    ``required`` (in declaration order) and every other field at its default."""
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__} has a __post_init__, which a fresh maker would skip")
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    # Instances with a __dict__ read a plain default from the class until they
    # set their own (a slotted class has a descriptor there instead).
    shared_defaults = "__slots__" not in cls.__dict__
    required: list[str] = []
    body: list[str] = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = field.name
        if field.default_factory is not dataclasses.MISSING:
            literal = _LITERALS.get(field.default_factory)
            if literal is None:
                namespace[f"_factory_{name}"] = field.default_factory
                literal = f"_factory_{name}()"
            body.append(f"    made.{name} = {literal}")
        elif field.default is not dataclasses.MISSING:
            if shared_defaults and cls.__dict__.get(name, dataclasses.MISSING) is field.default:
                continue
            namespace[f"_default_{name}"] = field.default
            body.append(f"    made.{name} = _default_{name}")
        else:
            required.append(name)
            body.append(f"    made.{name} = {name}")
    source = "\n".join(
        [f"def fresh({', '.join(required)}):", "    made = _new(_cls)", *body, "    return made"]
    )
    exec(source, namespace)
    maker = namespace["fresh"]
    maker.__qualname__ = f"{cls.__qualname__}.fresh"
    maker.__doc__ = f"A new {cls.__name__} at its defaults (see trainwatch.fresh)."
    return maker  # type: ignore[no-any-return]
