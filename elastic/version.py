"""`code_version()`: which Baton code this process runs, as one comparable string.

Contract:
- `code_version()` is `"<package version>+<digest>"`, e.g. `"0.1.0+3f2a9c1d07be"`: the
  installed distribution's version (`baton-train`; `"0+unknown"` when not installed) and the
  first 12 hex digits of a SHA-256 over the `.py` sources of the packages that run on
  workers (`trainer`, `elastic`, `sketch_ops`, `data_state`), taken in sorted order of their
  paths relative to each package's parent, each path hashed with its bytes. Two processes
  with the same string run the same code; an edited checkout, a reinstall from another
  commit or a node set up from another tag all give a different string. Computed once per
  process (cached): the files are read at the first call.
- The packages are located with `importlib.util.find_spec`, never imported, so `elastic`
  still imports nothing from `trainer`, `sketch_ops` or `data_state`.
- `source_digest(roots)` is the digest alone, for any package directories (tests use a copy).

Why a digest and not only the version: a node that installed `@main` an hour after the head
has the same version number and other code; so has a checkout edited after `pip install -e`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from collections.abc import Iterable
from pathlib import Path

DISTRIBUTION = "baton-train"
PACKAGES = ("trainer", "elastic", "sketch_ops", "data_state")
DIGEST_CHARS = 12


def package_dirs(packages: Iterable[str] = PACKAGES) -> list[Path]:
    """The source directories of `packages` (those that cannot be found are left out)."""
    dirs: list[Path] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(Path(p) for p in spec.submodule_search_locations)
    return dirs


def source_digest(roots: Iterable[Path]) -> str:
    """SHA-256 (first `DIGEST_CHARS` hex digits) of every `.py` file under `roots`, in sorted
    order of `<root name>/<relative path>`; each entry hashes its path and its bytes, so a
    renamed, added or removed file changes the digest as an edit does."""
    files: list[tuple[str, Path]] = []
    for root in roots:
        for path in root.rglob("*.py"):
            files.append((f"{root.name}/{path.relative_to(root).as_posix()}", path))
    digest = hashlib.sha256()
    for rel, path in sorted(files):
        data = path.read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:DIGEST_CHARS]


def package_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@functools.cache
def code_version() -> str:
    """`"<package version>+<source digest>"` of this process's Baton code (see module doc)."""
    return f"{package_version()}+{source_digest(package_dirs())}"
