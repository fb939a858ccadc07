"""The loop and the session agree on what a step is (issue 36, points 1-4), without Ray.

A new user converting a Ray Train loop keeps some of its habits; each trained on silently
(or hung) and now fails in one line naming the mistake and the fix
(`trainer.train.step_checks`):
1. the resume skip (`if epoch * steps_per_epoch + i < start: continue`) kept after the
   conversion throws away the batches the restored loader hands out: refused at the first;
2. a loop that keeps its own `DataLoader` and gives the Session none never ends a step, so
   nothing is ever snapshotted: refused at the second `optimizer.step()`;
3. the per-rank batch size (`global_batch // world_size`) kept changes the global batch when
   the world size changes: a continuation at another `batch_size` than the snapshot's is
   refused naming both (`allow_batch_change=True` continues, with a warning);
4. the loop's own gradient accumulation at an uneven split runs a different number of
   collectives on each rank, which hung DDP and FSDP2: every rank fails in one line, with plain
   DDP or FSDP2 (ranks in one gloo group) and, for DDP, under in-process recovery (each
   worker a group of its own, the gradients reduced by Baton's hook on the membership's
   group); the fix it names
   (`loader.microbatches`) trains on at the same split, and an agreement whose collective
   failed (a member lost: the step is redone) refuses nothing.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from recovery_harness import serve
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from elastic.coord.local_coordinator import LocalCoordinator
from elastic.coord.membership import MembershipSettings
from elastic.format.records import DEFAULT_BLOCK_BYTES
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.train.session import Session, UsageError

ITEMS, EPOCHS = 40, 2


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(ITEMS, 3, generator=generator)
    return TensorDataset(torch.arange(ITEMS), x, x.sum(dim=1, keepdim=True).tanh())


class _Scale(nn.Module):
    """A buffer, so that DDP broadcasts buffers before each forward that follows a synced one
    (a collective of its own that the agreement on the passes must not cross)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def _parts() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1), _Scale())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.8)


def _train(run: Path, *, batch_size: int = 8, until: int | None = None, skip: bool = False,
           **loader_settings: Any) -> tuple[Session, list[int]]:
    """The docs' loop (`skip`: with the resume skip of a Ray loop kept); the samples it
    trained, in order."""
    model, optimizer, schedule = _parts()
    session = Session(model, optimizer, schedule, run_uri=str(run), snapshot_every=2,
                      until=until)
    start = session.start_step
    loader = session.data_loader(_dataset(), batch_size=batch_size, seed=1, **loader_settings)
    steps_per_epoch = len(loader)
    trained: list[int] = []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for i, (ids, x, y) in enumerate(loader):
            if skip and epoch * steps_per_epoch + i < start:
                continue
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            trained += ids.tolist()
    session.close()
    return session, trained


def test_a_resume_skip_kept_after_the_conversion_is_refused_at_the_first_batch(
    tmp_path: Path,
) -> None:
    first, trained = _train(tmp_path / "run", until=3)
    assert first.stopped_at == 3
    with pytest.raises(UsageError) as caught:
        _train(tmp_path / "run", skip=True)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("step 4: the loop asked for the next "
                                                      "batch without training on this one")
    assert "if epoch * steps_per_epoch + i < start: continue" in message
    from trainer.train.session_setup import open_session

    session = open_session()
    assert session is not None
    session.close(commit=False)
    assert SnapshotStore(str(tmp_path / "run")).committed_steps()[-1] == 3  # nothing counted

    # Without the skip the same continuation trains every sample once per epoch.
    again, rest = _train(tmp_path / "run")
    assert again.step == EPOCHS * ITEMS // 8
    for epoch in range(EPOCHS):
        epoch_ids = (trained + rest)[epoch * ITEMS:(epoch + 1) * ITEMS]
        assert sorted(epoch_ids) == list(range(ITEMS))


