"""Run metrics: records written to the run directory and read back for reports.

Contract:
- A record is one JSON object. Kinds: `start` (a worker group began: `attempt`, restored
  `step`, `world_size`, `time`) and `step` (one completed optimizer step: `attempt`, `step`,
  `loss`, `val_loss`, `lr`, `tokens_per_s`, `world_size`, `peak_rss_mb`, `time`).
- `MetricsWriter` buffers records and writes each flush as a new object
  `RUN/metrics/part-<session>-<seq>.jsonl` through the storage layer (`elastic.storage.storage_io`:
  local or S3, with its deadlines and retries). Objects are never appended to or
  rewritten, so the same code works on local disk and S3, and a crash loses at most the
  unflushed tail (metrics are not training state: snapshots never depend on them). Each
  object appears whole or not at all: on local disk it is written under a temporary name,
  fsync'ed and renamed; on S3 it is one PUT.
- `read_records(run_uri)` returns every record of every session, oldest first. A part file
  that cannot be read, or a line that is not a valid record (a truncated or hand-edited file),
  is skipped with one logged warning per call; it never raises for bad content, so `fit` and
  `baton report` never fail on it.
- `summarize(records)` derives what a user asks after a run: restarts, steps redone,
  final losses, mean throughput.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic.storage import INT64, MAX_JSON_BYTES, RefusedEntryError, Storage, loads_json

log = logging.getLogger(__name__)

MAX_PART_BYTES = MAX_JSON_BYTES  # one flush writes ~20 records: KiB; a larger part is refused

# Fields `summarize` and the report read from each kind; a record without them is invalid.
_NUMERIC_FIELDS: dict[str, tuple[str, ...]] = {
    "start": ("attempt", "step", "world_size", "time"),
    "step": ("attempt", "step", "loss", "tokens_per_s", "world_size", "time"),
    "recovery": ("step", "world_size", "before", "seconds", "time"),
}


class MetricsWriter:
    """Buffers records; `flush()` writes them as one new object."""

    def __init__(self, run_uri: str, *, flush_every: int = 20) -> None:
        self.run_uri = run_uri
        self.session = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
        self.flush_every = flush_every
        self._buffer: list[dict[str, Any]] = []
        self._seq = 0

    def add(self, record: dict[str, Any]) -> None:
        self._buffer.append(record)
        if len(self._buffer) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        io = Storage(self.run_uri)
        name = f"part-{self.session}-{self._seq:06d}.jsonl"
        # Whole-object write: a crash mid-flush leaves no half-written part for readers.
        io.write_file(io.path("metrics", name),
                      "".join(json.dumps(r) + "\n" for r in self._buffer).encode())
        self._buffer.clear()
        self._seq += 1


# Fields that, when present, must be numbers or null (a diverged loss may be NaN).
_OPTIONAL_NUMBERS = ("val_loss", "lr", "peak_rss_mb", "snapshot_stall_s")


def _is_number(value: Any) -> bool:
    """A float (NaN and infinities included: a diverged run's loss) or an int of 64 bits
    (a longer one cannot become a float for a plot or a sum)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) < INT64)


def _valid_record(record: Any) -> bool:
    """A JSON object with a string `kind`, a numeric `time` if any, the numeric fields its
    kind needs (`_NUMERIC_FIELDS`) and numbers (or null) in the optional numeric fields.
    Unknown kinds are kept for newer readers (summaries and reports skip them)."""
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return False
    if "time" in record and not _is_number(record["time"]):
        return False
    if any(record.get(k) is not None and not _is_number(record[k]) for k in _OPTIONAL_NUMBERS):
        return False
    return all(_is_number(record.get(k)) for k in _NUMERIC_FIELDS.get(record["kind"], ()))


def _parse_part(text: str, where: str) -> tuple[list[dict[str, Any]], int]:
    """The valid records of one part file and the number of lines that were not."""
    records, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:  # bounded (depth, numbers): a crafted line is a bad line, never a traceback
            record = loads_json(line, where, nonfinite=True)
        except ValueError:
            record = None
        if _valid_record(record):
            records.append(record)
        else:
            bad += 1
    return records, bad


