"""In-process recovery without Ray: the membership protocol under real processes and faults.

Each case runs Baton's worker loop on spawned processes that share one coordinator (as Ray
workers share the coordinator actor; `tests/recovery_harness.py`), every worker with a
process group of its own, as Ray Train's replica groups give it, and kills, stops or delays
one of them mid-step. Checked at the end, on what the workers and the snapshots say: the
survivors finished in the processes they started in; the final parameters and AdamW moments
equal an uninterrupted run's (P1); every sample of the run was trained exactly once over the
recorded steps (P5); at most the interrupted step was redone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from recovery_harness import Fault, Worker, run_workers
from snapshot_compare import assert_same_state, final_state

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.membership import MembershipSettings
from elastic.format.records import DEFAULT_BLOCK_BYTES
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import load_recipe
from trainer.train.loop import WorkerEnv, run_worker

STEPS = 12
# Forward passes per step: 4 microbatches over 3 workers: 2, 1, 1 (then 2 and 2 over 2).
pytestmark = [pytest.mark.timeout(300)]


def _overrides(run: Path, dataset: str, timeout_s: float = 10.0) -> list[str]:
    return [f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={STEPS}",
            "eval.every=0", "snapshots.snapshot_every=4", "optim.warmup_steps=2",
            f"recovery.collective_timeout_s={timeout_s}"]


def _coordinator(run: Path, expected: int, **membership: float) -> LocalCoordinator:
    coordinator = LocalCoordinator(SnapshotStore(str(run)), keep_last=3,
                                   block_bytes=DEFAULT_BLOCK_BYTES,
                                   membership=MembershipSettings(**membership),
                                   rendezvous_host="127.0.0.1")
    coordinator.membership_reset(expected)
    return coordinator


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> Path:
    """The same run on one worker, in this process, without faults."""
    run = tmp_path_factory.mktemp("uninterrupted") / "one"
    run_worker(load_recipe(ROOT / "recipes" / "tiny.toml", _overrides(run, tiny_dataset)),
               WorkerEnv())
    return run


def _steps(records: dict[str, list[dict[str, Any]]]) -> dict[int, list[int]]:
    """Samples of each recorded step (the last record of a step wins: a redone step)."""
    steps: dict[int, list[int]] = {}
    for member in records.values():
        for r in member:
            if r["kind"] == "step":
                steps[r["step"]] = r["samples"]
    return steps


def _ends(records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {m: next((r for r in rs if r["kind"] == "end"), None) for m, rs in records.items()}


def _recoveries(records: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [r for rs in records.values() for r in rs if r["kind"] == "recovery"]


def _assert_ends_where_the_uninterrupted_run_ends(
        records: dict[str, list[dict[str, Any]]], run: Path, uninterrupted: Path,
        tmp_path: Path) -> None:
    steps = _steps(records)
    assert sorted(steps) == list(range(1, STEPS + 1))
    trained = [i for samples in steps.values() for i in samples]
    assert len(trained) == len(set(trained)) == STEPS * 8  # global_batch 8: every sample once
    assert_same_state(final_state(uninterrupted, tmp_path, STEPS),
                      final_state(run, tmp_path, STEPS))


@pytest.mark.slow
def test_a_lost_worker_costs_one_step_and_a_replacement_joins(
        tmp_path: Path, tiny_dataset: str, uninterrupted: Path) -> None:
    run = tmp_path / "run"
    coordinator = _coordinator(run, 3)
    workers = [Worker("a", 0), Worker("b", 1), Worker("c", 2, Fault(die_at=9)),
               Worker("d", 2, replaces="c")]
    # Slow steps: the replacement (a new process importing torch) must find the run going.
    records = run_workers(coordinator, workers, _overrides(run, tiny_dataset), tmp_path / "out",
                          pace_s=1.0)

    ends = _ends(records)
    for member in ("a", "b", "d"):
        assert ends[member] == {"kind": "end", "error": None, "step": STEPS}, ends[member]
    assert ends["c"] is None  # killed: it never ended
    history = coordinator.membership.health()["history"]
    assert [(h["reason"], h["members"]) for h in history] == [
        ("start", ["a", "b", "c"]), ("failure", ["a", "b"]), ("join", ["a", "b", "d"])]
    recoveries = _recoveries(records)
    assert [(r["reason"], r["world_size"], r["counted"]) for r in recoveries] == [
        ("failure", 2, False), ("join", 3, False)]  # the interrupted step redone, once
    _assert_ends_where_the_uninterrupted_run_ends(records, run, uninterrupted, tmp_path)


@pytest.mark.slow
def test_a_sharded_run_restarts_its_state_in_process(
        tmp_path: Path, tiny_dataset: str, uninterrupted: Path) -> None:
    """FSDP2: the lost shards exist only in the newest commit, so the survivors — the same
    processes — start their training state again from it over the re-formed group (the lost
    worker's shards from the store), redo the steps since, and let the replacement in at a
    step boundary after committing it (all restore that commit: nothing redone).

    The middle rank is lost: "c" shards as rank 2 of 3, then 1 of 2, then 1 of 3 beside the
    replacement — a mesh of a later generation that DeviceMesh equality (blind to the rank)
    finds equal to the first one's, which DTensor's caches must not confuse."""
    run = tmp_path / "run"
    coordinator = _coordinator(run, 3)
    workers = [Worker("a", 0), Worker("b", 1, Fault(die_at=9)), Worker("c", 2),
               Worker("d", 1, replaces="b")]
    overrides = [*_overrides(run, tiny_dataset), 'parallelism="fsdp"',
                 "snapshots.snapshot_every=2"]
    records = run_workers(coordinator, workers, overrides, tmp_path / "out", pace_s=1.0)

    ends = _ends(records)
    for member in ("a", "c", "d"):
        assert ends[member] == {"kind": "end", "error": None, "step": STEPS}, ends[member]
    history = coordinator.membership.health()["history"]
    assert [(h["reason"], h["members"]) for h in history] == [
        ("start", ["a", "b", "c"]), ("failure", ["a", "c"]), ("join", ["a", "c", "d"])]
    recoveries = _recoveries(records)
    assert [(r["reason"], r["world_size"]) for r in recoveries] == [("failure", 2), ("join", 3)]
    assert recoveries[0]["redone"] <= 2 + 1 and recoveries[1]["redone"] == 0, recoveries
    _assert_ends_where_the_uninterrupted_run_ends(records, run, uninterrupted, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_replacement_that_comes_after_the_last_commit_trains_nothing(
        tmp_path: Path, tiny_dataset: str, parallelism: str) -> None:
    """Ray Train may place a replacement only once the others have finished: it ends at the
    run's last step without a step, a start record or a commit of its own."""
    run = tmp_path / "run"
    coordinator = _coordinator(run, 2)
    workers = [Worker("a", 0), Worker("b", 1), Worker("late", 2, after_end=True)]
    overrides = [*_overrides(run, tiny_dataset), f'parallelism="{parallelism}"']
    records = run_workers(coordinator, workers, overrides, tmp_path / "out")
    ends = _ends(records)
    for member in ("a", "b", "late"):
        assert ends[member] == {"kind": "end", "error": None, "step": STEPS}, ends[member]
    assert [r["kind"] for r in records["late"]] == ["pid", "end"], records["late"]
    assert SnapshotStore(str(run)).committed_steps()[-1] == STEPS
    history = coordinator.membership.health()["history"]
    assert [(h["reason"], h["members"]) for h in history] == [("start", ["a", "b"])]


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_worker_that_hangs_is_left_out_and_comes_back_as_a_joiner(
        tmp_path: Path, tiny_dataset: str, uninterrupted: Path, parallelism: str) -> None:
    """A collective that hangs instead of failing: the others wait at most
    `recovery.collective_timeout_s`, re-form without the silent worker, and when it wakes up
    it is fenced (its generation is over) and joins again, taking their state (FSDP2: all
    restore the commit the members made to let it in). Never a fallback: the member left out
    is the one that was silent."""
    run = tmp_path / "run"
    coordinator = _coordinator(run, 3)
    workers = [Worker("a", 0), Worker("b", 1),
               Worker("c", 2, Fault(stop_at=9, resume_after_s=3.0))]
    overrides = [*_overrides(run, tiny_dataset, timeout_s=2.0), f'parallelism="{parallelism}"']
    records = run_workers(coordinator, workers, overrides, tmp_path / "out", pace_s=0.5)

    ends = _ends(records)
    for member in ("a", "b", "c"):
        assert ends[member] == {"kind": "end", "error": None, "step": STEPS}, ends[member]
    history = coordinator.membership.health()["history"]
    assert [(h["reason"], h["members"]) for h in history] == [
        ("start", ["a", "b", "c"]), ("failure", ["a", "b"]), ("join", ["a", "b", "c"])]
    _assert_ends_where_the_uninterrupted_run_ends(records, run, uninterrupted, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_second_loss_while_recovering_falls_back_to_a_group_restart(
        tmp_path: Path, tiny_dataset: str, parallelism: str) -> None:
    run = tmp_path / "run"
    coordinator = _coordinator(run, 3)
    workers = [Worker("a", 0), Worker("b", 1, Fault(exit_in="recover_formed")),
               Worker("c", 2, Fault(die_at=9))]
    overrides = [*_overrides(run, tiny_dataset, timeout_s=2.0), "snapshots.snapshot_every=2",
                 f'parallelism="{parallelism}"']
    records = run_workers(coordinator, workers, overrides, tmp_path / "out", pace_s=0.3)

    end = _ends(records)["a"]
    # The generation the survivors re-formed (the last one the membership started).
    generation = coordinator.membership.health()["history"][-1]["generation"]
    assert end is not None and end["error"].startswith(
        "RecoveryFailedError: in-process recovery fell back to a group restart: the process "
        f"group of generation {generation} did not form"), end
    health = coordinator.membership.health()
    assert health["phase"] == "fallback" and f"generation {generation}" in health["fallback"]
    # The group restart that follows continues from the newest commit, intact.
    newest = SnapshotStore(str(run)).committed_steps()[-1]
    assert 2 <= newest <= 4
    assert final_state(run, tmp_path, newest)


class LostCoordinator(LocalCoordinator):
    """A coordinator whose node is lost as the group fails: no membership call answers."""

    def membership_reform(self, *args: Any) -> dict[str, Any]:
        raise ConnectionError("the coordinator's node is gone")


@pytest.mark.slow
def test_a_lost_coordinator_falls_back_to_a_group_restart(
        tmp_path: Path, tiny_dataset: str) -> None:
    run = tmp_path / "run"
    coordinator = LostCoordinator(SnapshotStore(str(run)), keep_last=3,
                                  block_bytes=DEFAULT_BLOCK_BYTES, rendezvous_host="127.0.0.1")
    coordinator.membership_reset(3)
    workers = [Worker("a", 0), Worker("b", 1), Worker("c", 2, Fault(die_at=9))]
    overrides = [*_overrides(run, tiny_dataset), "recovery.coordinator_timeout_s=2"]
    records = run_workers(coordinator, workers, overrides, tmp_path / "out")
    for member in ("a", "b"):
        end = _ends(records)[member]
        assert end is not None and end["error"].startswith(
            "RecoveryFailedError: in-process recovery fell back to a group restart: the "
            "coordinator does not answer"), end


@pytest.mark.slow
def test_a_replacement_whose_state_does_not_fit_makes_every_member_fall_back(
        tmp_path: Path, tiny_dataset: str) -> None:
    """A worker that cannot take the members' state (here: another model) is no member to
    train with: it says so, and every member ends its worker (the group restarts whole)."""
    run = tmp_path / "run"
    coordinator = _coordinator(run, 3)
    workers = [Worker("a", 0), Worker("b", 1), Worker("c", 2, Fault(die_at=9)),
               Worker("d", 2, replaces="c", overrides=["model.d_model=48"])]
    records = run_workers(coordinator, workers, _overrides(run, tiny_dataset), tmp_path / "out",
                          pace_s=1.0)
    ends = _ends(records)
    assert "did not load" in ends["d"]["error"], ends["d"]
    for member in ("a", "b"):
        assert ends[member]["error"].startswith(
            "RecoveryFailedError: in-process recovery fell back"), ends[member]
    assert coordinator.membership.health()["phase"] == "fallback"


class SlowCoordinator(LocalCoordinator):
    """Every membership call takes 0.3 s (a coordinator on a busy head node)."""

    def membership_reform(self, *args: Any) -> dict[str, Any]:
        time.sleep(0.3)
        return super().membership_reform(*args)

    def membership_beat(self, *args: Any) -> dict[str, Any]:
        time.sleep(0.3)
        return super().membership_beat(*args)


@pytest.mark.slow
def test_a_slow_coordinator_only_slows_the_recovery(
        tmp_path: Path, tiny_dataset: str, uninterrupted: Path) -> None:
    run = tmp_path / "run"
    coordinator = SlowCoordinator(SnapshotStore(str(run)), keep_last=3,
                                  block_bytes=DEFAULT_BLOCK_BYTES,
                                  membership=MembershipSettings(beat_s=0.1, dead_after_s=2.0),
                                  rendezvous_host="127.0.0.1")
    coordinator.membership_reset(3)
    workers = [Worker("a", 0), Worker("b", 1), Worker("c", 2, Fault(die_at=9))]
    records = run_workers(coordinator, workers, _overrides(run, tiny_dataset), tmp_path / "out")
    ends = _ends(records)
    assert ends["a"] == {"kind": "end", "error": None, "step": STEPS}, ends["a"]
    assert ends["b"] == {"kind": "end", "error": None, "step": STEPS}, ends["b"]
    _assert_ends_where_the_uninterrupted_run_ends(records, run, uninterrupted, tmp_path)


def _own_fsdp_loop_rank(rank: int, world_size: int) -> None:
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from trainer.config.recovery import RecoveryConfig
    from trainer.config.training import SnapshotConfig
    from trainer.train.session_recovery import start_recovery
    from trainer.train.session_setup import UsageError, WorkerContext

    model = nn.Linear(4, 4)
    fully_shard(model)
    coordinator: Any = object()  # never reached: the refusal comes first
    on = WorkerContext(SnapshotConfig(), coordinator, recovery=RecoveryConfig(),
                       member=("m", 0))
    with pytest.raises(UsageError, match=r"in_process=False"):
        start_recovery(on, model)
    # Off, the same model is a plain session's: no recovery, nothing refused.
    off = WorkerContext(SnapshotConfig(), coordinator,
                        recovery=RecoveryConfig(in_process=False), member=("m", 0))
    assert start_recovery(off, model) == (None, False)


def test_a_users_own_fsdp2_loop_under_in_process_recovery_is_refused_in_one_line(
        tmp_path: Path) -> None:
    """Ray's replica groups give each worker a process group of its own: FSDP2 would shard
    over one worker. Baton's loop forms the default group itself; a user's loop is told how."""
    from elastic.testing import run_group

    run_group(_own_fsdp_loop_rank, 1, tmp_dir=str(tmp_path))
