"""Driver-side checks and set-up of a run directory, done before Ray starts.

Contract:
- `check_run_dir(cfg)` fails fast with `RunDirError` when the run URI cannot be reached or
  written, or when it already holds a run of a different model (the shapes recorded in its
  `run.json` differ from the recipe's); returns the newest committed step (0 if none), so the
  CLI can say "continuing from step N".
- `ensure_dataset(cfg)` returns the config with `data.uri` set: an empty `data.uri` means the
  embedded default corpus, prepared once into `RUN/data` (later sessions reuse it).
(`RUN/run.json`, with the recipe and library versions, is written once by the first
worker's `elastic.Snapshotter`.)
"""

from __future__ import annotations

import dataclasses
import uuid

import fsspec

from elastic.store import SnapshotStore
from trainer.config import FitConfig

# The parts of a config that fix tensor shapes: a run directory holding snapshots made with
# other values cannot be continued with this config.
_SHAPE_FIELDS = ("model", "data.seq_len")


class RunDirError(ValueError):
    """The run directory is unreachable or holds an incompatible run."""


def _probe_writable(run_uri: str) -> SnapshotStore:
    """Write and delete a small object, through the store the workers will use. Buckets are
    never created here: a mistyped bucket name must be an error, not a new bucket."""
    try:
        store = SnapshotStore(run_uri)
        if store.is_local:
            store.fs.makedirs(store.root, exist_ok=True)
        elif not store.fs.exists(store.root.split("/", 1)[0]):
            raise FileNotFoundError(f"bucket {store.root.split('/', 1)[0]!r} does not exist")
        probe = store.path(f".baton-probe-{uuid.uuid4().hex[:8]}")
        store.write_file(probe, b"ok", durable=False)
        store.fs.rm(probe)
        return store
    except Exception as err:  # noqa: BLE001 - any failure here means "cannot use this URI"
        raise RunDirError(
            f"snapshots.run_uri {run_uri!r} is not reachable or not writable "
            f"({type(err).__name__}: {err}). For s3:// check the bucket exists and the AWS "
            "credentials/endpoint (AWS_ENDPOINT_URL) are set; for a path, check permissions."
        ) from err


def _shape_config(cfg_dict: dict) -> dict:
    return {"model": cfg_dict.get("model"), "seq_len": cfg_dict.get("data", {}).get("seq_len")}


def check_run_dir(cfg: FitConfig) -> int:
    store = _probe_writable(cfg.snapshots.run_uri)
    committed = store.committed_steps()
    run_json = store.read_run_json()
    if committed and run_json and cfg.model_factory is None:
        saved = _shape_config(run_json.get("config", {}))
        wanted = _shape_config(cfg.to_dict())
        if saved != wanted:
            raise RunDirError(
                f"snapshots.run_uri {cfg.snapshots.run_uri!r} holds a run of a different model: "
                f"it was made with {saved}, this recipe asks for {wanted}. Use another "
                "--run-dir, or the recipe the run was started with."
            )
    return max(committed, default=0)


def ensure_dataset(cfg: FitConfig) -> FitConfig:
    if cfg.data.uri:
        return cfg
    from data_state import prepare_corpus

    uri = f"{cfg.snapshots.run_uri.rstrip('/')}/data"
    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.exists(f"{root}/dataset.json"):
        prepare_corpus(
            None, uri, seq_len=cfg.data.seq_len, max_bytes=cfg.data.max_corpus_bytes or None
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, uri=uri))
