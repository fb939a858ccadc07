"""The storage layer never lies and never hangs (issue 13, points 3 and 5, storage side).

S3 tests run against moto behind ``tests/s3_fault_proxy.py`` (the ``s3_faults`` fixture):
injected 500/503s, black holes, responses cut short and lost answers. The retry helper
itself is checked with a fake clock. Each test states the promise it checks.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
from s3_fault_proxy import S3FaultProxy

from elastic.errors import SnapshotIntegrityError, StorageUnavailableError
from elastic.format.records import MANIFEST_NAME
from elastic.storage.retry import RetryPolicy, call_with_retries, is_transient
from elastic.store.snapshot_store import SnapshotStore

DATA = bytes(range(256)) * 64  # 16 KiB, every byte value


def s3_store(bucket: str, **kwargs: float) -> SnapshotStore:
    return SnapshotStore(f"s3://{bucket}/run", **kwargs)


def fill_step(store: SnapshotStore, step: int, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        store.write_file(store.step_path(step, name), data)


def key_regex(store: SnapshotStore, path: str) -> str:
    """The proxy sees path-style targets: /bucket/key."""
    return "^/" + path.replace(".", r"\.") + r"(\?|$)"


# ---------------------------------------------------------------- the retry helper


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_retry_helper_backs_off_then_succeeds_and_gives_up_by_the_deadline() -> None:
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=10.0, base_s=0.5, cap_s=4.0, sleep=fake.sleep,
                         clock=fake.clock, rand=lambda: 1.0)
    calls: list[float] = []

    def flaky(timeout: float) -> str:
        calls.append(timeout)
        if len(calls) <= 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    assert call_with_retries(flaky, what="read", path="p", policy=policy, attempt_s=2) == "ok"
    assert fake.sleeps == [0.5, 1.0, 2.0]  # exponential (jitter pinned to its maximum)

    def dead(timeout: float) -> None:
        fake.now += timeout  # every attempt uses up its whole timeout
        raise TimeoutError("no answer")

    fake.now, fake.sleeps = 0.0, []
    with pytest.raises(StorageUnavailableError, match="bucket/key.*TimeoutError: no answer"):
        call_with_retries(dead, what="read", path="bucket/key", policy=policy, attempt_s=2)
    assert fake.now <= policy.deadline_s + 1.0  # bounded by the deadline, not by attempts


def test_definite_errors_are_not_retried() -> None:
    fake = FakeTime()
    policy = RetryPolicy(sleep=fake.sleep, clock=fake.clock)
    for err in (FileNotFoundError("gone"), FileExistsError("there"), PermissionError("no"),
                ValueError("bug")):
        calls: list[float] = []

        def once(timeout: float, err: Exception = err, calls: list[float] = calls) -> None:
            calls.append(timeout)
            raise err

        with pytest.raises(type(err)):
            call_with_retries(once, what="read", path="p", policy=policy, attempt_s=1)
        assert len(calls) == 1 and fake.sleeps == []
    assert is_transient(TimeoutError()) and is_transient(ConnectionRefusedError())


# ---------------------------------------------------------------- S3 faults


def test_get_500_three_times_then_the_right_bytes(s3_bucket: str, s3_faults: S3FaultProxy
                                                  ) -> None:
    store = s3_store(s3_bucket)
    path = store.step_path(2, "shard.bin")
    store.write_file(path, DATA)
    rule = s3_faults.add_rule("GET", key_regex(store, path), "status", status=500, times=3)
    assert store.read_range(path, 100, 5000) == DATA[100:5000]
    assert rule.hits == 3


def test_put_slowdown_then_the_write_lands(s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    store = s3_store(s3_bucket)
    path = store.step_path(2, "shard.bin")
    rule = s3_faults.add_rule("PUT", key_regex(store, path), "status", status=503, times=2)
    store.write_file(path, DATA)
    assert rule.hits == 2
    assert store.read_file(path) == DATA


def test_exists_does_not_say_no_when_the_store_does_not_answer(
        s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    store = s3_store(s3_bucket)
    fill_step(store, 4, {MANIFEST_NAME: b"{}"})
    manifest = store.step_path(4, MANIFEST_NAME)
    s3_faults.add_rule("HEAD", key_regex(store, manifest), "status", status=503, times=2)
    assert store.committed_steps() == [4]


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_black_hole_fails_within_the_deadline(s3_bucket: str, s3_faults: S3FaultProxy,
                                              method: str) -> None:
    store = s3_store(s3_bucket, timeout_s=2.0, retry_deadline_s=2.0)
    path = store.step_path(2, "shard.bin")
    if method == "GET":
        store.write_file(path, DATA)
    rule = s3_faults.add_rule(method, key_regex(store, path), "blackhole", times=None)
    begin = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="shard.bin"):
        if method == "GET":
            store.read_file(path)
        else:
            store.write_file(path, DATA)
    elapsed = time.monotonic() - begin
    assert rule.hits >= 1
    # Not a timing assertion but a hang check: without the deadline this takes minutes.
    assert elapsed < 30, f"took {elapsed:.1f}s against a 2s deadline"


def test_slow_answer_times_out_and_is_retried(s3_bucket: str, s3_faults: S3FaultProxy
                                              ) -> None:
    store = s3_store(s3_bucket, timeout_s=1.0, retry_deadline_s=10.0)
    path = store.step_path(2, "shard.bin")
    store.write_file(path, DATA)
    rule = s3_faults.add_rule("GET", key_regex(store, path), "delay", seconds=30.0, times=1)
    begin = time.monotonic()
    assert store.read_range(path, 0, 100) == DATA[:100]
    # Far below the 30 s delay: the slow answer was abandoned and the read retried.
    assert rule.hits == 1 and time.monotonic() - begin < 20.0


def test_response_cut_short_is_retried(s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    store = s3_store(s3_bucket)
    path = store.step_path(2, "shard.bin")
    store.write_file(path, DATA)
    rule = s3_faults.add_rule("GET", key_regex(store, path), "cut", fraction=0.3, times=2)
    assert store.read_range(path, 0, len(DATA)) == DATA
    assert store.read_file(path) == DATA
    assert rule.hits == 2


def test_truncated_object_is_definite_not_retried(s3_bucket: str, s3_faults: S3FaultProxy
                                                  ) -> None:
    store = s3_store(s3_bucket, retry_deadline_s=30.0)
    path = store.step_path(2, "shard.bin")
    store.write_file(path, DATA[:1000])
    begin = time.monotonic()
    with pytest.raises(SnapshotIntegrityError, match="truncated"):
        store.read_range(path, 500, 2000)
    with pytest.raises(SnapshotIntegrityError, match="truncated"):
        store.read_range(path, 1500, 2000)  # starts past the end: S3 answers 416
    assert time.monotonic() - begin < 20.0  # far below the 30 s retry deadline: not retried


def test_missing_key_is_file_not_found_at_once(s3_bucket: str, s3_faults: S3FaultProxy
                                               ) -> None:
    store = s3_store(s3_bucket)
    path = store.step_path(2, "nothing.bin")
    rule = s3_faults.add_rule(None, key_regex(store, path), "forward", times=None)
    with pytest.raises(FileNotFoundError):
        store.read_file(path)
    assert rule.hits == 1  # one GET, the store answered 404: no retry
    with pytest.raises(FileNotFoundError):
        store.read_range(path, 0, 10)
    assert rule.hits == 2


def test_retries_exhausted_names_the_path(s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    store = s3_store(s3_bucket, retry_deadline_s=5.0)
    path = store.step_path(2, "shard.bin")
    store.write_file(path, DATA)
    rule = s3_faults.add_rule("GET", key_regex(store, path), "status", status=500, times=None)
    with pytest.raises(StorageUnavailableError) as info:
        store.read_range(path, 0, 10)
    assert path in str(info.value) and "internal error" in str(info.value).lower()
    assert rule.hits >= 2


# ---------------------------------------------------------------- exclusive create


def test_exclusive_create_local(tmp_path) -> None:
    store = SnapshotStore(str(tmp_path / "run"))
    path = store.step_path(2, MANIFEST_NAME)
    store.write_file(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        store.write_file(path, b"second", exclusive=True)
    assert store.read_file(path) == b"first"
    assert os.listdir(store.step_path(2)) == [MANIFEST_NAME]  # no temp file left behind


def test_exclusive_create_s3(s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    store = s3_store(s3_bucket)
    path = store.step_path(2, MANIFEST_NAME)
    store.write_file(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        store.write_file(path, b"second", exclusive=True)
    # Hide the object from the HEAD check: the conditional PUT itself must refuse it.
    s3_faults.add_rule("HEAD", key_regex(store, path), "status", status=404, times=1)
    put = s3_faults.add_rule("PUT", key_regex(store, path), "forward", times=None)
    with pytest.raises(FileExistsError):
        store.write_file(path, b"third", exclusive=True)
    assert put.hits == 1  # the PUT was sent and refused by the store (If-None-Match: *)
    assert store.read_file(path) == b"first"


def test_exclusive_create_s3_whose_answer_was_lost(s3_bucket: str, s3_faults: S3FaultProxy
                                                   ) -> None:
    store = s3_store(s3_bucket)
    path = store.step_path(2, MANIFEST_NAME)
    rule = s3_faults.add_rule("PUT", key_regex(store, path), "drop", times=1)
    store.write_file(path, b"mine", exclusive=True)  # the retry finds our own bytes: success
    assert rule.hits == 1 and store.read_file(path) == b"mine"


# ---------------------------------------------------------------- quarantine and deletes


FILES = {"shard-00000-of-00002-g000001.safetensors": DATA,
         "shard-00001-of-00002-g000001.safetensors": DATA[::-1],
         MANIFEST_NAME: b'{"step": 4}'}


def check_quarantine(store: SnapshotStore) -> None:
    fill_step(store, 2, {MANIFEST_NAME: b"{}"})
    fill_step(store, 4, FILES)
    assert store.committed_steps() == [2, 4]
    where = store.quarantine_step(4, "checksum mismatch in shard 1")
    assert where.endswith("quarantine/000000004")
    assert store.committed_steps() == [2] and store.all_steps() == [2]
    for name, data in FILES.items():
        assert store.read_file(f"{where}/{name}") == data
    reason = json.loads(store.read_file(f"{where}/reason.json"))
    assert reason["step"] == 4 and reason["reason"] == "checksum mismatch in shard 1"
    fill_step(store, 4, {MANIFEST_NAME: b"again"})  # the same step, rejected again
    second = store.quarantine_step(4, "again")
    assert second.endswith("quarantine/000000004-2")
    rows = store.quarantined()
    assert [(r["step"], r["where"], r["reason"]) for r in rows] == [
        (4, where, "checksum mismatch in shard 1"), (4, second, "again")]
    assert all(isinstance(r["time"], float) for r in rows)


def test_quarantine_local(tmp_path) -> None:
    check_quarantine(SnapshotStore(str(tmp_path / "run")))


def test_quarantine_s3(s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    store = s3_store(s3_bucket)
    # A flaky copy must not lose anything: a 503 on one copy is retried.
    s3_faults.add_rule("PUT", r"/quarantine/000000004/shard-00001", "status", status=503)
    check_quarantine(store)


def check_delete_files(store: SnapshotStore) -> None:
    fill_step(store, 6, FILES)
    mine = [n for n in FILES if "shard-00000" in n] + ["not-there.bin"]
    store.delete_files(6, mine)
    assert store.step_files(6) == sorted(n for n in FILES if "shard-00000" not in n)
    with pytest.raises(ValueError, match="plain file name"):
        store.delete_files(6, ["../../run.json"])


def test_delete_files_local(tmp_path) -> None:
    check_delete_files(SnapshotStore(str(tmp_path / "run")))


def test_delete_files_s3(s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    check_delete_files(s3_store(s3_bucket))


def test_cli_ls_lists_quarantined(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.cli import snapshots as cli

    store = SnapshotStore(str(tmp_path / "run"))
    fill_step(store, 2, {MANIFEST_NAME: b"{}"})
    store.quarantine_step(2, "bad checksum")
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["snapshots", "ls", store.run_uri])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "quarantined" in out and "bad checksum" in out
