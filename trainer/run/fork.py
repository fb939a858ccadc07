"""Forks: a new run that starts from a committed snapshot of another, optimizer warm.

- `parse_source("RUN@STEP")` splits `baton fit --from`'s value: a run URI and an optional
  committed step (`RUN` alone: its newest committed snapshot; a snapshot's directory
  `RUN/snapshots/000000200`, a `ray.train.Checkpoint`'s, names both).
- `plan_fork(cfg, source, step, data_cursor)` makes every check that needs no writing, before the
  lease and Ray, each failure one `RunDirError` (`ValueError`) line naming field or flag and fix:
  * the source run exists and `step` is one of its committed snapshots (its manifest validated
    as untrusted input, `elastic.format.manifest_check`);
  * the new run directory (`cfg.snapshots.run_uri`) holds no run (no `run.json`, snapshots,
    session log or `generation.json`; a prepared `data/` or a released lease may be there) or
    only what a fork killed before its commit left (`interrupted_fork`), and neither directory
    lies inside the other: a fork never writes into its parent;
  * nothing that fixes a tensor shape changes (`TENSOR_SHAPE_FIELDS` against the parent's
    `run.json`, then every model tensor, built on the meta device, against the snapshot's, so a
    custom `model_factory` too); the optimizer is the parent's (`optimizer_change`); `steps`
    is past the fork step (a fork's step count continues the parent's);
  * `data_cursor`: `keep` needs the same seed and (with `data.uri`) dataset fingerprint; `auto`
    keeps the cursor when both match, else resets it; `reset` starts the data at epoch 0.
  Everything else may change: lr and schedule (and the optimizer's hyper-parameters), steps,
  global batch, world size, parallelism, sketch settings, the data.
- `make_fork(plan, cfg)` (the caller holds the new run's lease) prepares the default corpus when
  `data.uri` is empty, decides the cursor, then copies the snapshot in as the new run's first
  commit: `run.json` (the recipe as the workers record it, `data.uri` and `model.vocab_size`
  resolved; the lineage: parent uri, step, loss, dataset fingerprint, cursor kept or not); each
  shard file, checked and written create-only (`elastic.catalog.copy_shard`, one file in RAM at
  a time); `generation.json` (above the parent's: no shard name is reused); last the manifest
  (the commit; the cursor reset when asked, its data origin, `trainer.train.story`, moved to the
  fork step). On any failure what it wrote is removed; a fork killed before its commit leaves
  files the next fork into that directory removes first (under the lease, logged).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from elastic.catalog import copy_shard
from elastic.coord import GENERATION_NAME
from elastic.format import Manifest
from elastic.snapshot_ref import split_snapshot_dir
from elastic.store import SnapshotStore
from trainer.config import FitConfig
from trainer.run.preflight import dataset_fingerprint, with_dataset_vocab
from trainer.run.run_dir import clear_interrupted_fork, held_run_parts, interrupted_fork
from trainer.train import (
    TENSOR_SHAPE_FIELDS,
    RunDirError,
    model_config_record,
    optimizer_change,
    shape_value,
)

DATA_CURSOR_CHOICES = ("auto", "keep", "reset")
_GENERATION_RE = re.compile(r"-g(\d{6})\.safetensors$")


@dataclass
class ForkPlan:
    source: SnapshotStore
    step: int
    manifest: Manifest
    parent_config: dict[str, Any]
    target: SnapshotStore
    data_cursor: str  # as asked: auto | keep | reset


@dataclass
class ForkResult:
    step: int
    files: int
    bytes: int
    cursor_kept: bool
    parent: dict[str, Any]  # the lineage recorded in run.json


def parse_source(text: str) -> tuple[str, int | None]:
    """`RUN`, `RUN@STEP` (the step: a number >= 0) or a snapshot's directory,
    `RUN/snapshots/<step>` (what a `ray.train.Checkpoint` of the run points at)."""
    named = split_snapshot_dir(text)
    if named is not None:
        return named
    uri, sep, tail = text.rpartition("@")
    if not sep or "/" in tail:
        uri, tail = text, ""
    elif not tail.isdigit():
        raise RunDirError(f"--from {text!r}: expected RUN or RUN@STEP with STEP a committed "
                          "step number, e.g. runs/base@200")
    if not uri:
        raise RunDirError("--from: the run directory to fork from is empty")
    return uri, int(tail) if tail else None


def _root(store: SnapshotStore) -> str:
    return os.path.realpath(store.root) if store.is_local else store.run_uri


def _inside(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/")


def _field(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return None
        config = config[part]
    return config


def plan_fork(cfg: FitConfig, source_uri: str, step: int | None,
              data_cursor: str = "auto") -> ForkPlan:
    """Every check of a fork that writes nothing (module contract)."""
    if data_cursor not in DATA_CURSOR_CHOICES:
        raise RunDirError(f"--data-cursor {data_cursor!r}: must be one of "
                          f"{', '.join(DATA_CURSOR_CHOICES)}")
    source = SnapshotStore(source_uri)
    if not source.isdir(source.root):
        raise RunDirError(f"--from {source_uri}: run directory does not exist")
    target = SnapshotStore(cfg.snapshots.run_uri)
    new, old = _root(target), _root(source)
    if _inside(new, old) or _inside(old, new):
        raise RunDirError(
            f"--run-dir {cfg.snapshots.run_uri}: a fork needs its own run directory, outside "
            f"the run it forks ({source_uri}) and not containing it")
    committed = source.committed_steps()
    if not committed:
        raise RunDirError(f"--from {source_uri}: the run has no committed snapshot to fork from")
    if step is None:
        step = committed[-1]
    elif step not in committed:
        raise RunDirError(f"--from {source_uri}@{step}: step {step} is not a committed snapshot "
                          f"of {source_uri}; committed: {committed}")
    held = [] if interrupted_fork(target) else held_run_parts(target)
    if held:
        raise RunDirError(
            f"--run-dir {cfg.snapshots.run_uri} already holds a run ({', '.join(held)}): a fork "
            "starts a new run in an empty directory; to continue that run, drop --from")
    manifest = source.load_manifest(step)  # untrusted: validated as it is parsed
    run_json = source.read_run_json() or {}
    config = run_json.get("config")
    parent_config: dict[str, Any] = config if isinstance(config, dict) else {}
    # model.vocab_size 0 is the dataset's: compare the resolved number (an empty data.uri's
    # corpus is prepared by make_fork, which checks the shapes again with it resolved).
    _refuse_shape_change(with_dataset_vocab(cfg, cfg.data.uri), source_uri, parent_config,
                         manifest)
    _refuse_optimizer_change(cfg, source_uri, parent_config)
    if cfg.steps <= step:
        raise RunDirError(
            f"steps: the fork starts at step {step} of {source_uri} and its step count "
            f"continues from there; set steps above {step}, e.g. --set steps={step + 100}")
    cursor = manifest.state.get("data")
    if data_cursor == "keep":
        if not isinstance(cursor, dict):
            raise RunDirError(f"--data-cursor keep: snapshot {step} of {source_uri} has no "
                              "data cursor; use --data-cursor reset")
        if cursor.get("seed") != cfg.seed:
            raise RunDirError(
                f"seed: --data-cursor keep needs the parent's seed ({cursor.get('seed')}), the "
                f"recipe has {cfg.seed} (the cursor's sample order comes from it); --set "
                f"seed={cursor.get('seed')}, or --data-cursor reset")
        if cfg.data.uri:
            _refuse_other_dataset(cfg.data.uri, dataset_fingerprint(cfg.data.uri), cursor,
                                  source_uri, step)
    return ForkPlan(source, step, manifest, parent_config, target, data_cursor)


def _refuse_shape_change(cfg: FitConfig, source_uri: str, parent: dict[str, Any],
                         manifest: Manifest) -> None:
    wanted = cfg.to_dict()
    vocab_known = cfg.model_factory is None and cfg.model.vocab_size != 0
    for name in TENSOR_SHAPE_FIELDS:
        if name.startswith("model.") and cfg.model_factory is not None:
            continue
        if name == "model.vocab_size" and not vocab_known:
            continue
        saved, new = (shape_value(name, v) for v in (_field(parent, name), _field(wanted, name)))
        if saved is not None and saved != new:
            raise RunDirError(
                f"{name}: a fork keeps every tensor shape, and {source_uri} was trained with "
                f"{name} = {json.dumps(saved)}, this recipe asks for {json.dumps(new)}. Keep "
                f"it (--set {name}={json.dumps(saved)}), or start a new run without --from")
    shapes = _model_shapes(cfg) if vocab_known or cfg.model_factory is not None else None
    if shapes is None:
        return  # the model cannot be built on the meta device: restore checks it instead
    saved_shapes = {k[len("model."):]: tuple(r.shape) for k, r in manifest.tensors.items()
                    if k.startswith("model.")}
    for name in sorted(shapes.keys() | saved_shapes.keys()):
        have, want = saved_shapes.get(name), shapes.get(name)
        if have != want:
            raise RunDirError(
                f"model: a fork keeps every tensor shape, but tensor {name} is "
                f"{list(have) if have is not None else 'absent'} in snapshot "
                f"{manifest.step} of {source_uri} and "
                f"{list(want) if want is not None else 'absent'} in this recipe's model")


def _refuse_optimizer_change(cfg: FitConfig, source_uri: str, parent: dict[str, Any]) -> None:
    change = optimizer_change(parent, cfg)
    if change is None:
        return
    name, saved, new = change
    if name == "optimizer_factory":
        raise RunDirError(
            f"optimizer_factory: a fork restores its parent's optimizer state, and "
            f"{source_uri} was trained with {saved}, this run has {new}; build the parent's "
            "optimizer, or start a new run without --from")
    raise RunDirError(
        f"{name}: a fork restores its parent's optimizer state (moments, step counters), and "
        f"{source_uri} was trained with {name} = {json.dumps(saved)}, this recipe asks for "
        f"{json.dumps(new)}. Keep it (--set {name}={json.dumps(saved)}), or start a new run "
        "without --from")


def _model_shapes(cfg: FitConfig) -> dict[str, tuple[int, ...]] | None:
    """The recipe's model parameter and buffer shapes, built without memory (meta device)."""
    import torch

    from trainer.train import build_model

    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 - a model that cannot go on meta is checked at restore
        return None
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _refuse_other_dataset(uri: str, fingerprint: str | None, cursor: dict[str, Any],
                          source_uri: str, step: int) -> None:
    if fingerprint is not None and cursor.get("dataset") != fingerprint:
        raise RunDirError(
            f"data.uri: --data-cursor keep needs the dataset the parent read (fingerprint "
            f"{cursor.get('dataset')}, snapshot {step} of {source_uri}), but {uri} has "
            f"fingerprint {fingerprint}; use --data-cursor reset (or auto) to start its data "
            "from epoch 0")


