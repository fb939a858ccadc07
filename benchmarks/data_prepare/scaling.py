"""The worker-scaling part of `benchmarks/data_prepare/run.py`: `prepare_corpus` serial
(1 process x 1 thread) against `workers=2` (2 processes x 1 thread, their spawn inside the
time), each run a fresh `benchmarks/data_prepare/worker.py` process whose tokenizer is pinned
to one thread, and the machine's own ceiling for two such processes (two independent serial
prepares at once). `os.cpu_count()` and the load average at start and end are recorded, since
on a shared machine other jobs take cores from both sides.
"""

from __future__ import annotations

import json
import os
from typing import Any

from benchmarks.common import spread, start_worker, worker_result

SEQ_LEN = 256


def _start_pinned(paths: list[str], out: str, tokenizer_file: str, workers: int) -> Any:
    """A `data_prepare.worker` process whose tokenizer uses one thread: RAYON_NUM_THREADS=1
    is in its environment before `tokenizers` is loaded."""
    payload = json.dumps({"paths": paths, "out": out, "seq_len": SEQ_LEN,
                          "tokenizer": tokenizer_file, "workers": workers})
    return start_worker("data_prepare.worker", "prepare", "-", stdin=payload,
                        capture_stderr=True,
                        env={"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})


def _finish_pinned(child: Any, what: str) -> dict[str, float]:
    return {k: float(v) for k, v in worker_result(child, f"scaling run ({what})").items()}


def pinned_prepare_s(paths: list[str], out: str, tokenizer_file: str, workers: int) -> float:
    """Seconds `prepare_corpus` takes in a fresh process whose tokenizer uses one thread."""
    child = _start_pinned(paths, out, tokenizer_file, workers)
    return _finish_pinned(child, f"workers={workers}")["seconds"]


def two_independent_s(paths: list[str], out: str, tokenizer_file: str) -> float:
    """The machine's own ceiling for two single-threaded processes: two independent serial
    prepares at once, each on every other file (half the text), timed from the first one's
    start to the last one's end. Nothing is shared between them, so their speed-up over one
    serial prepare is what two processes can get from these cores — on a VM whose two vCPUs
    are hyperthreads of one core, or on a loaded machine, that is well below 2x."""
    children = [_start_pinned(paths[i::2], f"{out}-{i}", tokenizer_file, 1) for i in (0, 1)]
    times = [_finish_pinned(c, "two independent") for c in children]
    return max(t["end"] for t in times) - min(t["start"] for t in times)


CEILING = "two independent serial, 1 thread each"


def worker_scaling(paths: list[str], nbytes: int, rounds: int, tokenizer_file: str,
                   tmp: str) -> dict[str, Any]:
    """Serial (1 process x 1 thread) against workers=2 (2 x 1 thread), alternating, on
    `paths` (`nbytes` of text)."""
    load_start = os.getloadavg()
    runs: dict[str, list[float]] = {"serial, 1 thread": [], "workers=2, 1 thread each": [],
                                    CEILING: []}
    for r in range(rounds):
        for name, workers in (("serial, 1 thread", 1), ("workers=2, 1 thread each", 2)):
            seconds = pinned_prepare_s(paths, f"{tmp}/scaling-{workers}-{r}", tokenizer_file,
                                       workers)
            runs[name].append(nbytes / 1e6 / seconds)
        runs[CEILING].append(nbytes / 1e6 / two_independent_s(paths, f"{tmp}/two-{r}",
                                                               tokenizer_file))
    # One workers=2 run on one small file: mostly the two processes starting.
    startup = pinned_prepare_s(paths[:1], f"{tmp}/scaling-start", tokenizer_file, 2)
    stats = {name: spread(values) for name, values in runs.items()}
    return {
        "cpu_count": os.cpu_count(), "text_bytes": nbytes, "files": len(paths),
        "rounds": rounds, "worker_start_s": startup,
        "load_average_start": list(load_start), "load_average_end": list(os.getloadavg()),
        "mb_per_s": stats, "mb_per_s_runs": runs,
        "speedup_workers2_over_serial": stats["workers=2, 1 thread each"]["median"]
        / stats["serial, 1 thread"]["median"],
        "speedup_two_independent_over_serial": stats[CEILING]["median"]
        / stats["serial, 1 thread"]["median"],
        "workers2_over_two_independent": stats["workers=2, 1 thread each"]["median"]
        / stats[CEILING]["median"],
    }


def print_scaling(s: dict[str, Any]) -> None:
    print(f"worker scaling, tokenizer pinned to 1 thread per process (RAYON_NUM_THREADS=1): "
          f"{s['text_bytes'] / 1e6:.1f} MB, {s['files']} files, {s['rounds']} alternating rounds; "
          f"os.cpu_count() = {s['cpu_count']}")
    print("  load average (1, 5, 15 min) at start "
          + ", ".join(f"{x:.2f}" for x in s["load_average_start"]) + "; at end "
          + ", ".join(f"{x:.2f}" for x in s["load_average_end"])
          + ("  (other jobs were running)" if max(s["load_average_start"]) > 0.5 else ""))
    for name, st in s["mb_per_s"].items():
        print(f"  {name:<28} {st['median']:>8.2f} MB/s median  ({st['min']:.2f}-{st['max']:.2f})")
    print(f"  speed-up workers=2 / serial: {s['speedup_workers2_over_serial']:.2f}x "
          f"(ideal 2.00x; worker start-up {s['worker_start_s']:.1f} s is inside the time)")
    print(f"  what two processes get from these cores (two independent serial prepares at "
          f"once, half the text each): {s['speedup_two_independent_over_serial']:.2f}x")
    print(f"  --workers 2 / two independent prepares: {s['workers2_over_two_independent']:.2f} "
          f"(1.00 = linear in what the cores give)")
