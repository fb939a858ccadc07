"""The Ray wing of `trainer`: every module of the package that imports Ray lives here.

- `ray_fit`: `fit(config)`, Baton's own loop on Ray Train; `elastic_trainer`: the drop-in
  `ElasticTorchTrainer` (lease, coordinator, restart policy, snapshot-before-resize);
- `scaling` (restart policies), `resize` (snapshot before a planned resize), `monitor` (the run's
  progress actor), `ray_messages` (Ray's driver-side messages to a log file);
- `local_cluster` and `demo`: the local multi-node cluster and the elastic demo.

Every Baton actor and driver lives in one Ray namespace, `elastic.coord.ray_actors.NAMESPACE`
(the coordinator's module defines it; the monitor, the fit and the demo use that one).

The rest of `trainer` (config, the loop, the session, the CLI) imports nothing from Ray at
module level, so recipes can be checked and the CLI can answer without starting it.
Import rule (`tests/project/test_imports.py`): this room sits above the driver
(`trainer.run`) and the worker (`trainer.train`) and below the commands (`trainer.cli`).
"""
