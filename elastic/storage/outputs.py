"""Where a command's local output may go, and how it is written there (P8). Every ``--out`` a
person names (``baton snapshots export``, ``report``, ``data prepare``) goes through here: no
output lands in a run or dataset directory, through a link, or over what is not a regular file.

* ``baton_directories(path)``: the run and dataset directories ``path`` (as given) is or lies
  in, deepest first, as ``(kind, directory)``. A run directory holds one of ``RUN_MARKERS``
  (``run.json``, ``lease.json``, ``generation.json``, ``sessions.json``) or a ``snapshots/``
  step entry; a dataset directory ``DATASET_MARKER`` (``dataset.json``). The names repeat the
  owners' constants (this leaf imports nothing of theirs); a test keeps them equal.
* ``output_location(out)``: ``out``, directories resolved, final component not (never followed).
* ``file_output_problem(out)``: the one line (starting with ``out``) why a file output must not
  be written, or None: it resolves (through a link anywhere, or as located) into a run or
  dataset directory, or it exists and is neither a regular file nor a link (``/dev/full``, a
  FIFO, a directory, a socket are never replaced).
* ``directory_output_problem(out, new=...)``: the same for a directory (it is or lies in a run
  or dataset directory, its final component is a link, or it exists and is not a directory;
  ``new``: exists at all). ``dataset_output_problem(out)``: ``baton data prepare``'s form: a
  dataset directory itself (``--overwrite``) or a run's own ``data/`` is allowed, no other part
  of a run nor the inside of another dataset; its root may be a link to a directory.
* ``replaced_file(out)``: a temporary file beside ``output_location(out)`` (exclusive create),
  fsynced and renamed over the name on success (a link there replaced, its target untouched;
  anything else that appeared meanwhile refused), else removed.
* ``new_directory(out)``: yields a temporary directory, renamed to the name on success (refused
  if it exists by then), else removed with its contents (a failed write leaves nothing).
* ``merged_directory(out)``: a temporary directory whose entries, on success, are renamed into
  ``out`` (made if absent), replacing files or links of that name only (a Hugging Face model).
Refusals are one line for the caller to prefix with ``--out``. Local paths only (``file://``
stripped); the standard library only (a leaf of the storage layer).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator

RUN_MARKERS = ("run.json", "lease.json", "generation.json", "sessions.json")
DATASET_MARKER = "dataset.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_STEP_ENTRY = re.compile(r"\d{9}")  # elastic.format.records.step_dirname


def _local(out: str) -> str:
    return os.path.abspath(out.removeprefix("file://"))


def output_location(out: str) -> str:
    """``out`` with its directories resolved and its final component as named."""
    path = _local(out)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def _is_run(directory: str) -> bool:
    if any(os.path.lexists(os.path.join(directory, m)) for m in RUN_MARKERS):
        return True
    snapshots = os.path.join(directory, "snapshots")
    if not os.path.isdir(snapshots) or os.path.islink(snapshots):
        return False
    try:
        with os.scandir(snapshots) as entries:
            return any(_STEP_ENTRY.fullmatch(e.name) for e in entries)
    except OSError:  # unreadable: a person's directory, not one Baton wrote
        return False


def baton_directories(path: str) -> list[tuple[str, str]]:
    """``(kind, directory)`` for ``path`` itself and each directory above it that is a Baton
    run or dataset directory, deepest first (contract)."""
    found: list[tuple[str, str]] = []
    current = path.rstrip("/") or "/"
    while True:
        if os.path.isdir(current):
            if os.path.lexists(os.path.join(current, DATASET_MARKER)):
                found.append(("dataset", current))
            if _is_run(current):
                found.append(("run", current))
        parent = os.path.dirname(current)
        if parent == current:
            return found
        current = parent


def _inside(out: str, where: str, owners: list[tuple[str, str]]) -> str:
    kind, directory = owners[0]
    shown = "" if where == _local(out) else f" (it resolves to {where})"
    return (f"{out} is inside the {kind} directory {directory}{shown}, which holds only what "
            "Baton writes there (a committed snapshot or a dataset could be overwritten); "
            "write it elsewhere, outside every run and dataset directory")


def _owned(out: str) -> str | None:
    """Why ``out`` is inside a Baton directory, resolved through every link or as located."""
    for where in dict.fromkeys((os.path.realpath(_local(out)), output_location(out))):
        owners = baton_directories(where)
        if owners:
            return _inside(out, where, owners)
    return None


def _describe(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode)
            or stat.S_ISBLK(mode) else "a regular file" if stat.S_ISREG(mode)
            else "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file")


def _mode(path: str) -> int | None:
    try:
        return os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None


def file_output_problem(out: str) -> str | None:
    """Why the file output ``out`` must not be written, or None (contract)."""
    owned = _owned(out)
    if owned:
        return owned
    mode = _mode(output_location(out))
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        return (f"{out} is {_describe(mode)}, not a regular file; Baton never replaces it by "
                "a file: name a new file (or a regular file to replace)")
    return None


def directory_output_problem(out: str, *, new: bool = False) -> str | None:
    """Why the directory output ``out`` must not be written, or None (contract)."""
    owned = _owned(out)
    if owned:
        return owned
    mode = _mode(output_location(out))
    if mode is None:
        return None
    if new:
        return f"{out} exists: name a new directory"
    if stat.S_ISLNK(mode):
        return (f"{out} is a symbolic link; Baton never writes through a link: name the "
                "directory itself")
    if not stat.S_ISDIR(mode):
        return f"{out} is {_describe(mode)}, not a directory: name a directory to write"
    return None


def dataset_output_problem(out: str) -> str | None:
    """``baton data prepare``'s rule (contract): a directory output that may be a dataset
    directory itself (replaced with ``--overwrite``) or a run's own ``data/``, and whose root
    may be a link to a directory (a person's choice of where a dataset lives)."""
    for where in dict.fromkeys((os.path.realpath(_local(out)), output_location(out))):
        for kind, directory in baton_directories(where):
            data = os.path.join(directory, "data")
            if (kind == "dataset" and directory == where) or (
                    kind == "run" and (where == data or where.startswith(data + "/"))):
                continue
            return _inside(out, where, [(kind, directory)])
    mode = _mode(os.path.realpath(_local(out)))
    if mode is not None and not stat.S_ISDIR(mode):
        return f"{out} is {_describe(mode)}, not a directory: name the dataset directory"
    return None


@contextlib.contextmanager
def replaced_file(out: str) -> Iterator[str]:
    """A temporary file beside ``out``, renamed over it at the end (contract)."""
    final = output_location(out)
    directory, name = os.path.split(final)
    tmp = _temporary(directory, name)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o666))
    try:
        yield tmp
        with open(tmp, "rb+") as fh:  # durable before it takes the name
            os.fsync(fh.fileno())
        mode = _mode(final)
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise FileExistsError(f"{out} became {_describe(mode)} while it was written; "
                                  "nothing replaced it")
        os.replace(tmp, final)  # renames over a link itself, never through it
        _fsync_dir(directory)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def new_directory(out: str) -> Iterator[str]:
    """A temporary directory beside ``out``, renamed to it at the end (contract)."""
    final = output_location(out)
    parent, name = os.path.split(final)
    tmp = _temporary(parent, name)
    os.mkdir(tmp, 0o777)
    try:
        yield tmp
        if os.path.lexists(final):
            raise FileExistsError(f"{out} appeared while it was written; it is left as it "
                                  "is: name a new directory")
        os.rename(tmp, final)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # ours alone; rmtree never follows a link
        raise


