"""Restore: read the byte ranges this rank needs and materialise its state.

A restore is ``check_compatible`` → ``check_rules`` → ``plan_targets`` → ``read_tensors`` →
``StateRegistry.load``: all that can be checked is checked before a byte of a live tensor is
written, every byte verified before anything is loaded. The manifest is untrusted (P8): parsed
by ``elastic.format.manifest_check``, its claims about the files checked here (the steps in
detail: docs/design.md, "The restore, step by step").

* ``check_compatible``: the snapshot's model tensors are the registered model's (else
  ``SnapshotMismatchError`` listing missing, unexpected and shape-mismatched tensors); every
  component's JSON state and optimizer tensor shapes fit the live component (else
  ``SnapshotMisfitError`` naming the component and path).
* ``check_rules``: the trainer's rules (``StateRegistry.add_rule``) hold, else a misfit.
* ``plan_targets``: targets from the registry's tensors (another dtype: ``SnapshotMisfitError``);
  moments that do not exist yet take their parameter's layout and device. In place
  (``in_place=keys``) a live tensor that is contiguous, of the target's dtype and local shape
  and alone on its storage is written into directly (CPU: ``preadv``; GPU:
  ``elastic.read.device_stage``).
* ``read_tensors``: each used file's safetensors header first (each chunk as the manifest says,
  else ``ManifestError``), then one range per target and chunk, widened to whole checksum
  blocks, each verified against its crc32 (``SnapshotIntegrityError`` naming file, chunk, block)
  and every floating element checked finite (``NonFiniteError``). With its process group
  ``elastic.read.group_read`` reads each block once. Bytes come from a ``ByteSource``.
* A failure before reading begins leaves the registry as it was; once reading has begun it
  leaves the live tensors unspecified and the caller never trains from them:
  ``Snapshotter.restore`` falls back to the previous commit, which overwrites every target
  element (``check_coverage``) and the optimizer's state whole, ending bitwise at it.

``collector_paused()``: the context a restore runs in (cyclic GC off). Bad input is never a
RuntimeError/KeyError/TypeError/IndexError: always a ``SnapshotIntegrityError`` (or subclass).
"""

from __future__ import annotations

import contextlib
import gc
import math
import operator
from collections.abc import Collection, Iterator
from typing import Any

import torch

from elastic.errors import (
    ManifestError,
    RestoreMemoryError,
    SnapshotMisfitError,
)
from elastic.format import (
    Manifest,
    check_headers,
    str_to_dtype,
)
from elastic.format import snapshot_label as _snap
from elastic.read.byte_source import ByteSource
from elastic.read.device_stage import read_to
from elastic.read.prefault import prefault
from elastic.read.read_batches import Placed, ReadOp, place
from elastic.state import (
    Piece,
    SnapshotMismatchError,
    StateRegistry,
    Target,
    storage_owners,
    target_piece,
    with_fill,
)

