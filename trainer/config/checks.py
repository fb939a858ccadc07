"""Validation shared by every config section (`trainer.config`).

Contract:
- `ConfigError` (a `ValueError`): a bad recipe or config value; its message is one line naming
  the dotted field (`optim.lr`) and the fix.
- `require(condition, field, message)` raises `ConfigError(f"{field}: {message}")` unless
  `condition`.
- `check_types(section_obj, section)` refuses any field of a dataclass whose value does not
  match its annotation (below), and stores an int given for a float field as a float.
- `finite_number(value)`: a JSON/TOML number (not bool) that is finite, a huge integer
  included (never `OverflowError`): the check for numbers read from untrusted files. It and
  `INT64` are the storage layer's number rules (`elastic.storage.json_bounds`), re-exported here.
- `describe(value)` is how a wrong value reads in an error; `default_of(obj, name)` is a
  dataclass field's default.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import tomllib
import types
import typing
from typing import Any

from elastic.storage import INT64, finite_number

__all__ = ["INT64", "ConfigError", "check_types", "default_of", "describe", "finite_number",
           "require"]


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
    an integer field refuses floats (`32.0` too) and integers beyond 64 bits (torch and the
    workers take int64); a float field takes integers (stored as float) but not nan,
    infinity or one too large for a float; a string field refuses control characters (a NUL
    in a path); `list[str]` wants a list of strings. Raises `ConfigError` naming the dotted
    field, what it must be and what it got.
    """
    prefix = f"{section}." if section else ""
    for f in dataclasses.fields(obj):
        cls: type = type(obj)
        expected = _field_types(cls)[f.name]
        value = getattr(obj, f.name)
        wanted = _type_mismatch(value, expected)
        if wanted is not None:
            raise ConfigError(f"{prefix}{f.name}: must be {wanted}, got "
                              f"{describe(value, integer=expected is int)}")
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
        if not isinstance(value, int) or isinstance(value, bool):
            return "an integer"
        return None if -INT64 <= value < INT64 else "an integer in [-2**63, 2**63)"
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "a number"
        return None if finite_number(value) else "a finite number"
    if expected is str:
        if not isinstance(value, str):
            return "a string (in quotes)"
        return None if value.isprintable() else "text without control characters"
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


def describe(value: Any, *, integer: bool = False) -> str:
    """How a wrong value reads in an error, with the likely fix when there is one
    (`integer`: the field wants an integer, so `32.0` reads "write 32")."""
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
    if integer and isinstance(value, float) and value.is_integer() and abs(value) < INT64:
        return f"{value!r} (write {int(value)})"
    if isinstance(value, dict):
        return "a table"
    text = repr(value)
    if len(text) > 60:
        text = f"{text[:20]}...{text[-8:]} ({len(text)} characters)"
    return f"{text} ({type(value).__name__})"


def default_of(obj: Any, name: str) -> Any:
    """The default of dataclass `obj`'s field `name`."""
    return next(f.default for f in dataclasses.fields(obj) if f.name == name)
