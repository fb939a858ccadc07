"""ResumableLoader: exactly-once across resizes and resumes (P5), world-size invariance (P1),
resume equality, epoch rollover and the tail policy, the prefetch thread, and every error."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data_state.corpus import prepare_corpus
from data_state.cursor import DataCursor, assign_microbatches
from data_state.dataset import TokenDataset
from data_state.loader import Microbatch, ResumableLoader
from data_state.manifest import DatasetError
from data_state.order import Permutation


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> TokenDataset:
    out = tmp_path_factory.mktemp("loader_ds")
    # ~12 KB of real text -> ~180 train sequences of 64 tokens, several shards/row groups.
    prepare_corpus(
        None,
        str(out),
        seq_len=64,
        max_bytes=12_000,
        rows_per_group=8,
        sequences_per_shard=64,
        progress=False,
    )
    dataset = TokenDataset(str(out))
    assert len(dataset) % 12 != 0  # so the tail policy is exercised with global_batch 12
    yield dataset
    dataset.close()


def _loaders(ds: TokenDataset, world_size: int, state: dict | None = None, **kw: int) -> list:
    kw = {"global_batch": 12, "microbatch_size": 2, "seed": 7, **kw}
    loaders = [ResumableLoader(ds, rank=r, world_size=world_size, **kw) for r in range(world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    return loaders


def _step_union(loaders: list[ResumableLoader]) -> list[Microbatch]:
    """Every worker's microbatches of the current step, ordered by microbatch index."""
    mbs = [mb for loader in loaders for mb in loader.next_step()]
    return sorted(mbs, key=lambda mb: mb.index)


def _commit(loaders: list[ResumableLoader]) -> dict:
    for loader in loaders:
        loader.advance()
    states = [loader.state_dict() for loader in loaders]
    assert all(s == states[0] for s in states)  # every rank holds the same cursor
    return states[0]


@settings(max_examples=40, deadline=None)
@given(
    segments=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 6), st.booleans()), min_size=1, max_size=6
    ),
    microbatch_size=st.sampled_from([1, 2, 3]),
)
def test_exactly_once_across_resizes_and_resumes(
    ds: TokenDataset, segments: list[tuple[int, int, bool]], microbatch_size: int
) -> None:
    """P5: whatever the (steps, world size) history, with a save/load between segments and
    prefetched-but-uncommitted steps thrown away, each epoch trains every sample of its order
    exactly once, except the tail that does not fill a step."""
    global_batch = 6 * microbatch_size  # 6 microbatches: world sizes 4 and 5 do not divide it
    trained: dict[int, list[int]] = {}
    state = None
    for num_steps, world_size, peek_uncommitted in [*segments, (10**6, 2, False)]:
        loaders = _loaders(
            ds, world_size, state, global_batch=global_batch, microbatch_size=microbatch_size
        )
        for _ in range(num_steps):
            for mb in _step_union(loaders):
                trained.setdefault(mb.epoch, []).extend(mb.sample_indices)
            state = _commit(loaders)
            if state["epoch"] == 1:
                break
        if peek_uncommitted:  # a step prefetched and even handed out, then lost with the worker
            _step_union(loaders)
        state = loaders[0].state_dict()
        for loader in loaders:
            loader.close()
        if state["epoch"] == 1:
            break
    assert state == {
        "version": 1,
        "dataset": ds.fingerprint,
        "seed": 7,
        "epoch": 1,
        "samples_consumed": 0,
    }
    counts = Counter(trained[0])
    steps = len(ds) // global_batch
    assert len(trained[0]) == steps * global_batch and set(counts.values()) == {1}
    order = Permutation(len(ds), seed=7, epoch=0)(np.arange(len(ds)))
    assert set(counts) | set(order[steps * global_batch :].tolist()) == set(range(len(ds)))


@pytest.mark.parametrize("new_world_size", [1, 2, 3, 5])
def test_resume_gives_the_same_next_microbatches(ds: TokenDataset, new_world_size: int) -> None:
    reference = _loaders(ds, 1)
    expected = []
    for _ in range(7):
        expected.append(_step_union(reference))
        _commit(reference)
    before = _loaders(ds, 2)
    for _ in range(3):
        _step_union(before)
        state = _commit(before)
    _step_union(before)  # prefetched, never committed
    after = _loaders(ds, new_world_size, state)
    for step in range(3, 7):
        got = _step_union(after)
        assert [mb.index for mb in got] == list(range(6))
        for mb, want in zip(got, expected[step], strict=True):
            assert mb.sample_indices == want.sample_indices and mb.step == want.step == step
            assert torch.equal(mb.tokens, want.tokens)
        _commit(after)
    for loader in [*reference, *before, *after]:
        loader.close()