__all__ = ["SnapshotMismatchError", "allocate", "check_compatible", "check_coverage",
           "check_headers", "check_rules", "collector_paused", "plan_reads", "plan_targets",
           "read_tensors"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block, on again after if it was on: a
    restore's tens of thousands of short-lived acyclic objects set off full collections in a
    process holding millions (150 ms, twice in 16 restores of 0.37 GB otherwise ~80 ms)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

def check_compatible(registry: StateRegistry, manifest: Manifest,
                     templates: dict[str, torch.Tensor],
                     live_skeletons: dict[str, Any] | None = None) -> None:
    """The snapshot holds the registered model (``SnapshotMismatchError``) and its JSON state
    fits every live component (``ManifestError``); nothing is read or loaded. ``templates``
    (and ``live_skeletons``, when given) are the registry's ``flatten()``."""
    models = tuple(m + "." for m in registry.module_keys())
    # Only model tensors must all be there: an optimizer has state only for parameters that
    # had a gradient (the JSON state check says which entries the snapshot may hold).
    missing = sorted(k for k in templates if k not in manifest.tensors and k.startswith(models))
    unexpected = sorted(k for k in manifest.tensors if k not in templates and k.startswith(models))
    mismatched = {k: (list(manifest.tensors[k].shape), list(t.shape))
                  for k, t in templates.items()
                  if k in manifest.tensors and tuple(t.shape) != manifest.tensors[k].shape}
    if missing or unexpected or mismatched:
        raise SnapshotMismatchError(
            f"snapshot {manifest.step} does not match the registered state: missing "
            f"{missing}, unexpected {unexpected}, shape-mismatched (saved, expected) {mismatched}")
    registry.check_state(manifest.state, _snap(manifest.step), live=live_skeletons,
                         shapes={name: rec.shape for name, rec in manifest.tensors.items()})


def check_rules(registry: StateRegistry, manifest: Manifest, source: ByteSource) -> None:
    """The registry's rules (``StateRegistry.add_rule``) on the snapshot's state, after
    reading (verified, into new CPU tensors: never a live one) the scalar tensors they name;
    a rule that fails is ``SnapshotMisfitError``."""
    names = [n for n in registry.rule_scalars(manifest.state)
             if n in manifest.tensors and math.prod(manifest.tensors[n].shape) == 1]
    values: dict[str, float] = {}
    if names:
        targets = {}
        for name in names:
            rec = manifest.tensors[name]
            piece = Piece(name, str_to_dtype(rec.dtype), rec.shape, (0,) * len(rec.shape),
                          rec.shape)
            targets[name] = Target(piece, torch.device("cpu"), lambda t: t)
        values = {n: float(t.reshape(-1)[0]) for n, t in
                  read_tensors(manifest, targets, source).items()}
    registry.check_rules(manifest.state, values, _snap(manifest.step))


def plan_targets(manifest: Manifest, templates: dict[str, torch.Tensor],
                 in_place: Collection[str] = ()) -> dict[str, Target]:
    """What to read for each tensor of ``manifest``, laid out as ``templates`` (the
    registry's ``flatten()``); tensors of the components named in ``in_place`` are filled
    in place where they can be (module contract)."""
    # State the registry does not hold yet (a fresh optimizer's moments, step counters) is
    # allocated here; the optimizer's load_state_dict adopts it, as torch expects.
    targets: dict[str, Target] = {}
    by_fqn: dict[str, list[tuple[str, torch.Tensor]]] = {}  # "<fqn>" of "<component>.<fqn>"
    for name, t in templates.items():
        by_fqn.setdefault(name.split(".", 1)[-1], []).append((name, t))
    owners = storage_owners(templates) if in_place else {}
    for key, rec in manifest.tensors.items():
        dtype = str_to_dtype(rec.dtype)
        template = templates.get(key)
        if template is not None and template.dtype != dtype:
            raise SnapshotMisfitError(
                f"{_snap(manifest.step)}: tensor {key!r} is {rec.dtype} in the manifest but "
                f"the registered tensor is {template.dtype}")
        live = template is not None and key.split(".", 1)[0] in in_place
        if template is None:
            template = _parameter_like(key, rec.shape, by_fqn)
        if template is None:  # no allocation here: only once the file headers agree
            piece = Piece(key, dtype, rec.shape, (0,) * len(rec.shape), rec.shape)
            targets[key] = Target(piece, torch.device("cpu"), lambda t: t)
            continue
        target = target_piece(key, template, dtype=dtype, global_shape=rec.shape)
        targets[key] = with_fill(target, template, owners) if live else target
    return targets


def _parameter_like(key: str, shape: tuple[int, ...],
                    by_fqn: dict[str, list[tuple[str, torch.Tensor]]]) -> torch.Tensor | None:
    # "optim.state.<fqn>.exp_avg" takes the layout of "model.<fqn>" (same shape): the longest
    # run of its dotted parts naming a template, by index (every moment of a fresh optimizer).
    parts = key.split(".")
    for length in range(len(parts), 0, -1):
        for start in range(len(parts) - length + 1):
            for name, t in by_fqn.get(".".join(parts[start:start + length]), ()):
                if name != key and tuple(t.shape) == shape:
                    return t
    return None


def plan_reads(manifest: Manifest, targets: dict[str, Target]) -> list[ReadOp]:
    # Tuples built with map() over the operator/builtin functions: this runs per chunk (a
    # few hundred per state) and the generator-expression form was its main cost.
    ops: list[ReadOp] = []
    block = manifest.block_bytes
    for key, target in targets.items():
        rec = manifest.tensors[key]
        if len(target.piece.shape) != len(rec.shape):
            raise ManifestError(f"{_snap(manifest.step)}: tensor {key!r} has "
                                f"{len(rec.shape)} dimensions, the target "
                                f"{len(target.piece.shape)}")
        esize = target.piece.dtype.itemsize
        t_lo = target.piece.offsets
        t_hi = tuple(map(operator.add, t_lo, target.piece.shape))
        for chunk in rec.chunks:
            c_lo = chunk.offsets
            c_hi = tuple(map(operator.add, c_lo, chunk.shape))
            lo = tuple(map(max, t_lo, c_lo))
            hi = tuple(map(min, t_hi, c_hi))
            if lo and any(map(operator.le, hi, lo)):
                continue  # the chunk and the target do not overlap
            c0, c1 = chunk.byte_range
            full_tail = bool(lo) and lo[1:] == c_lo[1:] and hi[1:] == c_hi[1:]
            if full_tail:
                row_bytes = math.prod(chunk.shape[1:]) * esize
                need0 = c0 + (lo[0] - c_lo[0]) * row_bytes
                need1 = c0 + (hi[0] - c_lo[0]) * row_bytes
            else:
                need0, need1 = c0, c1
            start = c0 + (need0 - c0) // block * block
            end = min(c1, c0 + -(-(need1 - c0) // block) * block)
            ops.append(ReadOp(key, chunk, start, end, lo, hi, full_tail, need0, need1))
    return ops


def allocate(targets: dict[str, Target], step: int) -> dict[str, torch.Tensor]:
    """One tensor per target: its ``fill`` (the live tensor), else a new one on the
    target's device (a GPU's through ``elastic.read.device_stage``), a CPU one with its pages
    faulted in (``elastic.read.prefault``: faults taken inside the read syscall that fills it
    cost about twice as much)."""
    local: dict[str, torch.Tensor] = {}
    for key, t in targets.items():
        if t.fill is not None:
            local[key] = t.fill
            continue
        device = t.device if t.device.type not in ("cpu", "meta") else torch.device("cpu")
        try:
            local[key] = torch.empty(t.piece.shape, dtype=t.piece.dtype, device=device)
            prefault(local[key])
        except RuntimeError as err:  # torch's allocation failure (out of memory)
            # The worker's shortage, not the snapshot's fault: never a reason to quarantine.
            # (A manifest's sizes are bounded by its checks, and on the per-rank path its
            # chunks are checked against the files before anything is allocated.)
            raise RestoreMemoryError(
                f"{_snap(step)}: cannot allocate {t.piece.nbytes} bytes for {key!r} on "
                f"{device} ({str(err).splitlines()[0]}): this worker is short of memory; "
                "free some, or restore on a bigger machine") from err
    return local


def check_coverage(manifest: Manifest, targets: dict[str, Target],
                   placed: list[Placed]) -> None:
    """The planned ops fill every element of every target (else ``ManifestError``)."""
    filled = dict.fromkeys(targets, 0)
    for p in placed:
        filled[p.op.key] += p.dst.numel()
    for key, target in targets.items():
        if filled[key] != target.piece.numel:
            raise ManifestError(f"{_snap(manifest.step)}: chunks cover "
                                f"{filled[key]} of {target.piece.numel} elements of {key!r}")


def read_tensors(manifest: Manifest, targets: dict[str, Target],
                 source: ByteSource) -> dict[str, torch.Tensor]:
    """Read, verify and assemble every target's local tensor (wrapped as DTensor if needed).

    Each target's tensor is its live tensor or allocated once, and its bytes are read
    straight into it (local disk: ``preadv`` into the tensor's memory; a GPU's through
    ``elastic.read.device_stage``); only the partial checksum blocks at the edges of a needed
    range, and whole chunks of which a resharded target needs a non-contiguous part, pass
    through a staging buffer (``elastic.read.read_batches``). Every block is verified before
    anything is loaded; a failure once reading has begun leaves the live tensors unspecified
    (module contract). This reads alone; ``elastic.read.group_read`` reads with its group."""
    ops = plan_reads(manifest, targets)
    check_headers(manifest, [(op.key, op.chunk) for op in ops], source)
    local = allocate(targets, manifest.step)
    placed = [place(op, targets[op.key], local[op.key]) for op in ops]
    check_coverage(manifest, targets, placed)
    read_to(placed, source, manifest)  # the first write into a live tensor
    return {k: t.wrap(local[k].to(t.device)) for k, t in targets.items()}
