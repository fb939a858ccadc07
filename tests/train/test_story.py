"""A snapshot whose counters do not tell one story (issue 36, point 8), and the data cursor's
last epoch.

Baton's loop (`run_worker`, in this process, the tiny recipe) commits snapshots 4 and 8;
a writer with a bug (the torch-free writer, as a JAX program uses it) commits snapshot 12
from snapshot 8's tensors with its counters edited:

* `trainer.step` and the schedule moved on but the optimizer and the data did not (too high),
  `trainer.step` below the optimizer's step count (too low), the data cursor at the end of
  its epoch: each is refused before a byte of a live tensor is written, in one line naming
  the field and snapshot 8 (the newest that tells one story), nothing moved; a rewind to 8
  then ends where an uninterrupted run ends.
* the cursor one step before the end of the last epoch a cursor can hold (2**62 - 1), its
  origin consistent: refused the same way (every epoch takes a step, and the step stays
  below 2**62), where it used to roll over into an epoch out of range and be committed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from snapshot_compare import assert_same_state, final_state

from data_state.cursor import LAST_EPOCH
from data_state.dataset import TokenDataset
from elastic.errors import FatalRunError
from elastic.portable import PortableRun, write_snapshot
from elastic.store.snapshot_store import SnapshotStore
from trainer.cli import main as baton_main
from trainer.config import load_recipe
from trainer.train.loop import WorkerEnv, run_worker
from trainer.train.story import ORIGIN_KEY

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16
GLOBAL_BATCH = 8  # tiny.toml


def _cfg(run: Path, dataset: str) -> Any:
    return load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
        "eval.every=0", "sketch.rank=0", "snapshots.snapshot_every=4",
        "snapshots.keep_last=10"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> dict[str, Path]:
    """A run stopped (committed) at step 8, and the uninterrupted 16-step reference."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("story")
    run_worker(_cfg(root / "stopped", tiny_dataset), WorkerEnv(stop_after=8))
    run_worker(_cfg(root / "reference", tiny_dataset), WorkerEnv())
    return {"stopped": root / "stopped", "reference": root / "reference"}


def _crafted(trained: dict[str, Path], tmp_path: Path, dataset: str, edit: Any) -> Path:
    """A copy of the stopped run with snapshot 12: snapshot 8's tensors, its state edited
    by `edit(state, samples in an epoch)`."""
    run = tmp_path / "run"
    shutil.copytree(trained["stopped"], run, symlinks=True)
    source = PortableRun(str(run)).read(8)
    state = json.loads(json.dumps(source.state))
    assert state[ORIGIN_KEY]["step"] == 0  # the session's start, as Baton's loop wrote it
    edit(state, len(TokenDataset(dataset, split="train")))
    write_snapshot(str(run), 12, source.tensors, state)
    return run


def _counters(trainer: int, sched: int) -> Any:
    def edit(state: dict[str, Any], size: int) -> None:
        state["trainer"]["step"], state["sched"]["step"] = trainer, sched
    return edit


def _epoch_end(state: dict[str, Any], size: int) -> None:
    state["data"]["samples_consumed"] = size


@pytest.mark.parametrize(("case", "edit", "field"), [
    ("step too high", _counters(12, 12), "state data is at epoch"),
    ("step too low", _counters(6, 6), ".step is 8 but trainer.step 6"),
    ("schedule behind", _counters(12, 8), "state sched.step is 8 but trainer.step 12"),
    ("cursor at the epoch's end", _epoch_end, "the end of its epoch"),
])
def test_counters_that_disagree_are_refused_and_a_rewind_trains_on(
        trained: dict[str, Path], tmp_path: Path, tiny_dataset: str, case: str, edit: Any,
        field: str) -> None:
    run = _crafted(trained, tmp_path, tiny_dataset, edit)
    store = SnapshotStore(str(run))
    with pytest.raises(FatalRunError) as refused:
        run_worker(_cfg(run, tiny_dataset), WorkerEnv())
    message = str(refused.value)
    assert "\n" not in message and "snapshot 12" in message and field in message, message
    assert f"rewind {run} --to 8" in message, message
    assert store.committed_steps() == [4, 8, 12]  # nothing moved, nothing trained

    assert baton_main(["snapshots", "rewind", str(run), "--to", "8"]) == 0
    result = run_worker(_cfg(run, tiny_dataset), WorkerEnv())
    assert (result.start_step, result.step) == (8, STEPS)
    assert_same_state(final_state(trained["reference"], tmp_path, STEPS),
                      final_state(run, tmp_path, STEPS))


def test_a_cursor_in_the_last_epoch_it_can_hold_is_refused(trained: dict[str, Path],
                                                           tmp_path: Path,
                                                           tiny_dataset: str) -> None:
    """The writer put the cursor one step before the end of epoch 2**62 - 1, its origin made
    to agree. Before, it restored, rolled over into epoch 2**62 at step 13 and was committed
    so at 16, a cursor every later restore refuses. Every epoch takes a step, and
    `trainer.step` stays below 2**62: such a cursor is refused before anything is read."""
    def edit(state: dict[str, Any], size: int) -> None:
        last = size // GLOBAL_BATCH * GLOBAL_BATCH - GLOBAL_BATCH  # one step left
        state["trainer"]["step"] = state["sched"]["step"] = 12
        state["data"].update(epoch=LAST_EPOCH, samples_consumed=last)
        state[ORIGIN_KEY].update(step=12, epoch=LAST_EPOCH, samples_consumed=last)

    run = _crafted(trained, tmp_path, tiny_dataset, edit)
    with pytest.raises(FatalRunError) as refused:
        run_worker(_cfg(run, tiny_dataset), WorkerEnv())
    message = str(refused.value)
    assert "\n" not in message and f"state data is at epoch {LAST_EPOCH}" in message, message
    assert "every epoch takes a step" in message and f"rewind {run} --to 8" in message
    assert SnapshotStore(str(run)).committed_steps() == [4, 8, 12]  # nothing trained on it
