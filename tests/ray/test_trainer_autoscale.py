"""A fit on an autoscaling cluster grows from min_workers to max_workers as nodes arrive.

The cluster is Ray's fake multi-node provider driven by a config derived from cluster.yaml:
the same worker node type (`gpu_spot_worker`) and head resources, the worker's GPU replaced
by one logical CPU (this machine has none) and the counts scaled down to min 1 / max 2.
The provider launches the minimum at start; Ray Train's elastic policy asks the autoscaler
for max_workers, the autoscaler launches the second node, and the running group grows to 2
in place (`trainer.on_ray.grow_in_place`): the first worker keeps its process and never
stops, the new one joins at a step boundary with its state, nothing is redone, and every
sample is trained once.

Capacity arrives late, as spot capacity does: the config starts with the worker type
capped at 1 node and is raised to 2 once the group has started (the autoscaler re-reads
its config file on every update). Without that, the second node can come up before Ray
Train first sizes the group, and the run would start at 2 — the test would then not show
a resize at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray_harness import (
    ROOT,
    RayHead,
    free_port,
    non_loopback_listeners,
    ray_client_env,
    start_head,
)

from elastic.store.snapshot_store import SnapshotStore
from trainer.run.metrics import read_records, summarize

WORKER_TYPE = "gpu_spot_worker"
FAKE_HEAD_TYPE = "ray.head.default"  # ray.autoscaler._private.fake_multi_node's head type
MIN_WORKERS, MAX_WORKERS = 1, 2
STEPS = 200
SNAPSHOT_EVERY = 10
# >= 40 s of training at 1 worker: time for the autoscaler to add a node (~2 s here) and for
# Ray Train to notice it (resize_interval_s) before the run would end at its first size.
PACE_S = 0.2
FIT_TIMEOUT_S = 420

# Keys the autoscaler indexes even when a provider does not use them.
_EMPTY_KEYS: dict[str, Any] = {
    "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
    "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
}


def fake_cluster_config(cluster_yaml: Path, gcs_port: int, max_workers: int) -> dict[str, Any]:
    """cluster.yaml's node types on the fake provider: CPU-only, min 1 / `max_workers`."""
    real = yaml.safe_load(cluster_yaml.read_text())
    head_type = real["head_node_type"]
    assert set(real["available_node_types"]) == {head_type, WORKER_TYPE}, (
        "cluster.yaml's node types changed: update this test's derived config"
    )
    head = real["available_node_types"][head_type]
    node_types = {
        # The fake provider tags its head node with this fixed type name, whatever the
        # config calls it; under another name the autoscaler ignores the head's resources.
        FAKE_HEAD_TYPE: {"resources": head["resources"], "node_config": {}, "max_workers": 0},
        WORKER_TYPE: {"resources": {"CPU": 1}, "node_config": {},
                      "min_workers": MIN_WORKERS, "max_workers": max_workers},
    }
    return {
        "cluster_name": f"{real['cluster_name']}-fake",
        "max_workers": max_workers,
        "upscaling_speed": real["upscaling_speed"],
        "idle_timeout_minutes": real["idle_timeout_minutes"],
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            # Without it the fake nodes join GCS port 6379, whoever runs there.
            "gcs_address": f"127.0.0.1:{gcs_port}",
        },
        "available_node_types": node_types,
        "head_node_type": FAKE_HEAD_TYPE,
        **_EMPTY_KEYS,
    }


def write_config(path: Path, gcs_port: int, max_workers: int) -> None:
    """Replace the autoscaler's config atomically (it may read the file at any moment)."""
    config = fake_cluster_config(ROOT / "cluster.yaml", gcs_port, max_workers)
    partial = path.with_suffix(".partial")
    partial.write_text(yaml.safe_dump(config))
    partial.replace(path)


@dataclass
class AutoscalingCluster:
    head: RayHead
    config_path: Path

    def set_max_workers(self, max_workers: int) -> None:
        write_config(self.config_path, self.head.port, max_workers)


@pytest.fixture
def autoscaling_cluster(tmp_path: Path) -> Iterator[AutoscalingCluster]:
    # The head's GCS port must be in the config before the head starts: choose it first.
    port = free_port()
    config_path = tmp_path / "fake-cluster.yaml"
    write_config(config_path, port, max_workers=MIN_WORKERS)
    head = start_head(
        num_cpus=0,
        port=port,
        autoscaling_config=config_path,
        extra_env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"},
    )
    try:
        yield AutoscalingCluster(head, config_path)
    finally:
        head.stop()


