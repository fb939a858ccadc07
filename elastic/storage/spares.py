"""Spare shard files: a retired snapshot's shards are reused for the next ones (local stores).

``RUN/spare/`` (``SPARE_DIR``) holds shard files of snapshots that retention removed
(``SnapshotStore.retire_step``), under fresh names, never read by anything; they are only ever
overwritten whole and renamed into a step directory by the atomic write:

* ``retire(paths, spare_dir, keep)`` moves up to ``keep`` minus the spares already there of
  ``paths`` into ``spare_dir`` (one rename each, same filesystem) and returns the paths it did
  not take, for the caller to delete: ``spare/`` never holds more than one retired snapshot's
  shards (``keep`` = the retiring step's shard count).
* ``claim(spare_dir, tmp)`` renames one spare to ``tmp`` (atomic: of two writers racing for it
  exactly one wins) and opens it for writing without following a link; it returns the
  descriptor, or None when there is none. Entries that are not regular files stay where they
  are; a claimed spare that is not a plain file with a single link is unlinked and the next
  tried (a symlink could point outside the run, a hard link's other name, such as a ``cp -al``
  backup, would change with it). The caller (``local_files.LocalFiles.write``) writes the whole
  content from offset 0, truncates, fsyncs and renames as for a new file, so a crash leaves at
  most a temporary file.
* Both do nothing when ``spare_dir`` is not a plain directory (a link would move files into or
  out of the run): ``retire`` then returns all paths.

Why: a new file's pages and disk blocks are allocated as it is written; a retired shard has
both, so its overwrite is a copy into cached pages (RocksDB's ``recycle_log_file_num`` and
PostgreSQL's WAL recycling do the same). The timings: "Spares, and why new files were slow on
this VM" in benchmarks/reports/2026-12-05-snapshot-scale.md.

For readers: a process that opened a shard before its snapshot was retired (only snapshots older
than the newest ``keep_last`` are) may see its bytes replaced; every read is checked against the
manifest's crc32s, so it fails as corrupt (``SnapshotIntegrityError``), never returns wrong
data. ``rm -rf RUN/spare`` is always safe.
"""

from __future__ import annotations

import os
import stat
import uuid

SPARE_DIR = "spare"
_OPEN_FLAGS = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def retire(paths: list[str], spare_dir: str, keep: int) -> list[str]:
    """Move up to ``keep`` (less those present) of ``paths`` into ``spare_dir``; the rest."""
    os.makedirs(spare_dir, exist_ok=True)
    if not _plain_directory(spare_dir):
        return list(paths)
    room = max(0, keep - len(os.listdir(spare_dir)))
    left = []
    for path in paths:
        if room and os.path.isfile(path) and not os.path.islink(path):
            try:
                os.rename(path, os.path.join(spare_dir, f"{uuid.uuid4().hex}.spare"))
                room -= 1
                continue
            except OSError:  # moved or removed by someone else: nothing to keep
                pass
        left.append(path)
    return left


def claim(spare_dir: str, tmp: str) -> int | None:
    """A writable descriptor of a spare renamed to ``tmp``, or None (module docstring)."""
    if not _plain_directory(spare_dir):
        return None
    try:
        names = sorted(os.listdir(spare_dir))
    except OSError:
        return None
    for name in names:
        spare = os.path.join(spare_dir, name)
        try:
            if not stat.S_ISREG(os.lstat(spare).st_mode):
                continue  # not ours (a directory, a link, a device): left alone
            os.rename(spare, tmp)
        except OSError:  # taken by another writer, or gone
            continue
        try:
            fd = os.open(tmp, _OPEN_FLAGS)
        except OSError:  # a symbolic link (O_NOFOLLOW) or not openable: not reused
            _unlink(tmp)
            continue
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
            return fd
        os.close(fd)
        _unlink(tmp)
    return None


def _plain_directory(path: str) -> bool:
    """Whether ``path`` is a directory itself, not a symbolic link to one: spares are moved
    in and out by name, and a linked directory would move files across the run's boundary."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
