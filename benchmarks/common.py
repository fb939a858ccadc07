"""What every benchmark does the same way: one way of timing, alternating, reading memory,
writing results, reading its command line and starting fresh processes.

Contract:
- Paths and files: `ROOT` (the repository), `RESULTS` (`benchmarks/results/`, not kept in git),
  `write_json(path, obj)` (creates the folder), `read_json(path)` ({} if absent).
- Timing: `timed(fn)` is one call's wall seconds; `spread(values)` and `ratios(num, den)` give
  median, min and max (of values; of per-round ratios num[i] / den[i], both sides measured in
  the same round); `mean_std` over seeds, `versus` a difference of means against the noise.
- Alternation, so no side always runs first or after the same other: `alternating(seq, r)` (ABBA),
  `rotated(seq, r)` (round r starts at item r), `in_every_order(fns, r)` (the r-th of n! orders).
- Memory (Linux): `status_bytes("VmRSS" | "VmHWM")`, `reset_peak_rss()` (VmHWM to the resident
  set now), `malloc_env(...)`: the glibc setting under which the resident set follows live memory.
- Command line: `arg_parser(__doc__, __spec__)`, whose usage line names `python -m <script>`.
- Fresh processes: `start_worker("sketch_memory.worker", ...)` runs `python -m
  benchmarks.sketch_memory.worker ...` from the repository root; `worker_result` is the JSON of
  its last stdout line; `worker_main(handlers)` is the worker's side (`MODE JSON`).
- `moto_s3()`: a local S3 API with the standard AWS variables pointing at it; `CpuLock`: an
  flock that timing-sensitive benchmarks hold so they do not overlap.

Only the standard library is imported at module level: data_prepare's spawned tokenizer
workers import the benchmark that imports this module again and must not pay for torch.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import IO, Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CPU_LOCK = "/tmp/baton_cpu.lock"
T = TypeVar("T")


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn`."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of `values`."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratios(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """`spread` of num[i] / den[i]: ratios of two sides measured in the same round."""
    return spread([a / b for a, b in zip(num, den, strict=True)])


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def versus(values: Sequence[float], reference: Sequence[float]) -> dict[str, Any]:
    """How the mean of `values` (one per seed) differs from the mean of `reference`'s: in per
    cent of the reference, and whether the difference is outside the noise (more than two
    standard errors of the difference)."""
    mean, std = mean_std(values)
    ref_mean, ref_std = mean_std(reference)
    se = (std**2 / len(values) + ref_std**2 / len(reference)) ** 0.5
    return {"delta_pct": 100 * (mean - ref_mean) / ref_mean,
            "significant": abs(mean - ref_mean) > 2 * se}


# --------------------------------------------------------------------------- alternation


def alternating(seq: Sequence[T], r: int) -> list[T]:
    """`seq` in round `r`: as given in even rounds, reversed in odd ones (ABBA)."""
    return list(seq) if r % 2 == 0 else list(seq)[::-1]


def rotated(seq: Sequence[T], r: int) -> list[T]:
    """`seq` in round `r`: starting at its (r mod n)-th item, so each item leads in turn."""
    shift = r % len(seq)
    return [*seq[shift:], *seq[:shift]]


def in_every_order(fns: Sequence[Callable[[], object]], r: int) -> None:
    """Run `fns` in the `r`-th of their n! orders (mod n!): over n! rounds each one runs in
    each position, and right after each other one, equally often. Turns alone (`rotated`) are
    not enough where a side's speed depends on what ran just before it: with three sides in
    turns one order repeats every third round."""
    orders = list(itertools.permutations(range(len(fns))))
    for i in orders[r % len(orders)]:
        fns[i]()


# --------------------------------------------------------------------------- memory (Linux)


def status_bytes(field: str) -> int:
    """A field of /proc/self/status in bytes: "VmRSS" (resident now), "VmHWM" (its peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError as err:
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs, "
                           "Linux >= 4.0)") from err


def malloc_env(mmap_threshold: int, *, trim: bool = False) -> dict[str, str]:
    """glibc settings under which the resident set follows live tensors: every allocation
    above `mmap_threshold` bytes is mapped on its own and unmapped when freed (and, with
    `trim`, freed heap is given back at once). Otherwise a freed block may stay in the heap
    and the resident set measures the allocator's history. It makes each large allocation
    fault in fresh pages, so only memory measurements run under it, never timings."""
    trim_env = {"MALLOC_TRIM_THRESHOLD_": "0"} if trim else {}
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap_threshold), **trim_env}


# --------------------------------------------------------------------------- results, arguments


