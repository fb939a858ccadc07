"""Local files for the storage layer (``elastic.storage.storage_io``): plain calls, atomic writes.

Contract
--------
``LocalFiles`` does for paths of the local filesystem what ``elastic.storage.s3_files.S3Files`` does
for S3 objects (same method names; ``Storage`` picks one by its URI and counts the bytes).
Local calls run once: no deadline, no retries.

* Exact reads: ``read_range`` returns exactly ``end - start`` bytes or raises
  (``elastic.storage.byte_ranges.short_read``: truncated, definite). ``read_into`` fills
  caller-owned buffers with ``preadv``, straight into them (no intermediate copy).
* Atomic writes: ``write`` puts the bytes in ``NAME.tmp-*`` in the same directory, fsyncs
  it, renames it over ``NAME`` and fsyncs the directory (``durable=False`` skips both fsyncs);
  a crash leaves at most a temporary file, never a partial ``NAME``. ``mid_write`` (fault
  injection) runs after half the bytes went to the temporary file. ``exclusive`` creates
  only: ``os.link(tmp, NAME)`` (atomic, an existing file untouched: ``FileExistsError``), or
  ``O_EXCL`` on a filesystem without hard links (there a reader may briefly see a partial
  file). The memory given is written as is (a tensor's memoryview: no copy). With
  ``spare_dir`` the temporary file is a spare claimed from it when there is one
  (``elastic.storage.spares``: overwritten whole, then fsynced and renamed the same way).
* ``fsync_dir(directory)`` makes a rename durable (filesystems that refuse are ignored).
* **Plain entries only** (``elastic.storage.plain_files``): below ``root`` every open, listing,
  write, rename and removal refuses a symbolic link on the way (``RefusedEntryError``), and a
  file is opened non-blocking and read only when it is a regular file (a FIFO never blocks);
  ``read_file``'s ``max_bytes`` refuses a longer file before reading it. ``follow=True`` (a
  person's own input files) follows links but still refuses what is not a regular file.

Imports: the standard library, fsspec's local filesystem (removal, copy, listing with
``follow``), ``elastic.storage.byte_ranges``, ``elastic.storage.json_bounds``,
``elastic.storage.plain_files`` and ``elastic.storage.spares``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import fsspec

from elastic.storage.byte_ranges import short_read
from elastic.storage.json_bounds import too_large
from elastic.storage.plain_files import check_below, entry_kind, open_plain
from elastic.storage.spares import claim as claim_spare

_NO_HARD_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_REMOVE_TREE_ATTEMPTS = 3  # walks of a tree that others delete too (remove_tree)


class LocalFiles:
    """Paths of the local filesystem below ``root``; see the module contract."""

    def __init__(self, options: dict[str, Any], root: str = "/", *,
                 follow: bool = False) -> None:
        self.fs: Any = fsspec.filesystem("file", **options)
        self.root = root
        self.follow = follow

    def _below(self, path: str, *, final: bool = False) -> None:
        """Refuse a link on the way to ``path`` (and at it, with ``final``)."""
        if not self.follow:
            check_below(self.root, path, final=final)

    def _open(self, path: str) -> Any:
        """A binary file object of the regular file ``path`` (``plain_files.open_plain``)."""
        return open(open_plain(self.root, path, follow=self.follow), "rb")

    # ------------------------------------------------------------------ reads

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """The whole file; more than ``max_bytes`` is refused before it is read."""
        with self._open(path) as fh:
            if max_bytes is None:
                whole: bytes = fh.read()
                return whole
            size = os.fstat(fh.fileno()).st_size
            if size > max_bytes:
                raise too_large(path, size, max_bytes)
            # Its size and one byte more (a buffer that large is allocated up front, so never
            # max_bytes): a file that grew meanwhile is read on, within the bound.
            data = fh.read(size + 1)
            if len(data) > size:
                data += fh.read(max_bytes + 1 - len(data))
        if len(data) > max_bytes:
            raise too_large(path, len(data), max_bytes)
        return data

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with self._open(path) as fh:
            fh.seek(start)
            data = fh.read(end - start)
            if len(data) != end - start:
                short_read(path, start, end, len(data), os.fstat(fh.fileno()).st_size)
        return data

    def read_into(self, path: str, reads: Sequence[tuple[int, Sequence[memoryview]]],
                  counted: Callable[[int], None]) -> None:
        """Each read's buffers filled from its offset on (``counted(nbytes)`` after each)."""
        with self._open(path) as fh:
            for offset, bufs in reads:
                want = sum(len(b) for b in bufs)
                got = preadv_exact(fh, list(bufs), offset)
                if got != want:
                    short_read(path, offset, offset + want, got, os.fstat(fh.fileno()).st_size)
                counted(got)

    def kind(self, path: str) -> str | None:
        """"file", "directory", "link", "other" (FIFO, socket, device) or None."""
        return entry_kind(self.root, path, follow=self.follow)

    def size(self, path: str) -> int:
        with self._open(path) as fh:
            return os.fstat(fh.fileno()).st_size

    def listdir(self, directory: str) -> list[str]:
        self._below(directory, final=True)
        try:
            return sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, directory: str) -> dict[str, Any]:
        """Every regular file below ``directory``: full path -> details (links and other
        entries are skipped, never followed, unless ``follow``)."""
        if self.follow:
            found: dict[str, Any] = self.fs.find(directory, detail=True)
            return found
        self._below(directory, final=True)
        files: dict[str, Any] = {}
        for parent, _, names in os.walk(directory):  # never descends into a linked directory
            for name in names:
                path = os.path.join(parent, name)
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    files[path] = {"name": path, "size": info.st_size, "type": "file"}
        return files

    # ------------------------------------------------------------------ writes

    def write(self, path: str, data: bytes | memoryview, *, durable: bool,
              mid_write: Callable[[], None] | None, exclusive: bool,
              spare_dir: str | None = None) -> None:
        view = memoryview(data).cast("B")
        directory = os.path.dirname(path)
        self._below(path)  # never write through a linked directory
        _make_dirs(directory, durable)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            # A retired shard's file when there is one (elastic.storage.spares), else a new file;
            # either way overwritten whole from offset 0.
            fd = None if spare_dir is None else claim_spare(spare_dir, tmp)
            if fd is None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW
                             | _O_CLOEXEC, 0o644)
            try:
                half = len(view) // 2
                _write_all(fd, view[:half], 0)
                if mid_write is not None:
                    mid_write()
                _write_all(fd, view[half:], half)
                os.ftruncate(fd, len(view))  # a spare may have been longer
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if exclusive:
                _link_exclusive(tmp, path, view, durable=durable)
            else:
                os.replace(tmp, path)
        finally:
            # No temp file stays behind a completed, refused or failed write; a crash still
            # may.
            if os.path.exists(tmp):
                os.unlink(tmp)
        if durable:
            fsync_dir(directory)

    def makedirs(self, directory: str) -> None:
        self._below(directory, final=True)
        os.makedirs(directory, exist_ok=True)

    def remove(self, path: str) -> None:
        self._below(path)  # a link itself may go (its target is untouched), not one on the way
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def remove_many(self, paths: Sequence[str]) -> None:
        for path in paths:
            self.remove(path)

    def remove_tree(self, directory: str) -> None:
        # Another deleter may walk the same tree (a second coordinator's collection, its
        # housekeeping thread): an entry that vanished under us is gone as wanted, so walk
        # what is left again; only a tree that keeps failing is an error.
        self._below(directory, final=True)  # a linked directory is refused, left alone
        for attempt in range(_REMOVE_TREE_ATTEMPTS):
            if not os.path.isdir(directory):
                return
            try:
                self.fs.rm(directory, recursive=True)
                return
            except FileNotFoundError:
                if attempt == _REMOVE_TREE_ATTEMPTS - 1:
                    raise

    def copy(self, source: str, target: str, *, nbytes: int = 0) -> None:
        self._below(source, final=True)
        self._below(target)
        self.fs.copy(source, target)


