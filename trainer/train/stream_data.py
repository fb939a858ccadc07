"""`session.data_loader` over a Ray Data pipeline: which feeder a rank reads it from.

Contract:
- `is_stream(dataset)`: a `ray.data.Dataset`, or the name of one passed to the trainer
  (`ElasticTorchTrainer(datasets={"train": ds})`).
- `stream_shares(dataset, rank=, world_size=, ...)` is the rank's
  `data_state.StreamShareLoader`. A name reads through the run's feeder actor for that dataset
  (`trainer.on_ray.data_feeders`: the driver starts one per dataset, on the head node; each
  unit goes through the pipeline once for every rank). A `Dataset` passed directly reads
  through a feeder in this process (Ray started if it is not: every rank reads every unit).
- Refusals are one-line `UsageError`s naming the setting: an unknown name, a pipeline Baton
  cannot resume (`data_state.pipeline_units`), `num_workers` or `fingerprint` (a pipeline
  runs in Ray Data, and is named by its operators and files), an `on_error` other than
  "raise" or "skip".
"""

from __future__ import annotations

from typing import Any

from data_state import StreamShareLoader
from trainer.train.session_setup import UsageError, current_context

ON_ERROR = ("raise", "skip")


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, str) or type(dataset).__module__.startswith("ray.data")


def stream_shares(dataset: Any, *, rank: int, world_size: int, batch_size: int,
                  microbatch_size: int, seed: int, shuffle: bool, drop_last: bool,
                  collate_fn: Any, dtypes: Any, on_error: str, num_workers: int,
                  fingerprint: str | None) -> StreamShareLoader:
    if num_workers:
        raise UsageError("session.data_loader: num_workers is for map-style datasets; a Ray "
                         "Dataset's pipeline runs in Ray Data (set its concurrency there)")
    if fingerprint is not None:
        raise UsageError("session.data_loader: fingerprint is for map-style datasets; a Ray "
                         "Dataset is named by its operators and files")
    if on_error not in ON_ERROR:
        raise UsageError(f"session.data_loader: on_error must be 'raise' or 'skip', got "
                         f"{on_error!r}")
    try:
        feeder = _feeder(dataset)
        return StreamShareLoader(feeder, units=feeder.units, fingerprint=feeder.fingerprint,
                                 global_batch=batch_size, microbatch_size=microbatch_size,
                                 seed=seed, shuffle=shuffle, drop_last=drop_last,
                                 collate_fn=collate_fn, dtypes=dtypes, on_error=on_error,
                                 rank=rank, world_size=world_size,
                                 owns_feeder=not isinstance(dataset, str))
    except ValueError as err:
        raise UsageError(f"session.data_loader: {err}") from err


def _feeder(dataset: Any) -> Any:
    import ray

    from data_state import FeederClient, local_feeder
    from elastic.coord import NAMESPACE

    if isinstance(dataset, str):
        context = current_context()
        feeders = context.datasets if context is not None else {}
        if dataset not in feeders:
            known = ", ".join(sorted(feeders)) or "none"
            raise UsageError(f"session.data_loader({dataset!r}): no dataset of that name was "
                             f"passed to the trainer (datasets={{...}}; here: {known})")
        return FeederClient(ray.get_actor(feeders[dataset], namespace=NAMESPACE))
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    return local_feeder(dataset)
