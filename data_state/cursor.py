"""The data cursor — the whole data state of a run — and the pure arithmetic of steps.

- `DataCursor(dataset, seed, epoch, samples_consumed)` is everything needed to continue the
  data stream exactly: the dataset's fingerprint, the shuffle seed, the epoch and how many
  samples of that epoch's order were consumed by committed steps. It holds no rank and no
  world size, so it restores under any `(rank, world_size)`. `to_dict()` is plain JSON;
  `from_dict` validates every field and raises `ValueError` naming it; a loader also refuses
  a cursor further into its epoch than the dataset has samples (it was edited).
- A step consumes the next `global_batch` positions of the epoch's order. When fewer than
  `global_batch` positions remain, the epoch ends: that tail (at most `global_batch - 1`
  samples) is not trained this epoch. The order changes every epoch, so a different tail is
  dropped next time and no sample is systematically left out. Positions count samples, not
  steps, so a run may even resume with a different `global_batch`. With `drop_last=False`
  the tail is trained instead, as one shorter last step (`step_samples`), and the epoch ends
  when every position was used.
- Bounded: `seed` below 2**63, `epoch` and `samples_consumed` below 2**62 (`from_dict`
  refuses anything else). A cursor never moves past `LAST_EPOCH` (2**62 - 1): the step that
  would end that epoch raises `CursorRangeError` instead (a `ValueError`), so a cursor out of
  range is never written. `after_steps(n, ...)` is where n more steps lead, computed at once.
- `step_samples`: the samples of the step at a cursor (`global_batch`, or the tail), in
  `ceil(step_samples / microbatch_size)` microbatches (the last short if the tail does not divide).
- `assign_microbatches` shares a step's microbatches among workers in contiguous, balanced
  blocks: worker `rank` of `world_size` gets microbatches
  `[rank * M // world_size, (rank + 1) * M // world_size)`. Block sizes differ by at most one,
  so any world size up to M works, including ones that do not divide M (`share` is the same
  block without that bound: a rank past M gets an empty block). The trainer must
  therefore weight each microbatch's mean loss by `1 / M` and sum gradients over workers (or,
  with DDP/FSDP's gradient average, by `world_size / M`), never by `1 / (its own count)`, so
  uneven blocks give the same update as one worker doing all M.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

CURSOR_VERSION = 1
# The permutation takes seeds and epochs below 2**63; epochs and positions of a real run stay
# far below 2**62, so every epoch a valid cursor can reach is one it can order.
_LIMITS = {"2**63": 1 << 63, "2**62": 1 << 62}
# The last epoch a cursor holds: one past its end is out of range, so it is never entered
# (a cursor written there would be refused by every later restore).
LAST_EPOCH = (1 << 62) - 1


class CursorRangeError(ValueError):
    """A cursor would move past the last epoch it can hold (`LAST_EPOCH`)."""


@dataclass(frozen=True)
class DataCursor:
    dataset: str  # fingerprint of the dataset split (`TokenDataset.fingerprint`)
    seed: int  # shuffle seed; the order of epoch e is Permutation(n, seed=seed, epoch=e)
    epoch: int = 0
    samples_consumed: int = 0  # positions of this epoch's order used by committed steps

    def to_dict(self) -> dict[str, Any]:
        return {"version": CURSOR_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: Any) -> DataCursor:
        if not isinstance(state, dict):
            raise ValueError(f"data cursor must be a dict, got {type(state).__name__}")
        if type(state.get("version")) is not int or state["version"] != CURSOR_VERSION:
            raise ValueError(
                f"data cursor version is {state.get('version')!r}, this code reads version "
                f"{CURSOR_VERSION}"
            )
        unknown = set(state) - {"version", "dataset", "seed", "epoch", "samples_consumed"}
        if unknown:
            raise ValueError(f"data cursor has unknown fields {sorted(unknown)}")
        if not isinstance(state.get("dataset"), str) or not state["dataset"]:
            raise ValueError("data cursor field 'dataset' must be a non-empty fingerprint string")
        for key, limit in (("seed", "2**63"), ("epoch", "2**62"), ("samples_consumed", "2**62")):
            value = state.get(key)
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not 0 <= value < _LIMITS[limit]:
                raise ValueError(
                    f"data cursor field {key!r} must be an integer in [0, {limit}), got {value!r}"
                )
        return cls(state["dataset"], state["seed"], state["epoch"], state["samples_consumed"])

    def normalized(self, *, num_samples: int, global_batch: int,
                   drop_last: bool = True) -> DataCursor:
        """This cursor, moved to the next epoch if no step is left in this one (no full step
        when `drop_last`, no sample at all otherwise); `CursorRangeError` past `LAST_EPOCH`."""
        left = num_samples - self.samples_consumed
        if left < (global_batch if drop_last else 1):
            if self.epoch >= LAST_EPOCH:
                raise CursorRangeError(
                    f"data cursor field 'epoch' is {self.epoch}, the last epoch a cursor can "
                    "hold (epochs stay below 2**62), and it has no step left: start a new run "
                    "to train further")
            return DataCursor(self.dataset, self.seed, self.epoch + 1, 0)
        return self

    def after_steps(self, steps: int, *, num_samples: int, global_batch: int,
                    drop_last: bool = True) -> DataCursor:
        """Where `steps` more steps of `global_batch` from this cursor lead: what `advanced`
        gives applied `steps` times, computed at once (`CursorRangeError` past `LAST_EPOCH`)."""
        cursor = self.normalized(num_samples=num_samples, global_batch=global_batch,
                                 drop_last=drop_last)
        rest = num_samples - cursor.samples_consumed
        left = rest // global_batch if drop_last else -(-rest // global_batch)
        if steps < left:
            return DataCursor(self.dataset, self.seed, cursor.epoch,
                              cursor.samples_consumed + steps * global_batch)
        per_epoch = steps_per_epoch(num_samples, global_batch, drop_last)
        epochs, within = divmod(steps - left, per_epoch)
        if cursor.epoch + 1 + epochs > LAST_EPOCH:
            raise CursorRangeError(
                f"{steps} steps from epoch {cursor.epoch} lead past the last epoch a cursor "
                "can hold (epochs stay below 2**62)")
        return DataCursor(self.dataset, self.seed, cursor.epoch + 1 + epochs,
                          within * global_batch)

    def advanced(self, *, num_samples: int, global_batch: int,
                 drop_last: bool = True) -> DataCursor:
        """The cursor after committing the step that starts at this cursor."""
        size = step_samples(self, num_samples=num_samples, global_batch=global_batch)
        moved = DataCursor(self.dataset, self.seed, self.epoch, self.samples_consumed + size)
        return moved.normalized(num_samples=num_samples, global_batch=global_batch,
                                drop_last=drop_last)


def step_samples(cursor: DataCursor, *, num_samples: int, global_batch: int) -> int:
    """Samples in the step that starts at (normalized) `cursor`: `global_batch`, or the tail."""
    return min(global_batch, num_samples - cursor.samples_consumed)


def steps_per_epoch(num_samples: int, global_batch: int, drop_last: bool = True) -> int:
    return num_samples // global_batch if drop_last else -(-num_samples // global_batch)


def assign_microbatches(num_microbatches: int, *, rank: int, world_size: int) -> range:
    """The microbatch indices worker `rank` trains in every step (see module docstring)."""
    mine = share(num_microbatches, rank=rank, world_size=world_size)
    if world_size > num_microbatches:
        raise ValueError(
            f"world_size {world_size} is larger than the {num_microbatches} microbatches of a "
            "step, so some workers would get no data: lower microbatch_size, raise "
            "global_batch, or use fewer workers"
        )
    return mine


def share(num_microbatches: int, *, rank: int, world_size: int) -> range:
    """Worker `rank`'s contiguous block of `num_microbatches`; empty for some ranks when
    `world_size > num_microbatches` (callers that allow idle ranks use this directly)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return range(rank * num_microbatches // world_size, (rank + 1) * num_microbatches // world_size)
