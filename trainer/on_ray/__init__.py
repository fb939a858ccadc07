"""The Ray wing of `trainer`: every module of the package that imports Ray lives here.

- `ray_fit`: `fit(config)`, Baton's own loop on Ray Train; `elastic_trainer`: the drop-in
  `ElasticTorchTrainer` (lease, coordinator, restart policy, snapshot-before-resize);
- `scaling` (restart policies), `resize` (snapshot before a planned resize), `monitor` (the run's
  progress actor), `ray_messages` (Ray's driver-side messages to a log file);
- `replica_groups` (one Ray Train replica group per worker: a lost one is replaced alone) and
  `grow_in_place` (workers added to the running group), `train_fn` (Ray Train's calls inside a
  worker), `failures` (which errors restart);
- `local_cluster` and `demo`: the local multi-node cluster and the elastic demo.

Every Baton actor and driver lives in one Ray namespace, `elastic.coord.ray_actors.NAMESPACE`
(the coordinator's module defines it; the monitor, the fit and the demo use that one).

The rest of `trainer` (config, the loop, the session, the CLI) imports nothing from Ray at
module level, so recipes can be checked and the CLI can answer without starting it.
Import rule (`tests/project/test_imports.py`): this room sits above the driver
(`trainer.run`) and the worker (`trainer.train`) and below the commands (`trainer.cli`),
which import the names below; each loads on first use, so importing this room starts no Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.on_ray.demo import run_demo
    from trainer.on_ray.elastic_trainer import ElasticTorchTrainer
    from trainer.on_ray.failures import RunFailedError
    from trainer.on_ray.monitor import RunFeed
    from trainer.on_ray.ray_fit import FitResult, connect_ray, fit
    from trainer.on_ray.ray_messages import ray_log_path, ray_log_root, ray_messages_to

# Loaded on first use (PEP 562): the module that defines each name.
_LAZY = {
    "run_demo": "trainer.on_ray.demo",
    "ElasticTorchTrainer": "trainer.on_ray.elastic_trainer",
    "RunFailedError": "trainer.on_ray.failures",
    "RunFeed": "trainer.on_ray.monitor",
    "FitResult": "trainer.on_ray.ray_fit",
    "connect_ray": "trainer.on_ray.ray_fit",
    "fit": "trainer.on_ray.ray_fit",
    "ray_log_path": "trainer.on_ray.ray_messages",
    "ray_log_root": "trainer.on_ray.ray_messages",
    "ray_messages_to": "trainer.on_ray.ray_messages",
}

__all__ = ["ElasticTorchTrainer", "FitResult", "RunFailedError", "RunFeed", "connect_ray", "fit",
           "ray_log_path", "ray_log_root", "ray_messages_to", "run_demo"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.on_ray' has no attribute {name!r}")
    # Looked up each time, not cached here: the name stays its module's (a patch is seen).
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