def _keep_cursor(plan: ForkPlan, cfg: FitConfig, fingerprint: str | None) -> bool:
    cursor = plan.manifest.state.get("data")
    same = (isinstance(cursor, dict) and cursor.get("seed") == cfg.seed
            and fingerprint is not None and cursor.get("dataset") == fingerprint)
    if plan.data_cursor == "keep":
        assert isinstance(cursor, dict)  # plan_fork refused otherwise
        _refuse_other_dataset(cfg.data.uri, fingerprint, cursor, plan.source.run_uri, plan.step)
        return True
    return plan.data_cursor == "auto" and same


def _parent_loss(source_uri: str, step: int) -> float | None:
    from trainer.run.metrics import read_records

    try:
        losses = [r["loss"] for r in read_records(source_uri)
                  if r["kind"] == "step" and r["step"] == step]
    except (ValueError, OSError):
        return None
    return float(losses[-1]) if losses else None


def make_fork(plan: ForkPlan, cfg: FitConfig) -> ForkResult:
    """Write the fork's first committed snapshot and its lineage (module contract)."""
    from data_state import DataCursor
    from elastic.snapshotter import library_versions
    from trainer.run.preflight import ensure_dataset
    from trainer.train import ORIGIN_KEY

    data_cfg = ensure_dataset(cfg)  # data.uri set, model.vocab_size resolved
    _refuse_shape_change(data_cfg, plan.source.run_uri, plan.parent_config, plan.manifest)
    fingerprint = dataset_fingerprint(data_cfg.data.uri)
    kept = _keep_cursor(plan, cfg, fingerprint)
    state = dict(plan.manifest.state)
    if not kept and "data" in state:
        if fingerprint is None:
            raise RunDirError(f"data.uri: the dataset at {data_cfg.data.uri} cannot be read")
        state["data"] = DataCursor(fingerprint, cfg.seed).to_dict()
        if isinstance(state.get(ORIGIN_KEY), dict):  # the data's story starts here afresh
            state[ORIGIN_KEY] = {"step": plan.step, "epoch": 0, "samples_consumed": 0,
                                 "global_batch": cfg.data.global_batch, "drop_last": True}
    target, step = plan.target, plan.step
    if interrupted_fork(target):  # we hold the lease: that fork is not running
        clear_interrupted_fork(target)
    parent = {
        "uri": _absolute(plan.source),
        "step": step,
        "loss": _parent_loss(plan.source.run_uri, step),
        "dataset": (plan.manifest.state.get("data") or {}).get("dataset")
        if isinstance(plan.manifest.state.get("data"), dict) else None,
        "data_cursor": "kept" if kept else "reset",
        "forked_at": time.time(),
    }
    written: list[str] = []
    try:
        # run.json first: whatever a kill leaves after it is recognisably an interrupted
        # fork (`interrupted_fork`), which the next fork replaces.
        path = target.path("run.json")
        target.write_json(path, {**_run_info(library_versions()), "config": data_cfg.to_dict(),
                                 **model_config_record(data_cfg), "parent": parent},
                          exclusive=True)
        written.append(path)
        nbytes = 0
        for name in plan.manifest.files:
            nbytes += _copy_shard(plan, name, written)
        generation = max((int(m.group(1)) for n in plan.manifest.files
                          if (m := _GENERATION_RE.search(n))), default=0)
        path = target.path(GENERATION_NAME)
        target.write_json(path, {"generation": generation, "time": time.time()},
                          exclusive=True)
        written.append(path)
        target.write_manifest(dataclasses.replace(plan.manifest, state=state), exclusive=True)
    except BaseException:
        # Only what this fork wrote (the new run held no snapshot before: plan_fork), and
        # run.json last: cut off here, what is left is still an interrupted fork.
        try:
            target.delete_step(step)
        except OSError:
            pass
        for path in reversed([p for p in written if "/snapshots/" not in p]):
            try:
                target.remove(path)
            except OSError:
                pass
        raise
    return ForkResult(step=step, files=len(plan.manifest.files), bytes=nbytes,
                      cursor_kept=kept, parent=parent)


def _run_info(versions: dict[str, str]) -> dict[str, Any]:
    from elastic.format import FORMAT_VERSION

    return {"format_version": FORMAT_VERSION, **versions}


def _absolute(store: SnapshotStore) -> str:
    return os.path.abspath(store.run_uri) if store.is_local and "://" not in store.run_uri \
        else store.run_uri


def _copy_shard(plan: ForkPlan, name: str, written: list[str]) -> int:
    """One shard file of the parent, checked and copied by the catalog
    (`elastic.catalog.copy_shard`); its refusals become a fork's one-line `RunDirError`."""
    source, step = plan.source, plan.step
    where = f"snapshot {step} of {source.run_uri}: {name}"
    try:
        size = copy_shard(source, plan.manifest, name, plan.target)
    except FileNotFoundError as err:
        raise RunDirError(f"{where} is missing (if the parent run is still training, its "
                          "keep_last may have just deleted this snapshot: fork a newer one)"
                          ) from err
    except ValueError as err:  # ManifestError, SnapshotIntegrityError: a link, a bad chunk
        raise RunDirError(f"{where}: {err}; the parent snapshot is corrupt or unsafe (fork "
                          "an older step)") from err
    written.append(plan.target.step_path(step, name))
    return size
