"""A stream read in units (`data_state.stream_loader`, `stream_feeder`, `stream_order`), without
Ray: units of uneven sizes (empty ones too) from an in-memory reader.

Checked: every row of an epoch is trained exactly once, in the same steps at any world size; a
run stopped mid-epoch and resumed at another world size trains exactly the rows the
uninterrupted run trains, reading only the units from its position on; the order depends on
(seed, epoch) only; a unit whose rows changed (a UDF drawing randomness, an edited file) is
refused on resume; a unit that fails to read stops the run in one line, or is skipped and
counted the same way on every read.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from stream_steps import walk

from data_state.stream_feeder import UnitFeeder, UnitReadError
from data_state.stream_loader import StreamShareLoader
from data_state.stream_order import StreamCursor, StreamEmptyError, plan_step

COUNTS = [7, 0, 13, 5, 1, 9, 0, 11]  # uneven units, two empty (a filter kept nothing)
ROWS = sum(COUNTS)  # 46
SETTINGS = {"units": len(COUNTS), "fingerprint": "test-data", "global_batch": 8, "seed": 3,
            "microbatch_size": 2, "collate_fn": lambda batch: batch["x"].tolist()}


def _reader(counts: list[int], salt: int = 0, fail: set[int] | None = None) -> Any:
    starts = np.cumsum([0, *counts])

    def read(unit: int) -> pa.Table:
        if fail and unit in fail:
            raise OSError(f"bad record in part-{unit}")
        values = np.arange(starts[unit], starts[unit + 1]) + salt
        return pa.table({"x": values, "y": values * 2})

    return read


def _feeder(counts: list[int] = COUNTS, **kwargs: Any) -> UnitFeeder:
    salt = kwargs.pop("salt", 0)
    fail = kwargs.pop("fail", None)
    return UnitFeeder(_reader(counts, salt, fail), [f"part-{k}" for k in range(len(counts))],
                      **kwargs)


def _loader(feeder: UnitFeeder, **kwargs: Any) -> StreamShareLoader:
    return StreamShareLoader(feeder, **{**SETTINGS, **kwargs})  # type: ignore[arg-type]


def _steps(world: int, steps: int, feeder: UnitFeeder | None = None,
           state: dict[str, Any] | None = None, **kwargs: Any
           ) -> tuple[list[list[int]], dict[str, Any]]:
    """The rows of each step over all ranks (rank order), and the state after them."""
    return walk(feeder or _feeder(), world, steps, list, state, **{**SETTINGS, **kwargs})


def test_an_epoch_trains_every_row_once_in_the_same_steps_at_any_world_size() -> None:
    steps = -(-ROWS // 8)  # 6: five of 8, a tail of 6
    one, _ = _steps(1, steps)
    assert sorted(x for step in one for x in step) == list(range(ROWS))
    assert [len(s) for s in one] == [8, 8, 8, 8, 8, 6]
    for world in (2, 3, 5):  # 5 ranks, 4 microbatches: one rank idle
        many, _ = _steps(world, steps)
        assert many == one


def test_drop_last_skips_the_tail_and_the_next_epoch_is_another_order() -> None:
    two_epochs, _ = _steps(2, 10, drop_last=True)
    first, second = two_epochs[:5], two_epochs[5:]
    assert all(len(s) == 8 for s in two_epochs)
    assert len({x for s in first for x in s}) == 40
    assert first != second  # epoch 1 is another permutation
    unshuffled, _ = _steps(1, 2, shuffle=False)
    assert unshuffled == [list(range(8)), list(range(8, 16))]  # units in order, rows in order


def test_a_resume_mid_epoch_at_another_world_size_trains_what_the_uninterrupted_run_trains(
        ) -> None:
    whole, _ = _steps(2, 9)  # into the second epoch
    head, state = _steps(3, 4)
    assert state["cursor"]["step"] == 4 and json.loads(json.dumps(state)) == state
    feeder = _feeder()
    tail, _ = _steps(1, 5, feeder=feeder, state=state)
    assert head + tail == whole


def test_a_resume_reads_only_the_units_from_its_position_on() -> None:
    _, state = _steps(1, 4)
    cursor = StreamCursor.from_dict(state["cursor"])
    feeder = _feeder(read_ahead=0)
    loader = _loader(feeder)
    loader.load_state_dict(state)
    loader.next_step()
    # Units before the cursor's place in the epoch order were never read again.
    read = set(feeder._counts)
    order_before = {loader._unit_at(StreamCursor(epoch=cursor.epoch, ordinal=o))
                    for o in range(cursor.ordinal)}
    assert read.isdisjoint(order_before - {loader._unit_at(cursor)})
    assert feeder.reads <= len(COUNTS) - cursor.ordinal
    loader.close()


def test_a_unit_whose_rows_changed_since_the_snapshot_is_refused() -> None:
    _, state = _steps(1, 3)
    loader = _loader(_feeder(salt=1000))  # the same files, other rows (a random UDF)
    with pytest.raises(ValueError, match="not the ones the snapshot recorded"):
        loader.load_state_dict(state)
    other = _loader(_feeder(), seed=4)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="cursor field 'offset'"):
        _loader(_feeder()).load_state_dict({**state, "cursor": {**state["cursor"],
                                                                "offset": -1}})


def test_a_unit_that_fails_stops_in_one_line_or_is_skipped_the_same_way_each_time() -> None:
    with pytest.raises(UnitReadError, match=r"part-2 .*OSError: bad record in part-2"):
        _steps(1, 6, feeder=_feeder(fail={2}))
    skipped_a, _ = _steps(2, 4, feeder=_feeder(fail={2}), on_error="skip")
    skipped_b, _ = _steps(3, 4, feeder=_feeder(fail={2}), on_error="skip")
    assert skipped_a == skipped_b
    assert not {x for s in skipped_a for x in s} & set(range(7, 20))  # part-2's rows
    feeder = _feeder(fail={2})
    _steps(1, 5, feeder=feeder, on_error="skip")
    assert list(feeder.skipped()) == [2] and "bad record in part-2" in feeder.skipped()[2]


def test_an_epoch_without_a_step_is_an_error() -> None:
    count = [3, 0, 2].__getitem__
    with pytest.raises(StreamEmptyError, match="fewer than 8"):
        plan_step(StreamCursor(), units=3, global_batch=8, drop_last=True, seed=0,
                  shuffle=True, count=count)
    start, pieces, after = plan_step(StreamCursor(), units=3, global_batch=8, drop_last=False,
                                     seed=0, shuffle=False, count=count)
    assert sum(p.rows for p in pieces) == 5 and after.epoch == 1 and start.epoch == 0


def test_session_data_loader_names_what_a_ray_dataset_does_not_take(tmp_path: Any) -> None:
    """A name no trainer passed, and settings of map-style datasets, are one-line refusals
    before any data is read."""
    import torch
    from torch import nn

    from trainer.train.session import Session
    from trainer.train.session_setup import UsageError

    model = nn.Linear(2, 1)
    session = Session(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      run_uri=str(tmp_path / "run"))
    with pytest.raises(UsageError, match=r"no dataset of that name .* here: none"):
        session.data_loader("train", batch_size=8)
    with pytest.raises(UsageError, match="num_workers is for map-style datasets"):
        session.data_loader("train", batch_size=8, num_workers=2)
    with pytest.raises(UsageError, match="on_error must be 'raise' or 'skip'"):
        session.data_loader("train", batch_size=8, on_error="ignore")
    with pytest.raises(UsageError, match="dtypes and on_error are for a Ray Dataset"):
        session.data_loader([1, 2, 3], batch_size=1, dtypes=torch.float32)
    session.close(commit=False)
