"""Baton's one storage layer (``elastic/storage/storage_io.py``): local and S3 behave the same,
writes are atomic (a crash never leaves a partial file under the final name), create-only writes
refuse an existing name, reads are exact, near ranges are merged by one constant, S3 requests are
retried under deadlines (against the fault proxy), and no other module imports fsspec/s3fs. Each
test states the promise it checks.
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_fault_proxy import S3FaultProxy

from elastic.errors import SnapshotIntegrityError, StorageUnavailableError
from elastic.lease.lease_io import LEASE_NAME, LeaseConflict, lease_backend
from elastic.storage import (
    MAX_SPAN_BYTES,
    MERGE_HOLE_BYTES,
    JSONBoundsError,
    RefusedEntryError,
    Storage,
    TruncatedError,
    merge_ranges,
)
from elastic.store.snapshot_store import SnapshotStore

ROOT = Path(__file__).resolve().parents[2]
# The storage layer: the only modules that import fsspec (see elastic/storage/storage_io.py).
LAYER_FILES = {"elastic/storage/storage_io.py", "elastic/storage/s3_files.py",
               "elastic/storage/local_files.py"}
DATA = bytes(range(256)) * 64  # 16 KiB, every byte value


def key_regex(path: str) -> str:
    """The proxy sees path-style targets: /bucket/key."""
    return "^/" + path.replace(".", r"\.") + r"(\?|$)"


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield Storage(str(tmp_path / "root"))
    else:
        bucket = request.getfixturevalue("s3_bucket")
        yield Storage(f"s3://{bucket}/root")


# ---------------------------------------------------------------- one behaviour, two stores


def test_local_and_s3_behave_the_same(storage: Storage) -> None:
    a, b = storage.path("d", "a.bin"), storage.path("d", "sub", "b.bin")
    assert not storage.exists(a) and storage.listdir(storage.path("d")) == []
    storage.write_file(a, DATA)
    storage.write_file(b, b"small")
    assert storage.read_file(a) == DATA and storage.size(a) == len(DATA)
    assert storage.read_range(a, 100, 5000) == DATA[100:5000]
    assert storage.read_range(a, 7, 7) == b""
    assert storage.read_ranges(a, [(9000, 9010), (0, 4), (10, 20)]) == [
        DATA[9000:9010], DATA[:4], DATA[10:20]]
    assert storage.isfile(a) and not storage.isdir(a)
    assert storage.isdir(storage.path("d")) and not storage.isfile(storage.path("d"))
    assert storage.listdir(storage.path("d")) == ["a.bin", "sub"]
    assert storage.find(storage.path("d")) == {"a.bin": len(DATA), "sub/b.bin": 5}
    storage.write_file(a, b"replaced")  # a plain write replaces
    assert storage.read_file(a) == b"replaced"
    storage.copy(a, storage.path("c.bin"), nbytes=8)
    assert storage.read_file(storage.path("c.bin")) == b"replaced"
    with pytest.raises(FileNotFoundError):
        storage.read_file(storage.path("nothing"))
    with pytest.raises(FileNotFoundError):
        storage.read_range(storage.path("nothing"), 0, 1)
    storage.remove(storage.path("nothing"))  # a missing name is not an error
    storage.remove_many([a, storage.path("c.bin")])
    assert not storage.exists(a) and not storage.exists(storage.path("c.bin"))
    storage.remove_tree(storage.path("d"))
    assert storage.find(storage.path("d")) == {} and not storage.exists(b)
    assert storage.stats.files_written == 3 and storage.stats.range_reads >= 6


def test_create_only_refuses_an_existing_name(storage: Storage) -> None:
    path = storage.path("once.json")
    storage.write_file(path, b"first", exclusive=True)
    with pytest.raises(FileExistsError):
        storage.write_file(path, b"second", exclusive=True)
    assert storage.read_file(path) == b"first"
    assert storage.listdir(storage.root) == ["once.json"]  # no temporary file left behind


def test_exact_reads_truncated_is_definite(storage: Storage) -> None:
    path = storage.path("short.bin")
    storage.write_file(path, DATA[:1000])
    with pytest.raises(TruncatedError, match="ends at 1000; truncated"):
        storage.read_range(path, 500, 2000)
    with pytest.raises(SnapshotIntegrityError, match="truncated"):  # the snapshot vocabulary
        storage.read_range(path, 1500, 2000)  # starts past the end (S3 answers 416)
    with pytest.raises(ValueError, match="invalid byte range"):
        storage.read_range(path, 10, 5)


def test_other_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported URI scheme 'gs'"):
        Storage("gs://bucket/x")
    with pytest.raises(ValueError, match="empty"):
        Storage("")


# ---------------------------------------------------------------- atomic writes and crashes


_CRASH = textwrap.dedent("""
    import os, signal, sys
    from elastic.storage import Storage

    where, path, phase = sys.argv[1:]
    storage = Storage(where)
    die = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
    if phase == "before_rename":  # every byte in the temporary file, fsync'ed; then the crash
        os.replace = die
        storage.write_file(path, b"N" * 100_000)
    else:  # half the bytes written
        storage.write_file(path, b"N" * 100_000, mid_write=die)
