"""`trainer.train.session.Session` without Ray: restore warm, cadence, stop / until, preemption, the
optimizer hook, and data in a user's loop (`MapStyleLoader` at 1 vs 2 ranks; a stateful
loader with a per-rank position, exact at the same world size, warned about at another).

The loop under test is a user's: a small regression model, AdamW, a StepLR schedule and a
map-style `TensorDataset` read through `data_state.map_loader.MapStyleLoader`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from data_state.map_loader import MapStyleLoader
from elastic.coord.local_coordinator import LocalCoordinator
from elastic.errors import FatalRunError
from elastic.format.records import DEFAULT_BLOCK_BYTES
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.train.session import PreemptedError, Session

ITEMS, GLOBAL_BATCH, MICROBATCH = 64, 8, 2


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(ITEMS, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


class Parts:
    """A user's training state; `seed` only changes the initial weights (restore must win)."""

    def __init__(self, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.schedule = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.7)
        self.loader = MapStyleLoader(_dataset(), global_batch=GLOBAL_BATCH,
                                     microbatch_size=MICROBATCH, seed=3, rank=rank,
                                     world_size=world_size)

    def session(self, run: Path, **kwargs: Any) -> Session:
        return Session(self.model, self.optimizer, self.schedule, self.loader,
                       run_uri=str(run), **kwargs)

    def train_step(self) -> list[int]:
        seen = []
        for mb in self.loader.next_step():
            x, y = mb.batch
            loss = nn.functional.mse_loss(self.model(x), y) / mb.num_microbatches
            loss.backward()
            seen += mb.sample_indices
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        self.loader.advance()
        return seen

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for i, s in enumerate(self.optimizer.state.values()):
            out.update({f"optim.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
        return out


def _train(parts: Parts, session: Session, total: int) -> list[int]:
    seen: list[int] = []
    for _ in session.steps(total):
        seen += parts.train_step()
    parts.loader.close()
    return seen


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_until_then_continue_restores_warm_and_ends_where_an_uninterrupted_run_ends(
    tmp_path: Path,
) -> None:
    reference = Parts()
    ref_seen = _train(reference, reference.session(tmp_path / "ref", snapshot_every=4), 12)

    first = Parts()
    session = first.session(tmp_path / "run", snapshot_every=4, until=6)
    seen = _train(first, session, 12)
    assert session.stopped_at == 6 and session.step == 6
    assert SnapshotStore(str(tmp_path / "run")).committed_steps()[-1] == 6

    again = Parts(seed=99)  # other initial weights: the restore must replace them
    resumed = again.session(tmp_path / "run", snapshot_every=4)
    assert resumed.start_step == 6
    counters = {float(s["step"]) for s in again.optimizer.state.values()}
    assert counters == {6.0}, "AdamW resumed cold"
    assert again.schedule.last_epoch == 6  # the LR schedule's position came back too
    seen += _train(again, resumed, 12)
    _assert_equal(reference.state(), again.state())
    assert seen == ref_seen  # the same samples, in the same order, each epoch once


def test_until_at_the_restored_step_trains_nothing(tmp_path: Path) -> None:
    first = Parts()
    _train(first, first.session(tmp_path, snapshot_every=4, until=4), 12)
    again = Parts(seed=5)
    session = again.session(tmp_path, snapshot_every=4, until=4)
    assert _train(again, session, 12) == []
    assert session.stopped_at == 4 and SnapshotStore(str(tmp_path)).committed_steps() == [4]


def test_cadence_and_the_final_commit(tmp_path: Path) -> None:
    parts = Parts()
    coordinator = LocalCoordinator(SnapshotStore(str(tmp_path)), keep_last=10,
                                   block_bytes=DEFAULT_BLOCK_BYTES)
    session = parts.session(tmp_path, snapshot_every=4, coordinator=coordinator)
    _train(parts, session, 10)
    # Due steps (a due step is skipped, not waited for, while the previous one persists),
    # then the last step.
    committed, skipped = coordinator.committed_steps(), session.snapshotter.skipped
    assert committed[0] == 4 and committed[-1] == 10
    assert sorted(committed[:-1] + skipped) == [4, 8]


def test_the_optimizer_hook_finishes_an_in_flight_capture(tmp_path: Path) -> None:
    parts = Parts()
    session = parts.session(tmp_path, snapshot_every=1)
    parts.train_step()
    session.step_done()  # begins capturing step 1; its copies may still be running
    assert session.snapshotter._handle is not None
    parts.train_step()  # optimizer.step() waits for it first (the pre-hook)
    assert session.snapshotter._handle is None
    session.step_done()
    session.close()
    assert SnapshotStore(str(tmp_path)).committed_steps()[-1] == 2


def test_a_stop_asked_through_the_coordinator_commits_the_current_step(tmp_path: Path) -> None:
    parts = Parts()
    coordinator = LocalCoordinator(SnapshotStore(str(tmp_path)), keep_last=2,
                                   block_bytes=DEFAULT_BLOCK_BYTES)
    session = parts.session(tmp_path, snapshot_every=100, coordinator=coordinator)
    for step in session.steps(50):
        parts.train_step()
        if step == 4:  # during step 5: the driver's Ctrl-C or time limit
            coordinator.request_stop()
    assert session.step == 5 and session.stopped_at == 5
    assert coordinator.committed_steps() == [5]
    assert coordinator.health()["stopped_at"] == 5


def test_a_preemption_notice_commits_then_raises(tmp_path: Path) -> None:
    parts = Parts()
    session = parts.session(tmp_path, snapshot_every=100)
    with pytest.raises(PreemptedError, match="preempted at step 3 .signal."):
        for step in session.steps(50):
            parts.train_step()
            if step == 2:
                session.watcher.request()  # as SIGTERM would
    assert SnapshotStore(str(tmp_path)).committed_steps() == [3]


def test_an_error_in_the_loop_commits_nothing_new(tmp_path: Path) -> None:
    parts = Parts()
    with pytest.raises(ZeroDivisionError), parts.session(tmp_path, snapshot_every=2) as session:
        for step in session.steps(50):
            parts.train_step()
            if step == 2:  # step 3 fails half-way: never capture it
                raise ZeroDivisionError
    assert SnapshotStore(str(tmp_path)).committed_steps() == [2]


def test_without_a_run_directory_the_session_says_what_to_pass() -> None:
    parts = Parts()
    with pytest.raises(ValueError, match=r"pass run_uri=\.\.\."):
        Session(parts.model, parts.optimizer)


# ------------------------------------------------------------------ data in a user's loop


def _steps(loader: MapStyleLoader, count: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    out = []
    for _ in range(count):
        out.append([(mb.index, mb.sample_indices) for mb in loader.next_step()])
        loader.advance()
    return out


def test_map_style_loader_shares_out_the_same_microbatches_at_any_world_size() -> None:
    one = MapStyleLoader(_dataset(), global_batch=GLOBAL_BATCH, microbatch_size=MICROBATCH,
                         seed=3)
    halves = [MapStyleLoader(_dataset(), global_batch=GLOBAL_BATCH, microbatch_size=MICROBATCH,
                             seed=3, rank=r, world_size=2) for r in (0, 1)]
    steps = ITEMS // GLOBAL_BATCH + 2  # into the second epoch
    alone = _steps(one, steps)
    shared = [_steps(h, steps) for h in halves]
    for s in range(steps):
        assert sorted(shared[0][s] + shared[1][s]) == alone[s]
        assert {i for _, mb in shared[0][s] for i in mb}.isdisjoint(
            {i for _, mb in shared[1][s] for i in mb})
    epoch = [i for step in alone[: ITEMS // GLOBAL_BATCH] for _, mb in step for i in mb]
    assert sorted(epoch) == list(range(ITEMS))  # every item once per epoch
    # The cursor has no rank in it: rank 1 of 2 continues from rank 0 of 1's state.
    halves[1].load_state_dict(one.state_dict())
    one_more = _steps(one, 1)[0]
    assert _steps(halves[1], 1)[0] == one_more[len(one_more) // 2:]


def test_map_style_loader_uses_the_collate_function() -> None:
    loader = MapStyleLoader(_dataset(), global_batch=GLOBAL_BATCH, microbatch_size=MICROBATCH,
                            seed=3, collate_fn=lambda items: {"n": len(items), "first": items[0]})
    (mb, *_) = loader.next_step()
    assert mb.batch["n"] == MICROBATCH
    assert torch.equal(mb.batch["first"][0], _dataset()[mb.sample_indices[0]][0])
    loader.close()


class StridedLoader:
    """A stateful loader as users write them (torchdata's `StatefulDataLoader` keeps the same
    kind of state): rank r of W reads items r, r + W, r + 2W, ...; its state is how many."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size, self.position = rank, world_size, 0

    def next(self) -> int:
        index = (self.rank + self.position * self.world_size) % ITEMS
        self.position += 1
        return index

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def _strided_session(run: Path, loader: StridedLoader, *, strict: bool = False) -> Session:
    torch.manual_seed(0)
    model: nn.Module = nn.Linear(2, 1)
    if torch.distributed.is_initialized():  # ranks of a group train one DDP model
        model = nn.parallel.DistributedDataParallel(model)
    return Session(model, torch.optim.SGD(model.parameters(), lr=0.1), data=loader,
                   run_uri=str(run), snapshot_every=100, strict_data=strict)


def test_a_stateful_loader_is_exact_at_the_same_world_size(tmp_path: Path) -> None:
    loader = StridedLoader()
    session = _strided_session(tmp_path, loader)
    read = [loader.next() for _ in session.steps(5)]
    again = StridedLoader()
    resumed = _strided_session(tmp_path, again)
    read += [again.next() for _ in resumed.steps(9)]
    assert read == list(range(9))


def _strided_on_two_ranks(rank: int, world_size: int, run: str) -> None:
    loader = StridedLoader(rank, world_size)
    session = _strided_session(Path(run), loader)
    for _ in session.steps(3):
        loader.next()


def test_a_stateful_loader_at_another_world_size_is_warned_about_or_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    run_group(_strided_on_two_ranks, 2, str(run), tmp_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="baton.session"):
        session = _strided_session(run, StridedLoader())  # 1 rank now
    assert session.start_step == 3
    assert "saved at world size 2 and restores at 1" in caplog.text
    assert "MapStyleLoader" in caplog.text
    session.close(commit=False)
    with pytest.raises(FatalRunError, match="world size 2 and restores at 1"):
        _strided_session(run, StridedLoader(), strict=True)
