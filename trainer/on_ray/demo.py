"""`baton demo` (`make demo`): the whole product in a few minutes on one machine.

Contract: starts a local multi-node Ray cluster (head + 2 worker raylets), prepares the
embedded corpus, trains `recipe` with BASIS on 2 workers, kills a worker node once training
passes a third of the steps (the survivor trains on alone, in-process: no restart), adds a node
back once it passes half of them (Ray Train replaces the lost worker, which joins at a step
boundary: 2 workers again), and prints a summary: final loss, steps, restarts, lost workers
survived in-process and the longest such recovery, steps redone, snapshot stall, the events
(the demo's node changes, each in-process recovery and join, each restart, as announced during
the run), memory saved by sketching, where the report PNG is.
During the run it shows what `baton fit` shows (`trainer.run.terminal`: progress bar or plain
lines, restart events); Ray's own messages about the killed node go to RUN/logs/ray.log.
The run directory is fresh each time: one an earlier demo made (marked `.baton-demo`) is
removed first; anything else there (a real run, a link, other files) is refused in one line.
The report PNG goes beside it (`runs/demo-report.png`), never into the run directory.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from trainer.config import FitConfig, load_recipe

# Slows each step a little so the node loss and the scale-up land mid-run on a fast machine.
DEMO_PACE_S = 0.1
console = Console(stderr=True, soft_wrap=True)  # never wrap: logs are parsed


def _wait_for_monitor(cfg: FitConfig, trainer: threading.Thread) -> Any:
    from trainer.on_ray.monitor import get_monitor

    while trainer.is_alive():
        try:
            return get_monitor(cfg)
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
    import functools

    import torch

    from sketch_ops import saved_bytes, sketch_seed
    from trainer.train import build_model, next_token_loss

    vocab = cfg.model.vocab_size or 256  # 0: the dataset's; the demo's corpus is bytes
    tokens = torch.randint(0, vocab, (cfg.data.microbatch_size, cfg.data.seq_len))
    exact_cfg = dataclasses.replace(
        cfg, sketch=dataclasses.replace(cfg.sketch, rank=0, memory_budget_mib=0.0)
    )
    sizes = []
    for variant in (exact_cfg, cfg):
        model = build_model(variant)
        with sketch_seed(variant.seed, 0):
            sizes.append(saved_bytes(functools.partial(next_token_loss, model, tokens), model))
    return sizes[0], sizes[1]


DEMO_MARK = ".baton-demo"  # in a run directory the demo made, so the next demo may remove it


def fresh_demo_dir(run_dir: Path) -> None:
    """Start the demo from nothing in `run_dir`: an earlier demo's directory (marked) is
    removed, anything else is refused in one line (`ValueError`) and left as it is: a real
    run's snapshots, a link to anywhere, a file, a directory holding other things."""
    if run_dir.is_symlink() or run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a link or a file; the demo removes and "
                         "remakes its directory: pass a plain path")
    if run_dir.exists() and any(run_dir.iterdir()):
        if not (run_dir / DEMO_MARK).is_file():
            raise ValueError(f"--run-dir {run_dir} holds something `baton demo` did not make "
                             "(a run?); the demo removes its directory first: pass another "
                             "--run-dir, or remove that one yourself")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARK).write_text("made by baton demo: the next demo removes it\n")


def run_demo(recipe: str, run_dir: str) -> int:
    import ray

    from elastic.coord import NAMESPACE
    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import RunFeed
    from trainer.on_ray.ray_fit import fit
    from trainer.on_ray.ray_messages import ray_log_path, ray_log_root, ray_messages_to
    from trainer.run import ProgressDisplay, fmt_mib, fmt_ratio, print_summary, write_report

    fresh_demo_dir(Path(run_dir))
    cfg = load_recipe(recipe, [f'snapshots.run_uri="{Path(run_dir).resolve()}"'])
    console.print("[bold]Baton demo[/bold]: local cluster of a head and 2 worker nodes")
    outcome: dict[str, Any] = {}
    feed = RunFeed(cfg, ProgressDisplay(cfg.steps, console))

    def train() -> None:
        try:
            outcome["result"] = fit(cfg, on_progress=feed, pace_s=DEMO_PACE_S)
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            outcome["error"] = err

    # Ray's messages about the node this demo kills go to a file, not between the progress.
    with ray_messages_to(ray_log_path(cfg),
                         lambda text: console.print(escape(text), highlight=False),
                         ray_log_root(cfg)):
        cluster = LocalCluster(worker_nodes=2, cpus_per_node=cfg.scaling.cpus_per_worker)
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        # Node changes happen on the main thread (Ray installs signal handlers there), so the
        # fit runs on a second thread and this one follows the fault schedule.
        trainer = threading.Thread(target=train, name="baton-demo-fit")
        started = time.perf_counter()
        trainer.start()
        try:
            monitor = _wait_for_monitor(cfg, trainer)
            if monitor is not None and _wait_for_step(monitor, cfg.steps // 3, trainer):
                cluster.remove_worker()
                feed.event(f"demo: removed a worker node after step {cfg.steps // 3}")
            if monitor is not None and _wait_for_step(monitor, cfg.steps // 2, trainer):
                cluster.add_worker()
                feed.event(f"demo: added a worker node after step {cfg.steps // 2}")
            trainer.join()
        finally:
            feed.close()
            ray.shutdown()
            cluster.shutdown()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    # Beside the run, not in it: a run directory holds only what training writes there.
    png = Path(run_dir).parent / f"{Path(run_dir).name}-report.png"
    write_report(cfg.snapshots.run_uri, png)
    exact, sketched = activation_bytes(cfg)
    summary = result.summary.to_dict()
    summary.update(
        {
            "wall_time_s": time.perf_counter() - started,
            "events": "; ".join(feed.events) or "none",
            "activation memory kept for backward (exact → BASIS)": (
                f"{fmt_mib(exact)} → {fmt_mib(sketched)} "
                f"({fmt_ratio(exact / max(sketched, 1))} less)"
            ),
            "report": str(png),
        }
    )
    print_summary(summary, Console(soft_wrap=True))
    return 0
