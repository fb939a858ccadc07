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

from trainer.config import FitConfig, load_recipe

# Slows each step a little so the node loss and the scale-up land mid-run on a fast machine.
DEMO_PACE_S = 0.1
console = Console(stderr=True, soft_wrap=True)  # never wrap: logs are parsed


def _wait_for_monitor(run_name: str, trainer: threading.Thread) -> Any:
    from trainer.monitor import get_monitor

    while trainer.is_alive():
        try:
            return get_monitor(run_name)
        except ValueError:  # fit has not created it yet
            time.sleep(0.5)
    return None


def _wait_for_step(monitor: Any, step: int, trainer: threading.Thread) -> bool:
    """Wait until the run passes `step`; False if training ended first."""
    import ray

    while trainer.is_alive():
        if ray.get(monitor.latest.remote()).get("step", 0) >= step:
            return True
        time.sleep(0.5)
    return False


def activation_bytes(cfg: FitConfig) -> tuple[int, int]:
    """Bytes one microbatch keeps for backward with exact backprop and with the recipe's
    BASIS layers (measured, not estimated)."""
    import dataclasses

    import torch

    from sketch_ops import sketch_seed
    from sketch_ops.memory import saved_bytes
    from trainer.loop import build_model, next_token_loss

    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.data.microbatch_size, cfg.data.seq_len))
    exact_cfg = dataclasses.replace(
        cfg, sketch=dataclasses.replace(cfg.sketch, rank=0, memory_budget_mib=0.0)
    )
    sizes = []
    for variant in (exact_cfg, cfg):
        model = build_model(variant)
        with sketch_seed(variant.seed, 0):
            sizes.append(saved_bytes(lambda m=model: next_token_loss(m, tokens), model))
    return sizes[0], sizes[1]


def run_demo(recipe: str, run_dir: str) -> int:
    import ray

    from trainer.fit_cli import _print_progress, _print_summary
    from trainer.local_cluster import LocalCluster
    from trainer.monitor import NAMESPACE
    from trainer.ray_fit import fit
    from trainer.report import write_report

    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_recipe(recipe, [f'snapshots.run_uri="{Path(run_dir).resolve()}"'])
    console.print("[bold]Baton demo[/bold]: local cluster of a head and 2 worker nodes")
    cluster = LocalCluster(worker_nodes=2, cpus_per_node=cfg.scaling.cpus_per_worker)
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    events: list[str] = []
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"] = fit(cfg, on_progress=_print_progress, pace_s=DEMO_PACE_S)
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = err

    # Node changes happen on the main thread (Ray installs signal handlers there), so the
    # fit runs on a second thread and this one follows the fault schedule.
    trainer = threading.Thread(target=train, name="baton-demo-fit")
    started = time.perf_counter()
    trainer.start()
    try:
        monitor = _wait_for_monitor(cfg.run_name, trainer)
        if monitor is not None and _wait_for_step(monitor, cfg.steps // 3, trainer):
            cluster.remove_worker()
            events.append(f"removed a worker node after step {cfg.steps // 3}")
            console.print(f"[yellow]>>> {events[-1]}[/yellow]")
        if monitor is not None and _wait_for_step(monitor, 2 * cfg.steps // 3, trainer):
            cluster.add_worker()
            events.append(f"added a worker node after step {2 * cfg.steps // 3}")
            console.print(f"[yellow]>>> {events[-1]}[/yellow]")
        trainer.join()
    finally:
        ray.shutdown()
        cluster.shutdown()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    png = Path(run_dir) / "report.png"
    write_report(cfg.snapshots.run_uri, png)
    exact, sketched = activation_bytes(cfg)
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
