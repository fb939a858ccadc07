"""The epoch order of a stream read in units, and where each step's rows come from. Pure: no Ray.

A Ray Data pipeline (`data_state.ray_units`) is read as *units*, its read tasks, each run
through the whole pipeline on its own: unit k's output is `count(k)` rows, known once the unit
is read. This module orders those rows and walks them in fixed global batches:

- Epoch e reads the units in `unit_order(units, seed, e, shuffle)` (a keyed permutation of
  [0, units); 0, 1, ... unshuffled) and the rows of unit k at positions 0, 1, ... in
  `row_order(count, seed, e, k, shuffle)` (a keyed permutation of its rows). Both depend on
  `(seed, epoch)` and the data only, never on the world size.
- `StreamCursor(epoch, ordinal, offset, consumed, step)`: the next row to train is position
  `offset` of the unit at place `ordinal` of the epoch's unit order; `consumed` rows of the
  epoch came before it; `step` steps were taken since the stream began. JSON, no rank, so a
  snapshot taken at one world size continues at any other.
- `plan_step(cursor, ...)` gives the step at `cursor`: the settled cursor it starts at, its
  rows as `Piece`s (a unit and a range of its positions) and the cursor after it. A step is
  `global_batch` rows; at an epoch's end a shorter tail is a step of its own
  (`drop_last=False`) or skipped (`drop_last=True`); an epoch with no step is an error.
  `settle(cursor, ...)` moves a cursor standing at its epoch's end (no step left there) to the
  next epoch's start, so that the cursor a snapshot holds names the next step's epoch.
- `piece_rows(pieces, start, stop)` cuts the step's rows [start, stop) (a rank's share) out of
  its pieces. `sample_id(unit, row)`: a row's identity for audits (unit in the high 32 bits).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from data_state.order import Permutation

Count = Callable[[int], int]  # unit -> rows of its output (reads the unit if need be)
_MAX = 1 << 62


class StreamEmptyError(ValueError):
    """An epoch of the stream holds no step."""


@dataclass(frozen=True)
class StreamCursor:
    epoch: int = 0
    ordinal: int = 0
    offset: int = 0
    consumed: int = 0
    step: int = 0

    @property
    def samples_consumed(self) -> int:
        """Rows of the epoch before the cursor (as `DataCursor` names it)."""
        return self.consumed

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: Any) -> StreamCursor:
        """A cursor from its JSON; a `ValueError` naming the field if it is not one."""
        if not isinstance(state, dict):
            raise ValueError(f"a stream cursor is a JSON object, got {type(state).__name__}")
        values = {}
        for name in ("epoch", "ordinal", "offset", "consumed", "step"):
            value = state.get(name)
            if type(value) is not int or not 0 <= value < _MAX:
                raise ValueError(f"stream cursor field {name!r} is {value!r}, not an integer "
                                 "in [0, 2**62)")
            values[name] = value
        return cls(**values)


@dataclass(frozen=True)
class Piece:
    unit: int
    start: int  # positions in the unit's epoch row order
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def unit_order(units: int, seed: int, epoch: int, shuffle: bool) -> Callable[[int], int]:
    """Place in the epoch -> unit."""
    if not shuffle:
        return lambda ordinal: ordinal
    permutation = Permutation(units, seed=seed, epoch=epoch)
    return lambda ordinal: int(permutation(ordinal))


def row_order(count: int, seed: int, epoch: int, unit: int, shuffle: bool,
              positions: np.ndarray) -> np.ndarray:
    """Rows of unit `unit` (of `count` rows) at `positions` of its epoch order."""
    positions = np.asarray(positions, dtype=np.int64)
    if not shuffle or count <= 1:
        return positions
    return np.asarray(Permutation(count, seed=_unit_seed(seed, unit), epoch=epoch)(positions))


def _unit_seed(seed: int, unit: int) -> int:
    digest = hashlib.blake2b(f"baton.stream/1:{seed}:{unit}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63, as Permutation asks


def _walk(cursor: StreamCursor, rows: int, units: int, order: Callable[[int], int],
          count: Count) -> tuple[list[Piece], StreamCursor]:
    """Up to `rows` rows from `cursor` within its epoch, and the cursor after them."""
    pieces: list[Piece] = []
    ordinal, offset, taken = cursor.ordinal, cursor.offset, 0
    while taken < rows and ordinal < units:
        unit = order(ordinal)
        left = count(unit) - offset
        if left <= 0:
            ordinal, offset = ordinal + 1, 0
            continue
        n = min(left, rows - taken)
        pieces.append(Piece(unit, offset, offset + n))
        taken += n
        offset += n
        if offset >= count(unit):
            ordinal, offset = ordinal + 1, 0
    return pieces, replace(cursor, ordinal=ordinal, offset=offset,
                           consumed=cursor.consumed + taken)


def _has_step(cursor: StreamCursor, *, units: int, global_batch: int, drop_last: bool,
              seed: int, shuffle: bool, count: Count) -> bool:
    order = unit_order(units, seed, cursor.epoch, shuffle)
    pieces, _ = _walk(cursor, global_batch if drop_last else 1, units, order, count)
    taken = sum(p.rows for p in pieces)
    return taken == global_batch if drop_last else taken > 0


def settle(cursor: StreamCursor, *, units: int, global_batch: int, drop_last: bool,
           seed: int, shuffle: bool, count: Count) -> StreamCursor:
    """`cursor`, or the next epoch's start if no step is left in its epoch (module doc)."""
    kwargs = dict(units=units, global_batch=global_batch, drop_last=drop_last, seed=seed,
                  shuffle=shuffle, count=count)
    if _has_step(cursor, **kwargs):  # type: ignore[arg-type]
        return cursor
    following = StreamCursor(epoch=cursor.epoch + 1, step=cursor.step)
    if not _has_step(following, **kwargs):  # type: ignore[arg-type]
        tail = "with drop_last=True, " if drop_last else ""
        raise StreamEmptyError(f"the dataset holds no step: {tail}epoch {following.epoch} has "
                               f"fewer than {global_batch if drop_last else 1} row(s)")
    return following


def plan_step(cursor: StreamCursor, *, units: int, global_batch: int, drop_last: bool,
              seed: int, shuffle: bool, count: Count
              ) -> tuple[StreamCursor, list[Piece], StreamCursor]:
    """The step at `cursor`: where it starts (`cursor` settled: its epoch is the step's),
    its pieces, and the settled cursor after it."""
    kwargs = dict(units=units, global_batch=global_batch, drop_last=drop_last, seed=seed,
                  shuffle=shuffle, count=count)
    start = settle(cursor, **kwargs)  # type: ignore[arg-type]
    pieces, after = _walk(start, global_batch, units,
                          unit_order(units, seed, start.epoch, shuffle), count)
    return start, pieces, settle(replace(after, step=after.step + 1), **kwargs)  # type: ignore[arg-type]


def piece_rows(pieces: list[Piece], start: int, stop: int) -> list[Piece]:
    """The parts of `pieces` holding the step's rows [start, stop)."""
    out, at = [], 0
    for piece in pieces:
        lo, hi = max(start, at), min(stop, at + piece.rows)
        if lo < hi:
            out.append(Piece(piece.unit, piece.start + lo - at, piece.start + hi - at))
        at += piece.rows
    return out


def sample_id(unit: int, row: int) -> int:
    """A row's identity: its unit and its index in the unit's output (audits, exactly once)."""
    return (unit << 32) | row
