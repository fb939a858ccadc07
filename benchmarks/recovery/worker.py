"""The fresh process of `benchmarks/recovery/run.py`: one tool in one failure-detection setting,
on a fresh local Ray cluster (a head with no CPUs and 2 worker nodes of 1 logical CPU).

    python -m benchmarks.recovery.worker run '{"setting": "fast"|"ray-defaults",
        "tool": "baton"|"standard"|"standard-model", "plan": "full"|"quick",
        "work": DIR, "data": DATASET, "out": RESULT.json}'

It trains on 2 workers (`num_workers=(1, 2)`), kills a worker node ungracefully once step
`lose_at` is reached, lets the run finish on 1 worker, and writes the recovery figures
(`analyse`) to `out`. A cluster is not reused across runs: after a node comes back, Ray Train's
elastic policy may still see one CPU for a while and start the next run on 1 worker.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, worker_main
from benchmarks.recovery.standard import standard_train_fn

RECIPE = ROOT / "recipes" / "default.toml"


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    lose_at: int  # the node is killed once rank 0 reports this step
    snapshot_every: int  # Baton's snapshot interval = the standard recipe's checkpoint interval
    pace_s: float  # sleep per step, so the loss lands mid-run on a fast machine


PLANS = {
    "full": Plan(steps=200, lose_at=85, snapshot_every=10, pace_s=0.2),
    "quick": Plan(steps=60, lose_at=25, snapshot_every=10, pace_s=0.2),
}


def _config(plan: Plan, run: Path, dataset: str) -> Any:
    from trainer.config import load_recipe

    return load_recipe(RECIPE, [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={plan.steps}",
        f"snapshots.snapshot_every={plan.snapshot_every}", "eval.every=0",
        "scaling.min_workers=1", "scaling.max_workers=2",
    ])


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _kill_during(cluster: Any, target: Any, current_step: Any, plan: Plan) -> float:
    """Run `target` on a thread, kill a worker node (main thread: Ray installs signal
    handlers) once `current_step()` reaches LOSE_AT, wait for the end; returns the kill time."""
    error: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            error.append(err)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    _wait(lambda: current_step() >= plan.lose_at or not thread.is_alive(), 300,
          f"step {plan.lose_at}")
    killed_at = time.time()
    cluster.remove_worker()
    thread.join(timeout=900)
    if error:
        raise error[0]
    if thread.is_alive():
        raise TimeoutError("the run did not finish within 900 s of the node loss")
    return killed_at


def run_baton(cluster: Any, plan: Plan, work: Path, dataset: str, tag: str) -> dict[str, Any]:
    import ray
    from safetensors.torch import load_file

    from elastic.catalog import export_model
    from elastic.store.snapshot_store import SnapshotStore
    from trainer.on_ray.monitor import get_monitor
    from trainer.on_ray.ray_fit import fit
    from trainer.run.metrics import read_records

    run = work / f"baton-{tag}"
    cfg = _config(plan, run, dataset)

    def current_step() -> int:
        try:
            return ray.get(get_monitor(cfg).latest.remote()).get("step", 0)
        except ValueError:  # the monitor does not exist yet
            return 0

    killed_at = _kill_during(
        cluster, lambda: fit(cfg, pace_s=plan.pace_s, storage_path=str(work / "ray")),
        current_step, plan,
    )
    store = SnapshotStore(str(run))
    final = max(store.committed_steps())
    export_model(store, final, str(work / f"{tag}-optim.safetensors"), component="optim")
    counters = sorted({float(v.item()) for k, v in
                       load_file(work / f"{tag}-optim.safetensors").items() if k.endswith("step")})
    result = analyse(read_records(str(run)), killed_at)
    result["warm"] = counters == [float(plan.steps)]
    result["warm_evidence"] = f"final snapshot {final}: AdamW step counters {counters}"
    return result


def run_standard(cluster: Any, plan: Plan, work: Path, dataset: str, tag: str,
                 model_only: bool = False) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"standard{'-model' if model_only else ''}-{tag}"
    log = work / f"{name}.jsonl"
    cfg = _config(plan, work / name, dataset)
    trainer = TorchTrainer(
        standard_train_fn,
        train_loop_config={"cfg": cfg, "log": str(log), "pace_s": plan.pace_s,
                           "model_only": model_only},
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"{name}-{int(time.time())}",
                             storage_path=str(work / "ray"),
                             failure_config=FailureConfig(max_failures=20)),
    )

    def records() -> list[dict[str, Any]]:
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    def current_step() -> int:
        return max((r["step"] for r in records() if r["kind"] == "step"), default=0)

    killed_at = _kill_during(cluster, trainer.fit, current_step, plan)
    result = analyse(records(), killed_at)
    restart = result.pop("_restart")
    result["warm"] = restart.get("restored_opt_step", 0) == restart["step"] > 0
    result["warm_evidence"] = (f"restored AdamW step counter {restart.get('restored_opt_step')} "
                               f"at restored step {restart['step']}")
    return result


def analyse(records: list[dict[str, Any]], killed_at: float) -> dict[str, Any]:
    """Recovery figures from `start`/`step` records (see `trainer.run.metrics`) and the kill
    time."""
    starts = [r for r in records if r["kind"] == "start"]
    steps = [r for r in records if r["kind"] == "step"]
    after = [s for s in starts if s["time"] > killed_at]
    if not after:
        raise RuntimeError("no worker group started after the node loss")
    restart = after[0]
    before = [r["step"] for r in steps if r["attempt"] < restart["attempt"]]
    resumed = [r for r in steps if r["attempt"] >= restart["attempt"]]
    first = min(resumed, key=lambda r: r["time"])
    reached = max(before, default=0)
    return {
        "kill_step": reached,
        "restored_step": restart["step"],
        "steps_redone": reached - restart["step"],
        "restart_s": restart["time"] - killed_at,
        "recovery_s": first["time"] - killed_at,
        "lr_first_step_after": first.get("lr"),
        "world_sizes": [s["world_size"] for s in starts],
        "final_step": max(r["step"] for r in steps),
        "curve": [[r["step"], r["loss"], r["attempt"]] for r in steps],
        "_restart": restart,
    }



def run_one(payload: dict[str, Any]) -> dict[str, str]:
    """One tool in one setting, on a fresh cluster in this process; the result goes to
    payload["out"] (Ray's own output shares stdout)."""
    import ray

    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import NAMESPACE

    setting, tool, plan = payload["setting"], payload["tool"], PLANS[payload["plan"]]
    work, dataset = Path(payload["work"]), payload["data"]
    cluster = LocalCluster(worker_nodes=2, fast_failure_detection=setting == "fast")
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        if tool == "baton":
            result = run_baton(cluster, plan, work, dataset, setting)
        else:
            result = run_standard(cluster, plan, work, dataset, setting,
                                  model_only=tool == "standard-model")
        result.pop("_restart", None)
        if result["world_sizes"][0] != 2:
            result["error"] = f"started on {result['world_sizes'][0]} workers, not 2: not valid"
    except Exception as err:  # noqa: BLE001 - reported in the table, the other runs go on
        result = {"error": f"{type(err).__name__}: {err}"}
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary = {k: v for k, v in result.items() if k != "curve"}
    print(f"[{setting}] {tool}: {summary}", flush=True)
    Path(payload["out"]).write_text(json.dumps(result))
    return {"out": payload["out"]}


if __name__ == "__main__":
    raise SystemExit(worker_main({"run": run_one}))
