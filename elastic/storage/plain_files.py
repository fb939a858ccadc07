"""The one rule for local entries inside a run or dataset directory: plain, never through a link.

A ``Storage`` (``elastic.storage.storage_io``) is rooted at a run or dataset directory. Below
that root everything Baton reads, lists, writes, moves or removes must be what Baton puts there:
regular files in real directories. A symbolic link would make Baton act on another run's
snapshot or any file the process can reach (P8), and a FIFO or a device would block an open
forever. For a ``path`` below ``root`` (the root itself may be a link: a person chose where the
run lives):

* ``open_plain(root, path)`` opens a file for reading without following any link on the way
  (each directory opened ``O_NOFOLLOW`` relative to the one above, so a link swapped in
  meanwhile is not followed either), ``lstat``s the entry, opens it ``O_NOFOLLOW | O_NONBLOCK``
  (a FIFO swapped in after the ``lstat`` does not block) and ``fstat``s the descriptor: only a
  regular file is returned.
* ``check_below(root, path, final=...)`` refuses a path whose directories below the root (with
  ``final``, the entry too) include a link: the check before a listing, write, rename or removal.
* ``open_append(root, path)``: the same rule for a file Baton appends to (``RUN/logs/ray.log``).
* ``entry_kind(root, path)``: ``"file"``, ``"directory"``, ``"link"``, ``"other"`` (a FIFO, socket
  or device) or None, never following a link below the root.
* A refusal is ``RefusedEntryError`` (an ``OSError``), one line naming the entry and why.
* ``follow=True`` (a person's own input files, e.g. ``baton data prepare``'s sources, which may
  live in a cache of links) follows links, but still opens non-blocking and refuses what is
  not a regular file.
* ``output_problem(out, dirs)``: why a local output must not be written, or None: it resolves
  inside one of ``dirs`` (links resolved; ``baton data prepare``: its own sources). The rule
  for run and dataset directories and what an output may replace is ``elastic.storage.outputs``.

Paths not below the root are opened as named (``O_NONBLOCK``, regular files only). Imports:
the standard library only (a leaf of the storage layer).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class RefusedEntryError(OSError):
    """An entry below a run or dataset directory is a link or not a regular file."""

    def __str__(self) -> str:  # the one line itself, without "[Errno N]" and the path again
        return self.strerror or super().__str__()


def _link(path: str) -> RefusedEntryError:
    return RefusedEntryError(
        errno.ELOOP, f"{path} is a symbolic link; Baton never reads, writes, moves or removes "
        "through a link inside a run or dataset directory (replace it by the real file or "
        "directory)", path)


def _not_regular(path: str, mode: int) -> RefusedEntryError:
    what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")
    return RefusedEntryError(errno.EINVAL, f"{path} is {what}, not a regular file; refused "
                             "(Baton reads only regular files and never waits on a FIFO)",
                             path)


def parts_below(root: str, path: str) -> list[str] | None:
    """The components of ``path`` below ``root`` ([] for the root itself), or None when
    ``path`` is not below it. A ``..`` component is refused: it would leave the root."""
    root = root.rstrip("/") or "/"
    path = path.rstrip("/") or "/"
    if path == root:
        return []
    prefix = root if root.endswith("/") else root + "/"
    if not path.startswith(prefix):
        return None
    parts = [p for p in path[len(prefix):].split("/") if p and p != "."]
    if ".." in parts:
        raise RefusedEntryError(errno.EINVAL, f"{path} leaves {root} ('..'); refused", path)
    return parts


def check_below(root: str, path: str, *, final: bool = False) -> None:
    """Refuse ``path`` if a directory between ``root`` and it (and, with ``final``, the entry
    itself) is a symbolic link. Components that do not exist end the check."""
    parts = parts_below(root, path)
    if not parts:
        return
    current = root.rstrip("/") or "/"
    for part in parts if final else parts[:-1]:
        current = os.path.join(current, part)
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISLNK(mode):
            raise _link(current)


def entry_kind(root: str, path: str, *, follow: bool = False) -> str | None:
    """"file", "directory", "link", "other" or None (nothing there); see the contract."""
    parts = parts_below(root, path)
    if not follow and parts:
        check_below(root, path)
    try:
        info = os.stat(path) if follow or not parts else os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    mode = info.st_mode
    return ("file" if stat.S_ISREG(mode) else "directory" if stat.S_ISDIR(mode)
            else "link" if stat.S_ISLNK(mode) else "other")


def open_plain(root: str, path: str, *, follow: bool = False) -> int:
    """A read-only descriptor of the regular file ``path`` (see the contract)."""
    parts = None if follow else parts_below(root, path)
    if not parts:  # the root itself, a path outside it, or links allowed: open as named
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    else:
        fd = _open_walk(root, path, parts)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_walk(root: str, path: str, parts: list[str]) -> int:
    """Open ``path`` from ``root`` one component at a time, never following a link."""
    directory = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    current = root.rstrip("/") or "/"
    try:
        for part in parts[:-1]:
            current = os.path.join(current, part)
            following = _open_component(directory, part, current,
                                        os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
            os.close(directory)
            directory = following
        mode = os.stat(parts[-1], dir_fd=directory, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            raise _link(path)
        if not stat.S_ISREG(mode):  # never opened: a device's open may act
            raise _not_regular(path, mode)
        return _open_component(directory, parts[-1], path,
                               os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    finally:
        os.close(directory)


def _open_component(directory: int, name: str, where: str, flags: int) -> int:
    try:
        return os.open(name, flags, dir_fd=directory)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                is_link = stat.S_ISLNK(os.stat(name, dir_fd=directory,
                                               follow_symlinks=False).st_mode)
            except OSError:
                is_link = False
            if is_link:
                raise _link(where) from None
        raise


def open_append(root: str, path: str) -> int:
    """A write descriptor appending to ``path`` below ``root`` (created when absent): no link
    on the way or at it, non-blocking (a FIFO is refused, never waited on), a regular file."""
    check_below(root, path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK
                     | _CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _link(path) from None
        if err.errno == errno.ENXIO:  # a FIFO nobody reads
            raise _not_regular(path, stat.S_IFIFO) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_regular(path, mode)
    return fd


def output_problem(out: str, run_dirs: Iterable[str], *,
                   what: str = "the run directory") -> str | None:
    """Why the local output path ``out`` must not be written (it resolves, links included,
    inside one of ``run_dirs``: local paths; other URIs are skipped), or None. ``what``
    names those directories in the message."""
    target = os.path.realpath(out.removeprefix("file://"))
    for run in run_dirs:
        if not run or "://" in run and not run.startswith("file://"):
            continue
        base = os.path.realpath(run.removeprefix("file://"))
        if target == base or target.startswith(base.rstrip("/") + "/"):
            shown = "" if target == os.path.abspath(out) else f" (it resolves to {target})"
            return (f"{out} is inside {what} {run}{shown}, which holds only what Baton writes "
                    "(a committed snapshot's files could be overwritten); write it elsewhere")
    return None
