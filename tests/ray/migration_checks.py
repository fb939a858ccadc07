"""What the migration tests check the same way (tests/ray/test_ray_train_migration.py,
tests/ray/test_ray_data_migration.py): a converted loop against the loop Ray's guide writes.

- `assert_docs_show_the_diff(standard, baton, page)`: `page` holds exactly `diff -u` of the two
  loop files (code after their docstrings; a diff's blank context lines are " ", editors trim
  them), which adds or changes 1 to 12 lines.
- `one_rank_ray_train(monkeypatch)`: Ray Train's per-worker calls as one worker alone sees
  them (rank 0 of 1, `prepare_model` as is, `report` ignored), for an uninterrupted reference
  run of the converted loop in the test's process.
- `read_records(log)`, `wait(predicate, timeout, what)`: the loop's JSON lines; a bounded wait.
- `fit_losing_a_node(fit, cluster, log, at_step=, world_size=)`: `fit` in a thread, a worker
  node removed once the loop recorded `at_step` at `world_size` workers; `{"result": ...}` if
  the fit finished.
- `steps_as_last_trained(records, planned)`: each step's sample ids over all ranks, as the last
  attempt that trained the step trained them (a redone step replaces what it redoes; the
  iteration a lost peer interrupted, which applied nothing, is left out: `applied_steps`);
  `planned_steps(records)`: the uninterrupted run's ids of each step.
- `assert_each_step_trains_the_planned_rows(by_step, planned)`: P1 on the data, step by step.
- `assert_every_sample_once_per_epoch(by_step, steps, epochs, samples)` and
  `assert_ends_where_uninterrupted(run, reference, tmp, steps)`: P5, then P1/P2 on the final
  snapshots (parameters and AdamW moments, step counters `steps`: never a cold start).
"""

from __future__ import annotations

import contextlib
import difflib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from snapshot_compare import assert_same_state, final_state


def _code(module: Any) -> list[str]:
    text = Path(module.__file__).read_text()
    return text[text.index('"""', 3) + 3:].lstrip("\n").splitlines(keepends=True)


def migration_diff(standard: Any, baton: Any) -> str:
    return "".join(difflib.unified_diff(
        _code(standard), _code(baton), f"{Path(standard.__file__).name}",
        f"{Path(baton.__file__).name}", n=2))


