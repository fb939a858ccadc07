"""Worker processes that recover in-process without Ray, for the membership's fault tests.

`Coordinators` serves one `LocalCoordinator` (the one a Ray actor would be) to spawned worker
processes over a local `multiprocessing` manager, as the actor is served to Ray workers; each
`Worker` process runs `trainer.train.loop.run_worker` on the tiny recipe with its own process
group of one (what Ray Train's replica groups give a worker) and a worker context asking for
in-process recovery, exactly as `ElasticTorchTrainer` sets it up. Faults are keyed by the
number of forward passes a worker has run (`die_at`, `stop_at`: SIGKILL or SIGSTOP itself in
the middle of a step). Each worker appends what it saw to `<out>/<member>.jsonl`: the step
records it published as rank 0, its recoveries, its pid and how it ended.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AUTHKEY = b"baton-recovery-tests"


class _Manager(BaseManager):
    pass


@dataclass
class Fault:
    die_at: int | None = None  # SIGKILL itself during its die_at-th forward pass
    stop_at: int | None = None  # SIGSTOP itself during that forward pass (a hang)
    resume_after_s: float = 0.0  # with stop_at: a helper sends SIGCONT after this long
    exit_in: str | None = None  # end the process in this phase of a recovery (elastic.faults)


@dataclass
class Worker:
    member: str
    order: int
    fault: Fault = field(default_factory=Fault)
    start_delay_s: float = 0.0  # start this long after the others (or after `replaces` died)
    replaces: str | None = None  # a replacement: start once this member's process is gone
    after_end: bool = False  # start once every other worker has ended (too late to join)
    overrides: list[str] = field(default_factory=list)  # recipe overrides of its own


def serve(coordinator: Any) -> tuple[_Manager, tuple[str, int]]:
    """Serve `coordinator` to worker processes; returns the manager and its address."""
    _Manager.register("coordinator", callable=lambda: coordinator)
    manager = _Manager(address=("127.0.0.1", 0), authkey=AUTHKEY)
    server = manager.get_server()
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    return manager, server.address


def _connect(address: tuple[str, int]) -> Any:
    _Manager.register("coordinator")
    manager = _Manager(address=address, authkey=AUTHKEY)
    manager.connect()
    return manager.coordinator()  # type: ignore[attr-defined]


def _faulty_loss(fault: Fault, write: Any) -> Any:
    from trainer.train.model_build import next_token_loss  # before it is replaced

    calls = {"n": 0}

    def loss(model: Any, tokens: Any) -> Any:
        calls["n"] += 1
        if fault.die_at is not None and calls["n"] == fault.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.stop_at is not None and calls["n"] == fault.stop_at:
            write({"kind": "stopping", "time": time.time()})  # the harness resumes it
            os.kill(os.getpid(), signal.SIGSTOP)
        return next_token_loss(model, tokens)

    return loss


def _main(address: tuple[str, int], worker: Worker, overrides: list[str], out: str,
          pace_s: float, go: Any) -> None:
    import torch
    import torch.distributed as dist

    from elastic.faults import FaultInjector
    from trainer.config import load_recipe
    from trainer.train import model_build
    from trainer.train.loop import WorkerEnv, run_worker
    from trainer.train.session import WorkerContext, worker_context

    log = Path(out) / f"{worker.member}.jsonl"

    def write(record: dict[str, Any]) -> None:
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")

    torch.set_num_threads(1)
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", [*overrides, *worker.overrides])
    if go is not None:
        go.wait()  # a replacement: imported and ready, it starts once the lost one is gone
    time.sleep(worker.start_delay_s)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    coordinator = _connect(address)
    # The run's loss (the built-in GPT's), counting forward passes to strike mid-step.
    model_build.next_token_loss = _faulty_loss(worker.fault, write)
    faults = FaultInjector()
    if worker.fault.exit_in is not None:
        faults.arm(worker.fault.exit_in, action="exit")
    context = WorkerContext(snapshots=cfg.snapshots, coordinator=coordinator,
                            recovery=cfg.recovery, member=(worker.member, worker.order),
                            faults=faults)
    write({"kind": "pid", "pid": os.getpid()})
    env = WorkerEnv(coordinator=coordinator, record_samples=True, pace_s=pace_s,
                    on_metrics=lambda r: write({"kind": "step", **r}),
                    on_recovery=lambda r: write({"kind": "recovery", **r}))
    try:
        with worker_context(context):
            result = run_worker(cfg, env)
    except BaseException as err:  # noqa: BLE001 - the test reads how each worker ended
        write({"kind": "end", "error": f"{type(err).__name__}: {err}",
               "trace": traceback.format_exc()[-2000:]})
        raise SystemExit(1) from None
    write({"kind": "end", "error": None, "step": result.step})


def _stopped_at(path: Path) -> float | None:
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "stopping":
            return float(record["time"])
    return None


def _recovered(out: Path, workers: list[Worker]) -> bool:
    """Whether any worker has written a recovery record."""
    for w in workers:
        path = out / f"{w.member}.jsonl"
        if path.exists() and any(json.loads(line)["kind"] == "recovery"
                                 for line in path.read_text().splitlines()):
            return True
    return False


def run_workers(coordinator: Any, workers: list[Worker], overrides: list[str], out: Path,
                *, pace_s: float = 0.0, timeout_s: float = 240.0
                ) -> dict[str, list[dict[str, Any]]]:
    """Run the workers against `coordinator` until all have ended; returns each member's
    records. `pace_s`: each worker sleeps that long after every step (so that a late
    replacement finds the run still going). A worker that is still running after
    `timeout_s` is killed (and says so)."""
    _, address = serve(coordinator)
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    # A replacement's process starts with the others (a slow machine's torch import is not
    # the test's fault) and waits for its `go`: set once the member it replaces is gone and a
    # survivor recovered without it (a new node comes after the loss, as on a cluster).
    go = {w.member: ctx.Event() for w in workers if w.replaces is not None or w.after_end}
    procs = [ctx.Process(target=_main, args=(address, w, overrides, str(out), pace_s,
                                             go.get(w.member)), daemon=True)
             for w in workers]
    by_member = {w.member: p for w, p in zip(workers, procs, strict=True)}
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    # A worker stopped for good never ends: wait for the others, then end it.
    hung = [w.fault.stop_at is not None and not w.fault.resume_after_s for w in workers]
    resumed: set[str] = set()
    waiting = [w for w in workers if w.member in go]
    while time.monotonic() < deadline and (waiting or any(
            p.is_alive() for p, stopped in zip(procs, hung, strict=True) if not stopped)):
        for w in list(waiting):
            if w.after_end:
                ready = not any(by_member[o.member].is_alive() for o in workers
                                if o.member not in go)
            else:
                lost = by_member[w.replaces]  # type: ignore[index]
                ready = not lost.is_alive() and _recovered(out, workers)
            if ready:
                go[w.member].set()
                waiting.remove(w)
        for p, w in zip(procs, workers, strict=True):
            if w.fault.resume_after_s and w.member not in resumed and p.pid is not None:
                stopped_at = _stopped_at(out / f"{w.member}.jsonl")
                if stopped_at is not None and time.time() > stopped_at + w.fault.resume_after_s:
                    os.kill(p.pid, signal.SIGCONT)
                    resumed.add(w.member)
        time.sleep(0.05)
    for p, w in zip(procs, workers, strict=True):
        if p.is_alive():
            p.kill()
            p.join(5)
            with open(out / f"{w.member}.jsonl", "a") as f:
                f.write(json.dumps({"kind": "end", "error": "killed: timed out"}) + "\n")
    records: dict[str, list[dict[str, Any]]] = {}
    for w in workers:
        path = out / f"{w.member}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        records[w.member] = [json.loads(line) for line in lines]
    return records