@contextlib.contextmanager
def merged_directory(out: str) -> Iterator[str]:
    """A temporary directory beside ``out`` whose entries move into ``out`` at the end
    (contract)."""
    final = output_location(out)
    parent, name = os.path.split(final)
    tmp = _temporary(parent, name)
    os.mkdir(tmp, 0o777)
    try:
        yield tmp
        if _mode(final) is None:
            os.mkdir(final)
        mode = _mode(final)
        if mode is None or not stat.S_ISDIR(mode):  # a link or a file swapped in meanwhile
            raise FileExistsError(f"{out} became {_describe(mode or 0)} while it was "
                                  "written; nothing was moved into it")
        for entry in sorted(os.listdir(tmp)):
            target = os.path.join(final, entry)
            there = _mode(target)
            if there is not None and not (stat.S_ISREG(there) or stat.S_ISLNK(there)):
                raise FileExistsError(f"{target} is {_describe(there)}; Baton never replaces "
                                      "it: move it away or name another directory")
            os.replace(os.path.join(tmp, entry), target)  # a link there is replaced
        _fsync_dir(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours alone; rmtree never follows a link


def _temporary(directory: str, name: str) -> str:
    """A fresh name beside ``name``; created exclusively by the caller, with the modes the
    umask gives (``O_EXCL`` and ``mkdir`` never follow a link of that name)."""
    return os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse a directory fsync; the rename stands
        pass
    finally:
        os.close(fd)