""")


@pytest.mark.parametrize("phase", ["mid_write", "before_rename"])
def test_a_crash_before_the_rename_leaves_the_old_file_whole(tmp_path: Path, phase: str) -> None:
    storage = Storage(str(tmp_path))
    old, new = storage.path("old.bin"), storage.path("new.bin")
    storage.write_file(old, b"O" * 50_000)
    for path in (old, new):
        proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path), path, phase],
                              cwd=ROOT, capture_output=True, timeout=120)
        assert proc.returncode == -9, proc.stderr.decode()[-2000:]  # killed, as planned
    # Readers see the old bytes or nothing; only temporary names were left by the crash.
    assert storage.read_file(old) == b"O" * 50_000
    assert not storage.exists(new)
    leftovers = [n for n in storage.listdir(storage.root) if n != "old.bin"]
    assert len(leftovers) == 2 and all(".tmp-" in n for n in leftovers)


def test_write_is_fsynced_before_the_rename(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic.storage.local_files as local_files

    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(local_files.os, "fsync",
                        lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(local_files.os, "replace",
                        lambda a, b: (events.append("rename"), real_replace(a, b))[1])
    Storage(str(tmp_path)).write_file(str(tmp_path / "f"), b"x")
    assert events == ["fsync", "rename", "fsync"]  # file, rename, then its directory
    events.clear()
    Storage(str(tmp_path)).write_file(str(tmp_path / "g"), b"x", durable=False)
    assert events == ["rename"]


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_write_is_whole_when_the_kernel_writes_less_per_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool) -> None:
    """One write call may write less than asked (Linux: under 2 GiB per call), on the
    temporary file and on the create-only path of a filesystem without hard links."""
    import errno

    import elastic.storage.local_files as local_files

    real_pwrite, real_write = os.pwrite, os.write
    monkeypatch.setattr(local_files.os, "pwrite",
                        lambda fd, data, offset: real_pwrite(fd, bytes(data[:7]), offset))
    monkeypatch.setattr(local_files.os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    if not hard_links:
        def no_link(src: str, dst: str) -> None:
            raise OSError(errno.EPERM, "no hard links here")

        monkeypatch.setattr(local_files.os, "link", no_link)
    storage = Storage(str(tmp_path))
    data = bytes(range(256)) * 3
    storage.write_file(storage.path("f.bin"), data, exclusive=True)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


# ---------------------------------------------------------------- range merging


def test_range_merging_uses_one_constant() -> None:
    ranges = [(0, 10), (60, 70), (100, 200), (9_900, 10_000)]
    spans = merge_ranges(ranges, hole_limit=40)  # gaps: 50, 30, 9700
    assert spans == [(0, 10, [0]), (60, 200, [1, 2]), (9_900, 10_000, [3])]
    # A hole of exactly MERGE_HOLE_BYTES is read; one byte more is skipped.
    near = [(0, 10), (10 + MERGE_HOLE_BYTES, 20 + MERGE_HOLE_BYTES)]
    far = [(0, 10), (11 + MERGE_HOLE_BYTES, 20 + MERGE_HOLE_BYTES)]
    assert len(merge_ranges(near, hole_limit=MERGE_HOLE_BYTES)) == 1
    assert len(merge_ranges(far, hole_limit=MERGE_HOLE_BYTES)) == 2
    # A span never grows past MAX_SPAN_BYTES (a single larger range stays whole).
    big = [(0, MAX_SPAN_BYTES - 10), (MAX_SPAN_BYTES - 5, MAX_SPAN_BYTES + 5)]
    assert len(merge_ranges(big, hole_limit=MERGE_HOLE_BYTES)) == 2
    assert merge_ranges([(0, 2 * MAX_SPAN_BYTES)], hole_limit=0) == [(0, 2 * MAX_SPAN_BYTES, [0])]
    with pytest.raises(ValueError, match="invalid byte range"):
        merge_ranges([(5, 2)], hole_limit=0)


def test_s3_reads_near_ranges_in_one_request_local_reads_only_what_is_asked(
        s3_bucket: str, s3_faults: S3FaultProxy, tmp_path: Path) -> None:
    blob = os.urandom(MERGE_HOLE_BYTES + 4096)
    s3 = Storage(f"s3://{s3_bucket}/r")
    local = Storage(str(tmp_path))
    assert (s3.hole_limit, local.hole_limit) == (MERGE_HOLE_BYTES, 0)
    ranges = [(0, 100), (MERGE_HOLE_BYTES, MERGE_HOLE_BYTES + 100), (len(blob) - 10, len(blob))]
    for io in (s3, local):
        path = io.path("blob.bin")
        io.write_file(path, blob)
        before = io.stats.bytes_read
        gets = s3_faults.add_rule("GET", key_regex(path), "forward", times=None)
        assert io.read_ranges(path, ranges) == [blob[s:e] for s, e in ranges]
        if io is s3:
            assert gets.hits == 1  # one GET for the three ranges, holes included
        else:
            assert io.stats.bytes_read - before == 210  # three reads, no hole read


# ---------------------------------------------------------------- retries under faults


def test_s3_faults_are_retried_and_a_dead_endpoint_fails_within_the_deadline(
        s3_bucket: str, s3_faults: S3FaultProxy) -> None:
    io = Storage(f"s3://{s3_bucket}/r", timeout_s=2.0, retry_deadline_s=10.0)
    path = io.path("a.bin")
    put = s3_faults.add_rule("PUT", key_regex(path), "status", status=503, times=2)
    io.write_file(path, DATA)
    get = s3_faults.add_rule("GET", key_regex(path), "status", status=500, times=2)
    assert io.read_range(path, 10, 20) == DATA[10:20]
    cut = s3_faults.add_rule("GET", key_regex(path), "cut", fraction=0.3, times=1)
    assert io.read_file(path) == DATA  # a response cut short is a transient failure
    assert (put.hits, get.hits, cut.hits) == (2, 2, 1)
    s3_faults.add_rule("HEAD", key_regex(path), "status", status=503, times=2)
    assert io.exists(path)  # doubt is retried, never answered "no"
    # Timeouts long enough for a loaded machine's proxy thread to take the request at all.
    dead = Storage(f"s3://{s3_bucket}/r", timeout_s=2.0, retry_deadline_s=5.0)
    hole = s3_faults.add_rule("GET", key_regex(path), "blackhole", times=None)
    begin = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="a.bin"):
        dead.read_file(path)
    assert hole.hits >= 1
    # Not a timing assertion but a hang check: without the deadline this takes minutes.
    assert time.monotonic() - begin < 30


def test_the_s3_lease_runs_under_the_store_deadlines(s3_bucket: str,
                                                     s3_faults: S3FaultProxy) -> None:
    store = SnapshotStore(f"s3://{s3_bucket}/run", timeout_s=1.0, retry_deadline_s=10.0)
    backend = lease_backend(store)
    lease = key_regex(store.path(LEASE_NAME))
    flaky_put = s3_faults.add_rule("PUT", lease, "status", status=503, times=2)
    backend.create(b"token-1")
    flaky_get = s3_faults.add_rule("GET", lease, "status", status=500, times=2)
    data, etag = backend.read()
    assert data == b"token-1" and (flaky_put.hits, flaky_get.hits) == (2, 2)
    lost = s3_faults.add_rule("PUT", lease, "drop", times=1)
    backend.replace(b"token-2", etag)  # the retry comes back 412 yet the write is ours
    assert lost.hits == 1 and backend.read()[0] == b"token-2"
    with pytest.raises(LeaseConflict):
        backend.replace(b"token-3", etag)  # an outdated version is refused
    # A black-holed endpoint fails the lease read within the deadline instead of hanging.
    s3_faults.add_rule("GET", lease, "blackhole", times=None)
    quick = SnapshotStore(f"s3://{s3_bucket}/run", timeout_s=1.0, retry_deadline_s=2.0)
    with pytest.raises(StorageUnavailableError, match=LEASE_NAME):
        lease_backend(quick).read()


# ---------------------------------------------------------------- the import rule


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_only_the_storage_layer_imports_fsspec_or_s3fs() -> None:
    offenders = []
    for package in ("trainer", "elastic", "sketch_ops", "data_state"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() in LAYER_FILES:
                continue
            bare = {n for n in _imported_modules(path) if n.split(".")[0] in ("fsspec", "s3fs")}
            if bare:
                offenders.append(f"{path.relative_to(ROOT)}: {sorted(bare)}")
    assert offenders == [], "use elastic.storage.Storage instead: " + "; ".join(offenders)


def test_the_storage_layer_is_a_leaf() -> None:
    """The layer's modules (``elastic/storage/``) import from Baton only each other;
    data_state imports nothing from elastic but the layer's face (``elastic.storage``);
    importing the layer loads neither torch nor Ray."""
    baton = ("trainer", "elastic", "sketch_ops", "data_state")

    def baton_imports(path: Path) -> set[str]:
        return {n for n in _imported_modules(path) if n.split(".")[0] in baton}

    leaf = ROOT / "elastic" / "storage"
    for path in sorted(leaf.glob("*.py")):
        outside = {n for n in baton_imports(path) if not n.startswith("elastic.storage.")}
        assert outside == set(), f"{path.name} imports {outside}"
    assert baton_imports(leaf / "storage_io.py") == {
        "elastic.storage.byte_ranges", "elastic.storage.json_bounds",
        "elastic.storage.local_files", "elastic.storage.s3_files",
        "elastic.storage.s3_multipart"}
    for name in ("spares.py", "plain_files.py", "json_bounds.py", "s3_multipart.py",
                 "errors.py"):
        assert baton_imports(leaf / name) == set(), name
    assert baton_imports(leaf / "retry.py") == {"elastic.storage.errors"}
    assert baton_imports(leaf / "byte_ranges.py") == {"elastic.storage.errors"}
    for path in sorted((ROOT / "data_state").rglob("*.py")):
        from_elastic = {n for n in baton_imports(path) if n.split(".")[0] == "elastic"}
        assert from_elastic <= {"elastic.storage"}, f"{path.name} imports {from_elastic}"
    probe = ("import sys, elastic.storage; "
             "print(sorted(m for m in ('torch', 'ray', 'elastic.store', 'elastic.state') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    assert out == "[]"


def test_local_remove_tree_tolerates_another_deleter(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A second coordinator's collection may delete the same snapshot directory: entries that
    # vanish mid-walk are not an error, and what is left is still removed.
    from elastic.storage.local_files import LocalFiles

    files = LocalFiles({})
    tree = tmp_path / "snap"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "a.bin").write_bytes(b"x")
    real_rm, calls = files.fs.rm, []

    def racing_rm(path: str, recursive: bool = False) -> None:
        calls.append(path)
        if len(calls) == 1:  # the other deleter took a file first; this walk trips on it
            os.remove(tree / "sub" / "a.bin")
            raise FileNotFoundError(str(tree / "sub" / "a.bin"))
        real_rm(path, recursive=recursive)

    monkeypatch.setattr(files.fs, "rm", racing_rm)
    files.remove_tree(str(tree))
    assert not tree.exists() and len(calls) == 2
    files.remove_tree(str(tree))  # gone: nothing to do, not an error
    assert len(calls) == 2


# ---------------------------------------------------------------- plain entries only (P8)


def test_nothing_below_the_root_is_read_written_or_removed_through_a_link(
        tmp_path: Path) -> None:
    """One rule in the layer (elastic.storage.plain_files), for every caller: below the root no
    symbolic link is followed, by any operation; the file behind the link is untouched."""
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "f").write_bytes(b"theirs")
    root = tmp_path / "run"
    root.mkdir()
    (root / "d").symlink_to(outside / "d", target_is_directory=True)
    (root / "f").symlink_to(outside / "d" / "f")
    storage = Storage(str(root))
    linked_dir, linked_file = storage.path("d"), storage.path("f")
    attempts = [
        lambda: storage.read_file(f"{linked_dir}/f"),
        lambda: storage.read_file(linked_file),
        lambda: storage.read_range(linked_file, 0, 2),
        lambda: storage.read_into(linked_file, [(0, [memoryview(bytearray(2))])]),
        lambda: storage.size(linked_file),
        lambda: storage.listdir(linked_dir),
        lambda: storage.find(linked_dir),
        lambda: storage.write_file(f"{linked_dir}/g", b"ours"),
        lambda: storage.makedirs(f"{linked_dir}/sub"),
        lambda: storage.remove(f"{linked_dir}/f"),
        lambda: storage.remove_tree(linked_dir),
        lambda: storage.exists(f"{linked_dir}/f"),
    ]
    for attempt in attempts:
        with pytest.raises(RefusedEntryError, match="symbolic link"):
            attempt()
    assert storage.isfile(linked_file) is False and storage.isdir(linked_dir) is False
    assert storage.exists(linked_file)  # there, as a link: never read through
    assert sorted(p.name for p in (outside / "d").iterdir()) == ["f"]
    assert (outside / "d" / "f").read_bytes() == b"theirs"
    # A person's own files (Storage(follow_links=True), the sources of data prepare): links
    # are followed there.
    assert Storage(str(root), follow_links=True).read_file(linked_file) == b"theirs"


@pytest.mark.parametrize("follow", [False, True])
def test_a_fifo_is_refused_without_blocking(tmp_path: Path, follow: bool) -> None:
    os.mkfifo(tmp_path / "fifo")
    storage = Storage(str(tmp_path), follow_links=follow)
    for attempt in (lambda: storage.read_file(storage.path("fifo")),
                    lambda: storage.read_range(storage.path("fifo"), 0, 1),
                    lambda: storage.read_json(storage.path("fifo"))):
        with pytest.raises(RefusedEntryError, match="a FIFO, not a regular file"):
            attempt()  # were the open to block, the test would hang (its timeout fails it)
    assert not storage.isfile(storage.path("fifo")) and storage.exists(storage.path("fifo"))


def test_read_json_is_bounded(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path))
    cases = {b"[" * 100_000 + b"]" * 100_000: "nested more than 128 levels deep",
             b'{"a": NaN}': "NaN is not a number", b"[1e999]": "beyond the float range",
             b"[" + b"9" * 41 + b"]": "more than 40 digits", b'{"a": 1': "is not valid JSON",
             b" " * 64 + b"{}": "66 bytes, more than the 10"}
    for data, match in cases.items():
        storage.write_file(storage.path("x.json"), data)
        with pytest.raises(JSONBoundsError, match=match) as info:
            storage.read_json(storage.path("x.json"), max_bytes=10 if b" " in data else
                              1 << 20)
        assert "\n" not in str(info.value) and str(info.value).startswith(storage.path("x"))
    storage.write_file(storage.path("x.json"), b'{"loss": NaN}')
    assert math.isnan(storage.read_json(storage.path("x.json"), nonfinite=True)["loss"])
