"""The Ray wing of `trainer`: every module of the package that imports Ray lives here.

- `ray_fit`: `fit(config)`, Baton's own loop on Ray Train; `elastic_trainer`: the drop-in
  `ElasticTorchTrainer` (lease, coordinator, restart policy, snapshot-before-resize);
- `scaling` (restart policies), `resize` (snapshot before a planned resize), `monitor` (the run's
  progress actor), `ray_messages` (Ray's driver-side messages to a log file);
- `local_cluster` and `demo`: the local multi-node cluster and the elastic demo.

The rest of `trainer` (config, the loop, the session, the CLI) imports nothing from Ray at
module level, so recipes can be checked and the CLI can answer without starting it.
"""
