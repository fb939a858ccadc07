"""`baton demo` (`make demo`): the whole product in a few minutes on one machine.

Contract: starts a local multi-node Ray cluster (head + 2 worker raylets), prepares the
embedded corpus, trains `recipe` with BASIS on 2 workers, kills a worker node once training
passes a third of the steps (the run continues on 1 worker), adds a node back once it passes
two thirds (Ray Train grows the group to 2 again), and prints a summary: final loss, steps,
restarts, steps redone, snapshot stall, memory saved by sketching, where the report PNG is.
The run directory is fresh each time (`--run-dir` is cleared first).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from trainer.config import load_recipe

console = Console(stderr=True, soft_wrap=True)  # never wrap: logs are parsed


def _wait_for_step(monitor: Any, step: int, done: threading.Event) -> bool:
    import ray

    while not done.is_set():
        latest = ray.get(monitor.latest.remote())
        if latest.get("step", 0) >= step:
            return True
        time.sleep(0.5)
    return False


def run_demo(recipe: str, run_dir: str) -> int:
    import ray

    from trainer.fit_cli import _print_progress, _print_summary
    from trainer.local_cluster import LocalCluster
    from trainer.monitor import NAMESPACE, get_monitor
    from trainer.ray_fit import fit
    from trainer.report import write_report
    from trainer.sketch_memory import saved_bytes_per_step

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_recipe(recipe, [f'snapshots.run_uri="{Path(run_dir).resolve()}"'])
    console.print("[bold]Baton demo[/bold]: local cluster of a head and 2 worker nodes")
    cluster = LocalCluster(worker_nodes=2, cpus_per_node=cfg.scaling.cpus_per_worker)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    done = threading.Event()
    events: list[str] = []

    def faults() -> None:
        # Wait for the monitor to exist (fit creates it), then follow the schedule.
        while not done.is_set():
            try:
                monitor = get_monitor(cfg.run_name)
                break
            except ValueError:
                time.sleep(0.5)
        else:
            return
        if _wait_for_step(monitor, cfg.steps // 3, done):
            cluster.remove_worker()
            events.append(f"removed a worker node after step {cfg.steps // 3}")
            console.print(f"[yellow]>>> {events[-1]}[/yellow]")
        if _wait_for_step(monitor, 2 * cfg.steps // 3, done):
            cluster.add_worker()
            events.append(f"added a worker node after step {2 * cfg.steps // 3}")
            console.print(f"[yellow]>>> {events[-1]}[/yellow]")

    injector = threading.Thread(target=faults, daemon=True)
    injector.start()
    started = time.perf_counter()
    try:
        result = fit(cfg, on_progress=_print_progress)
    finally:
        done.set()
        injector.join(timeout=5)
        ray.shutdown()
        cluster.shutdown()
    png = Path(run_dir) / "report.png"
    write_report(cfg.snapshots.run_uri, png)
    exact, sketched = saved_bytes_per_step(cfg)
    summary = result.summary.to_dict()
    summary.update(
        {
            "wall_time_s": round(time.perf_counter() - started, 1),
            "events": "; ".join(events) or "none",
            "activation memory kept for backward (exact -> BASIS)": (
                f"{exact / 2**20:.1f} MiB -> {sketched / 2**20:.1f} MiB "
                f"({exact / max(sketched, 1):.1f}x less)"
            ),
            "report": str(png),
        }
    )
    _print_summary(summary)
    return 0
