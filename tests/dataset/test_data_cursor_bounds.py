"""The data cursor's counters are bounded (issue 36, point 8): a cursor never moves past the
last epoch it can hold, and a loader refuses one there before it loads anything.

Before, a cursor at the end of epoch 2**62 - 1 was accepted, rolled over into epoch 2**62
on the next step and was committed so: every later restore refused it (`from_dict` wants
epochs below 2**62). `after_steps` (where n steps lead, at once) is `advanced` n times.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_state.cursor import LAST_EPOCH, CursorRangeError, DataCursor
from data_state.loader import ResumableLoader


class _Samples:
    """A numpy sample source of `n` sequences of 4 tokens."""

    def __init__(self, n: int) -> None:
        self.n, self.fingerprint = n, f"samples-{n}"

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return np.repeat(np.asarray(indices, dtype=np.int64)[:, None], 4, axis=1)


def test_a_cursor_never_leaves_its_last_epoch() -> None:
    end = DataCursor("d", 1, LAST_EPOCH, 96)  # 100 samples, global batch 8: no step left
    with pytest.raises(CursorRangeError, match=f"'epoch' is {LAST_EPOCH}, the last epoch"):
        end.normalized(num_samples=100, global_batch=8)
    with pytest.raises(CursorRangeError):
        DataCursor("d", 1, LAST_EPOCH, 88).advanced(num_samples=100, global_batch=8)
    with pytest.raises(CursorRangeError):
        DataCursor("d", 1, LAST_EPOCH - 1, 0).after_steps(24, num_samples=100, global_batch=8)
    with pytest.raises(ValueError, match="'epoch' must be an integer in"):
        DataCursor.from_dict({**end.to_dict(), "epoch": LAST_EPOCH + 1})


def test_a_loader_refuses_a_cursor_at_the_end_of_the_last_epoch_and_never_commits_past_it(
        ) -> None:
    with ResumableLoader(_Samples(100), global_batch=8, microbatch_size=4, seed=1) as loader:
        fresh = loader.state_dict()
        at_end = {**fresh, "epoch": LAST_EPOCH, "samples_consumed": 96}
        with pytest.raises(CursorRangeError) as refused:
            loader.check_state(at_end)
        assert "\n" not in str(refused.value)
        with pytest.raises(CursorRangeError):
            loader.load_state_dict(at_end)
        assert loader.state_dict() == fresh  # nothing loaded

        last_step = {**fresh, "epoch": LAST_EPOCH, "samples_consumed": 88}
        loader.load_state_dict(last_step)
        assert len(loader.next_step()) == 2  # the epoch's last step trains
        with pytest.raises(CursorRangeError):
            loader.advance()  # but the cursor cannot move past it
        assert loader.state_dict() == last_step  # nothing past it to commit


@settings(max_examples=300, deadline=None)
@given(num_samples=st.integers(1, 60), batch=st.integers(1, 60), drop_last=st.booleans(),
       epoch=st.integers(0, 4), consumed=st.integers(0, 60), steps=st.integers(0, 200))
def test_after_steps_is_advanced_n_times(num_samples: int, batch: int, drop_last: bool,
                                         epoch: int, consumed: int, steps: int) -> None:
    batch, consumed = min(batch, num_samples), min(consumed, num_samples)
    kw = {"num_samples": num_samples, "global_batch": batch, "drop_last": drop_last}
    start = DataCursor("d", 1, epoch, consumed)
    cursor = start.normalized(**kw)
    for _ in range(steps):
        cursor = cursor.advanced(**kw)
    assert start.after_steps(steps, **kw) == cursor
