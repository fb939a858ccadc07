"""Driver-side checks and set-up of a run directory, done before Ray starts.

Contract:
- `check_run_dir(cfg)` fails fast with `RunDirError` when the run URI cannot be reached or
  written, or when it already holds a run that this recipe cannot continue
  (`check_continuation`); returns the newest committed step (0 if none), so the CLI can say
  "continuing from step N".
- `check_continuation(cfg, fingerprint=..., reschedule=False)` refuses — `RunDirError` naming
  the field, the saved and the new value, and the fix — a recipe that changes what a
  continued run must keep: `seed`, `data.seq_len`, the model's shape (`TENSOR_SHAPE_FIELDS`;
  not for a custom `model_factory`), the optimizer (its state is restored:
  `trainer.optim.optimizer_change`: `optim.name`, a custom
  `optimizer_factory` or not), the dataset (its train split's fingerprint differs from
  the one the newest snapshot's data cursor was made on), or, unless `reschedule`, the
  learning-rate schedule (`trainer.session_log.SCHEDULE_FIELDS`: `steps`, `optim.lr`,
  `optim.warmup_steps`, `optim.min_lr_ratio`, `optim.schedule`, `optim.decay_fraction`;
  the fix names `--reschedule`). Saved values
  come from `run.json`'s `config` (written by the run's first session; the fixed fields never
  change after), the session log for the schedule (`trainer.session_log.saved_schedule`) and
  the newest committed manifest's data cursor. A Hugging Face model's config is part of
  the model: `run.json` records its `config.json` object (`model_config_record`, key
  `hf_model_config`), and a continued run whose `model.hf_config` / `model.init_from` holds
  other content (wherever the file now lives), or that switches between a Hugging Face model
  and the built-in GPT, is refused naming the field and the first key that differs; the fix
  is to restore the file or to fork into a new run directory (`baton fit --from`), whose own
  checks compare tensor shapes. What cannot be read is not held against the
  recipe (doubt never refuses). The driver runs it before Ray starts and every worker's rank 0
  runs it again (`trainer.loop`), so the two refuse exactly the same recipes (a schedule
  change the driver accepted is in the session log before the workers start).
- `held_run_parts(store)` lists what of a run a directory holds; `interrupted_fork(store)`
  says whether that is only what a fork killed before its commit left, which
  `clear_interrupted_fork` removes (`trainer.fork`).
- Before anything else, `check_run_dir` runs `trainer.preflight`'s `check_dataset` and
  `check_local_capacity` (the dataset and a place for the workers).
(`RUN/run.json`, with the recipe and library versions, is written once by the first
worker's `elastic.Snapshotter`.)
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from elastic.coord.generation import GENERATION_NAME
from elastic.store.snapshot_store import SnapshotStore
from trainer.config import ConfigError, FitConfig, hf_source_field, raw_hf_config
from trainer.optim import optimizer_change
from trainer.preflight import (
    check_dataset,
    check_local_capacity,
    data_uri,
    dataset_fingerprint,
    with_dataset_vocab,
)
from trainer.session_log import SESSIONS_NAME, saved_schedule, schedule_changes

# Fields that fix tensor shapes (and what the tensors mean): a continued run and a fork
# (`trainer.fork`) must keep them. `model.*` is skipped for a custom model_factory.
TENSOR_SHAPE_FIELDS = (
    "data.seq_len", "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads",
)
# What a continued run must keep: the shapes, and the seed (it fixes the sample order, which
# the data cursor carries, and the sketches). The schedule may change only when asked
# (`reschedule`); other fields (global_batch, workers, parallelism, ...) freely.
_FIXED_FIELDS = ("seed", *TENSOR_SHAPE_FIELDS)


# run.json's key for a Hugging Face model's config.json object (`model_config_record`).
HF_MODEL_CONFIG_KEY = "hf_model_config"


class RunDirError(ValueError):
    """The run directory is unreachable or holds an incompatible run."""


def held_run_parts(store: SnapshotStore) -> list[str]:
    """What of a run the directory holds (empty: none; a prepared `data/` or a released
    lease is not a run)."""
    found = [n for n in ("run.json", SESSIONS_NAME, GENERATION_NAME)
             if store.exists(store.path(n))]
    if store.all_steps():
        found.append("snapshots/")
    return found


def interrupted_fork(store: SnapshotStore) -> bool:
    """Whether the directory holds only what a fork killed before its commit left: a
    `run.json` recording a parent, no committed snapshot and no session log (a forked run
    that ever trained has both). Nothing there was committed, so nothing is lost by
    replacing it."""
    if store.exists(store.path(SESSIONS_NAME)) or store.committed_steps():
        return False
    info = store.read_run_json()
    return info is not None and isinstance(info.get("parent"), dict)


def clear_interrupted_fork(store: SnapshotStore) -> None:
    """Remove what `interrupted_fork` found, run.json last (the caller holds the lease)."""
    for step in store.all_steps():
        store.delete_step(step)
    for name in (GENERATION_NAME, "run.json"):
        store.remove(store.path(name))
    logging.getLogger("baton.fork").warning(
        "%s: removed what an interrupted fork left (no committed snapshot); forking again",
        store.run_uri)


def _probe_writable(run_uri: str) -> SnapshotStore:
    """Write and delete a small object, through the store the workers will use. Buckets are
    never created here: a mistyped bucket name must be an error, not a new bucket."""
    try:
        store = SnapshotStore(run_uri)
        if store.is_local:
            store.makedirs(store.root)
        elif not store.exists(store.root.split("/", 1)[0]):
            raise FileNotFoundError(f"bucket {store.root.split('/', 1)[0]!r} does not exist")
        probe = store.path(f".baton-probe-{uuid.uuid4().hex[:8]}")
        store.write_file(probe, b"ok", durable=False)
        store.remove(probe)
        return store
    except Exception as err:  # noqa: BLE001 - any failure here means "cannot use this URI"
        raise RunDirError(
            f"snapshots.run_uri {run_uri!r} is not reachable or not writable "
            f"({type(err).__name__}: {err}). For s3:// check the bucket exists and the AWS "
            "credentials/endpoint (AWS_ENDPOINT_URL) are set; for a path, check permissions."
        ) from err


_MISSING = object()


def _field(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return _MISSING
        config = config[part]
    return config


def _saved_cursor(store: SnapshotStore, committed: list[int]) -> dict[str, Any] | None:
    """The data cursor of the newest committed snapshot, or None if it cannot be read."""
    if not committed:
        return None
    try:
        cursor = store.load_manifest(max(committed)).state.get("data")
    except (ValueError, OSError):  # a corrupt newest snapshot is restore's business
        return None
    return cursor if isinstance(cursor, dict) else None


def shape_value(name: str, value: Any) -> Any:
    """`value` of field `name` as the built-in model used it: a `model.vocab_size` of 0 (the
    dataset's, unresolved: a run started by `run_worker` itself) built the byte vocabulary."""
    if name == "model.vocab_size" and value == 0:
        from trainer.model import BYTE_VOCAB_SIZE

        return BYTE_VOCAB_SIZE
    return value


def check_continuation(cfg: FitConfig, *, fingerprint: str | None,
                       store: SnapshotStore | None = None,
                       committed: list[int] | None = None, reschedule: bool = False) -> None:
    """Refuse a recipe that the run at `cfg.snapshots.run_uri` cannot be continued with
    (module docstring); `fingerprint` is the train split's (None: not checked)."""
    store = store or SnapshotStore(cfg.snapshots.run_uri)
    committed = store.committed_steps() if committed is None else committed
    if not committed:
        return  # nothing to continue: a new run may use any recipe
    run_uri = cfg.snapshots.run_uri
    fix = "Use the original value, or another --run-dir to start a new run."
    run_json = store.read_run_json() or {}
    saved_config, wanted = run_json.get("config", {}), cfg.to_dict()
    for name in _FIXED_FIELDS:
        if name.startswith("model.") and cfg.model_factory is not None:
            continue
        saved, new = (shape_value(name, v) for v in (_field(saved_config, name),
                                                      _field(wanted, name)))
        if saved is not _MISSING and saved != new:
            what = ("another seed (it fixes the sample order and the sketches)"
                    if name == "seed" else "a different model")
            raise RunDirError(
                f"{name}: {run_uri} holds a run of {what}: it was made with "
                f"{name} = {json.dumps(saved)}, this recipe asks for {json.dumps(new)}; a "
                f"continued run cannot change it. {fix} (--set {name}={json.dumps(saved)})"
            )
    _refuse_model_config_change(cfg, run_json)
    change = optimizer_change(saved_config, cfg)
    if change is not None:
        name, saved, new = change
        raise RunDirError(
            f"{name}: {run_uri} holds a run trained with {name} = {json.dumps(saved)}, this "
            f"recipe asks for {json.dumps(new)}; its optimizer state (moments, step counters) "
            f"would not fit another optimizer. {fix} (--set {name}={json.dumps(saved)})"
            if name != "optimizer_factory" else
            f"optimizer_factory: {run_uri} holds a run trained with {saved}, this run has "
            f"{new}; its optimizer state would not fit. Build the run's optimizer, or use "
            "another run directory to start a new run.")
    cursor = _saved_cursor(store, committed)
    saved_fp = cursor.get("dataset") if cursor else None
    if saved_fp and fingerprint and saved_fp != fingerprint:
        raise RunDirError(
            f"data.uri: the run in {run_uri} reads the dataset with fingerprint {saved_fp} "
            f"(its data cursor), but {cfg.data.uri or 'the default corpus'} has fingerprint "
            f"{fingerprint} (other content); a continued run cannot change its data. Use the "
            "dataset the run was started on, or another --run-dir to start a new run."
        )
    if not reschedule:
        _refuse_schedule_change(cfg, store, max(committed), run_json)


def model_config_record(cfg: FitConfig) -> dict[str, Any]:
    """What `run.json` records of the model beyond the recipe: a Hugging Face model's
    `config.json` object under `HF_MODEL_CONFIG_KEY` (the file's content, not its path, which
    may differ between machines); `{}` for the built-in GPT or a `model_factory`."""
    if cfg.model_factory is not None or not cfg.model.is_hf:
        return {}
    field_name, path = hf_source_field(cfg.model.hf_config, cfg.model.init_from)
    return {HF_MODEL_CONFIG_KEY: raw_hf_config(path, field_name)}


def _refuse_model_config_change(cfg: FitConfig, run_json: dict[str, Any]) -> None:
    """A continued run keeps its Hugging Face model config (module docstring)."""
    if cfg.model_factory is not None:
        return
    run_uri = cfg.snapshots.run_uri
    saved = run_json.get(HF_MODEL_CONFIG_KEY)
    saved_model = _field(run_json.get("config", {}), "model")
    saved_builtin = (isinstance(saved_model, dict) and saved_model.get("hf_config") == ""
                     and saved_model.get("init_from") == ""
                     and _field(run_json.get("config", {}), "model_factory") is None)
    fix = (f"Restore the model's config, or fork the run into a new run directory "
           f"(baton fit RECIPE --from {run_uri} --run-dir NEW_DIR).")
    if not cfg.model.is_hf:
        if isinstance(saved, dict):
            raise RunDirError(
                f"model.hf_config: {run_uri} holds a run of a Hugging Face model "
                f"(model_type {json.dumps(saved.get('model_type'))}), this recipe builds the "
                f"built-in GPT; a continued run cannot change its model. {fix}")
        return
    field_name, path = hf_source_field(cfg.model.hf_config, cfg.model.init_from)
    if saved_builtin:
        raise RunDirError(
            f"{field_name}: {run_uri} holds a run of the built-in GPT, this recipe builds the "
            f"Hugging Face model of {path}; a continued run cannot change its model. {fix}")
    if not isinstance(saved, dict):
        return  # a run.json from before this record: nothing to compare with
    try:
        new = raw_hf_config(path, field_name)
    except ConfigError:
        return  # the recipe's own checks report an unreadable config
    if new == saved:
        return
    key = next(k for k in sorted({*saved, *new})
               if saved.get(k, _MISSING) != new.get(k, _MISSING))
    raise RunDirError(
        f"{field_name}: {run_uri} holds a run of another model config: it was made with "
        f"{key} = {_brief(saved, key)} in its config.json, {path} has {_brief(new, key)}; a "
        f"continued run cannot change the model's config. {fix}")


def _brief(config: dict[str, Any], key: str, limit: int = 60) -> str:
    """`config[key]` for a one-line message (`absent` when the key is not there)."""
    text = json.dumps(config[key]) if key in config else "absent"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refuse_schedule_change(cfg: FitConfig, store: SnapshotStore, step: int,
                            run_json: dict[str, Any]) -> None:
    """A continued run keeps its learning-rate schedule unless asked: changing `steps` or
    `lr` would silently move the learning rate of every step from here."""
    changes = schedule_changes(saved_schedule(store, step, run_json), cfg)
    if not changes:
        return
    name, saved, new = changes[0]
    raise RunDirError(
        f"{name}: the run in {cfg.snapshots.run_uri} was trained to committed step {step} "
        f"with {name} = {json.dumps(saved)}, this recipe asks for {json.dumps(new)}; that "
        "changes its learning-rate schedule from here. Pass --reschedule to accept it (from "
        "Python: trainer.session_log.accept_schedule(cfg)), or keep it: "
        f"--set {name}={json.dumps(saved)}"
    )


def check_run_dir(cfg: FitConfig, *, reschedule: bool = False) -> int:
    """All of the pre-flight checks above; returns the newest committed step (0 if none).
    `reschedule` accepts a change of the learning-rate schedule (`baton fit --reschedule`)."""
    check_dataset(cfg)
    check_local_capacity(cfg)
    store = _probe_writable(cfg.snapshots.run_uri)
    committed = store.committed_steps()
    if not committed:
        _refuse_quarantined_only(cfg, store)
    uri = data_uri(cfg)  # an empty data.uri: the corpus `ensure_dataset` prepared
    # run.json holds the vocab the driver resolved: compare it with this recipe's, resolved.
    check_continuation(with_dataset_vocab(cfg, uri) if committed else cfg,
                       fingerprint=dataset_fingerprint(uri) if committed else None,
                       store=store, committed=committed, reschedule=reschedule)
    return max(committed, default=0)


def _refuse_quarantined_only(cfg: FitConfig, store: SnapshotStore) -> None:
    """A run whose every snapshot was rejected must not quietly start again from step 0:
    the quarantined snapshots are the run's only trained state, and a person decides."""
    rows = store.quarantined()
    if not rows:
        return
    newest = rows[-1]
    raise RunDirError(
        f"snapshots.run_uri {cfg.snapshots.run_uri!r} has no committed snapshot, but "
        f"{len(rows)} quarantined (newest: step {newest['step']}: {newest['reason']}). "
        f"Inspect {newest['where']}; to start this run over, move the quarantine/ directory "
        "away (or use another --run-dir)."
    )
