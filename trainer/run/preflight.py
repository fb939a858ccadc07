"""Pre-flight checks of what a run needs before Ray starts: a prepared dataset that fits the
recipe, and a place for its workers. The driver runs them (`trainer.run.run_dir.check_run_dir`,
`trainer.on_ray.ray_fit`); each refusal is one `ConfigError` line naming the field and the fix.

Contract:
- `check_dataset(cfg)`: a set `data.uri` must hold a prepared dataset with a train split of
  `data.seq_len` tokens per sequence (local paths and s3://; a missing `dataset.json` is the
  same error). `check_local_capacity(cfg)`: when the fit will start its own local Ray, this
  machine must have `scaling.cpus_per_worker` CPUs (otherwise Ray would wait forever for a
  place for the worker). `check_run_dir` runs both before anything else; both raise
  `ConfigError` naming the field. `check_worker_fits(cfg, nodes, where)` is the same test
  against a Ray cluster's nodes (`trainer.on_ray.ray_fit` runs it after `ray.init`, unless
  the cluster has an autoscaler that can add nodes).
- `model.vocab_size` 0 (the default) is the dataset's vocabulary: `ensure_dataset` sets it
  from `dataset.json` (so the workers and `run.json` see the number) and `check_run_dir`
  resolves it the same way before comparing with a continued run; `check_dataset` refuses a
  set `model.vocab_size` smaller than the dataset's vocabulary, naming both numbers.
- `ensure_dataset(cfg)` returns the config with `data.uri` set: an empty `data.uri` means the
  embedded default corpus, prepared once into `RUN/data` (later sessions reuse it);
  `data_uri(cfg)` is that location without preparing anything.
- `dataset_fingerprint(uri)`: the train split's fingerprint of the dataset at `uri` (what a
  snapshot's data cursor was made on), None if it cannot be read.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping

from elastic.storage import Storage
from trainer.config import ConfigError, FitConfig


def dataset_fingerprint(uri: str) -> str | None:
    """The train split's fingerprint of the dataset at `uri`, or None if it cannot be read
    (a missing or bad dataset is reported by its own check, not as a mismatch)."""
    if not uri:
        return None
    from data_state import read_manifest

    try:
        return read_manifest(uri).fingerprint("train")
    except (ValueError, OSError):
        return None


def check_dataset(cfg: FitConfig) -> None:
    """Refuse (`ConfigError` naming `data.uri`) a set `data.uri` that holds no readable prepared
    dataset, or one whose sequences are not `data.seq_len` tokens long. An empty `data.uri`
    (the default corpus, prepared by `ensure_dataset`) passes."""
    uri = cfg.data.uri
    if not uri:
        return
    from data_state import read_manifest

    fix = "prepare one with `baton data prepare --out URI`, or leave data.uri empty for the " \
          "default corpus"
    try:
        manifest = read_manifest(uri)
    except ValueError as err:  # DatasetError (absent, malformed), unsupported scheme, ...
        raise ConfigError(f"data.uri: {' '.join(str(err).split())}") from err
    except Exception as err:  # noqa: BLE001 - OSError, botocore's: any means "cannot read it"
        raise ConfigError(
            f"data.uri {uri!r} cannot be read ({type(err).__name__}: "
            f"{' '.join(str(err).split())}): check the path, or for s3:// the bucket and the "
            "AWS credentials/endpoint (AWS_ENDPOINT_URL)"
        ) from err
    if "train" not in manifest.splits:
        raise ConfigError(f"data.uri {uri!r} has no train split (splits: "
                          f"{sorted(manifest.splits)}): {fix}")
    if manifest.seq_len != cfg.data.seq_len:
        raise ConfigError(
            f"data.seq_len: the dataset at data.uri {uri!r} stores sequences of "
            f"{manifest.seq_len} tokens, the recipe asks for {cfg.data.seq_len}; set "
            f"data.seq_len = {manifest.seq_len}, or prepare the dataset with --seq-len "
            f"{cfg.data.seq_len}"
        )
    vocab = cfg.model.vocab_size
    if vocab and cfg.model_factory is None and vocab < manifest.vocab_size:
        raise ConfigError(
            f"model.vocab_size: the recipe's model has {vocab} token ids but the dataset at "
            f"data.uri {uri!r} has a vocabulary of {manifest.vocab_size} (tokenizer "
            f"{manifest.tokenizer}); set model.vocab_size = {manifest.vocab_size} or more, or "
            "leave it out (0: the dataset's)"
        )


def with_dataset_vocab(cfg: FitConfig, uri: str) -> FitConfig:
    """`cfg` with `model.vocab_size` set to the vocabulary of the dataset at `uri` when it is
    0 (the default: "the dataset's"); unchanged for a custom model_factory, a set vocab, or
    a dataset that cannot be read (its own check reports that)."""
    if cfg.model.vocab_size or cfg.model_factory is not None or not uri:
        return cfg
    from data_state import read_manifest

    try:
        vocab = read_manifest(uri).vocab_size
    except (ValueError, OSError):
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


def check_worker_fits(cfg: FitConfig, nodes: list[Mapping[str, float]], where: str) -> None:
    """Refuse (`ConfigError`) a worker that none of `nodes` (their total resources, as in
    `ray.nodes()[i]["Resources"]`) can hold: `scaling.cpus_per_worker` CPUs, and a GPU when
    `scaling.use_gpu`. Without an autoscaler Ray would otherwise wait forever to place it.
    `where` names the nodes in the message ("this machine", "the Ray cluster")."""
    scaling = cfg.scaling
    if scaling.use_gpu:
        nodes = [n for n in nodes if n.get("GPU", 0.0) >= 1]
        if not nodes:
            raise ConfigError(
                f"scaling.use_gpu: no node of {where} has a GPU; set scaling.use_gpu = false "
                "to train on CPUs, or add GPU nodes"
            )
    most = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    if scaling.cpus_per_worker > most:
        kind = "GPU node" if scaling.use_gpu else "node"
        raise ConfigError(
            f"scaling.cpus_per_worker: a worker needs {scaling.cpus_per_worker:g} CPUs but no "
            f"{kind} of {where} has more than {most:g}, so it could never be placed; set "
            f"scaling.cpus_per_worker <= {most:g}"
            + ("" if where == "this machine" else ", or add bigger nodes")
        )


def check_local_capacity(cfg: FitConfig) -> None:
    """When the fit will start a local Ray of its own (no `RAY_ADDRESS` and no Ray initialized
    in this process), refuse a worker this machine cannot hold, before Ray starts."""
    if os.environ.get("RAY_ADDRESS"):
        return  # an existing cluster: trainer.on_ray.ray_fit checks its nodes after ray.init
    # Look Ray up rather than import it: this module must not start or load Ray.
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return  # connected already (the demo, tests): trainer.on_ray.ray_fit checks that cluster
    check_worker_fits(cfg, [{"CPU": float(os.cpu_count() or 1), "GPU": float("inf")}],
                      "this machine")  # GPUs are counted once Ray has started


def data_uri(cfg: FitConfig) -> str:
    """Where the run's dataset is: `data.uri`, or when it is empty the default corpus that
    `ensure_dataset` prepares into `RUN/data`."""
    return cfg.data.uri or f"{cfg.snapshots.run_uri.rstrip('/')}/data"


def ensure_dataset(cfg: FitConfig) -> FitConfig:
    if cfg.data.uri:
        return with_dataset_vocab(cfg, cfg.data.uri)
    from data_state import prepare_corpus

    uri = data_uri(cfg)
    io = Storage(uri)
    if not io.exists(io.path("dataset.json")):
        prepare_corpus(
            None, uri, seq_len=cfg.data.seq_len, max_bytes=cfg.data.max_corpus_bytes or None
        )
    return with_dataset_vocab(
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, uri=uri)), uri)
