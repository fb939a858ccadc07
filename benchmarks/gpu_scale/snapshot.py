"""The snapshot part of `benchmarks/gpu_scale/run.py`: a Llama's training state on one GPU, saved
and restored by Baton, by torch.save / torch.load and by DCP, side by side.

Contract: `measure_snapshots(config, device, workdir, rounds, budget_s)` builds the
LlamaForCausalLM of a local config.json (random init, fp32 master weights on `device`, as
Baton's `precision.dtype = "bf16"` trains: bf16 autocast), takes one AdamW step under bf16
autocast so that the moments exist (state: 12 bytes per parameter), then, after one
untimed warm-up save of the sides that keep buffers (Baton's pinned capture image, DCP's
pinned stager), measures in up to `rounds` rounds, the sides in alternating order:

- `baton`: stall = `Snapshotter.after_step` (the copy of the GPU state into the pinned
  capture image; the pipelined capture hides part of it behind forward/backward), persist =
  until the background persist (crc32, write, fsync, commit) is done, restore =
  `Snapshotter.restore`'s data path, in place into the live tensors through pinned staging
  buffers (`elastic.read.device_stage`);
- `torch`: `torch.save` + fsync of the state dicts (its own copy off the GPU), then
  `torch.load` + `load_state_dict`;
- `dcp`: `dcp.async_save` with its pinned-memory `DefaultStager`: until it returns, until its
  staging is done (the stall: the optimizer may not step before), until the upload is done;
  then `dcp.load` + `set_state_dict`; `dcp_save`: the blocking `dcp.save`.

Before each restore the weights are changed (+1) and after it their fingerprint must be the
saved one. Host memory: a side's peak RSS above the RSS before its first operation. A
side's files are removed after its restore (Baton's run directory, its retired files reused
as spares, stays: twice the state). A round starts only while the rounds so far, at their
pace, fit `budget_s`. Files were just written: restores read from the page cache, alike.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from benchmarks.common import alternating, reset_peak_rss, status_bytes
from elastic.read.restore import (
    ByteSource,
    check_compatible,
    collector_paused,
    plan_targets,
    read_tensors,
)
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import StateRegistry
from elastic.store.snapshot_store import SnapshotStore

SIDES = ("baton", "torch", "dcp")


def build_llama(config: Path, device: torch.device) -> tuple[Any, Any, StateRegistry]:
    """The model of `config` (random init on `device`), its AdamW with state, a registry."""
    from trainer.config import ModelConfig
    from trainer.train.hf import build_hf_model

    torch.manual_seed(0)
    with torch.device(device):
        model = build_hf_model(ModelConfig(hf_config=str(config)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    tokens = torch.randint(0, model.config.vocab_size, (1, 128), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim, registry


def fingerprint(model: Any) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Sides:
    """The three sides on one live state; `rows` collects seconds, `rss` peak growth."""

    def __init__(self, model: Any, optim: Any, registry: StateRegistry, workdir: str,
                 device: torch.device) -> None:
        self.model, self.optim, self.registry = model, optim, registry
        self.workdir, self.device = workdir, device
        self.run = os.path.join(workdir, "baton-run")
        self.snap = Snapshotter(self.run, registry,
                                settings=SnapshotSettings(keep_last=1, ram=False))
        cuda = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                   use_shared_memory=False,
                                                   use_async_staging=True,
                                                   use_non_blocking_copy=cuda))
        self.rows: dict[str, list[float]] = {}
        self.rss: dict[str, int] = {}
        self.saved = fingerprint(model)
        self.step = 0

    def _timed(self, side: str, name: str, fn: Any) -> Any:
        """Run `fn`, record its seconds under `name` and the side's peak RSS growth."""
        before = status_bytes("VmRSS")
        reset_peak_rss()
        self._sync()
        start = time.perf_counter()
        out = fn()
        self._sync()
        self.rows.setdefault(name, []).append(time.perf_counter() - start)
        self.rss[side] = max(self.rss.get(side, 0), status_bytes("VmHWM") - before)
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _restored(self, side: str, name: str, fn: Any) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1)
        self._timed(side, name, fn)
        got = fingerprint(self.model)
        assert abs(got - self.saved) <= 1e-9 * max(1.0, abs(self.saved)), (side, got,
                                                                             self.saved)

    def baton(self, timed: bool = True) -> None:
        self.step += 1
        step, snap = self.step, self.snap
        if not timed:
            snap.after_step(step, force=True)
            snap.persister.wait()
            snap.coordinator.flush(0)
            return
        self._timed("baton", "baton_stall", lambda: snap.after_step(step, force=True))
        self._timed("baton", "baton_persist", snap.persister.wait)
        snap.coordinator.flush(0)
        assert snap.persister.last_error is None, snap.persister.last_error
        self._restored("baton", "baton_restore", lambda: self._baton_restore(step))

    def _baton_restore(self, step: int) -> None:
        """Snapshotter.restore's data path (no coordinator bookkeeping: the saving
        Snapshotter goes on committing), in place."""
        store = SnapshotStore(self.run)
        with collector_paused():
            manifest = store.load_manifest(step)
            live = self.registry.flatten()
            check_compatible(self.registry, manifest, live.tensors, live.skeletons)
            targets = plan_targets(manifest, live.tensors, in_place=self.registry.model_keys())
            tensors = read_tensors(manifest, targets, ByteSource(store, step))
            self.registry.load(tensors, manifest.state, checked=True)

    def torch(self) -> None:
        path = os.path.join(self.workdir, "state.pt")

        def save() -> None:
            torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict()},
                       path)
            _fsync(path)

        def load() -> None:
            saved = torch.load(path, weights_only=True)
            self.model.load_state_dict(saved["model"])
            self.optim.load_state_dict(saved["optim"])

        self._timed("torch", "torch_save", save)
        self._restored("torch", "torch_load", load)
        os.remove(path)

    def dcp(self, timed: bool = True) -> None:
        directory = os.path.join(self.workdir, "dcp")
        msd, osd = get_state_dict(self.model, self.optim)
        state = {"model": msd, "optim": osd}
        start = time.perf_counter()
        got = dcp.async_save(state, checkpoint_id=directory, async_stager=self.stager,
                             no_dist=True)
        returned = time.perf_counter() - start
        staged, upload = (got.staging_completion, got.upload_completion) \
            if hasattr(got, "staging_completion") else (None, cast("Future[Any]", got))
        if staged is not None:
            staged.result()
        self._sync()
        staged_s = time.perf_counter() - start
        upload.result()
        done = time.perf_counter() - start
        if timed:
            for name, value in (("dcp_return", returned), ("dcp_staged", staged_s),
                                ("dcp_done", done)):
                self.rows.setdefault(name, []).append(value)
            self._restored("dcp", "dcp_load", lambda: self._dcp_load(directory))
            shutil.rmtree(directory)
            self._timed("dcp", "dcp_save", lambda: dcp.save(state, checkpoint_id=directory,
                                                            no_dist=True))
        shutil.rmtree(directory)

    def _dcp_load(self, directory: str) -> None:
        msd, osd = get_state_dict(self.model, self.optim)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=directory, no_dist=True)
        set_state_dict(self.model, self.optim, model_state_dict=msd, optim_state_dict=osd)

    def close(self) -> None:
        self.snap.close()
        self.stager.close()


def measure_snapshots(config: Path, device: torch.device, workdir: str, rounds: int,
                      budget_s: float) -> dict[str, Any]:
    """The snapshot part (module contract): seconds per side and round, RSS, ratios."""
    started = time.perf_counter()
    model, optim, registry = build_llama(config, device)
    nbytes = sum(t.numel() * t.element_size() for t in registry.flatten().tensors.values())
    params = sum(p.numel() for p in model.parameters())
    sides = Sides(model, optim, registry, workdir, device)
    sides.baton(timed=False)  # warm-up: the capture image and DCP's pinned buffers exist
    sides.dcp(timed=False)
    warm = time.perf_counter() - started
    done = 0
    while done < rounds:
        round_start = time.perf_counter()
        for side in alternating(SIDES, done):
            getattr(sides, side)()
        done += 1
        elapsed, per_round = time.perf_counter() - started, time.perf_counter() - round_start
        if elapsed + per_round > budget_s:
            break
    sides.close()
    return {"parameters": params, "state_bytes": nbytes, "rounds": done, "warm_up_s": warm,
            "times_s": sides.rows, "rss_growth_bytes": sides.rss,
            "rss_growth_vs_state": {k: v / nbytes for k, v in sides.rss.items()}}
