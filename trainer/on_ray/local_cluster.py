"""A local multi-node Ray cluster for the demo, tests and benchmarks.

Contract: `LocalCluster(worker_nodes=2, cpus_per_node=1)` starts a head (no CPUs, so training
never lands there, as on a real cluster) and that many worker raylets, each a separate set
of Ray processes with *logical* CPUs, via `ray.cluster_utils.Cluster`. `remove_worker()`
kills one worker node ungracefully (a node loss); `add_worker()` adds one (a scale-up).
`shutdown()` ends exactly the processes this cluster started.

Failure detection is tuned for a local machine (`FAST_FAILURE_DETECTION`): Ray's defaults
take ~30-70 s to declare a node dead (missed heartbeats, then the worker-group start
timeout), which would dominate every recovery. Benchmarks that compare with Ray's standard
recipe report both settings.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from ray.cluster_utils import Cluster

# A local cluster must stay on loopback, never the machine's network address. Ray picks
# 127.0.0.1 as every node's (and driver's) address when it believes multi-node clusters are
# unsupported on this OS; that switch is the only knob covering raylets, drivers and the
# fake autoscaler's nodes alike. (Only `ray start --address` refuses to run under it.)
LOOPBACK_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def use_loopback() -> None:
    """Make Ray processes started from here on (and this one) use 127.0.0.1 as node address.

    Only for clusters that live on this machine: a driver joining a real cluster must not call
    it. Ray reads the switch into a constant at import, so set both the environment (for the
    raylets and workers we start) and the constant (for this already-importing process).
    """
    from ray._private import ray_constants

    os.environ.update(LOOPBACK_ONLY_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False

# GCS declares a node dead after 3 missed 1 s health checks; Ray Train gives up on a worker
# group that cannot start within 15 s (instead of 60 s) and re-plans at the new size.
FAST_FAILURE_DETECTION: dict[str, Any] = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_failure_threshold": 3,
}
FAST_TRAIN_ENV = {
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1",
}


class LocalCluster:
    def __init__(
        self,
        worker_nodes: int = 2,
        cpus_per_node: float = 1,
        *,
        fast_failure_detection: bool = True,
        object_store_bytes: int = 300 * 1024**2,
    ) -> None:
        use_loopback()
        if fast_failure_detection:
            # Raylets and the actors they start inherit the driver's environment.
            os.environ.update(FAST_TRAIN_ENV)
        self.cpus_per_node = cpus_per_node
        self.object_store_bytes = object_store_bytes
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": object_store_bytes,
                "_system_config": FAST_FAILURE_DETECTION if fast_failure_detection else {},
            },
        )
        self.workers: list[Any] = []
        for _ in range(worker_nodes):
            self.add_worker()
        self.cluster.wait_for_nodes()

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_worker(self) -> Any:
        node = self.cluster.add_node(
            num_cpus=self.cpus_per_node,
            object_store_memory=self.object_store_bytes,
        )
        self.workers.append(node)
        return node

    def remove_worker(self) -> None:
        """Kill the newest worker node, as a spot reclaim would."""
        node = self.workers.pop()
        self.cluster.remove_node(node, allow_graceful=False)

    def drain_worker(self, deadline_s: int = 60) -> None:
        """Announce that the newest worker node will be preempted (a spot notice): Ray
        stops placing work there and Ray Train tells the workers on it."""
        node = self.workers[-1]
        ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        subprocess.run(
            [
                ray_cli, "drain-node", "--address", self.address,
                "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                "--reason-message", "spot instance reclaimed",
                "--deadline-remaining-seconds", str(deadline_s),
            ],
            check=True, capture_output=True, timeout=60,
        )

    def shutdown(self) -> None:
        self.cluster.shutdown()
