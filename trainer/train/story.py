"""The trainer's rule for a snapshot: its step, the optimizer's step counts, the schedule's
position and the data cursor tell one story.

`register_story(registry, components, progress_key=, progress=)` adds `StoryRule` to a
Session's registry (`elastic.state.registry.StateRegistry.add_rule`) and registers
`DataOrigin` under `ORIGIN_KEY` (optional: a snapshot without one restores, checked less).
`components` are the live components by key (`optim`, `sched`, `data`), told apart by type.
Before a restore writes a byte of a live tensor the rule checks the snapshot's JSON state and
the optimizer's `step` values (read first, verified) and refuses in one `ValueError` line
naming the field (the registry makes it a `SnapshotMisfitError`: nothing is quarantined nor
restored past; the newest snapshot that tells one story is named for a rewind). With T = the
snapshot's `<progress_key>.step`:

* T is an integer in [0, 2**62).
* A `torch.optim` optimizer: every parameter's `step` is a whole number in [0, T] (fewer:
  skipped updates, fp16 overflows, a parameter without a gradient yet; more is refused).
* The schedule: Baton's `LrSchedule` is at T exactly (stepped every step, skipped or not); a
  torch LR scheduler's `last_epoch` is at most T (per step, or per epoch) and its
  `_step_count`, where it keeps one, is `last_epoch + 1`.
* A world-size-free loader's cursor (`data_state.ResumableLoader` and kin) fits the live loader
  (`check_state`), is not at an epoch's end (no Baton loader writes one), and every epoch took a
  step (`epoch` <= T). Where the snapshot records its `DataOrigin` (the step, cursor, global
  batch and tail policy its session started from: each session's own, so `data.global_batch`
  may change between sessions), the cursor is exactly where T minus that step steps of that
  global batch lead from that cursor (`DataCursor.after_steps`).

`DataOrigin(loader, progress)`'s state is that origin; after every load (`loaded`) the rule
moves it to the restored step and cursor, with the live global batch, so the snapshots a
session writes name the point it started from. Only the check reads a saved origin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from data_state import LAST_EPOCH, DataCursor
from elastic.format import TENSOR_TAG
from elastic.state import StateRegistry
from trainer.train.optim import LrSchedule

ORIGIN_KEY = "data_origin"
_MAX_STEP = 1 << 62


class DataOrigin:
    """Where this session's data position started (module contract)."""

    def __init__(self, loader: Any, progress: Any) -> None:
        self.loader, self.progress = loader, progress
        self.anchor()

    def anchor(self) -> None:
        """The origin is now: the session's step and the loader's committed cursor."""
        cursor = self.loader.cursor
        self._state = {"step": int(self.progress.step), "epoch": cursor.epoch,
                       "samples_consumed": cursor.samples_consumed,
                       "global_batch": int(self.loader.global_batch),
                       "drop_last": bool(self.loader.drop_last)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing: a saved origin only serves the check; `StoryRule.loaded` re-anchors."""


def register_story(registry: StateRegistry, components: Mapping[str, Any], *,
                   progress_key: str, progress: Any) -> None:
    """Add the rule, and the data origin when the data is a world-size-free loader."""
    data = next(((k, c) for k, c in components.items() if _is_loader(c)), None)
    origin = DataOrigin(data[1], progress) if data is not None else None
    if origin is not None:
        registry.register(ORIGIN_KEY, origin, optional=True)
    registry.add_rule(StoryRule(components, progress_key, origin))


def _is_loader(obj: Any) -> bool:
    return all(hasattr(obj, n) for n in ("check_state", "cursor", "global_batch", "drop_last",
                                         "dataset"))


class StoryRule:
    """The rule of the module contract (an `elastic.state.registry.SnapshotRule`)."""

    def __init__(self, components: Mapping[str, Any], progress_key: str,
                 origin: DataOrigin | None) -> None:
        self.progress_key, self.origin = progress_key, origin
        self.optim = [(k, c) for k, c in components.items()
                      if isinstance(c, torch.optim.Optimizer)
                      and type(c).__module__.startswith("torch.optim")]
        self.sched = [(k, c) for k, c in components.items()
                      if isinstance(c, (LrSchedule, torch.optim.lr_scheduler.LRScheduler))]
        self.data = [(k, c) for k, c in components.items() if _is_loader(c)]

    def scalars(self, skeletons: Mapping[str, Any]) -> list[str]:
        return [ref for key, _ in self.optim for _, ref in _param_steps(skeletons.get(key))
                if isinstance(ref, str)]

    def check(self, skeletons: Mapping[str, Any], scalars: Mapping[str, float]) -> None:
        trainer = skeletons.get(self.progress_key)
        step = trainer.get("step") if isinstance(trainer, dict) else None
        if type(step) is not int or not 0 <= step < _MAX_STEP:
            raise ValueError(f"state {self.progress_key}.step is {step!r}, not a step count "
                             "in [0, 2**62)")
        where = f"{self.progress_key}.step {step}"
        for key, _ in self.optim:
            _check_optimizer(key, skeletons.get(key), scalars, step, where)
        for key, sched in self.sched:
            if key in skeletons:
                _check_schedule(key, sched, skeletons[key], step, where)
        for key, loader in self.data:
            if key in skeletons:
                _check_data(key, loader, skeletons[key], skeletons.get(ORIGIN_KEY), step,
                            where)

    def loaded(self) -> None:
        if self.origin is not None:
            self.origin.anchor()


def _param_steps(saved: Any) -> list[tuple[str, Any]]:
    """(fqn, the tensor name or number) of every parameter's saved `step`."""
    state = saved.get("state") if isinstance(saved, dict) else None
    out = []
    for fqn, entry in state.items() if isinstance(state, dict) else ():
        value = entry.get("step") if isinstance(entry, dict) else None
        if isinstance(value, dict):
            value = value.get(TENSOR_TAG)
        if value is not None:
            out.append((fqn, value))
    return out


def _check_optimizer(key: str, saved: Any, scalars: Mapping[str, float], step: int,
                     where: str) -> None:
    for fqn, value in _param_steps(saved):
        count = scalars.get(value) if isinstance(value, str) else value
        if isinstance(count, bool) or not isinstance(count, (int, float)):
            continue  # not read (not a scalar): the shape checks refuse it
        if not (math.isfinite(count) and count == int(count) and 0 <= count <= step):
            raise ValueError(
                f"state {key}.state.{fqn}.step is {count:g} but {where}: an optimizer steps "
                f"at most once per step (a whole number in [0, {step}])")


def _check_schedule(key: str, sched: Any, saved: Any, step: int, where: str) -> None:
    if not isinstance(saved, dict):
        return  # the skeleton check refuses it
    if isinstance(sched, LrSchedule):
        if saved.get("step") != step:
            raise ValueError(f"state {key}.step is {saved.get('step')!r} but {where}: the "
                             "schedule moves once every step, so the two are equal")
        return
    last, count = saved.get("last_epoch"), saved.get("_step_count")
    if type(last) is int and not last <= step:
        raise ValueError(f"state {key}.last_epoch is {last} but {where}: a scheduler steps "
                         "at most once per step")
    if type(last) is int and type(count) is int and count != last + 1:
        raise ValueError(f"state {key}._step_count is {count} but {key}.last_epoch is {last}: "
                         "a scheduler counts both at every step (_step_count = last_epoch + 1)")


def _check_data(key: str, loader: Any, saved: Any, origin: Any, step: int,
                where: str) -> None:
    loader.check_state(saved)  # another dataset or seed, counters out of range
    cursor = DataCursor.from_dict(saved)
    size = len(loader.dataset)
    if cursor.samples_consumed >= size:
        raise ValueError(f"state {key}.samples_consumed is {cursor.samples_consumed}, the end "
                         f"of its epoch of {size} samples: a Baton loader moves such a cursor "
                         "to the next epoch, so none wrote it")
    if cursor.epoch + (cursor.samples_consumed > 0) > step:
        raise ValueError(f"state {key} is at epoch {cursor.epoch}, samples_consumed "
                         f"{cursor.samples_consumed} but {where}: every epoch takes a step")
    if isinstance(origin, dict):
        _check_origin(key, cursor, origin, size, step, where)


def _check_origin(key: str, cursor: DataCursor, origin: dict[str, Any], size: int,
                  step: int, where: str) -> None:
    fields = {"step": (0, step), "epoch": (0, LAST_EPOCH),
              "samples_consumed": (0, size), "global_batch": (1, size)}
    for name, (low, high) in fields.items():
        value = origin.get(name)
        if type(value) is not int or not low <= value <= high:
            raise ValueError(f"state {ORIGIN_KEY}.{name} is {value!r}, not an integer in "
                             f"[{low}, {high}] ({where})")
    drop_last = origin.get("drop_last")
    if type(drop_last) is not bool:
        raise ValueError(f"state {ORIGIN_KEY}.drop_last is {drop_last!r}, not a boolean")
    batch, start = origin["global_batch"], origin["step"]
    begin = DataCursor(cursor.dataset, cursor.seed, origin["epoch"], origin["samples_consumed"])
    try:
        want = begin.after_steps(step - start, num_samples=size, global_batch=batch,
                                 drop_last=drop_last)
        got = cursor.normalized(num_samples=size, global_batch=batch, drop_last=drop_last)
    except ValueError as err:
        raise ValueError(f"state {key} cannot follow from {ORIGIN_KEY}: {err}") from err
    if (got.epoch, got.samples_consumed) != (want.epoch, want.samples_consumed):
        raise ValueError(
            f"state {key} is at epoch {cursor.epoch}, samples_consumed "
            f"{cursor.samples_consumed}, but {where}: {step - start} steps of global_batch "
            f"{batch} from the session's start at step {start} (epoch {begin.epoch}, "
            f"samples_consumed {begin.samples_consumed}) end at epoch {want.epoch}, "
            f"samples_consumed {want.samples_consumed}")
