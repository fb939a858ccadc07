"""A rank's share of each fixed global batch of a stream read in units (a Ray Data pipeline).

Contract:
- `StreamShareLoader(feeder, units=, fingerprint=, global_batch=, seed=, microbatch_size=1,
  shuffle=True, drop_last=False, collate_fn=None, dtypes=None, on_error="raise", rank=,
  world_size=)` walks the
  stream of `units` units that `feeder` (`data_state.stream_feeder.UnitFeeder`, or a proxy of
  one) reads, in the order of `data_state.stream_order` — a function of `(seed, epoch)` and
  the data only — one step of `global_batch` rows at a time, at any world size. A unit that
  fails to read raises `UnitReadError`, or, `on_error="skip"`, holds no rows (the feeder).
- `next_step()` returns this rank's share of the step at the committed cursor as a
  `data_state.StepShare`, the same until `advance()`, which moves the cursor past the step
  (`pending` in between). The step's rows form microbatches of `microbatch_size` shared out in
  contiguous blocks, as `data_state.ShareLoader` shares them: an idle rank gets the first
  microbatch as a stand-in with weight 0. `sample_indices` are the rows' identities
  (`stream_order.sample_id`). The batch is `collate_fn` of the rows as a dict of NumPy arrays
  (Ray's `iter_torch_batches` convention), by default that dict as torch tensors (`dtypes`).
- `state_dict()` is JSON, without rank: the data's fingerprint, seed, shuffle, the cursor, and
  the digest of the unit the cursor stands in (`UnitFeeder.digest`). `load_state_dict` refuses
  (a one-line `ValueError` naming the field) another dataset, seed or shuffle, and a unit whose
  rows are not the ones the snapshot saw: a pipeline that is not a function of its files and
  `(seed, epoch)` (randomness in a UDF), or files changed since. It reads only the units from
  the cursor on: what was consumed is not read again.
- `steps_per_epoch` raises `TypeError`: a stream's length is known once it is read (as
  `len()` of Ray's iterators). `reshard(rank=, world_size=)` changes the share in place.
  `close()` stops the prefetch, and closes the feeder too if `owns_feeder`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from data_state.cursor import share
from data_state.share_loader import StepShare
from data_state.stream_order import (
    Piece,
    StreamCursor,
    piece_rows,
    plan_step,
    row_order,
    sample_id,
    unit_order,
)

FORMAT = "baton.stream/1"
READ_AHEAD_UNITS = 2


class StreamShareLoader:
    """See the module docstring."""

    allow_idle_ranks = True

    def __init__(self, feeder: Any, *, units: int, fingerprint: str, global_batch: int,
                 seed: int, microbatch_size: int = 1, shuffle: bool = True,
                 drop_last: bool = False,
                 collate_fn: Callable[[dict[str, np.ndarray]], Any] | None = None,
                 dtypes: Any = None, on_error: str = "raise", rank: int = 0,
                 world_size: int = 1, owns_feeder: bool = False) -> None:
        if units < 1:
            raise ValueError("the dataset has no unit to read (no file, no read task)")
        if global_batch < 1 or microbatch_size < 1 or global_batch % microbatch_size:
            raise ValueError(f"global_batch ({global_batch}) must be a positive multiple of "
                             f"microbatch_size ({microbatch_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.feeder, self.units, self.fingerprint = feeder, units, fingerprint
        self.global_batch, self.microbatch_size = global_batch, microbatch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.collate_fn, self.dtypes, self.on_error = collate_fn, dtypes, on_error
        self.rank, self.world_size = rank, world_size
        self.owns_feeder = owns_feeder
        self._counts: dict[int, int] = {}
        self._cursor = StreamCursor()
        self._handed: StepShare | None = None
        self._after: StreamCursor | None = None
        self._ahead: tuple[tuple[StreamCursor, int, int], Future[Any]] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="baton-stream-prefetch")

    # ------------------------------------------------------------------ the loader's face

    @property
    def cursor(self) -> StreamCursor:
        return self._cursor

    @property
    def steps_per_epoch(self) -> int:
        raise TypeError("len(loader): a Ray Dataset's length is known only once it is read; "
                        "loop with `for batch in loader` (one epoch) instead")

    @property
    def pending(self) -> bool:
        return self._handed is not None

    def next_step(self) -> StepShare:
        if self._handed is None:
            self._handed, self._after = self._share_at(self._cursor)
        return self._handed

    def advance(self) -> None:
        if self._handed is None:
            self.next_step()
        assert self._after is not None
        self._cursor, self._handed, self._after = self._after, None, None
        self._prefetch()

    def state_dict(self) -> dict[str, Any]:
        cursor = self._cursor
        return {"format": FORMAT, "fingerprint": self.fingerprint, "seed": self.seed,
                "shuffle": self.shuffle, "cursor": cursor.to_dict(),
                "digest": self._digest_at(cursor)}

    def load_state_dict(self, state: Any) -> None:
        cursor = self.check_state(state)
        digest = self._digest_at(cursor)
        if digest != state.get("digest"):
            unit = self._unit_at(cursor)
            raise ValueError(
                f"the pipeline's rows of {self._label(unit)} are not the ones the snapshot "
                "recorded: its output must depend only on its files and (seed, epoch): seed "
                "the randomness of map/map_batches functions, and keep the files unchanged")
        self._cursor, self._handed, self._after = cursor, None, None
        self._drop_prefetch()

    def check_state(self, state: Any) -> StreamCursor:
        """The cursor of `state`, or a one-line `ValueError` naming what does not fit."""
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        if found != FORMAT:
            raise ValueError(f"data state format is {found!r}, not {FORMAT}: this snapshot "
                             "was taken with another loader")
        for name, mine in (("fingerprint", self.fingerprint), ("seed", self.seed),
                           ("shuffle", self.shuffle)):
            if state.get(name) != mine:
                raise ValueError(f"data state {name} is {state.get(name)!r}, the live loader's "
                                 f"{mine!r}: another dataset or order than the snapshot's")
        cursor = StreamCursor.from_dict(state.get("cursor"))
        if cursor.ordinal > self.units:
            raise ValueError(f"data state cursor ordinal {cursor.ordinal} is past the "
                             f"dataset's {self.units} units")
        return cursor

    def reshard(self, *, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self._handed, self._after = None, None
        self._drop_prefetch()

    def close(self) -> None:
        self._drop_prefetch()
        self._pool.shutdown(wait=True)
        if self.owns_feeder:
            self.feeder.close()

    def __enter__(self) -> StreamShareLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ steps

    def _count(self, unit: int) -> int:
        if unit not in self._counts:
            self._counts[unit] = int(self.feeder.count(unit, self.on_error))
        return self._counts[unit]

    def _share_at(self, cursor: StreamCursor) -> tuple[StepShare, StreamCursor]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (cursor, self.rank, self.world_size):
            return ahead[1].result()
        if ahead is not None:
            ahead[1].cancel()
        return self._build(cursor)

    def _build(self, cursor: StreamCursor) -> tuple[StepShare, StreamCursor]:
        start, pieces, after = plan_step(cursor, units=self.units,
                                         global_batch=self.global_batch,
                                         drop_last=self.drop_last, seed=self.seed,
                                         shuffle=self.shuffle, count=self._count)
        epoch = start.epoch
        rows = sum(p.rows for p in pieces)
        microbatches = -(-rows // self.microbatch_size)
        mine = share(microbatches, rank=self.rank, world_size=self.world_size)
        idle = not mine
        first, last = (0, 1) if idle else (mine.start, mine.stop)
        part = piece_rows(pieces, first * self.microbatch_size,
                          min(last * self.microbatch_size, rows))
        table, ids = self._read(part, epoch)
        self.feeder.read_ahead(self._units_after(after))
        step_share = StepShare(
            batch=self._collate(table), sample_indices=() if idle else tuple(ids),
            step_samples=rows, microbatch_size=self.microbatch_size,
            num_microbatches=microbatches,
            weight=0.0 if idle else self.world_size * len(ids) / rows,
            step=cursor.step + 1, epoch=epoch)
        return step_share, after

    def _read(self, pieces: list[Piece], epoch: int) -> tuple[pa.Table, list[int]]:
        tables: list[pa.Table] = []
        ids: list[int] = []
        for piece in pieces:
            count = self._count(piece.unit)
            rows = row_order(count, self.seed, epoch, piece.unit, self.shuffle,
                             np.arange(piece.start, piece.stop))
            tables.append(self.feeder.rows(piece.unit, rows, self.on_error))
            ids.extend(sample_id(piece.unit, int(r)) for r in rows)
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        return table, ids

    def _collate(self, table: pa.Table) -> Any:
        from ray.data.block import BlockAccessor
        from ray.data.util.torch_utils import convert_ndarray_batch_to_torch_tensor_batch

        batch = BlockAccessor.for_block(table).to_batch_format("numpy")
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        return convert_ndarray_batch_to_torch_tensor_batch(batch, dtypes=self.dtypes)

    def _units_after(self, cursor: StreamCursor) -> list[int]:
        order = unit_order(self.units, self.seed, cursor.epoch, self.shuffle)
        return [order(o) for o in range(cursor.ordinal,
                                        min(self.units, cursor.ordinal + READ_AHEAD_UNITS + 1))]

    def _unit_at(self, cursor: StreamCursor) -> int:
        ordinal = min(cursor.ordinal, self.units - 1)
        return unit_order(self.units, self.seed, cursor.epoch, self.shuffle)(ordinal)

    def _digest_at(self, cursor: StreamCursor) -> str:
        return str(self.feeder.digest(self._unit_at(cursor), self.on_error))

    def _label(self, unit: int) -> str:
        labels = getattr(self.feeder, "labels", None)
        return labels[unit] if labels else f"unit {unit}"

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self) -> None:
        key = (self._cursor, self.rank, self.world_size)
        self._ahead = (key, self._pool.submit(self._build, self._cursor))

    def _drop_prefetch(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].cancel()
