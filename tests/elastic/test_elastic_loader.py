"""The elastic `DataLoader` (`session.data_loader`, issue 30) and the mistakes it catches,
without Ray: in one process, or ranks joined in a gloo group (`elastic.testing.run_group`).

The loop under test is shaped as Ray's docs write one (epochs of `for x, y in loader`,
AdamW, a `LambdaLR` warmup-cosine schedule), on a small regression model. Checked:
- it iterates like a `DataLoader` (`len`, `set_epoch`, every sample once per epoch, the tail
  kept or dropped, dataset order without shuffling) and ends each step itself;
- a run resumed mid-epoch at another world size — 1 rank, then 3 with an uneven split and
  gradient accumulation (`loader.microbatches`), or with an idle rank — ends equal to an
  uninterrupted 1-rank run (P1, <= 1e-5), every sample once per epoch (P5), and every rank
  all-reduced exactly once per step (counted by a DDP comm hook);
- mistakes are one line each: a loader step never advanced, `set_epoch` out of step with the
  restored position, a second open Session, an unwrapped model at world size 3;
- replicas that diverged are never committed: the snapshot fails naming the tensor, and the
  previous committed snapshot still holds exactly what rank 0 had then.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from snapshot_compare import assert_same_state, final_state
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from data_state.map_loader import MapStyleLoader
from elastic.errors import ReplicasDivergedError
from elastic.replicas import fingerprints
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import run_group
from trainer.train.session import Session, UsageError

ITEMS, EPOCHS = 38, 3


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(ITEMS, 3, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def _parts() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    total = EPOCHS * math.ceil(ITEMS / 8)

    def warmup_cosine(step: int) -> float:
        return (step + 1) / 3 if step < 3 else 0.5 * (1 + math.cos(math.pi * step / total))

    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def _loop(rank: int, world_size: int, run: str, out: str, batch_size: int = 8,
          microbatch_size: int = 2, until: int | None = None,
          accumulate: bool = False) -> None:
    """The docs-shaped loop; writes what this rank trained and how often it all-reduced."""
    model, optimizer, schedule = _parts()
    reductions = [0]
    if dist.is_initialized():
        with pytest.raises(UsageError, match="not wrapped for data parallelism at world size"):
            Session(model, optimizer, run_uri=run)
        model = DistributedDataParallel(model)

        def counted(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            reductions[0] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counted)
    session = Session(model, optimizer, schedule, run_uri=run, snapshot_every=2, until=until)
    loader = session.data_loader(_dataset(), batch_size=batch_size,
                                 microbatch_size=microbatch_size, seed=5)
    seen: list[tuple[int, list[int]]] = []
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            seen.append((epoch, list(loader.sample_indices)))
            for px, py in loader.microbatches([x, y]) if accumulate else [(x, y)]:
                nn.functional.mse_loss(model(px), py).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
    session.close()
    Path(out, f"{Path(run).name}-{session.start_step}-rank{rank}.json").write_text(json.dumps(
        {"seen": seen, "reductions": reductions[0], "steps": session.step - session.start_step}))


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def _assert_every_sample_once_per_epoch(records: list[dict[str, Any]]) -> None:
    by_epoch: dict[int, list[int]] = {}
    for record in records:
        for epoch, indices in record["seen"]:
            by_epoch.setdefault(epoch, []).extend(indices)
    assert sorted(by_epoch) == list(range(EPOCHS))
    for epoch, indices in by_epoch.items():
        assert sorted(indices) == list(range(ITEMS)), f"epoch {epoch}"


def _resized_run(tmp_path: Path, *, batch_size: int, accumulate: bool, until: int) -> None:
    """1 rank up to `until` (mid-epoch), then 3 ranks to the end; equal to 1 rank throughout."""
    reference, run, out = tmp_path / "reference", tmp_path / "run", tmp_path / "out"
    out.mkdir()
    _loop(0, 1, str(reference), str(tmp_path), batch_size=batch_size)
    _loop(0, 1, str(run), str(out), batch_size=batch_size, until=until)
    run_group(_loop, 3, str(run), str(out), batch_size, 2, None, accumulate,
              tmp_dir=str(tmp_path))
    steps = EPOCHS * math.ceil(ITEMS / batch_size)
    assert_same_state(final_state(reference, tmp_path, steps), final_state(run, tmp_path, steps))
    records = _records(out)
    _assert_every_sample_once_per_epoch(records)
    grouped = [r for r in records if r["steps"] == steps - until]
    assert len(grouped) == 3 and all(r["reductions"] == r["steps"] for r in grouped), records


def test_a_run_resized_mid_epoch_with_an_uneven_split_and_accumulation_ends_as_one_rank(
    tmp_path: Path,
) -> None:
    # 8 samples in 4 microbatches of 2: ranks hold 1, 1 and 2 (the tail step: 1, 1, 1).
    _resized_run(tmp_path, batch_size=8, accumulate=True, until=7)


def test_an_idle_rank_joins_each_all_reduce_with_no_weight(tmp_path: Path) -> None:
    # 4 samples in 2 microbatches on 3 ranks: rank 2 has none (and rank 1 none in the tail).
    _resized_run(tmp_path, batch_size=4, accumulate=False, until=3)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
          y: torch.Tensor) -> None:
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_it_iterates_like_a_dataloader(tmp_path: Path) -> None:
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path / "a"), snapshot_every=3) as session:
        loader = session.data_loader(_dataset(), batch_size=8, shuffle=False, drop_last=True)
        assert len(loader) == ITEMS // 8 and loader.epoch == 0
        epochs = []
        for epoch in range(loader.epoch, 2):
            loader.set_epoch(epoch)
            batches = []
            for x, y in loader:
                batches.append(x)
                _step(model, optimizer, x, y)
            epochs.append(torch.cat(batches))
            assert session.step == (epoch + 1) * (ITEMS // 8)  # the loader ended each step
        with pytest.raises(UsageError, match=r"set_epoch\(0\): the data position is in "
                                             r"epoch 2.*range\(loader.epoch, epochs\)"):
            loader.set_epoch(0)
    data = _dataset().tensors[0]
    for batches in epochs:  # dataset order, the tail of 6 dropped
        assert torch.equal(batches, data[: ITEMS // 8 * 8])

    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path / "b")) as session:
        loader = session.data_loader(_dataset(), batch_size=8, seed=3)  # keeps the tail
        assert len(loader) == math.ceil(ITEMS / 8)
        order = []
        for x, y in loader:
            order += loader.sample_indices
            _step(model, optimizer, x, y)
        assert sorted(order) == list(range(ITEMS)) and order != list(range(ITEMS))


def test_settings_threads_collation_and_accumulation(tmp_path: Path) -> None:
    """Bad settings are one line naming the argument; `num_workers` threads read the same
    batches; `collate_fn` is the user's; `microbatches` splits tensors and per-sample lists
    and its pieces' gradients add up to the whole batch's."""
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path / "a")) as session:
        with pytest.raises(UsageError, match=r"batch_size \(64\) is larger than the dataset "
                                             r"\(38 samples\) and drop_last=True"):
            session.data_loader(_dataset(), batch_size=64, drop_last=True)
        with pytest.raises(UsageError, match=r"batch_size \(8\) must be a multiple of "
                                             r"microbatch_size \(3\)"):
            session.data_loader(_dataset(), batch_size=8, microbatch_size=3)

    def collate(items: list[Any]) -> dict[str, Any]:
        return {"x": torch.stack([x for x, _ in items]), "y": torch.stack([y for _, y in items]),
                "name": [f"item{float(x[0]):.3f}" for x, _ in items]}

    batches = {}
    for threads in (0, 2):
        model, optimizer, _ = _parts()
        with Session(model, optimizer, run_uri=str(tmp_path / f"t{threads}")) as session:
            loader = session.data_loader(_dataset(), batch_size=8, microbatch_size=2,
                                         collate_fn=collate, num_workers=threads, seed=2)
            batch = next(iter(loader))
            batches[threads] = batch
            with pytest.raises(UsageError, match="inside the loop over it"):
                list(loader.microbatches(batch))  # the forwards would run unweighted
            pieces = []
            for piece in loader.microbatches(batch):  # each piece's gradient counts a quarter
                nn.functional.mse_loss(model(piece["x"]), piece["y"]).backward()
                pieces.append(piece)
            assert [len(p["name"]) for p in pieces] == [2, 2, 2, 2]
            assert sum((p["name"] for p in pieces), []) == batch["name"]
            accumulated = [p.grad.clone() for p in model.parameters()]
            optimizer.zero_grad()
            nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
            for a, b in zip(accumulated, (p.grad for p in model.parameters()), strict=True):
                torch.testing.assert_close(a, b)
            optimizer.zero_grad()
    assert batches[0]["name"] == batches[2]["name"]
    assert torch.equal(batches[0]["x"], batches[2]["x"])


def test_a_break_after_the_optimizer_step_ends_that_step(tmp_path: Path) -> None:
    model, optimizer, _ = _parts()
    session = Session(model, optimizer, run_uri=str(tmp_path), snapshot_every=100)
    loader = session.data_loader(_dataset(), batch_size=8, seed=3)
    order = []
    for x, y in loader:
        order.append(loader.sample_indices)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if len(order) == 3:
            break
    session.close()
    assert SnapshotStore(str(tmp_path)).committed_steps() == [3]
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path)) as again:
        resumed = again.data_loader(_dataset(), batch_size=8, seed=3)
        first = next(iter(resumed))
        assert again.start_step == 3 and resumed.sample_indices not in order
        assert first[0].shape == (8, 3)


def test_under_a_trainer_the_last_step_commits_when_the_function_returns(
    tmp_path: Path,
) -> None:
    """`ElasticTorchTrainer`'s wrapper closes the session after the training function: the
    loop's end commits nothing, and a snapshot due at an epoch's last step is taken one step
    later, so a failure in the code after the loop restarts inside the loop."""
    from trainer.config import SnapshotConfig
    from trainer.train.session import WorkerContext, worker_context

    settings = SnapshotConfig(run_uri=str(tmp_path), snapshot_every=5)
    with worker_context(WorkerContext(snapshots=settings, close_at_return=True)):
        model, optimizer, _ = _parts()
        session = Session(model, optimizer)
    loader = session.data_loader(_dataset(), batch_size=8, seed=5)  # 5 steps an epoch
    for epoch in range(loader.epoch, 2):
        loader.set_epoch(epoch)
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    session.snapshotter.persister.wait()
    assert session.step == 10 and SnapshotStore(str(tmp_path)).committed_steps() == [6]
    session.close()  # what the wrapper does once the function returned
    assert SnapshotStore(str(tmp_path)).committed_steps()[-1] == 10


def test_a_loader_step_never_advanced_fails_the_step_in_one_line(tmp_path: Path) -> None:
    model, optimizer, _ = _parts()
    loader = MapStyleLoader(_dataset(), global_batch=8, microbatch_size=2, seed=3)
    session = Session(model, optimizer, data=loader, run_uri=str(tmp_path), snapshot_every=1)
    for step in session.steps(5):
        for mb in loader.next_step():
            nn.functional.mse_loss(model(mb.batch[0]), mb.batch[1]).backward()
        optimizer.step()
        if step < 2:
            loader.advance()
        elif step == 2:
            with pytest.raises(UsageError) as caught:
                session.step_done()
            break
    message = str(caught.value)
    assert "\n" not in message and "call loader.advance() after optimizer.step()" in message
    session.close(commit=False)
    loader.close()
    assert max(SnapshotStore(str(tmp_path)).committed_steps()) <= 2  # step 3: never


def test_a_second_open_session_is_refused(tmp_path: Path) -> None:
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path / "a")):
        with pytest.raises(UsageError, match=r"still open in this process: close\(\) it"):
            Session(model, optimizer, run_uri=str(tmp_path / "b"))
    Session(model, optimizer, run_uri=str(tmp_path / "b")).close()  # closed: fine again


def test_token_datasets_load_the_same_way(tmp_path: Path, tiny_dataset: str) -> None:
    from data_state import TokenDataset

    dataset = TokenDataset(tiny_dataset, split="train")
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(tmp_path)) as session:
        loader = session.data_loader(dataset, batch_size=4, seed=1)
        batch = next(iter(loader))
        assert batch.dtype == torch.int64 and batch.shape == (4, dataset.seq_len)
        assert torch.equal(batch, dataset.batch(np.array(loader.sample_indices)))
    dataset.close()


def test_fingerprints_compare_every_dtype_exactly() -> None:
    a = {"w": torch.randn(7, 5), "h": torch.randn(4).to(torch.bfloat16),
         "step": torch.tensor(3.0), "empty": torch.zeros(0)}
    b = {k: v.clone() for k, v in a.items()}
    names, values = fingerprints(a, step=4)
    assert names == ["h", "step", "w"] and values.shape == (12,)
    assert torch.equal(values, fingerprints(b, step=4)[1])
    b["w"] += 1e-3
    assert not torch.equal(values, fingerprints(b, step=4)[1])


# ------------------------------------------------------------------ diverged replicas


def _diverging(rank: int, world_size: int, run: str, out: str) -> None:
    model, optimizer, _ = _parts()
    model = DistributedDataParallel(model)
    session = Session(model, optimizer, run_uri=run, snapshot_every=2)
    loader = session.data_loader(_dataset(), batch_size=8, seed=5)
    try:
        for x, y in loader:
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if session.step == 1 and rank == 0:  # the state step 2's snapshot must hold
                torch.save(session.unwrapped_model.state_dict(), Path(out, "step2.pt"))
            if session.step == 2 and rank == 1:  # after step 3's update, rank 1 drifts
                with torch.no_grad():
                    session.unwrapped_model[2].weight.add_(0.5)
    except ReplicasDivergedError as err:
        Path(out, f"rank{rank}.txt").write_text(str(err))
    session.close(commit=False)


def test_replicas_that_diverged_are_never_committed(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    run_group(_diverging, 2, str(run), str(out), tmp_dir=str(tmp_path))
    for rank in (0, 1):
        message = (out / f"rank{rank}.txt").read_text()
        assert message.startswith("snapshot 4 not committed: model.2.weight differs between "
                                  "ranks") and "\n" not in message
    store = SnapshotStore(str(run))
    assert store.committed_steps() == [2]
    model, optimizer, _ = _parts()
    with Session(model, optimizer, run_uri=str(run)) as session:
        assert session.start_step == 2
        saved = torch.load(out / "step2.pt")
        for key, value in model.state_dict().items():
            assert torch.equal(value, saved[key]), key