def test_union_of_workers_is_the_same_for_world_sizes_1_to_4(ds: TokenDataset) -> None:
    per_world: dict[int, list[list[tuple[int, tuple[int, ...], bytes]]]] = {}
    for world_size in (1, 2, 3, 4):
        loaders = _loaders(ds, world_size, global_batch=24, microbatch_size=2)
        steps = []
        for _ in range(4):
            steps.append(
                [
                    (mb.index, mb.sample_indices, mb.tokens.numpy().tobytes())
                    for mb in _step_union(loaders)
                ]
            )
            _commit(loaders)
        per_world[world_size] = steps
        for loader in loaders:
            loader.close()
    assert per_world[1] == per_world[2] == per_world[3] == per_world[4]


def test_microbatch_contents(ds: TokenDataset) -> None:
    with ResumableLoader(
        ds, global_batch=12, microbatch_size=4, seed=3, rank=1, world_size=2
    ) as loader:
        assert loader.microbatches == range(1, 3)
        mbs = loader.next_step()
        order = Permutation(len(ds), seed=3, epoch=0)
        for mb, m in zip(mbs, (1, 2), strict=True):
            assert mb.index == m and mb.num_microbatches == 3 and mb.epoch == 0
            assert mb.tokens.dtype == torch.int64 and mb.tokens.shape == (4, 64)
            assert list(mb.sample_indices) == order(np.arange(4 * m, 4 * m + 4)).tolist()
            assert np.array_equal(
                mb.tokens.numpy(), ds.read(list(mb.sample_indices)).astype(np.int64)
            )


def test_epoch_rollover_drops_a_different_tail(ds: TokenDataset) -> None:
    global_batch = 12
    steps = len(ds) // global_batch
    with ResumableLoader(ds, global_batch=global_batch, microbatch_size=4, seed=1) as loader:
        seen: dict[int, set[int]] = {0: set(), 1: set()}
        for _ in range(2 * steps):
            for mb in loader.next_step():
                seen[mb.epoch].update(mb.sample_indices)
                assert mb.step == mb.epoch * steps + loader.cursor.samples_consumed // 12
            loader.advance()
        assert loader.cursor == DataCursor(ds.fingerprint, 1, 2, 0)
    tails = [set(range(len(ds))) - seen[e] for e in (0, 1)]
    assert len(tails[0]) == len(tails[1]) == len(ds) % global_batch > 0
    assert tails[0] != tails[1]


def test_next_step_is_idempotent_until_advance(ds: TokenDataset) -> None:
    with ResumableLoader(ds, global_batch=12, microbatch_size=2, seed=0, prefetch_steps=3) as ld:
        first = ld.next_step()
        again = ld.next_step()
        assert [mb.sample_indices for mb in first] == [mb.sample_indices for mb in again]
        assert ld.state_dict()["samples_consumed"] == 0  # prefetching counts nothing
        ld.advance()
        assert ld.state_dict()["samples_consumed"] == 12
        with pytest.raises(RuntimeError, match="advance\\(\\) without a step"):
            ld.advance()


def test_reshard_in_place_matches_a_fresh_loader(ds: TokenDataset) -> None:
    with ResumableLoader(
        ds, global_batch=12, microbatch_size=2, seed=4, rank=0, world_size=3
    ) as loader:
        loader.next_step()
        loader.advance()
        loader.next_step()  # uncommitted, dropped by the resize
        loader.reshard(rank=1, world_size=2)
        got = [mb.sample_indices for mb in loader.next_step()]
        state = loader.state_dict()
    fresh = _loaders(ds, 2, state, seed=4)
    assert got == [mb.sample_indices for mb in fresh[1].next_step()]
    assert [mb.index for mb in fresh[1].next_step()] == [3, 4, 5]
    for f in fresh:
        f.close()


