"""Validation shared by every config section (`trainer.config`).

Contract:
- `ConfigError` (a `ValueError`): a bad recipe or config value; its message is one line naming
  the dotted field (`optim.lr`) and the fix.
- `require(condition, field, message)` raises `ConfigError(f"{field}: {message}")` unless
  `condition`.
- `check_types(section_obj, section)` refuses any field of a dataclass whose value does not
  match its annotation (below), and stores an int given for a float field as a float.
- `describe(value)` is how a wrong value reads in an error; `default_of(obj, name)` is a
  dataclass field's default.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import tomllib
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A recipe or config value is invalid; the message names the field and the fix."""


def require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    # Annotations are strings here (`from __future__ import annotations`): resolve them once.
    return typing.get_type_hints(cls)


def check_types(obj: Any, section: str = "") -> None:
    """Refuse any field of dataclass `obj` whose value does not match its annotation.

    The one type check for every config section (each `__post_init__` calls it first, so a
    field added later is covered without more code). TOML and `--set` give the wrong type
    easily (`steps = "10"`, `--set optim.lr=abc`), and Python would otherwise fail later with
    a `TypeError` traceback, or silently accept `true` as 1. Rules: `bool` is not an integer;
    an integer field refuses floats (`32.0` too); a float field takes integers (stored as
    float) but not nan or infinity; `list[str]` wants a list of strings. Raises `ConfigError`
    naming the dotted field, what it must be and what it got.
    """
    prefix = f"{section}." if section else ""
    for f in dataclasses.fields(obj):
        cls: type = type(obj)
        expected = _field_types(cls)[f.name]
        value = getattr(obj, f.name)
        wanted = _type_mismatch(value, expected)
        if wanted is not None:
            raise ConfigError(f"{prefix}{f.name}: must be {wanted}, got {describe(value)}")
        if expected is float and type(value) is int:
            setattr(obj, f.name, float(value))  # to_dict()/run.json then show one type


def _type_mismatch(value: Any, expected: Any) -> str | None:
    """None if `value` fits the annotation `expected`, else what it must be (in words)."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        misses = [_type_mismatch(value, option) for option in options]
        return None if None in misses else " or ".join(m for m in misses if m)
    if expected is type(None):
        return None if value is None else "unset (None)"
    if expected is bool:
        return None if isinstance(value, bool) else "true or false"
    if expected is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "a number"
        return None if math.isfinite(value) else "a finite number"
    if expected is str:
        return None if isinstance(value, str) else "a string (in quotes)"
    if origin is list:
        (item,) = typing.get_args(expected) or (Any,)
        if isinstance(value, list) and all(_type_mismatch(v, item) is None for v in value):
            return None
        return "a list of strings, e.g. ['a', 'b']" if item is str else "a list"
    if origin is collections.abc.Callable:
        return None if callable(value) else "a callable"
    if isinstance(expected, type) and dataclasses.is_dataclass(expected):
        return None if isinstance(value, expected) else f"a {expected.__name__}"
    return None  # Any and other annotations are not checked


def describe(value: Any) -> str:
    """How a wrong value reads in an error, with the likely fix when there is one."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            return f"the string {value!r}"
        if isinstance(parsed, int | float | bool):
            return f"the string {value!r} (remove the quotes)"
        return f"the string {value!r}"
    if isinstance(value, float) and value.is_integer():
        return f"{value!r} (write {int(value)})"
    if isinstance(value, dict):
        return "a table"
    return f"{value!r} ({type(value).__name__})"


def default_of(obj: Any, name: str) -> Any:
    """The default of dataclass `obj`'s field `name`."""
    return next(f.default for f in dataclasses.fields(obj) if f.name == name)
