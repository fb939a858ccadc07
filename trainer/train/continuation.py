"""What a continued run must keep: the one rule the driver applies before Ray starts
(`trainer.run.run_dir.check_run_dir`) and every worker's rank 0 again (`trainer.train.loop`),
so the two refuse exactly the same recipes.

- `check_continuation(cfg, fingerprint=..., reschedule=False)` raises `RunDirError` (naming the
  field, the saved and the new value, and the fix) for a recipe that changes `seed`,
  `data.seq_len`, the model's shape (`TENSOR_SHAPE_FIELDS`; not for a custom `model_factory`),
  the optimizer (`trainer.train.optim.optimizer_change`), the dataset (its train split's
  fingerprint differs from the newest snapshot cursor's), or, unless `reschedule`, the
  learning-rate schedule (`SCHEDULE_FIELDS`; the fix names `--reschedule`). Saved values come
  from `run.json`'s `config` (written by the first session; the fixed fields never change
  after), the session log (`saved_schedule`) and the newest committed manifest's data cursor.
  A Hugging Face model's `config.json` object is recorded in `run.json` (`model_config_record`,
  `HF_MODEL_CONFIG_KEY`): other content there (wherever the file now lives), or a switch to or
  from the built-in GPT, is refused naming the field and the first key that differs; the fix
  is to restore the file or to fork (`baton fit --from`, whose checks compare tensor shapes).
  What cannot be read is not held against the recipe (doubt never refuses).
- The schedule is a function of the schedule fields (`schedule_of`), so stopping early never
  changes it; a record written before a field existed holds what the run was trained with then
  (`ADDED_LATER`). `saved_schedule(store, step)` is the schedule of the newest session entry
  that started at or before committed `step` (a later, rolled-back session does not count),
  else the first session's `run.json` config; None when neither reads. `schedule_changes`
  lists the fields a recipe changes.
- `read_sessions(store)`: the valid entries of `RUN/sessions.json` (written by
  `trainer.run.session_log`), oldest first. The file is untrusted: an unreadable file or an
  entry without a valid `from_step` and `schedule` is ignored (logged), never a crash.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from elastic.storage import INT64, finite_number
from elastic.store import SnapshotStore
from trainer.config import SCHEDULES, ConfigError, FitConfig, hf_source_field, raw_hf_config
from trainer.train.optim import optimizer_change

log = logging.getLogger("baton.sessions")

SESSIONS_NAME = "sessions.json"
SCHEDULE_FIELDS = ("steps", "optim.lr", "optim.warmup_steps", "optim.min_lr_ratio",
                   "optim.schedule", "optim.decay_fraction")
# Schedule fields younger than the session log, with the value every run had before them.
ADDED_LATER: dict[str, Any] = {"optim.schedule": "cosine", "optim.decay_fraction": 0.2}

# Fields that fix tensor shapes (and what the tensors mean): a continued run and a fork
# (`trainer.run.fork`) must keep them. `model.*` is skipped for a custom model_factory.
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


# ---------------------------------------------------------------------- the check

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
        from trainer.train.model import BYTE_VOCAB_SIZE

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
        "Python: trainer.run.session_log.accept_schedule(cfg)), or keep it: "
        f"--set {name}={json.dumps(saved)}"
    )


# ---------------------------------------------------------------------- schedule

def schedule_of(cfg: FitConfig) -> dict[str, Any]:
    """The recipe's schedule fields, by dotted name."""
    return {"steps": cfg.steps, "optim.lr": cfg.optim.lr,
            "optim.warmup_steps": cfg.optim.warmup_steps,
            "optim.min_lr_ratio": cfg.optim.min_lr_ratio,
            "optim.schedule": cfg.optim.schedule,
            "optim.decay_fraction": cfg.optim.decay_fraction}


def _from_config(config: Any) -> dict[str, Any] | None:
    """The schedule fields of a `run.json` config, or None if any is missing."""
    out: dict[str, Any] = {}
    for name in SCHEDULE_FIELDS:
        value = config
        for part in name.split("."):
            if not isinstance(value, dict) or part not in value:
                value = ADDED_LATER.get(name, _ABSENT)
                break
            value = value[part]
        if value is _ABSENT:
            return None
        out[name] = value
    return out


_ABSENT = object()


def saved_schedule(store: SnapshotStore, step: int,
                   run_json: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The schedule the run was trained with up to committed `step` (module contract)."""
    for entry in reversed(read_sessions(store)):
        if entry["from_step"] <= step:
            return dict(entry["schedule"])
    if run_json is None:
        try:
            run_json = store.read_run_json()
        except (ValueError, OSError):
            return None
    return _from_config((run_json or {}).get("config"))


def schedule_changes(saved: dict[str, Any] | None, cfg: FitConfig
                     ) -> list[tuple[str, Any, Any]]:
    """(field, saved value, recipe value) for each schedule field the recipe changes."""
    if saved is None:
        return []
    wanted = schedule_of(cfg)
    return [(name, saved[name], wanted[name]) for name in SCHEDULE_FIELDS
            if name in saved and _schedule_value(name, saved[name])
            and saved[name] != wanted[name]]


def bounded_number(value: Any) -> bool:
    return finite_number(value) and (not isinstance(value, int) or abs(value) < INT64)


def _schedule_value(name: str, value: Any) -> bool:
    """Whether `value` is one that field `name` can hold (untrusted input)."""
    return value in SCHEDULES if name == "optim.schedule" else bounded_number(value)


# ---------------------------------------------------------------------- the session log

def _valid_entry(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    start, schedule = entry.get("from_step"), entry.get("schedule")
    if not (bounded_number(start) and isinstance(start, int) and start >= 0):
        return False
    if not isinstance(schedule, dict):
        return False
    for name, value in ADDED_LATER.items():
        schedule.setdefault(name, value)
    return all(_schedule_value(n, schedule.get(n)) for n in SCHEDULE_FIELDS)


def read_sessions(store: SnapshotStore) -> list[dict[str, Any]]:
    """The valid entries of `RUN/sessions.json`, oldest first ([] if none can be read)."""
    path = store.path(SESSIONS_NAME)
    try:
        if not store.exists(path):
            return []
        raw = store.read_json(path)  # bounded; a link or a FIFO is refused, never waited on
    except (ValueError, OSError) as err:
        log.warning("%s: unreadable (%s); the session log is ignored", path, err)
        return []
    entries = raw.get("sessions") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        log.warning("%s: not a Baton session log; ignored", path)
        return []
    valid = [e for e in entries if _valid_entry(e)]
    if len(valid) != len(entries):
        log.warning("%s: %d malformed entries ignored", path, len(entries) - len(valid))
    return valid