def write_json(path: Path | str, obj: Any, indent: int = 1) -> Path:
    """Write `obj` as JSON to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent) + "\n")
    return path


def read_json(path: Path | str) -> Any:
    """The JSON in `path`, or {} if there is no such file (a resumable run's first start)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def arg_parser(doc: str | None, spec: ModuleSpec | None) -> argparse.ArgumentParser:
    prog = f"python -m {spec.name}" if spec else None  # None: run as a file, its name
    return argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])


# --------------------------------------------------------------------------- fresh processes


class WorkerFailed(RuntimeError):
    """A worker process exited with an error (its stderr went to ours, or is in the text)."""


def start_worker(module: str, *args: str, env: dict[str, str] | None = None,
                 stdin: str | None = None, capture_stderr: bool = False,
                 capture_stdout: bool = True,
                 drop_env: Sequence[str] = ()) -> subprocess.Popen[str]:
    """Start `python -m benchmarks.<module> *args` in a fresh interpreter, from the repository
    root (so that Ray workers it starts can import `benchmarks` too), with this environment
    plus `env`, less the variables starting with a prefix in `drop_env`; `stdin` is written to
    it. Its stdout is piped (read by `worker_result`) unless not `capture_stdout`; its stderr
    goes to ours unless `capture_stderr`."""
    child_env = {k: v for k, v in os.environ.items()
                 if not any(k.startswith(p) for p in drop_env)}
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT),
                                                            child_env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, env=child_env,
        stdin=subprocess.PIPE if stdin is not None else None,
        stdout=subprocess.PIPE if capture_stdout else None,
        stderr=subprocess.PIPE if capture_stderr else None, text=True)
    if stdin is not None:
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
        proc.stdin = None  # written and closed: `communicate` must not flush it again
    return proc


def worker_result(proc: subprocess.Popen[str], what: str, timeout: float | None = None) -> Any:
    """Wait for `proc`; the JSON of its last stdout line. Raises WorkerFailed if it failed."""
    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        detail = f":\n{stderr}" if stderr else "; its errors are above"
        raise WorkerFailed(f"{what} failed (exit {proc.returncode}){detail}")
    return json.loads(stdout.strip().splitlines()[-1])


def run_worker(module: str, *args: str, what: str = "", **kwargs: Any) -> Any:
    """`start_worker` then `worker_result`."""
    return worker_result(start_worker(module, *args, **kwargs), what or module)


def worker_main(handlers: dict[str, Callable[[Any], Any]], argv: list[str] | None = None) -> int:
    """A worker module's entry point: `MODE JSON`, prints the JSON of `handlers[MODE](payload)`
    as its last stdout line (JSON read from stdin when it is `-`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in handlers:
        print(f"usage: MODE JSON, MODE one of {', '.join(handlers)}", file=sys.stderr)
        return 2
    payload = json.loads(sys.stdin.read() if args[1] == "-" else args[1])
    print(json.dumps(handlers[args[0]](payload)), flush=True)
    return 0


# --------------------------------------------------------------------------- local S3, lock


@contextmanager
def moto_s3(bucket: str | None = None, *, own_process: bool = False) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with the standard AWS variables pointing at it (restored
    on exit), `bucket` created; yields its URL. In this process (a thread) by default; with
    `own_process` in a subprocess, whose request handling then does not compete for this
    process's GIL (large transfers)."""
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url, "AWS_ENDPOINT_URL_S3": url}
    saved = {k: os.environ.get(k) for k in env}
    stop = _start_moto(port, own_process)
    os.environ.update(env)
    try:
        if bucket:
            import boto3

            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
        yield url
    finally:
        stop()
        os.environ.update({k: v for k, v in saved.items() if v is not None})
        for k in [k for k, v in saved.items() if v is None]:
            os.environ.pop(k, None)


def _start_moto(port: int, own_process: bool) -> Callable[[], object]:
    """Start the server; returns what stops it."""
    if not own_process:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        return server.stop
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=30)

    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return stop
        except OSError:
            if time.monotonic() > deadline:
                stop()
                raise
            time.sleep(0.2)


class CpuLock:
    """`flock` on CPU_LOCK, held while timing-sensitive benchmark processes run, so that two
    such benchmarks on one machine take turns instead of slowing each other down."""

    _file: IO[str]
    def __enter__(self) -> CpuLock:
        self._file = open(CPU_LOCK, "w")  # noqa: SIM115 - released in __exit__
        fcntl.flock(self._file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        time.sleep(2)  # let a waiting benchmark of someone else take its turn
