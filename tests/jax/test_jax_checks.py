"""The JAX side checks what it reads and writes (issue 36 point 10: 1, 2 and 5). CPU, fp32.

The built-in GPT of recipes/tiny.toml is trained with Baton's worker loop to step 4 (global
batch 8), then continued in JAX. `save_train_state` refuses, in one line naming the field and
the fix, and writes nothing:

* a state whose data cursor was not handed back (`state.data = loader.state_dict()`
  forgotten: the next session would train those samples twice);
* a step and optax count moved ahead of the updates made (the schedule skips steps, the
  cursor is behind);
* an optax count other than the step;
* a weight decay changed in the written param groups, or in `state.settings`.

A run that changed `data.global_batch` between sessions continues in JAX at the last
session's global batch (the snapshot's `data_origin`), and what JAX writes restores in
PyTorch. `load_train_state` refuses a moment whose shape is not its parameter's (it would
broadcast silently in optax), and says once that a run trained with BASIS sketches continues
with exact gradients.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from data_state.dataset import TokenDataset
from data_state.numpy_source import numpy_loader
from elastic.errors import SnapshotMisfitError
from elastic.portable import PortableRun, write_snapshot
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import load_recipe
from trainer.on_jax import JaxTrainState, load_train_state, save_train_state
from trainer.on_jax.load_checks import SketchNotCarriedWarning
from trainer.on_jax.optim import adam_state, set_adam_state
from trainer.train.loop import WorkerEnv, run_worker
from trainer.train.story import ORIGIN_KEY

ROOT = Path(__file__).resolve().parents[2]


def _train(run: Path, dataset: str, stop_after: int | None, *more: str) -> Any:
    torch.set_num_threads(1)
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', "steps=16", "eval.every=0",
        "sketch.rank=0", "snapshots.snapshot_every=4", *more])
    return run_worker(cfg, WorkerEnv(stop_after=stop_after))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("jax-checks")
    _train(root / "torch4", tiny_dataset, 4)
    # A second session at another global batch: its snapshots' data_origin says so.
    shutil.copytree(root / "torch4", root / "rebatched")
    _train(root / "rebatched", tiny_dataset, 8, "data.global_batch=16")
    return {"root": root, "dataset": tiny_dataset}


@pytest.fixture
def torch4(runs: dict[str, Any], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(runs["root"] / "torch4", run)
    return run


def _steps(state: JaxTrainState, n: int, *, hand_back: bool = True) -> None:
    loader = state.loader()
    try:
        for _ in range(n):
            state.train_step(np.concatenate([mb.tokens for mb in loader.next_step()]))
            loader.advance()
        if hand_back:
            state.data = loader.state_dict()
    finally:
        loader.close()


def _refused(run: Path, state: JaxTrainState, *needles: str) -> str:
    """save_train_state refuses in one line holding `needles`, and writes nothing."""
    store = SnapshotStore(str(run))
    before = (store.committed_steps(), store.all_steps())
    with pytest.raises(ValueError) as err:
        save_train_state(str(run), state)
    message = str(err.value)
    assert "\n" not in message, message
    assert f"snapshot {state.step} not written" in message, message
    for needle in needles:
        assert needle in message, message
    assert (store.committed_steps(), store.all_steps()) == before
    return message


# ------------------------------------------------------------------ the data story


def test_a_cursor_not_handed_back_is_refused(torch4: Path) -> None:
    state = load_train_state(str(torch4))
    _steps(state, 4, hand_back=False)
    assert state.step == 8 and state.data["samples_consumed"] == 32  # still step 4's
    _refused(torch4, state, "state data is at epoch 0, samples_consumed 32",
             "4 steps of global_batch 8", "samples_consumed 64", "loader.state_dict()")
    state.data = PortableRun(str(torch4)).read(4).component("data")  # the same, handed over
    _refused(torch4, state, "samples_consumed 32")


def test_a_step_and_count_set_ahead_of_the_updates_are_refused(torch4: Path) -> None:
    state = load_train_state(str(torch4))
    _steps(state, 4)
    ahead = state.step + 4  # four steps of the schedule claimed, never made
    adam = adam_state(state.opt_state)
    state.opt_state = set_adam_state(state.opt_state, ahead, adam.mu, adam.nu)
    state.step = ahead
    _refused(torch4, state, "trainer.step 12", "8 steps of global_batch 8",
             "samples_consumed 96", "samples_consumed 64")


def test_an_optax_count_other_than_the_step_is_refused(torch4: Path) -> None:
    state = load_train_state(str(torch4))
    _steps(state, 2)
    state.step += 1
    _refused(torch4, state, "field state.opt_state count is 6 but state.step is 7")


def test_a_state_that_tells_one_story_is_written(torch4: Path) -> None:
    state = load_train_state(str(torch4))
    _steps(state, 4)
    manifest = save_train_state(str(torch4), state)
    assert manifest.step == 8
    written = PortableRun(str(torch4)).read(8)
    assert written.component(ORIGIN_KEY) == {"step": 4, "epoch": 0, "samples_consumed": 32,
                                            "global_batch": 8, "drop_last": True}
    assert written.component("data")["samples_consumed"] == 64


# ------------------------------------------------------------------ hyper-parameters


def test_a_weight_decay_changed_in_the_written_state_is_refused(torch4: Path) -> None:
    state = load_train_state(str(torch4))
    _steps(state, 1)
    groups = state.skeleton["optim"]["param_groups"]
    decayed = next(i for i, g in enumerate(groups) if g["weight_decay"] > 0)
    assert groups[decayed]["weight_decay"] == 0.1  # the recipe's
    groups[decayed]["weight_decay"] = 0.5
    _refused(torch4, state, f"optim.param_groups[{decayed}].weight_decay is 0.5 but the run's "
             "is 0.1", "put it back to the run's value")
    groups[decayed]["weight_decay"] = 0.1
    state.settings = dataclasses.replace(state.settings, weight_decay=0.5)
    _refused(torch4, state, "state.settings.weight_decay is 0.5 but the run's is 0.1")
    state.settings = dataclasses.replace(state.settings, weight_decay=0.1,
                                         lrs=tuple(2 * lr for lr in state.settings.lrs))
    _refused(torch4, state, "state.settings.lrs is not the run's schedule")


# ------------------------------------------------------------------ global batch


def test_a_rebatched_run_continues_at_its_last_global_batch(runs: dict[str, Any],
                                                           tmp_path: Path) -> None:
    run = tmp_path / "rebatched"
    shutil.copytree(runs["root"] / "rebatched", run)
    loaded = PortableRun(str(run)).read(8)
    assert loaded.component(ORIGIN_KEY)["global_batch"] == 16
    assert json.loads((run / "run.json").read_text())["config"]["data"]["global_batch"] == 8
    state = load_train_state(str(run))
    assert (state.step, state.global_batch) == (8, 16)
    # Trained at run.json's global batch instead: the cursor tells another story.
    dataset = TokenDataset(runs["dataset"], "train")
    wrong = numpy_loader(dataset, state.data, global_batch=8, microbatch_size=2)
    try:
        for _ in range(2):
            state.train_step(np.concatenate([mb.tokens for mb in wrong.next_step()]))
            wrong.advance()
        state.data = wrong.state_dict()
    finally:
        wrong.close()
    _refused(run, state, "2 steps of global_batch 16")
    state = load_train_state(str(run))
    _steps(state, 2)
    save_train_state(str(run), state)
    written = PortableRun(str(run)).read(10)
    assert written.component("data")["samples_consumed"] == \
        loaded.component("data")["samples_consumed"] + 2 * 16
    # PyTorch restores it (its story rule agrees) and trains on at global batch 16.
    result = _train(run, runs["dataset"], 12, "data.global_batch=16")
    assert (result.start_step, result.step) == (10, 12)


# ------------------------------------------------------------------ shapes


def test_a_moment_of_another_shape_is_refused_on_load(torch4: Path) -> None:
    """An (N,) bias's moment saved as (1, N) broadcasts in optax: the bias would become a
    (1, N) matrix at the first update. The PyTorch restore's shape rule refuses it."""
    snap = PortableRun(str(torch4)).read(4)
    tensors = dict(snap.tensors)
    key = "optim.state.ln_f.bias.exp_avg"
    tensors[key] = tensors[key].reshape(1, -1)
    write_snapshot(str(torch4), 5, tensors, json.loads(json.dumps(snap.state)))
    with pytest.raises(SnapshotMisfitError) as err:
        load_train_state(str(torch4), 5)
    message = str(err.value)
    assert "\n" not in message and "optim.state.ln_f.bias.exp_avg" in message, message
    assert "[1, 32] for a parameter of shape [32]" in message, message
    assert load_train_state(str(torch4), 4).step == 4  # the earlier one reads


