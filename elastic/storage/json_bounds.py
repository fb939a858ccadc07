"""The one bounded JSON reader for what Baton reads from run and dataset directories.

Contract
--------
Everything Baton parses from a run or dataset directory (manifests, receipts, ``run.json``,
``sessions.json``, ``generation.json``, ``lease.json``, ``reason.json``, metrics lines, a
dataset's ``dataset.json``) is untrusted: a crafted or damaged file must be one line of
error, never a traceback, an overflow or an allocation the size of the file's claims.
``loads(data, where)`` is that reader:

* **Size**: ``data`` longer than ``max_bytes`` (default ``MAX_JSON_BYTES``) is refused before
  it is parsed (the storage layer also refuses to read a longer file: ``Storage.read_json``;
  ``too_large`` is that error).
* **Depth**: arrays and objects nested deeper than ``max_depth`` (default ``MAX_DEPTH``) are
  refused, however deep (a 100,000-deep ``[[[...]]]`` is one error, not a ``RecursionError``
  in the parser or in whatever walks the value later).
* **Numbers**: an integer of more than ``MAX_INT_DIGITS`` digits is refused (Python would
  parse it, slowly, and nothing Baton writes is that long: 128-bit generator states fit);
  ``NaN``, ``Infinity`` and a float literal beyond the float range are refused unless
  ``nonfinite=True`` (metrics records and a snapshot's JSON state may hold a diverged loss or
  a ``float("inf")`` sentinel, which ``json.dumps`` writes as such).
* Any failure is ``JSONBoundsError`` (a ``ValueError``) whose message is one line starting
  with ``where`` and saying what is wrong.

The number rules shared with recipes and records live here too, so every reader applies the
same ones: ``INT64`` (the 64-bit bound torch and the workers take), ``is_int64(value)`` (a JSON
integer, not a bool, within it) and ``finite_number(value)`` (a number, not a bool, that is
finite; a huge integer is not, and never raises ``OverflowError``).

Imports: the standard library only (the storage layer and ``data_state`` use it).
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeGuard

MAX_JSON_BYTES = 256 << 20  # far beyond any run record; a manifest passes its own bound
MAX_DEPTH = 128  # real files nest < 20 deep (a manifest's state checks its own 64 on top)
MAX_INT_DIGITS = 40  # 2**128 has 39 digits
INT64 = 1 << 63


class JSONBoundsError(ValueError):
    """A JSON file is malformed or beyond the reader's bounds (module contract)."""


def too_large(where: str, size: int, max_bytes: int) -> JSONBoundsError:
    """The error for a file of ``size`` bytes where at most ``max_bytes`` may be read."""
    return JSONBoundsError(f"{where}: {size} bytes, more than the {max_bytes} such a file may "
                           "hold; refused")


def is_int64(value: Any) -> TypeGuard[int]:
    """A JSON integer (not a bool) in [-2**63, 2**63)."""
    return type(value) is int and -INT64 <= value < INT64


def finite_number(value: Any) -> TypeGuard[int | float]:
    """A number (not bool) that is finite; a huge integer is not (no OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def loads(data: bytes | str, where: str, *, max_bytes: int = MAX_JSON_BYTES,
          max_depth: int = MAX_DEPTH, nonfinite: bool = False) -> Any:
    """The JSON value in ``data`` within the module's bounds, else ``JSONBoundsError``."""
    if len(data) > max_bytes:
        raise too_large(where, len(data), max_bytes)

    def parse_float(text: str) -> float:
        value = float(text)
        if not nonfinite and not math.isfinite(value):
            raise JSONBoundsError(f"{where}: the number {text[:40]} is beyond the float range")
        return value

    def parse_constant(name: str) -> float:
        if not nonfinite:
            raise JSONBoundsError(f"{where}: {name} is not a number this file may hold")
        return float(name)

    try:
        value = json.loads(data, parse_float=parse_float, parse_constant=parse_constant)
    except JSONBoundsError:
        raise
    except RecursionError:  # the C parser's own guard, far below a real stack overflow
        raise JSONBoundsError(f"{where}: nested more than {max_depth} levels deep") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        detail = " ".join(str(err).split())[:200] or type(err).__name__
        raise JSONBoundsError(f"{where} is not valid JSON ({detail})") from None
    if type(value) is int and not -_INT_LIMIT < value < _INT_LIMIT:
        raise JSONBoundsError(f"{where}: an integer of more than {MAX_INT_DIGITS} digits")
    problem = _out_of_bounds(value, max_depth) if isinstance(value, dict | list) else None
    if problem:
        raise JSONBoundsError(f"{where}: {problem}")
    return value


_INT_LIMIT = 10 ** MAX_INT_DIGITS


def _out_of_bounds(value: Any, limit: int) -> str | None:
    """What of ``value`` is beyond the bounds (nesting deeper than ``limit``, an integer of
    more than ``MAX_INT_DIGITS`` digits), or None. Level by level, iterative: the check must
    not recurse, and it touches each element once (a manifest holds ~10^5 of them)."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return f"nested more than {limit} levels deep"
        below: list[Any] = []
        for node in level:
            for child in node.values() if type(node) is dict else node:
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
                elif kind is int and not -_INT_LIMIT < child < _INT_LIMIT:
                    return f"an integer of more than {MAX_INT_DIGITS} digits"
        level = below
    return None
