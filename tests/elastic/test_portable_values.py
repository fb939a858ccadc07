"""What a writer with a bug commits through the torch-free writer (issue 36, point 8): bytes
that verify, values that do not.

* NaN or Inf in a moment or a parameter: the restore finds it in the pass that verifies the
  bytes, names the tensor in one line, quarantines the snapshot (moved, never deleted) and
  restores the previous one bitwise; training continues from it. The torch-free reader
  refuses it the same way. Through staging buffers (a GPU's path) the batch that holds it is
  never copied to its destination.
* (further cases of the same issue: tests/train/test_story.py for the step, optimizer,
  schedule and data cursor; test_elastic_retention.py for what retention keeps.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

# The crafted snapshots of the PyTorch path's own tests, reused as they are.
from test_elastic_untrusted import pristine, run  # noqa: F401

from elastic.catalog import verify
from elastic.errors import NonFiniteError
from elastic.format.records import step_dirname
from elastic.portable import PortableRun, write_snapshot
from elastic.read.byte_source import ByteSource
from elastic.read.device_stage import HostCopier, read_staged
from elastic.read.read_batches import place
from elastic.read.restore import allocate, check_headers, plan_reads, plan_targets
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import build, full_state, json_state, train_step


def _poisoned(tensors: dict[str, np.ndarray], case: str) -> tuple[str, dict[str, np.ndarray]]:
    """One element of a moment made NaN, or of a model weight made Inf."""
    suffix, value = {"moment-nan": (".exp_avg_sq", np.nan), "weight-inf": (".weight", np.inf)}[case]
    key = next(k for k in sorted(tensors) if k.endswith(suffix) and tensors[k].ndim == 2)
    out = dict(tensors)
    out[key] = tensors[key].copy()
    out[key].flat[out[key].size // 2] = value
    return key, out


@pytest.mark.parametrize("case", ["moment-nan", "weight-inf"])
def test_non_finite_values_are_quarantined_and_the_previous_snapshot_restored(
        run: Path, pristine: tuple[Path, dict[int, Any]], case: str) -> None:  # noqa: F811
    refs = pristine[1]
    source = PortableRun(str(run)).read(4)
    key, tensors = _poisoned(source.tensors, case)
    write_snapshot(str(run), 6, tensors, json.loads(json.dumps(source.state)))
    store = SnapshotStore(str(run))
    with pytest.raises(NonFiniteError, match=key) as read:
        PortableRun(str(run)).read(6)
    assert "\n" not in str(read.value)

    ts = build(seed=11)
    snap = Snapshotter(str(run), ts.registry,
                       settings=SnapshotSettings(snapshot_every=2, keep_last=5))
    assert snap.restore() == 4
    [error] = snap.restore_errors
    assert "\n" not in error and "snapshot 6" in error and repr(key) in error, error
    assert ("NaN" if case == "moment-nan" else "Inf") in error
    full, js = refs[4]  # bitwise snapshot 4: model weights were read in place, then replaced
    got = full_state(ts)
    for name, value in full.items():
        assert torch.equal(got[name], value), name
    assert json_state(ts) == js
    # Nothing committed is lost: snapshot 6 lies in quarantine with its reason.
    assert store.committed_steps() == [2, 4]
    reason = json.loads((run / "quarantine" / step_dirname(6) / "reason.json").read_text())
    assert key in json.dumps(reason)
    # Training continues from snapshot 4.
    train_step(ts, 5)
    train_step(ts, 6)
    snap.after_step(6)
    snap.close()
    assert store.committed_steps() == [2, 4, 6]
    assert all(torch.isfinite(t).all() for t in full_state(ts).values())
    assert verify(store, 6)["tensors"] == len(full)


def test_a_staged_batch_holding_nan_is_never_copied(run: Path) -> None:  # noqa: F811
    source = PortableRun(str(run)).read(4)
    key, tensors = _poisoned(source.tensors, "moment-nan")
    write_snapshot(str(run), 6, tensors, json.loads(json.dumps(source.state)))
    store = SnapshotStore(str(run))
    manifest = store.load_manifest(6)
    targets = plan_targets(manifest, build(seed=11).registry.flatten().tensors)
    ops = plan_reads(manifest, targets)
    bytes_source = ByteSource(store, 6)
    check_headers(manifest, [(op.key, op.chunk) for op in ops], bytes_source)
    local = allocate(targets, 6)
    for tensor in local.values():
        tensor.fill_(7)
    placed = [place(op, targets[op.key], local[op.key]) for op in ops]
    with pytest.raises(NonFiniteError, match=key):
        read_staged(placed, bytes_source, manifest, HostCopier())  # one batch: all of it
    assert all(bool((t == 7).all()) for t in local.values())  # not a byte was copied
