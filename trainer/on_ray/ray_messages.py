"""Ray's own messages kept out of the user's terminal, in a log file instead.

Contract: `ray_messages_to(path, notice)` is a context manager for the driver. While it is
open, what Ray itself would print on the driver's terminal goes to the end of `path`
instead (each line with the time and where it came from), and `notice(text)` is called
once, at the first such message, with a line naming the file:
- the `ray` logger's records (connection lines, warnings of Ray and Ray Train on the
  driver): its terminal handlers are swapped for one writing to the file;
- the cluster's error messages the driver receives (`(raylet) Raylet is terminated...`,
  `The node ... has been marked dead...`): Ray's listener thread prints them through
  `ray._private.worker.print_to_stdstream` regardless of `log_to_driver`, so that function
  is swapped for the file writer. (A private name: if a Ray release renames it, those
  messages simply show on the terminal again.)
On exit everything is put back. Workers' own output is not affected: the driver connects
with `log_to_driver=False`, so it never reaches this terminal; it stays in Ray's session
logs. `ray_log_path(cfg)` is where a fit's file lives: RUN/<logging.dir>/ray.log for a local
run directory, the system temp directory for an s3:// run; `root` (`ray_log_root(cfg)`: the
run directory) is where no link may be on the way to it (`elastic.storage.plain_files.open_append`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elastic.storage import check_below, open_append
from trainer.config import FitConfig


def ray_log_root(cfg: FitConfig) -> Path:
    """The directory below which nothing on the way to `ray_log_path` may be a link."""
    run_uri = cfg.snapshots.run_uri
    if "://" in run_uri and not run_uri.startswith("file://"):
        return Path(tempfile.gettempdir())
    return Path(run_uri.removeprefix("file://"))


def ray_log_path(cfg: FitConfig) -> Path:
    run_uri = cfg.snapshots.run_uri
    if "://" in run_uri and not run_uri.startswith("file://"):
        return ray_log_root(cfg) / f"baton-{cfg.run_name}-ray.log"
    return ray_log_root(cfg) / cfg.logging.dir / "ray.log"


class _FileSink:
    """Appends lines to `path` (created on first use), and tells `notice` once. Nothing on
    the way below `root` (the run directory) may be a link, and `path` must be a regular file
    (`elastic.storage.plain_files.open_append`: a FIFO there never blocks the driver); where it
    cannot be written, the lines go to the terminal, as Ray would have printed them."""

    def __init__(self, path: Path, notice: Callable[[str], None], root: Path) -> None:
        self.path, self.root = path, root
        self._notice = notice
        self._told = False
        self._lock = threading.Lock()

    def write(self, source: str, lines: list[str]) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        text = "".join(f"{stamp} ({source}) {line}\n" for line in lines)
        with self._lock:
            try:
                check_below(str(self.root), str(self.path.parent), final=True)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(open_append(str(self.root), str(self.path)), "a",
                          encoding="utf-8") as out:
                    out.write(text)
                where = f"are in {self.path}"
            except OSError as err:
                sys.stderr.write(text)
                where = f"cannot go to {self.path} ({err.strerror or err}): shown here"
            tell, self._told = not self._told, True
        if tell:
            self._notice(f"Ray's own messages (node failures, connection lines) {where}")


class _ToFile(logging.Handler):
    def __init__(self, sink: _FileSink) -> None:
        super().__init__()
        self.sink = sink
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write("ray", self.format(record).splitlines())
        except Exception:  # noqa: BLE001 - logging must never raise (logging.Handler's rule)
            self.handleError(record)


@contextlib.contextmanager
def ray_messages_to(path: Path, notice: Callable[[str], None],
                    root: Path | None = None) -> Iterator[Path]:
    from ray._private import worker as ray_worker

    sink = _FileSink(path, notice, root if root is not None else path.parent)
    ray_logger = logging.getLogger("ray")
    handlers_before = list(ray_logger.handlers)
    terminal = [h for h in ray_logger.handlers if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]
    to_file = _ToFile(sink)
    original_print = ray_worker.print_to_stdstream

    def print_to_file(data: dict[str, Any], ignore_prefix: bool = False) -> None:
        sink.write(str(data.get("pid", "ray")), [str(line) for line in data.get("lines", [])])

    for handler in terminal:
        ray_logger.removeHandler(handler)
    ray_logger.addHandler(to_file)
    ray_worker.print_to_stdstream = print_to_file
    try:
        yield path
    finally:
        ray_worker.print_to_stdstream = original_print
        # Put the terminal handlers back where they were (their order is Ray's and pytest's),
        # keeping any handler someone added meanwhile.
        added = [h for h in ray_logger.handlers if h not in handlers_before and h is not to_file]
        ray_logger.handlers = [*handlers_before, *added]
