"""A Ray Data pipeline read by Baton against Ray's own `iter_torch_batches`, in one run.

The pipeline: FILES parquet files of ROWS_PER_FILE rows (an id and 64 float32 features) read
with `read_parquet` and preprocessed by `map_batches` (standardise, a 64x64 projection, a
tanh): what a tabular or embedding pipeline does, on a local Ray (2 CPUs). One consumer
(world size 1: the cost of the reading path, not of training), global batch 256.

- Throughput: rows/s over one epoch through `StreamShareLoader` (a feeder in this process,
  `data_state.local_feeder`, made before the clock starts: a run lists its files once, when
  its feeder starts, not every epoch; that start is reported on its own) against
  `ds.iter_torch_batches(batch_size=256)` on the same pipeline (its start, listing included,
  timed: Ray starts the pipeline every epoch), alternating which goes first, ROUNDS rounds;
  the ratio per round (goal >= 0.9).
- Time to the first batch of a resume mid-epoch, at 10 %, 50 % and 90 % of the epoch: Baton
  restores the state saved there (a fresh feeder: it lists the files and reads the unit the
  position stands in) against reaching the same batch by skipping the batches before it in
  a fresh `iter_torch_batches` (what a Ray loop does by hand). Goal: independent of how far.
- Memory: the peak resident set of this process while each side reads an epoch, from the
  resident set at its start: Baton with its feeder in this process (it keeps at most 4 units
  of preprocessed rows), Baton as a Ray Train worker reads (the feeder an actor of its own:
  this process holds its step shares only), Ray's iterator (its blocks in the object store).

    python -m benchmarks.ray_data.run          # writes benchmarks/results/ray_data.json
    python -m benchmarks.ray_data.run --quick  # fewer files and rounds (smoke run)
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    RESULTS,
    alternating,
    arg_parser,
    ratios,
    reset_peak_rss,
    spread,
    status_bytes,
    write_json,
)

DEFAULT_OUT = RESULTS / "ray_data.json"
FEATURES, BATCH = 64, 256


def _write_files(root: Path, files: int, rows: int) -> None:
    rng = np.random.default_rng(0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    for i in range(files):
        x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
        columns = {"id": np.arange(i * rows, (i + 1) * rows),
                   **{f"f{j}": x[:, j] for j in range(FEATURES)}}
        pq.write_table(pa.table(columns), root / f"part-{i:04d}.parquet")


def _preprocess(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    x = np.stack([batch[f"f{j}"] for j in range(FEATURES)], axis=1)
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    w = np.random.default_rng(1).normal(size=(FEATURES, FEATURES)).astype(np.float32)
    return {"id": batch["id"], "x": np.tanh(x @ w).astype(np.float32)}


def _pipeline(root: Path) -> Any:
    import ray.data

    return ray.data.read_parquet(str(root)).map_batches(_preprocess)


def _baton_loader(root: Path, state: dict[str, Any] | None = None, feeder: Any = None) -> Any:
    from data_state import StreamShareLoader, local_feeder

    owned = feeder is None
    feeder = local_feeder(_pipeline(root)) if owned else feeder
    loader = StreamShareLoader(feeder, units=feeder.units, fingerprint=feeder.fingerprint,
                               global_batch=BATCH, seed=0, owns_feeder=owned)
    if state is not None:
        loader.load_state_dict(state)
    return loader


def _baton_epoch(root: Path, steps: int, starts: list[float] | None = None
                 ) -> tuple[float, int]:
    """Seconds and rows of `steps` steps (one epoch) through Baton's loader, from a feeder
    that has listed the files (how long that took goes to `starts`)."""
    began = time.perf_counter()
    rows = 0
    with _baton_loader(root) as loader:
        start = time.perf_counter()
        if starts is not None:
            starts.append(start - began)
        for _ in range(steps):
            rows += len(loader.next_step().sample_indices)
            loader.advance()
        return time.perf_counter() - start, rows


def _worker_epoch(root: Path, steps: int) -> None:
    """One epoch as a Ray Train worker reads it: through a feeder actor."""
    import ray

    from data_state import FeederClient, create_feeder

    actor = create_feeder(_pipeline(root), "baton-bench-feeder")
    try:
        with _baton_loader(root, feeder=FeederClient(actor)) as loader:
            for _ in range(steps):
                loader.next_step()
                loader.advance()
    finally:
        ray.kill(actor)


def _ray_epoch(root: Path) -> tuple[float, int]:
    start = time.perf_counter()
    rows = sum(len(b["id"]) for b in _pipeline(root).iter_torch_batches(batch_size=BATCH))
    return time.perf_counter() - start, rows


def _peak_rss(run: Any) -> int:
    """Bytes the resident set grew by at most while `run()` ran."""
    reset_peak_rss()
    before = status_bytes("VmRSS")
    run()
    return status_bytes("VmHWM") - before


def _state_at(root: Path, step: int) -> dict[str, Any]:
    with _baton_loader(root) as loader:
        for _ in range(step):
            loader.next_step()
            loader.advance()
        state: dict[str, Any] = loader.state_dict()
    return state


def _baton_first_batch(root: Path, state: dict[str, Any]) -> float:
    start = time.perf_counter()
    with _baton_loader(root, state) as loader:
        loader.next_step()
        return time.perf_counter() - start


def _skipping_first_batch(root: Path, step: int) -> float:
    start = time.perf_counter()
    for i, _ in enumerate(_pipeline(root).iter_torch_batches(batch_size=BATCH)):
        if i == step:
            break
    return time.perf_counter() - start


def main() -> None:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    files, rows_per_file, rounds = (8, 4096, 2) if args.quick else (24, 8192, 3)

    import ray
    import ray.data

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ray.cloudpickle.register_pickle_by_value(__import__(__name__))
    result: dict[str, Any] = {"machine": f"{platform.node()}, {os.cpu_count()} CPUs",
                              "files": files, "rows_per_file": rows_per_file,
                              "global_batch": BATCH, "rounds": rounds}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write_files(root, files, rows_per_file)
        total = files * rows_per_file
        steps = -(-total // BATCH)
        _ray_epoch(root)  # warm-up: worker processes, imports
        seconds: dict[str, list[float]] = {"baton": [], "ray": []}
        starts: list[float] = []
        for r in range(rounds):
            for side in alternating(["baton", "ray"], r):
                took, rows = _baton_epoch(root, steps, starts) if side == "baton" \
                    else _ray_epoch(root)
                assert rows == total, (side, rows, total)
                seconds[side].append(took)
                print(f"round {r} {side}: {total / took:,.0f} rows/s", flush=True)
        rate = {side: [total / s for s in values] for side, values in seconds.items()}
        result["throughput_rows_per_s"] = {side: spread(v) for side, v in rate.items()}
        result["throughput_ratio_baton_over_ray"] = ratios(rate["baton"], rate["ray"])
        result["baton_feeder_start_s"] = spread(starts)

        resume: dict[str, Any] = {}
        for fraction in (0.1, 0.5, 0.9):
            step = int(steps * fraction)
            state = _state_at(root, step)
            baton, skipping = [], []
            for r in range(rounds):
                for side in alternating(["baton", "skip"], r):
                    if side == "baton":
                        baton.append(_baton_first_batch(root, state))
                    else:
                        skipping.append(_skipping_first_batch(root, step))
            resume[f"{fraction:.0%}"] = {"step": step, "baton_s": spread(baton),
                                         "skipping_s": spread(skipping),
                                         "ratio_skipping_over_baton": ratios(skipping, baton)}
            print(f"resume at {fraction:.0%} (step {step}): baton "
                  f"{spread(baton)['median']:.2f} s, skipping "
                  f"{spread(skipping)['median']:.2f} s", flush=True)
        result["first_batch_after_resume"] = resume
        result["peak_rss_growth_mib"] = {
            "baton": _peak_rss(lambda: _baton_epoch(root, steps)) / 2**20,
            "baton_worker_with_feeder_actor": _peak_rss(lambda: _worker_epoch(root, steps))
            / 2**20,
            "ray": _peak_rss(lambda: _ray_epoch(root)) / 2**20,
            "one_unit_mib": rows_per_file * (FEATURES + 2) * 4 / 2**20,
        }
    ray.shutdown()
    print(write_json(args.out, result))


if __name__ == "__main__":
    main()