# The CLI has no pacing option; the Python API does (a fake node is as fast as a laptop).
_FIT_SCRIPT = """
import json, sys
from trainer.config import load_recipe
from trainer.on_ray.ray_fit import fit
cfg = load_recipe("recipes/tiny.toml", json.loads(sys.argv[1]))
result = fit(cfg, pace_s=float(sys.argv[2]), record_samples=True)
print("SUMMARY " + json.dumps(result.summary.to_dict()))
print("MEMBERSHIP " + json.dumps(result.membership))
"""


def _wait_for_first_start(run: Path, fit: subprocess.Popen, log_path: Path,
                          timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and fit.poll() is None:
        starts = [r for r in read_records(str(run)) if r["kind"] == "start"]
        if starts:
            return starts[0]
        time.sleep(0.5)
    raise AssertionError("the fit never started a worker group:\n"
                         + log_path.read_text(errors="replace")[-6000:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_grows_from_min_to_max_workers_as_the_autoscaler_adds_a_node(
    autoscaling_cluster: AutoscalingCluster, tmp_path: Path
) -> None:
    head = autoscaling_cluster.head
    run = tmp_path / "run"
    overrides = [
        f"snapshots.run_uri={json.dumps(str(run))}",
        f"steps={STEPS}",
        f"scaling.min_workers={MIN_WORKERS}",
        f"scaling.max_workers={MAX_WORKERS}",
        "scaling.resize_interval_s=1.0",
        f"snapshots.snapshot_every={SNAPSHOT_EVERY}",
        "eval.every=100",
    ]
    log_path = tmp_path / "fit.log"
    with open(log_path, "wb") as log:  # a file, not a pipe: nobody reads while it runs
        fit = subprocess.Popen(
            [sys.executable, "-c", _FIT_SCRIPT, json.dumps(overrides), str(PACE_S)],
            cwd=ROOT, env=ray_client_env(head), stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        first = _wait_for_first_start(run, fit, log_path, FIT_TIMEOUT_S)
        # Only the minimum was up: the group started at 1 of the 2 workers it asks for.
        assert (first["step"], first["world_size"]) == (0, MIN_WORKERS), first
        autoscaling_cluster.set_max_workers(MAX_WORKERS)  # capacity arrives
        fit.wait(timeout=FIT_TIMEOUT_S)
    finally:
        if fit.poll() is None:
            fit.kill()
            fit.wait()
    output = log_path.read_text(errors="replace")[-6000:]
    assert fit.returncode == 0, output
    assert non_loopback_listeners(head.pids()) == []

    records = read_records(str(run))
    summary = summarize(records)
    # The group grew in place: one start, then the new worker joined the running one, whose
    # process is the member that started (a member id holds its node and process id).
    assert summary.restarts == 0 and summary.world_sizes == [MIN_WORKERS, MAX_WORKERS], (
        summary, output)
    assert summary.replacements_joined == 1 and summary.steps_redone == 0, summary
    membership = json.loads(next(line for line in output.splitlines()
                                 if line.startswith("MEMBERSHIP "))[len("MEMBERSHIP "):])
    history = membership["history"]
    assert [h["reason"] for h in history] == ["start", "join"], history
    first, grown = (h["members"] for h in history)
    assert len(first) == MIN_WORKERS and grown[:MIN_WORKERS] == first, history
    assert len(grown) == MAX_WORKERS, history
    assert max(r["step"] for r in records if r["kind"] == "step"
               and r["world_size"] == MIN_WORKERS) < STEPS  # it grew before the end
    assert summary.steps == STEPS
    assert max(SnapshotStore(str(run)).committed_steps()) == STEPS
    # Every sample of the run trained exactly once, across the growth (P5).
    samples: dict[int, list[int]] = {}
    for record in records:
        if record["kind"] == "step":
            samples[record["step"]] = record["samples"]
    assert sorted(samples) == list(range(1, STEPS + 1))
    trained = [i for ids in samples.values() for i in ids]
    assert len(trained) == len(set(trained)), "a sample trained twice"