def test_a_batch_whose_update_the_loop_skips_after_its_forward_still_counts(
    tmp_path: Path,
) -> None:
    """A deliberate skip (a NaN loss, fp16's overflow) has run the forward: the step counts,
    as it does in Baton's own loop."""
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path)) as session:
        loader = session.data_loader(_dataset(), batch_size=8, seed=1)
        for i, (_, x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            if i == 1:
                continue  # this batch's update skipped, on purpose
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert session.step == ITEMS // 8


def test_a_loop_that_keeps_its_own_data_loader_is_refused_at_the_second_update(
    tmp_path: Path,
) -> None:
    model, optimizer, schedule = _parts()
    session = Session(model, optimizer, schedule, run_uri=str(tmp_path), snapshot_every=2)
    updates = 0
    with pytest.raises(UsageError) as caught:
        for _, x, y in DataLoader(_dataset(), batch_size=8, shuffle=True):
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            updates += 1
    message = str(caught.value)
    assert updates == 1 and "\n" not in message
    assert message.startswith("step 1: optimizer.step() ran twice without a step boundary")
    assert "session.data_loader(...)" in message and "session.step_done()" in message
    session.close(commit=False)
    assert SnapshotStore(str(tmp_path)).committed_steps() == []

    # The same loop ending each step itself trains on; other optimizers (extras) may step
    # more often than once a step.
    model, optimizer, _ = _parts()
    critic = torch.optim.SGD(model[2].parameters(), lr=0.0)
    with Session(model, optimizer, extras={"critic": critic}, run_uri=str(tmp_path / "b"),
                 snapshot_every=2) as session:
        for _, x, y in DataLoader(_dataset(), batch_size=8):
            nn.functional.mse_loss(model(x), y).backward()
            critic.step()
            critic.step()
            optimizer.step()
            optimizer.zero_grad()
            session.step_done()
    assert SnapshotStore(str(tmp_path / "b")).committed_steps()[-1] == ITEMS // 8


def test_a_continuation_at_another_global_batch_is_refused_naming_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # The per-rank habit `global_batch // world_size`: 8 on one worker, then 4 when the run
    # continues on two.
    _train(tmp_path / "run", batch_size=8, until=3)
    with pytest.raises(UsageError) as caught:
        _train(tmp_path / "run", batch_size=4)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("session.data_loader: batch_size=4, but the snapshot of step 3 "
                              "trained at batch_size=8")
    assert "pass batch_size=8, or allow_batch_change=True" in message
    from trainer.train.session_setup import open_session

    session = open_session()
    assert session is not None
    session.close(commit=False)

    # Explicitly: it continues at the new batch, says so, and records it for the next.
    with caplog.at_level(logging.WARNING, logger="baton.session"):
        changed, _ = _train(tmp_path / "run", batch_size=4, until=5, allow_batch_change=True)
    assert changed.start_step == 3 and changed.stopped_at == 5
    assert "continuing at batch_size=4; the snapshot of step 3 trained at batch_size=8" \
        in caplog.text
    again, _ = _train(tmp_path / "run", batch_size=4)
    assert again.start_step == 5
    # 3 steps of 8, then 4s: epoch 0 ends after (40 - 24) / 4 = 4 more, epoch 1 takes 10.
    assert again.step == 3 + 4 + math.ceil(ITEMS / 4)


# ------------------------------------------------------------------ gradient accumulation


def _accumulating(rank: int, world_size: int, run: str, out: str, batch_size: int,
                  microbatch_size: int, piece: int, layout: str = "ddp") -> None:
    """The docs' loop at `world_size` ranks (DDP, or FSDP2: `layout="fsdp"`), accumulating
    over pieces of `piece` samples by itself (0: with `loader.microbatches`); writes how it
    ended."""
    model, optimizer, schedule = _parts()
    if layout == "fsdp":
        fully_shard(model)  # in place; the optimizer's parameters become the shards
        optimizer = torch.optim.AdamW(model.parameters(), lr=optimizer.defaults["lr"])
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.8)
    else:
        model = DistributedDataParallel(model)
    session = Session(model, optimizer, schedule, run_uri=run, snapshot_every=2)
    loader = session.data_loader(_dataset(), batch_size=batch_size,
                                 microbatch_size=microbatch_size, seed=1)
    outcome: dict[str, Any] = {"error": None}
    try:
        for _, x, y in loader:
            pieces = zip(x.split(piece), y.split(piece), strict=True) if piece \
                else loader.microbatches([x, y])
            for px, py in pieces:
                nn.functional.mse_loss(model(px), py).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    except UsageError as err:
        outcome["error"] = str(err)
    outcome["step"] = session.step
    session.close(commit=outcome["error"] is None)
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))