def preadv_exact(fh: Any, bufs: list[memoryview], offset: int) -> int:
    """Read into ``bufs`` from ``offset`` until they are full or the file ends; the bytes
    read. One ``preadv`` fills several buffers; the loop covers short reads."""
    bufs = [b.cast("B") if b.format != "B" else b for b in bufs if len(b)]
    total = 0
    while bufs:
        if hasattr(os, "preadv"):
            n = os.preadv(fh.fileno(), bufs, offset)
        else:  # no preadv on this platform: one buffer at a time
            fh.seek(offset)
            n = fh.readinto(bufs[0]) or 0
        if n <= 0:
            break
        total, offset = total + n, offset + n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if n:
            bufs[0] = bufs[0][n:]
    return total


def _link_exclusive(tmp: str, path: str, view: memoryview, *, durable: bool) -> None:
    try:
        os.link(tmp, path)  # atomic; EEXIST -> FileExistsError, the old file untouched
    except OSError as err:
        if isinstance(err, FileExistsError) or err.errno not in _NO_HARD_LINKS:
            raise
        # A filesystem without hard links: O_EXCL is atomic too, but a reader can see the
        # file before its bytes are all there.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        try:
            _write_all(fd, view, 0)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset``: one call may write less (Linux caps a call at
    just under 2 GiB)."""
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


# What a filesystem that does not fsync directories answers; any other error (EIO, ENOSPC,
# EACCES) means the entry may not be durable, and is raised.
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF}


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable; filesystems that refuse are ignored."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as err:
        if err.errno in _NO_DIR_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def _make_dirs(directory: str, durable: bool) -> None:
    """``os.makedirs``; when ``durable``, each directory it created is made durable in its
    parent too (a new step directory's entry, else a power cut could drop a commit)."""
    created = []
    while directory and not os.path.isdir(directory):
        created.append(directory)
        directory = os.path.dirname(directory)
    for new in reversed(created):
        with contextlib.suppress(FileExistsError):  # another writer made it meanwhile
            os.mkdir(new)
        if durable:
            fsync_dir(os.path.dirname(new) or ".")
