"""A Ray Data pipeline read in units (`data_state.ray_units`, `data_state.ray_feeder`) on a local
Ray: `read_parquet` files of uneven sizes through `map_batches`, `range` read tasks through
`map`, `read_text` files through `filter`.

Checked: the units' outputs are exactly the pipeline's rows; a run stopped mid-epoch and
resumed at another world size trains what the uninterrupted run trains, reading only the units
from its position on; a UDF that draws randomness is refused on resume; pipelines whose rows
depend on other units or on chance are refused in one line; a feeder actor serves every rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import ray.data
from stream_steps import walk

from data_state.ray_feeder import FeederClient, create_feeder, local_feeder
from data_state.ray_units import pipeline_units
from data_state.stream_feeder import UnitReadError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
FILE_ROWS = [30, 3, 17, 0, 41, 9]  # uneven parquet files, one empty


@pytest.fixture
def feeders() -> Any:
    """Local feeders made by a test, closed (their reads waited for) before Ray stops."""
    made: list[Any] = []

    def make(ds: Any) -> Any:
        made.append(local_feeder(ds))
        return made[-1]

    yield make
    for feeder in made:
        feeder.close()


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Any:
    # The pipelines' functions live here; Ray's workers cannot import a test module.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = not ray.is_initialized()
    if started:  # "local": our own instance, never a cluster another process left running
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


def _files(root: Path) -> Path:
    root.mkdir()
    start = 0
    for i, n in enumerate(FILE_ROWS):
        ids = np.arange(start, start + n)
        pq.write_table(pa.table({"id": ids, "x": ids.astype(np.float32) / 7}),
                       root / f"part-{i}.parquet")
        start += n
    return root


def _double(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"id": batch["id"], "x2": batch["x"] * 2}


def _steps(feeder: Any, world: int, steps: int, state: dict[str, Any] | None = None,
           **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """The ids each step trains over all ranks, and the state after them."""
    return walk(feeder, world, steps, lambda batch: [int(i) for i in batch["id"]], state,
                **{"global_batch": 8, "microbatch_size": 2, "seed": 5, **kwargs})


def test_parquet_files_are_units_and_a_resume_at_another_world_size_continues_exactly(
        tmp_path: Path, feeders: Any) -> None:
    ds = ray.data.read_parquet(str(_files(tmp_path / "data"))).map_batches(_double)
    units = pipeline_units(ds)
    assert units.kind == "files" and units.count == len(FILE_ROWS)
    assert [Path(p).name for p in units.paths] == sorted(f"part-{i}.parquet"
                                                           for i in range(len(FILE_ROWS)))
    per_unit = [units.dataset(k).take_all() for k in range(units.count)]
    assert sorted(r["id"] for rows in per_unit for r in rows) == list(range(sum(FILE_ROWS)))
    assert all(r["x2"] == pytest.approx(r["id"] / 7 * 2) for rows in per_unit for r in rows)

    steps = sum(FILE_ROWS) // 8 + 2  # 13 in epoch 0 (the last a tail of 4), one of epoch 1
    whole, _ = _steps(feeders(ds), 2, steps)
    epoch0 = [i for step in whole[:-1] for i in step]
    assert sorted(epoch0) == list(range(sum(FILE_ROWS))) and len(whole[-2]) == 4
    head, state = _steps(feeders(ds), 3, 7)
    resumed = feeders(ds)
    tail, _ = _steps(resumed, 1, steps - 7, state=state)
    assert head + tail == whole
    assert resumed.reads < units.count + 2  # never the whole epoch again (+ epoch 1's start)


def test_files_on_s3_are_read_as_on_local_disk(tmp_path: Path, feeders: Any,
                                              s3_endpoint: Any, s3_bucket: str) -> None:
    """The same files on an S3 API (moto, 127.0.0.1) and on disk: the same units, the same
    steps, and a resume reads on from the position."""
    import boto3
    from pyarrow import fs

    local = _files(tmp_path / "data")
    client = boto3.client("s3", endpoint_url=s3_endpoint.url)
    for path in sorted(local.glob("*.parquet")):
        client.upload_file(str(path), s3_bucket, f"data/{path.name}")
    s3 = fs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1",
                         endpoint_override=s3_endpoint.url, scheme="http")
    remote = ray.data.read_parquet(f"{s3_bucket}/data", filesystem=s3).map_batches(_double)
    assert pipeline_units(remote).count == len(FILE_ROWS)
    on_disk, _ = _steps(feeders(ray.data.read_parquet(str(local)).map_batches(_double)), 2, 8)
    head, state = _steps(feeders(remote), 2, 5)
    tail, _ = _steps(feeders(remote), 3, 3, state=state)
    assert head + tail == on_disk


def test_read_tasks_are_units_and_a_random_udf_is_refused_on_resume(tmp_path: Path,
                                                                   feeders: Any) -> None:
    ds = ray.data.range(60, override_num_blocks=7).map(lambda r: {"id": r["id"]})
    units = pipeline_units(ds)
    assert units.kind == "read_tasks" and units.count >= 7  # range cuts 60 rows its own way
    whole, _ = _steps(feeders(ds), 1, 8, drop_last=True)  # 7 steps of 8, then epoch 1
    epoch0 = [i for s in whole[:7] for i in s]
    assert len(set(epoch0)) == 56 and set(epoch0) <= set(range(60))

    def noisy(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"id": batch["id"] + np.random.randint(0, 1000, len(batch["id"]))}

    random_ds = ray.data.range(60, override_num_blocks=7).map_batches(noisy)
    _, state = _steps(feeders(random_ds), 1, 3)
    with pytest.raises(ValueError, match="not the ones the snapshot recorded"):
        _steps(feeders(random_ds), 1, 1, state=state)

    text = tmp_path / "text"
    text.mkdir()
    for i in range(3):
        (text / f"{i}.txt").write_text("".join(f"line {i}-{j}\n" for j in range(5 + i)))
    lines = ray.data.read_text(str(text)).filter(lambda r: not r["text"].endswith("-0"))
    found = pipeline_units(lines)
    assert found.kind == "read_tasks" and found.count == 3
    assert sum(found.dataset(k).count() for k in range(3)) == 5 + 6 + 7 - 3


def test_a_resume_after_the_files_changed_is_refused(tmp_path: Path, feeders: Any) -> None:
    data = _files(tmp_path / "data")
    ds = ray.data.read_parquet(str(data)).map_batches(_double)
    _, state = _steps(feeders(ds), 2, 3)
    # A file added: another dataset (the snapshot's fingerprint names its files).
    pq.write_table(pa.table({"id": np.arange(500, 505), "x": np.zeros(5, np.float32)}),
                   data / "part-9.parquet")
    grown = ray.data.read_parquet(str(data)).map_batches(_double)
    with pytest.raises(ValueError, match="fingerprint"):
        _steps(feeders(grown), 1, 1, state=state)
    (data / "part-9.parquet").unlink()
    # The same files, other values: refused by the sizes in the fingerprint, or, where the
    # sizes did not change, by the digest of the unit the position stands in.
    for path in sorted(data.glob("*.parquet")):
        table = pq.read_table(path)
        if table.num_rows:
            x = table.column("x").to_numpy() + 1
            pq.write_table(table.set_column(1, "x", pa.array(x)), path)
    edited = ray.data.read_parquet(str(data)).map_batches(_double)
    with pytest.raises(ValueError, match="fingerprint|not the ones the snapshot recorded"):
        _steps(feeders(edited), 1, 1, state=state)


def test_a_file_the_pipeline_fails_on_stops_the_read_or_is_skipped(tmp_path: Path,
                                                                    feeders: Any) -> None:
    def strict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if (batch["id"] == 31).any():  # a bad record in part-1 (ids 30..32)
            raise ValueError("cannot decode record 31")
        return batch

    ds = ray.data.read_parquet(str(_files(tmp_path / "data"))).map_batches(strict)
    with pytest.raises(UnitReadError, match=r"part-1\.parquet .*cannot decode record 31"):
        _steps(feeders(ds), 1, 14, shuffle=False)
    skipped, _ = _steps(feeders(ds), 2, 13, shuffle=False, on_error="skip")  # 97 rows
    trained = [i for step in skipped for i in step]
    assert sorted(trained) == [i for i in range(sum(FILE_ROWS)) if not 30 <= i < 33]


@pytest.mark.parametrize("make, cause", [
    (lambda ds: ds.random_shuffle(), "random_shuffle"),
    (lambda ds: ds.randomize_block_order(), "randomize_block_order"),
    (lambda ds: ds.limit(5), "limit"),
    (lambda ds: ds.union(ds), "union"),
    (lambda ds: ds.repartition(3), "repartition"),
])
def test_pipelines_that_are_not_per_unit_are_refused_in_one_line(make: Any, cause: str) -> None:
    with pytest.raises(ValueError, match=cause) as err:
        pipeline_units(make(ray.data.range(10)))
    assert "\n" not in str(err.value)


def test_data_held_in_memory_is_read_block_by_block(feeders: Any) -> None:
    """Ray's own quickstart: `from_items` through `map_batches`."""
    items = ray.data.from_items([{"x": [x], "y": [2 * x]} for x in range(40)],
                                override_num_blocks=3)
    ds = items.map_batches(lambda batch: {"x": batch["x"], "y": batch["y"] + 1})
    units = pipeline_units(ds)
    assert units.kind == "blocks" and units.count == 3
    def pairs(batch: dict[str, Any]) -> list[tuple[int, int]]:
        return [(int(x), int(y)) for x, y in zip(batch["x"].reshape(-1), batch["y"].reshape(-1),
                                                 strict=True)]

    whole, _ = walk(feeders(ds), 2, 5, pairs, global_batch=8, seed=1)
    assert sorted(p for step in whole for p in step) == [(x, 2 * x + 1) for x in range(40)]
    head, state = walk(feeders(ds), 3, 2, pairs, global_batch=8, seed=1)
    tail, _ = walk(feeders(ds), 1, 3, pairs, state, global_batch=8, seed=1)
    assert head + tail == whole


def test_a_feeder_actor_reads_each_unit_once_for_every_rank_and_survives_its_process(tmp_path: Path,
                                                            feeders: Any) -> None:
    ds = ray.data.read_parquet(str(_files(tmp_path / "data"))).map_batches(_double)
    actor = create_feeder(ds, "baton-test-feeder")
    try:
        client = FeederClient(actor)
        local = feeders(ds)
        assert client.fingerprint == local.fingerprint and client.units == local.units
        shared, _ = _steps(client, 3, 6)
        alone, _ = _steps(local, 3, 6)
        assert shared == alone
        reads = ray.get(actor.reads.remote())
        assert reads <= len(FILE_ROWS)  # once for all three ranks

        # Its process killed mid-epoch (out of memory, say): Ray starts it again and the
        # ranks read on from their position, the same rows.
        head, state = _steps(client, 3, 2)
        ray.kill(actor, no_restart=False)
        tail, _ = _steps(client, 3, 4, state=state)
        assert head + tail == alone
    finally:
        ray.kill(actor)