def test_prefetch_thread_stops_on_close_and_on_errors(ds: TokenDataset) -> None:
    earlier = set(threading.enumerate())  # other tests' loaders may still hold theirs

    def prefetchers() -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t.name.startswith("baton-data-prefetch") and t not in earlier]

    with ResumableLoader(ds, global_batch=12, microbatch_size=2, seed=0) as loader:
        loader.next_step()
        assert len(prefetchers()) == 1
    assert prefetchers() == []

    class Failing:
        fingerprint, seq_len = ds.fingerprint, ds.seq_len

        def __init__(self) -> None:
            self.calls = 0

        def __len__(self) -> int:
            return len(ds)

        def batch(self, indices: np.ndarray) -> torch.Tensor:
            self.calls += 1
            if self.calls == 2:
                raise DatasetError("shard train/part-00003.parquet is corrupt (test)")
            return ds.batch(indices)

    source = Failing()
    loader = ResumableLoader(source, global_batch=12, microbatch_size=2, seed=0)
    loader.next_step()
    loader.advance()
    with pytest.raises(DatasetError, match="part-00003.parquet is corrupt"):
        loader.next_step()
    assert prefetchers() == []
    assert loader.state_dict()["samples_consumed"] == 12
    assert len(loader.next_step()) == 6  # a retry re-reads the same step
    loader.close()
    assert prefetchers() == []


def test_prefetch_queue_is_bounded(ds: TokenDataset) -> None:
    class Counting:
        fingerprint, seq_len = ds.fingerprint, ds.seq_len
        reads = 0

        def __len__(self) -> int:
            return len(ds)

        def batch(self, indices: np.ndarray) -> torch.Tensor:
            Counting.reads += 1
            return ds.batch(indices)

    loader = ResumableLoader(
        Counting(),
        global_batch=12,
        microbatch_size=2,
        seed=0,
        prefetch_steps=2,
    )
    loader.next_step()
    time.sleep(0.3)  # ample time to run ahead if the queue did not stop it
    # The step handed out, two queued, and one built and waiting for room: never more.
    assert Counting.reads <= 4
    loader.close()


def test_resume_with_a_different_global_batch_continues_by_samples(ds: TokenDataset) -> None:
    with ResumableLoader(ds, global_batch=12, microbatch_size=2, seed=2) as a:
        trained = [i for mb in a.next_step() for i in mb.sample_indices]
        a.advance()
        state = a.state_dict()
    with ResumableLoader(ds, global_batch=8, microbatch_size=4, seed=2) as b:
        b.load_state_dict(state)
        trained += [i for mb in b.next_step() for i in mb.sample_indices]
    assert trained == Permutation(len(ds), seed=2, epoch=0)(np.arange(20)).tolist()