def _outcomes(out: Path, world_size: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _assert_refused(outcomes: list[dict[str, Any]], passes: list[int],
                    layout: str = "ddp") -> None:
    would, done = (("would gather the sharded parameters", "gathered its sharded parameters")
                   if layout == "fsdp" else ("would all-reduce", "all-reduced its gradients"))
    for rank, outcome in enumerate(outcomes):
        message = outcome["error"]
        assert message is not None and "\n" not in message, outcomes
        assert message.startswith("step 1: this rank holds"), message
        assert "loader.microbatches([x, y])" in message
        assert f"({'FSDP2' if layout == 'fsdp' else 'DDP'} hangs)" in message, message
        if passes[rank] == max(passes):
            assert f"its forward pass {max(passes)} {would}" in message, message
        else:
            assert f"{done} {passes[rank]} time(s), another rank {max(passes)}" in message, \
                message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_the_loops_own_accumulation_at_an_uneven_split_fails_in_one_line_on_every_rank(
    tmp_path: Path, layout: str,
) -> None:
    # 8 samples in 4 microbatches of 2 on 3 ranks: 2, 2 and 4 samples; pieces of 2 make
    # rank 2 run two passes where the others run one: DDP all-reduces, FSDP2 gathers the
    # parameters, once more on rank 2 (before: every rank hung).
    out = tmp_path / "uneven"
    out.mkdir()
    run_group(_accumulating, 3, str(tmp_path / "a"), str(out), 8, 2, 2, layout,
              tmp_dir=str(tmp_path))
    _assert_refused(_outcomes(out, 3), passes=[1, 1, 2], layout=layout)
    assert SnapshotStore(str(tmp_path / "a")).committed_steps() == []

    # The fix it names trains on: `loader.microbatches` at the same split, where every rank
    # runs the same collectives (DDP: rank 2's first piece under no_sync(); FSDP2: the
    # others add a zero-weight pass).
    out = tmp_path / "fixed"
    out.mkdir()
    run_group(_accumulating, 3, str(tmp_path / "b"), str(out), 8, 2, 0, layout,
              tmp_dir=str(tmp_path))
    steps = ITEMS // 8
    assert [(o["error"], o["step"]) for o in _outcomes(out, 3)] == [(None, steps)] * 3
    assert SnapshotStore(str(tmp_path / "b")).committed_steps()[-1] == steps


class _Group:
    """In-process recovery's group as `elastic.collectives` sees it, with a scripted
    all-reduce: what the ranks' values come to, and whether the collective went through."""

    rank, world_size, device = 0, 3, torch.device("cpu")

    def __init__(self, result: list[int], ok: bool) -> None:
        self.result, self.ok = result, ok

    def all_reduce(self, tensor: torch.Tensor, op: Any) -> bool:
        tensor.copy_(torch.tensor(self.result))  # an aborted one may leave anything
        return self.ok


def test_an_agreement_whose_collective_failed_refuses_nothing() -> None:
    """A member lost during the agreement (the step is then redone): no refusal from what
    the aborted collective left behind."""
    from elastic import collectives
    from trainer.train.step_checks import _agree

    with collectives.use_group(_Group([3, -1], ok=True)):  # type: ignore[arg-type]
        assert _agree(1) == (1, 3)
    with collectives.use_group(_Group([3, -1], ok=False)):  # type: ignore[arg-type]
        assert _agree(1) == (1, 1)


def _recovering_worker(address: tuple[str, int], order: int, run: str, out: str) -> None:
    """`_accumulating` as `ElasticTorchTrainer` runs it: a process group of this worker
    alone, the membership's group for the gradients (in-process recovery)."""
    from recovery_harness import _connect

    from trainer.config import RecoveryConfig, SnapshotConfig
    from trainer.train.session import WorkerContext, worker_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    context = WorkerContext(snapshots=SnapshotConfig(run_uri=run), coordinator=_connect(address),
                            recovery=RecoveryConfig(collective_timeout_s=20.0),
                            member=(f"worker{order}", order))
    with worker_context(context):
        _accumulating(order, 3, run, out, 8, 2, 2)


@pytest.mark.timeout(240)
def test_under_in_process_recovery_the_uneven_accumulation_fails_in_one_line_too(
    tmp_path: Path,
) -> None:
    import multiprocessing as mp

    coordinator = LocalCoordinator(SnapshotStore(str(tmp_path / "run")), keep_last=3,
                                   block_bytes=DEFAULT_BLOCK_BYTES,
                                   membership=MembershipSettings(), rendezvous_host="127.0.0.1")
    coordinator.membership_reset(3)
    _, address = serve(coordinator)
    out = tmp_path / "out"
    out.mkdir()
    context = mp.get_context("spawn")
    workers = [context.Process(target=_recovering_worker,
                               args=(address, order, str(tmp_path / "run"), str(out)))
               for order in range(3)]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(200)
    finally:
        hung = [w for w in workers if w.is_alive()]
        for worker in hung:
            worker.kill()
    assert not hung and [w.exitcode for w in workers] == [0, 0, 0], "a worker hung or crashed"
    outcomes = _outcomes(out, 3)
    # The membership ranks the workers by order: worker 2 holds the 4 samples.
    _assert_refused(outcomes, passes=[1, 1, 2])
