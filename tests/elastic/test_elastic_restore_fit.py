"""Restore against the live code: what a snapshot's state may be, and what a misfit costs.

* An optimizer has state only for parameters that have had a gradient (an unused head, an
  MoE expert not routed to yet): such a run restores, the unused parameters stay without
  state, and training goes on bitwise like the uninterrupted run (plain model, and a wrapped
  one that goes through DCP).
* A snapshot that does not fit the live code (a model in another dtype, a component whose
  state gained a key) is not corrupt: nothing is quarantined, restore says so in one line,
  and the original code restores the newest snapshot (P6, P7).
* A fresh model that already holds gradients restores like any other.
* A crafted optimizer entry cannot make a moment alias a model weight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from elastic.errors import SnapshotMisfitError
from elastic.settings import SnapshotSettings
from elastic.snapshotter import Snapshotter
from elastic.state.registry import SnapshotMismatchError, StateRegistry
from elastic.store.snapshot_store import SnapshotStore
from elastic.testing import Cursor, build, full_state, train_step


class _SometimesUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)  # a gradient only from step 3 on

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        y = self.used(x)
        return y + self.unused(x) if use else y


def _build(seed: int, wrapped: bool) -> tuple[nn.Module, torch.optim.Optimizer, StateRegistry]:
    torch.manual_seed(seed)
    net = _SometimesUnused()
    model: nn.Module = checkpoint_wrapper(net) if wrapped else net
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    registry = StateRegistry()
    registry.register("model", model)
    registry.register("optim", optim)
    return model, optim, registry


def _step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    optim.zero_grad(set_to_none=True)
    model(torch.randn(3, 4, generator=gen), use=step >= 3).square().mean().backward()
    optim.step()


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "through-dcp"])
def test_parameters_without_optimizer_state_restore_and_train_on_bitwise(
    tmp_path: Path, wrapped: bool,
) -> None:
    run = str(tmp_path / "run")
    model, optim, registry = _build(0, wrapped)
    snap = Snapshotter(run, registry, settings=SnapshotSettings(snapshot_every=2))
    for step in (1, 2):
        _step(model, optim, step)
        snap.after_step(step)
    snap.close()
    assert len(optim.state) == 2  # the unused layer has none
    for step in (3, 4):
        _step(model, optim, step)

    model2, optim2, registry2 = _build(1, wrapped)
    restorer = Snapshotter(run, registry2)
    assert restorer.restore() == 2 and restorer.restore_errors == []
    names = {id(p): n for n, p in model2.named_parameters()}
    assert sorted(names[id(p)] for p in optim2.state) == sorted(
        n for n in names.values() if ".used." in f".{n}")
    restorer.close()
    for step in (3, 4):
        _step(model2, optim2, step)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert sorted(len(s) for s in optim2.state.values()) == [3, 3, 3, 3]


def _committed_run(run: str) -> dict[str, torch.Tensor]:
    ts = build(seed=0)
    snap = Snapshotter(run, ts.registry, settings=SnapshotSettings(snapshot_every=2, keep_last=2))
    for step in range(1, 7):
        train_step(ts, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()
    return full_state(ts)


class _CursorWithEpoch(Cursor):
    """New code: the cursor's state gained a key."""

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples, "epoch": 0}


@pytest.mark.parametrize("change", ["model dtype", "component state"])
def test_a_snapshot_that_does_not_fit_the_code_is_kept(tmp_path: Path, change: str) -> None:
    run = str(tmp_path / "run")
    final = _committed_run(run)
    store = SnapshotStore(run)
    before = {s: sorted(store.step_files(s)) for s in store.committed_steps()}
    assert sorted(before) == [4, 6]

    ts = build(seed=1)
    if change == "model dtype":
        ts.model.to(torch.bfloat16)
    else:
        ts.registry._components["data"] = _CursorWithEpoch()
    snap = Snapshotter(run, ts.registry)
    with pytest.raises(SnapshotMismatchError, match="fits the registered state") as info:
        snap.restore()
    assert "\n" not in str(info.value) and "none was moved" in str(info.value)
    assert len(snap.restore_errors) == 2  # both tried, both kept
    snap.close()
    assert {s: sorted(store.step_files(s)) for s in store.committed_steps()} == before
    assert not os.path.exists(os.path.join(run, "quarantine"))

    ts = build(seed=1)  # the original code: the newest snapshot, bitwise
    assert Snapshotter(run, ts.registry).restore() == 6
    for key, value in final.items():
        assert torch.equal(full_state(ts)[key], value), key


def test_a_fresh_model_holding_gradients_restores_the_newest(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    final = _committed_run(run)
    ts = build(seed=1)
    ts.model(torch.randn(2, 8)).sum().backward()  # a probe backward before restore
    snap = Snapshotter(run, ts.registry)
    assert snap.restore() == 6 and snap.restore_errors == []
    for key, value in final.items():
        assert torch.equal(full_state(ts)[key], value), key


def test_an_optimizer_entry_cannot_refer_to_a_model_weight(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    _committed_run(run)
    store = SnapshotStore(run)
    skeletons = json.loads(json.dumps(store.load_manifest(6).state))
    entry = next(iter(skeletons["optim"]["state"].values()))
    ts = build(seed=1)
    ts.registry.check_state(skeletons)  # as saved: fits
    weight = next(k for k in ts.registry.flatten().tensors if k.startswith("model."))
    entry["exp_avg"] = {"__tensor__": weight}
    with pytest.raises(SnapshotMisfitError, match="exp_avg: expected tensor"):
        ts.registry.check_state(skeletons)


def test_a_worker_short_of_memory_quarantines_nothing(tmp_path: Path, monkeypatch) -> None:
    """A fresh optimizer's moments cannot be allocated (the worker is out of memory): that is
    the worker's shortage, not the snapshots' fault. Restore raises one line naming it on
    every snapshot's behalf, nothing is quarantined or rewound, and once memory is there the
    newest snapshot restores bitwise (P7: doubt never destroys)."""
    import elastic.read.restore as restore_module
    from elastic.errors import RestoreMemoryError

    run = str(tmp_path / "run")
    model, optim, registry = _build(0, wrapped=False)
    snap = Snapshotter(run, registry, settings=SnapshotSettings(snapshot_every=2, keep_last=3))
    for step in (1, 2, 3, 4):
        _step(model, optim, step)
        snap.after_step(step)
        snap.persister.wait()
    snap.close()
    want = {k: v.clone() for k, v in optim.state_dict()["state"][0].items()}

    class _NoMemory:  # restore's torch, where every new tensor fails as torch's would
        def __getattr__(self, name: str) -> object:
            return getattr(torch, name)

        @staticmethod
        def empty(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                               "allocate 17179869184 bytes. Error code 12")

    monkeypatch.setattr(restore_module, "torch", _NoMemory())
    _, _, registry2 = _build(1, wrapped=False)
    with pytest.raises(RestoreMemoryError, match="short of memory") as raised:
        Snapshotter(run, registry2).restore()
    assert "\n" not in str(raised.value) and "snapshot 4" in str(raised.value)
    store = SnapshotStore(run)
    assert store.committed_steps() == [2, 4]
    assert not (tmp_path / "run" / "quarantine").exists()

    monkeypatch.undo()
    _, optim3, registry3 = _build(2, wrapped=False)
    assert Snapshotter(run, registry3).restore() == 4
    for key, value in want.items():
        assert torch.equal(optim3.state_dict()["state"][0][key], value), key