def test_configuration_errors(ds: TokenDataset) -> None:
    with pytest.raises(
        ValueError, match="global_batch \\(10\\) must be a multiple of microbatch_size \\(4\\)"
    ):
        ResumableLoader(ds, global_batch=10, microbatch_size=4, seed=0)
    with pytest.raises(ValueError, match="world_size 4 is larger than the 3 microbatches"):
        ResumableLoader(ds, global_batch=12, microbatch_size=4, seed=0, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank must be in \\[0, world_size=2\\)"):
        ResumableLoader(ds, global_batch=12, microbatch_size=4, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed must be in"):
        ResumableLoader(ds, global_batch=12, microbatch_size=4, seed=-1)
    with pytest.raises(ValueError, match="larger than the dataset"):
        ResumableLoader(ds, global_batch=len(ds) + 1, microbatch_size=1, seed=0)
    with ResumableLoader(ds, global_batch=12, microbatch_size=4, seed=0) as loader:
        with pytest.raises(ValueError, match="world_size 5 is larger"):
            loader.reshard(rank=0, world_size=5)


def test_cursor_errors(ds: TokenDataset) -> None:
    with ResumableLoader(ds, global_batch=12, microbatch_size=4, seed=0) as loader:
        good = loader.state_dict()
        with pytest.raises(ValueError, match="cursor is for dataset 'feedbeef'.*resume with the"):
            loader.load_state_dict({**good, "dataset": "feedbeef"})
        with pytest.raises(ValueError, match="field 'seed' is 9"):
            loader.load_state_dict({**good, "seed": 9})
        with pytest.raises(ValueError, match="field 'samples_consumed' must be an integer"):
            loader.load_state_dict({**good, "samples_consumed": -1})
        with pytest.raises(ValueError, match="version is 2"):
            loader.load_state_dict({**good, "version": 2})
        with pytest.raises(ValueError, match="unknown fields \\['rank'\\]"):
            loader.load_state_dict({**good, "rank": 0})
        with pytest.raises(ValueError, match="field 'epoch'"):
            loader.load_state_dict({k: v for k, v in good.items() if k != "epoch"})
        # Edited cursors that the types alone let through: a bool or float version, an
        # epoch the order cannot key, a position past the end of the epoch (which would
        # otherwise skip the rest of the epoch without a word).
        for version in (True, 1.0):
            with pytest.raises(ValueError, match="version is"):
                loader.load_state_dict({**good, "version": version})
        with pytest.raises(ValueError, match=r"field 'epoch' must be an integer in \[0, 2\*\*62"):
            loader.load_state_dict({**good, "epoch": 2**63})
        with pytest.raises(ValueError, match=f"'samples_consumed' is {len(ds) + 1} but an epoch"):
            loader.load_state_dict({**good, "samples_consumed": len(ds) + 1})
        loader.load_state_dict({**good, "samples_consumed": len(ds)})  # the end: next epoch
        assert loader.cursor.epoch == good["epoch"] + 1 and loader.cursor.samples_consumed == 0


def test_assignment_is_contiguous_and_balanced() -> None:
    for num_microbatches in range(1, 25):
        for world_size in range(1, num_microbatches + 1):
            blocks = [
                assign_microbatches(num_microbatches, rank=r, world_size=world_size)
                for r in range(world_size)
            ]
            assert [m for b in blocks for m in b] == list(range(num_microbatches))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_cursor_round_trips_as_plain_json() -> None:
    import json

    cursor = DataCursor("abc", seed=3, epoch=2, samples_consumed=48)
    assert DataCursor.from_dict(json.loads(json.dumps(cursor.to_dict()))) == cursor
    assert "rank" not in cursor.to_dict() and "world_size" not in cursor.to_dict()
    assert cursor.advanced(num_samples=100, global_batch=48) == DataCursor("abc", 3, 3, 0)
    assert cursor.advanced(num_samples=200, global_batch=48) == DataCursor("abc", 3, 2, 96)


def test_documented_loss_weighting_makes_gradients_world_size_free(ds: TokenDataset) -> None:
    """P1 from the data side: weighting each microbatch loss by 1/M and summing over workers
    gives the one-worker gradient, even for a world size that does not divide M."""
    from trainer.config import ModelConfig
    from trainer.train.model import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2), seq_len=64)

    def summed_gradient(world_size: int) -> torch.Tensor:
        total = torch.zeros(sum(p.numel() for p in model.parameters()))
        for loader in _loaders(ds, world_size):  # 6 microbatches of 2
            model.zero_grad()
            for mb in loader.next_step():
                (model.loss(mb.tokens) / mb.num_microbatches).backward()
            total += torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # all-reduce
            loader.close()
        return total

    one = summed_gradient(1)
    for world_size in (2, 4):
        torch.testing.assert_close(summed_gradient(world_size), one, rtol=1e-5, atol=1e-7)


def test_shard_reads_stay_off_arrows_thread_pools(ds: TokenDataset, monkeypatch) -> None:
    """Parquet is opened without pre-buffering and decoded without Arrow's thread pools.

    Shards are read through a Python file object; a task on Arrow's IO or CPU pool holds its
    buffers, and one released there while the interpreter shuts down aborts the process
    ("terminate called without an active exception", exit 134: seen in a few % of exits of
    a torch-free process reading a dataset on a busy machine). That race cannot be shown
    deterministically, so this checks the reads that would start it: every `ParquetFile` a
    loader opens has `pre_buffer=False` and every row group is read with `use_threads=False`.
    """
    import pyarrow.parquet as pq

    opened: list[dict] = []
    reads: list[dict] = []

    class Spy(pq.ParquetFile):
        def __init__(self, source, **kwargs):  # type: ignore[no-untyped-def]
            opened.append(kwargs)
            super().__init__(source, **kwargs)

        def read_row_group(self, i, **kwargs):  # type: ignore[no-untyped-def]
            reads.append(kwargs)
            return super().read_row_group(i, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", Spy)
    fresh = TokenDataset(ds.uri, ds.split)  # its shard footers are opened anew, through the spy
    try:
        with ResumableLoader(fresh, global_batch=12, microbatch_size=2, seed=7) as loader:
            for _ in range(3):
                assert loader.next_step()
                loader.advance()
    finally:
        fresh.close()
    assert opened and reads
    assert all(kw.get("pre_buffer") is False for kw in opened), opened
    assert all(kw.get("use_threads") is False for kw in reads), reads