def read_records(run_uri: str) -> list[dict[str, Any]]:
    """Every valid record under `RUN/metrics/`, oldest first ([] if there is none); bad parts
    and lines are skipped with one warning (module docstring)."""
    io = Storage(run_uri)
    root = io.path("metrics")
    records: list[dict[str, Any]] = []
    skipped: list[str] = []  # "name (why)" of each part file with something skipped
    try:
        names = io.listdir(root)  # [] when there is no metrics directory
    except RefusedEntryError as err:  # a link in its place: nothing of it is read
        log.warning("metrics of %s: %s; no records read", run_uri, err.strerror)
        names = []
    for name in names:
        if not fnmatch.fnmatchcase(name, "part-*.jsonl"):
            continue
        path = f"{root}/{name}"
        try:  # a link or a FIFO is refused, not followed or waited on (elastic.storage.storage_io)
            text = io.read_file(path, max_bytes=MAX_PART_BYTES).decode("utf-8")
        except (OSError, ValueError) as err:  # ValueError: too large, not UTF-8
            skipped.append(f"{path.rsplit('/', 1)[-1]} ({type(err).__name__})")
            continue
        part, bad = _parse_part(text, path)
        records.extend(part)
        if bad:
            skipped.append(f"{path.rsplit('/', 1)[-1]} ({bad} bad line(s))")
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3
                                          else "")
        log.warning("metrics of %s: skipped unreadable or invalid records in %s; the other "
                    "records are used", run_uri, shown)
    records.sort(key=lambda r: (r.get("time", 0.0), r.get("kind") != "start"))
    return records


@dataclass
class RunSummary:
    steps: int  # last completed step
    final_loss: float | None
    final_val_loss: float | None
    restarts: int  # worker-group starts after the first
    steps_redone: int  # steps trained again (after the last commit, or interrupted in-process)
    world_sizes: list[int]  # the group's size at each start and in-process change, in order
    mean_tokens_per_s: float | None
    snapshot_stall_ms_max: float | None  # longest time one step waited for a snapshot
    snapshot_stall_ms_mean: float | None  # that time averaged over all steps
    # In-process recovery (`elastic.recovery`): lost workers the survivors trained on past,
    # workers that joined a running group (replacements, or workers it grew by), the longest
    # such re-forming (seconds).
    recovered_in_process: int = 0
    replacements_joined: int = 0
    recovery_s_max: float | None = None
    # Why in-process recovery gave up and the whole group restarted, each time (the driver
    # fills it from the coordinator; empty when it never did).
    recovery_fallbacks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _redone(recovery: dict[str, Any]) -> int:
    """Steps an in-process recovery trained again (records before `redone` was written:
    one when the interrupted step did not count)."""
    redone = recovery.get("redone")
    if isinstance(redone, int) and not isinstance(redone, bool) and redone >= 0:
        return redone
    return 1 if recovery.get("counted") is False else 0


def summarize(records: list[dict[str, Any]]) -> RunSummary:
    records = [r for r in records if r["kind"] in _NUMERIC_FIELDS]  # start, step, recovery
    starts = [r for r in records if r["kind"] == "start"]
    steps = [r for r in records if r["kind"] == "step"]
    recoveries = [r for r in records if r["kind"] == "recovery"]
    lost = [r for r in recoveries if r.get("reason") == "failure"]
    redone, reached = sum(_redone(r) for r in lost), 0
    for record in records:
        if record["kind"] == "start":
            redone += max(0, reached - record["step"])
            reached = record["step"]
        elif record["kind"] == "step":
            reached = max(reached, record["step"])
    vals = [r["val_loss"] for r in steps if r.get("val_loss") is not None]
    rates = [r["tokens_per_s"] for r in steps[1:]]  # the first step pays one-off costs
    stalls = [r["snapshot_stall_s"] for r in steps if r.get("snapshot_stall_s") is not None]
    return RunSummary(
        steps=max((r["step"] for r in steps), default=0),
        final_loss=steps[-1]["loss"] if steps else None,
        final_val_loss=vals[-1] if vals else None,
        restarts=max(0, len(starts) - 1),
        steps_redone=redone,
        world_sizes=[r["world_size"] for r in records if r["kind"] != "step"],
        mean_tokens_per_s=sum(rates) / len(rates) if rates else None,
        snapshot_stall_ms_max=1e3 * max(stalls) if stalls else None,
        snapshot_stall_ms_mean=1e3 * sum(stalls) / len(stalls) if stalls else None,
        recovered_in_process=len(lost),
        replacements_joined=sum(1 for r in recoveries if r.get("reason") == "join"),
        recovery_s_max=max((r["seconds"] for r in recoveries), default=None),
    )