def assert_docs_show_the_diff(standard: Any, baton: Any, page: Path) -> None:
    diff = migration_diff(standard, baton)

    def bare(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.splitlines())

    assert bare(diff) in bare(page.read_text()), f"{page.name}'s diff is out of date:\n" + diff
    added = [line for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    assert 0 < len(added) <= 12, added


@contextlib.contextmanager
def one_rank_ray_train(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import ray.train
    import ray.train.torch

    class OneRank:
        def get_world_rank(self) -> int:
            return 0

        def get_world_size(self) -> int:
            return 1

    with monkeypatch.context() as patch:
        patch.setattr(ray.train, "get_context", OneRank)
        patch.setattr(ray.train.torch, "prepare_model", lambda model: model)
        patch.setattr(ray.train, "report", lambda metrics: None)
        yield


def read_records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def fit_losing_a_node(fit: Callable[[], Any], cluster: Any, log: Path, *, at_step: int,
                      world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(result=fit()))
    thread.start()
    wait(lambda: any(r["step"] >= at_step and r["world_size"] == world_size
                     for r in read_records(log)) or not thread.is_alive(), 300,
         f"step {at_step} at {world_size} workers")
    cluster.remove_worker()
    thread.join(timeout=400)
    return out


def applied_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of iterations whose optimizer step applied an update. The iteration a lost
    peer interrupts runs to its end with an `optimizer.step()` that changes nothing, and the
    loader hands its batch out again (docs/ray-train-loop.md, "When a worker is lost"): its
    record repeats the process's previous step count, at the same world size, with the
    interrupted step's ids. A redo after a rollback (FSDP2) is at another world size: kept."""
    kept: list[dict[str, Any]] = []
    previous: dict[int, tuple[int, int]] = {}  # pid -> (step, world size) of its last record
    for r in sorted(records, key=lambda r: r["time"]):
        if previous.get(r["pid"]) != (r["step"], r["world_size"]):
            kept.append(r)
        previous[r["pid"]] = (r["step"], r["world_size"])
    return kept


def steps_as_last_trained(records: list[dict[str, Any]],
                          planned: dict[int, list[int]]) -> dict[int, list[int]]:
    """Each step's sample ids over all ranks of the world that last trained it. A rank of that
    world may have left no record of a step that counted: its node was lost after the step's
    all-reduce, before the loop's record line (its process never recorded again), or its own
    all-reduce failed where a peer's went through, so its iteration applied nothing (it then
    receives the peer's state: docs/design.md, in-process recovery). Such ranks' ids are the
    step's `planned` ids (the uninterrupted run's) less their peers'."""
    kept = applied_steps(records)
    kept_ids = {id(r) for r in kept}
    applied_nothing = {(r["pid"], r["step"], r["world_size"]) for r in records
                       if id(r) not in kept_ids}
    latest: dict[tuple[int, int], dict[str, Any]] = {}  # (step, rank) -> newest record
    for r in kept:
        if r["ids"] and r["time"] >= latest.get((r["step"], r["rank"]), {"time": 0})["time"]:
            latest[(r["step"], r["rank"])] = r
    last_seen: dict[int, float] = {}
    for r in records:
        last_seen[r["pid"]] = max(last_seen.get(r["pid"], 0.0), r["time"])
    by_step: dict[int, list[int]] = {}
    for step in sorted({s for s, _ in latest}):
        newest = max((r for (s, _), r in latest.items() if s == step), key=lambda r: r["time"])
        world = newest["world_size"]
        ids = [i for rank in range(world) if (step, rank) in latest
               for i in latest[(step, rank)]["ids"]]
        for rank in (rank for rank in range(world) if (step, rank) not in latest):
            before = latest.get((step - 1, rank))
            assert before is not None and before["world_size"] == world, (
                f"step {step}: no record of rank {rank} and none of its step before")
            lost = last_seen[before["pid"]] < newest["time"]
            assert lost or (before["pid"], step - 1, world) in applied_nothing, (
                f"step {step}: rank {rank} (pid {before['pid']}) recorded later, "
                "not this step")
        if len(ids) < len(planned[step]):
            rest = list(planned[step])
            for i in ids:
                if i in rest:
                    rest.remove(i)
            ids += rest
        by_step[step] = ids
    return by_step


def planned_steps(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """The uninterrupted one-rank run's ids of each step (its records)."""
    return {r["step"]: r["ids"] for r in records if r["ids"]}


def assert_each_step_trains_the_planned_rows(by_step: dict[int, list[int]],
                                             planned: dict[int, list[int]]) -> None:
    """Each step trained exactly the rows the uninterrupted run trained at that step (P1: the
    global batch is a function of the seed and the step, never of the world size)."""
    assert sorted(by_step) == sorted(planned), (sorted(by_step), sorted(planned))
    wrong = {step: {"missing": sorted(set(planned[step]) - set(ids)),
                    "extra": sorted(set(ids) - set(planned[step])),
                    "repeated": sorted({i for i in ids if ids.count(i) > 1})}
             for step, ids in by_step.items() if sorted(ids) != sorted(planned[step])}
    assert not wrong, f"steps that trained other rows than planned: {wrong}"


def assert_every_sample_once_per_epoch(by_step: dict[int, list[int]], steps: int, epochs: int,
                                       samples: int) -> None:
    assert sorted(by_step) == list(range(1, steps + 1))
    per_epoch = steps // epochs
    for epoch in range(epochs):
        ids = [i for s in range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1)
               for i in by_step[s]]
        assert sorted(ids) == list(range(samples)), (
            f"epoch {epoch}: missing {sorted(set(range(samples)) - set(ids))}, "
            f"repeated {sorted({i for i in ids if ids.count(i) > 1})}")


def assert_ends_where_uninterrupted(run: Path, reference: Path, tmp: Path,
                                    steps: int) -> None:
    state = final_state(run, tmp, steps)
    assert_same_state(final_state(reference, tmp, steps), state)
    counters = {v.item() for k, v in state.items() if k.endswith(".step")}
    assert counters == {float(steps)}, f"AdamW step counters {counters}: a cold start"