def test_a_parameter_of_another_shape_than_the_model_is_refused(torch4: Path) -> None:
    snap = PortableRun(str(torch4)).read(4)
    tensors = dict(snap.tensors)
    for key in ("model.ln_f.weight", "optim.state.ln_f.weight.exp_avg",
                "optim.state.ln_f.weight.exp_avg_sq"):
        tensors[key] = np.ascontiguousarray(tensors[key][:16])
    write_snapshot(str(torch4), 5, tensors, json.loads(json.dumps(snap.state)))
    with pytest.raises(ValueError, match=r"ln_f/scale has shape \[16\], the model declares "
                                         r"\[32\]") as err:
        load_train_state(str(torch4), 5)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------ BASIS


def test_a_sketched_run_is_said_once_to_continue_with_exact_gradients(
        runs: dict[str, Any], tmp_path: Path) -> None:
    run = tmp_path / "sketched"
    _train(run, runs["dataset"], 4, "sketch.rank=8")
    with pytest.warns(SketchNotCarriedWarning, match=r"BASIS .*rank 8.*exact gradients") as seen:
        state = load_train_state(str(run))
    assert len([w for w in seen if w.category is SketchNotCarriedWarning]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", SketchNotCarriedWarning)
        _steps(state, 1)  # training says nothing more
        load_train_state(str(runs["root"] / "torch4"))  # an exact run: no warning
