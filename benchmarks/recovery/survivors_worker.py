"""One run of `benchmarks/recovery/survivors.py`, on a fresh local Ray cluster in this process.

    python -m benchmarks.recovery.survivors_worker run '{"mode": "in-process"|"restart"|
        "torchft", "kill": true|false, "work": DIR, "out": RESULT.json, "pace_s": 0.1}'
    ... '{"mode": "in-process"|"restart", "grow": true, ...}'   # benchmarks/recovery/growth.py

A head with no CPUs and 3 worker nodes of 1 logical CPU (`trainer.on_ray.local_cluster`, fast
failure detection: GCS health checks 1 s x 3, `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S` 0.5). Three
workers train `benchmarks.recovery.survivors_loops`: "in-process" and "restart" are Baton's
loop on `ElasticTorchTrainer` with in-process recovery on and off, "torchft" the same model on
torchft under Ray's `TorchftConfig`. With `kill`, once a worker logs step KILL_AT the node of a
worker is removed ungracefully (`Cluster.remove_node`) and ADD_AFTER_S later a node is added.
With `grow` the cluster starts with 2 worker nodes (the run at 2 workers, at most 3, a resize
check every second) and once a worker logs step GROW_AT a third node is added (`analyse_growth`).
The per-step logs are turned into the figures of `analyse`; the final state is the run's
`final.safetensors`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import worker_main

KILL_AT = 25
ADD_AFTER_S = 2.0
GROW_AT = 10


def _records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return sorted((json.loads(line) for line in log.read_text().splitlines() if line.strip()),
                  key=lambda r: r["time"])


def _trainer(mode: str, config: dict[str, Any], work: Path, grow: bool = False) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from benchmarks.recovery import survivors_loops as loops

    # Growing: a resize check every second, so the node added is used at once in both modes.
    checks = {"elastic_resize_monitor_interval_s": 1.0} if grow else {}
    scaling = ScalingConfig(num_workers=3 if mode == "torchft" else (1, 3),
                            resources_per_worker={"CPU": 1}, **checks)
    run_config = RunConfig(name=f"{mode}-{int(time.time())}", storage_path=str(work / "ray"),
                           failure_config=FailureConfig(max_failures=10))
    if mode == "torchft":
        from ray.train.torch import TorchTrainer

        return TorchTrainer(loops.torchft_train_fn, train_loop_config=config,
                            scaling_config=scaling, run_config=run_config,
                            torch_config=_torchft_config())
    from trainer import ElasticTorchTrainer
    from trainer.config import RecoveryConfig

    return ElasticTorchTrainer(loops.baton_train_fn, run_uri=str(work / "run"),
                               train_loop_config=config, scaling_config=scaling,
                               run_config=run_config,
                               recovery=RecoveryConfig(in_process=mode == "in-process"))


def _torchft_config() -> Any:
    """Ray's `TorchftConfig`, but its Lighthouse actor asks for no CPU: the local cluster's
    head (where Ray pins it) has none, as a real head node keeps its CPUs off training."""
    import ray
    from ray.train.v2.torch.torchft_config import (
        LighthouseServerActor,
        TorchftConfig,
        _TorchftBackend,
    )
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    class Backend(_TorchftBackend):
        def _maybe_create_lighthouse_actor(self, backend_config: Any) -> str:
            if self.lighthouse_actor is None:
                self.lighthouse_actor = LighthouseServerActor.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                        node_id=ray.get_runtime_context().get_node_id(), soft=False),
                ).remote(lighthouse_kwargs={"bind": "[::]:0", **backend_config.lighthouse_kwargs})
            return ray.get(self.lighthouse_actor.address.remote())

    class Config(TorchftConfig):
        @property
        def backend_cls(self) -> type:
            return Backend

    return Config(lighthouse_kwargs={"min_replicas": 1}, backend="gloo")


def analyse(records: list[dict[str, Any]], killed: float | None) -> dict[str, Any]:
    """What the node loss cost, from the per-step logs (all times in seconds after the kill).
    - survivor_first: the first step a survivor (a process that trained before the kill and
      until the end) completed after it; none when every process was replaced (a restart);
    - longest_gap: the longest time between two steps completed by one survivor across the
      kill; with no survivors, from the last step before it to the new group's first;
    - replacement_first: the first step of a process that joined after the kill;
    - steps_redone: the steps a survivor trained twice; with no survivors, the last step
      reached before the kill minus the first after it, plus one;
    - samples: over each step's last attempt, how many samples of the epoch were trained
      once, never or more than once."""
    out: dict[str, Any] = {"steps": max((r["step"] for r in records), default=0),
                           "killed_at": killed}
    if killed is not None:
        before = [r for r in records if r["time"] < killed]
        after = [r for r in records if r["time"] >= killed]
        old = {r["pid"] for r in before}
        # A survivor trained before the kill and until the end (a worker of a group that
        # restarts may still finish the step it was in, then dies with the others).
        last_step = max(r["step"] for r in records)
        survivors = {r["pid"] for r in after if r["step"] >= last_step} & old
        new = [r for r in after if r["pid"] not in old]
        out["survivor_first"] = (min(r["time"] for r in after if r["pid"] in survivors)
                                 - killed) if survivors else None
        gaps = []
        for pid in survivors:
            times = [r["time"] for r in records if r["pid"] == pid]
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)
                     if a < killed + 60 and b > killed]
        # No survivors (a group restart): from the last step before the kill to the first
        # step of the new group (a worker of the old one may finish its step, then die).
        out["longest_gap"] = max(gaps) if gaps else (
            min((r["time"] for r in new), default=float("nan"))
            - max(r["time"] for r in before))
        out["replacement_first"] = (min(r["time"] for r in new) - killed
                                    if new and survivors else None)
        redone = [len(steps) - len(set(steps)) for steps in (
            [r["step"] for r in records if r["pid"] == pid] for pid in survivors)]
        out["steps_redone"] = max(redone) if redone else max(
            0, max(r["step"] for r in before) - min(r["step"] for r in after) + 1)
    out["samples"] = _samples(records)
    return out


def analyse_growth(records: list[dict[str, Any]], added: float) -> dict[str, Any]:
    """What a node added cost the running workers (times in seconds after the node was added):
    - longest_gap: the longest time between two steps of a process that trained before the
      node came and until the end, after it came; with none (a restart), from the old group's
      last step to the new group's first;
    - joined_first: the first step of a process that started after the node came;
    - at_three: the first step trained by 3 workers;
    - steps_redone, samples: as in `analyse`."""
    before = {r["pid"] for r in records if r["time"] < added}
    last_step = max(r["step"] for r in records)
    kept = {r["pid"] for r in records if r["step"] >= last_step} & before
    new = [r for r in records if r["pid"] not in before]
    gaps = []
    for pid in kept:
        times = [r["time"] for r in records if r["pid"] == pid]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False) if b > added]
    old_last = max(r["time"] for r in records if r["pid"] in before)
    first_new = min((r["time"] for r in new), default=float("nan"))
    redone = [len(steps) - len(set(steps)) for steps in (
        [r["step"] for r in records if r["pid"] == pid] for pid in kept)]
    return {"steps": last_step, "added_at": added,
            "longest_gap": max(gaps) if gaps else first_new - old_last,
            "joined_first": first_new - added,
            "at_three": min((r["time"] for r in records if r["world"] == 3),
                            default=float("nan")) - added,
            "steps_redone": max(redone) if redone else max(
                0, max(r["step"] for r in records if r["pid"] in before)
                - min((r["step"] for r in new), default=last_step) + 1),
            "kept_processes": len(kept), "samples": _samples(records)}


def _samples(records: list[dict[str, Any]]) -> dict[str, int]:
    from benchmarks.recovery.survivors_loops import ITEMS

    last: dict[int, list[dict[str, Any]]] = {}
    for r in records:  # oldest first: a later attempt of a step replaces the earlier
        attempt = last.setdefault(r["step"], [])
        if len(attempt) >= r["world"]:
            attempt.clear()
        attempt.append(r)
    counts: dict[int, int] = {}
    for attempt in last.values():
        for r in attempt:
            for i in r["ids"]:
                counts[i] = counts.get(i, 0) + 1
    return {"once": sum(1 for c in counts.values() if c == 1),
            "more_than_once": sum(1 for c in counts.values() if c > 1),
            "never": ITEMS - len(counts)}


def run_one(payload: dict[str, Any]) -> dict[str, str]:
    import ray
    import ray.cloudpickle

    from benchmarks.recovery import survivors_loops as loops
    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import NAMESPACE

    work = Path(payload["work"])
    work.mkdir(parents=True, exist_ok=True)
    log = work / "steps.jsonl"
    config = {"log": str(log), "final": str(work / "final.safetensors"),
              "pace_s": payload["pace_s"], "snapshot_every": 10}
    grow = bool(payload.get("grow"))
    cluster = LocalCluster(worker_nodes=2 if grow else 3)
    killed: float | None = None
    added: float | None = None
    result: dict[str, Any]
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        ray.cloudpickle.register_pickle_by_value(loops)  # the workers cannot import benchmarks/
        trainer = _trainer(payload["mode"], config, work, grow)
        errors: list[BaseException] = []
        thread = threading.Thread(target=lambda: _fit(trainer, errors), daemon=True)
        thread.start()
        if payload["kill"]:
            _wait_for_step(log, KILL_AT, thread)
            killed = time.time()
            cluster.remove_worker()
            time.sleep(ADD_AFTER_S)
            cluster.add_worker()
        if grow:
            _wait_for_step(log, GROW_AT, thread)
            added = time.time()
            cluster.add_worker()
        thread.join(timeout=900)
        if errors:
            raise errors[0]
        figures = analyse_growth(_records(log), added) if added is not None \
            else analyse(_records(log), killed)
        result = {"mode": payload["mode"], "kill": payload["kill"], "grow": grow, **figures}
    except Exception as err:  # noqa: BLE001 - reported in the table, the other runs go on
        result = {"mode": payload["mode"], "error": f"{type(err).__name__}: {err}"}
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"[{payload['mode']}{' kill' if payload['kill'] else ''}] {result}", flush=True)
    Path(payload["out"]).write_text(json.dumps(result))
    return {"out": payload["out"]}


def _wait_for_step(log: Path, step: int, fit: threading.Thread) -> None:
    """Until a worker logged `step` (at most 300 s, and while the fit runs)."""
    deadline = time.monotonic() + 300
    while max((r["step"] for r in _records(log)), default=0) < step:
        if time.monotonic() > deadline or not fit.is_alive():
            raise RuntimeError(f"step {step} never came")
        time.sleep(0.05)


def _fit(trainer: Any, errors: list[BaseException]) -> None:
    try:
        trainer.fit()
    except BaseException as err:  # noqa: BLE001 - handed to the main thread
        errors.append(err)


if __name__ == "__main__":
    raise SystemExit(worker_main({"run": run_one}))
