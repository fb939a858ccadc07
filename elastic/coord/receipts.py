"""One rank's receipt, and from the receipts of one step to its manifest: the checks that make a
commit whole.

``Receipt`` is what a rank reports once its shard of a step is durable (``elastic.write.persist``):
``step, rank, world_size, generation, layout, file, chunks`` (tensor key -> its
``ChunkRecord``s), ``versions`` (the writing code), ``ram`` (the nodes whose RAM stores took a
copy), ``replicas`` (at world size > 1: the crc32 of every replicated model and optimizer tensor
held whole, ``elastic.write.replica_sums``; absent from the JSON when empty) and, from rank 0
only, ``skeletons`` (the state's JSON skeletons) and ``catalog`` (every logical tensor's
``TensorSpec``). Across Ray or the disk (a store group's
``shard-R-of-W-gG.safetensors.receipt.json``) it travels as JSON: ``to_json()``, and
``Receipt.from_json(obj)``, untrusted: a wrong type or missing field is a one-line
``ValueError`` naming it; nothing is unpickled.

``manifest_from_receipts(step, world_size, generation, receipts, *, block_bytes, versions)``
builds step's ``Manifest`` from all ``world_size`` receipts (rank -> receipt) with its
``manifest.json`` bytes (serialised once, checked and written as is: at tens of thousands of
chunks a manifest is tens of MB), or raises a one-line ``ValueError`` (abort the step) unless:

* rank 0's receipt carries the catalog (dtype, shape), the state skeletons and the layout;
* every rank runs rank 0's library versions (a mixed install could write unreadable shards);
* every rank wrote exactly its own shard of this generation (``shard_filename``: no straggler);
* every chunk names a catalog tensor, and each tensor's chunks cover exactly its elements;
* every rank holds every replicated tensor as rank 0 does (the same ``replicas`` checksums;
  one element that differs fails the step with ``elastic.errors.divergence_message``);
* the manifest passes every check a restore makes (``manifest_check.check_manifest``), so
  nothing is committed that a restore would refuse.

The manifest's ``versions`` are ``versions`` (the coordinator's) updated with rank 0's.
Nothing here reads storage.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from elastic.errors import ManifestError, divergence_message
from elastic.format import (
    ChunkRecord,
    Manifest,
    TensorRecord,
    check_manifest,
    json_kind,
    shard_filename,
    short_repr,
)

V = TypeVar("V")


@dataclass(frozen=True)
class TensorSpec:
    """A logical tensor of rank 0's catalog: its dtype (safetensors name) and full shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Receipt:
    """One rank's shard of ``step`` is durable (module docstring)."""

    step: int
    rank: int
    world_size: int
    generation: int
    layout: str
    file: str
    chunks: dict[str, tuple[ChunkRecord, ...]]
    versions: dict[str, str]
    ram: tuple[str, ...] = ()
    skeletons: dict[str, Any] | None = None  # rank 0 only
    catalog: dict[str, TensorSpec] | None = None  # rank 0 only
    replicas: dict[str, int] = field(default_factory=dict)  # key -> crc32 (world size > 1)

    def to_json(self) -> dict[str, Any]:
        """The receipt as a plain JSON object (its form on disk and over Ray)."""
        obj: dict[str, Any] = {
            "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "generation": self.generation, "layout": self.layout, "file": self.file,
            "ram": list(self.ram),
            "chunks": {k: [c.to_json() for c in v] for k, v in self.chunks.items()},
            "versions": self.versions,
        }
        if self.skeletons is not None:
            obj["skeletons"] = self.skeletons
        if self.replicas:
            obj["replicas"] = dict(self.replicas)
        if self.catalog is not None:
            obj["catalog"] = {k: {"dtype": t.dtype, "shape": list(t.shape)}
                              for k, t in self.catalog.items()}
        return obj

    @staticmethod
    def from_json(obj: object) -> Receipt:
        """A receipt from its JSON object (untrusted: ``ValueError`` naming what is wrong)."""
        if not isinstance(obj, dict):
            raise ValueError(f"receipt: expected an object, got {json_kind(obj)}")
        where = f"receipt of rank {short_repr(obj.get('rank'))}"
        catalog = obj.get("catalog")
        return Receipt(
            step=_int(obj, "step", where), rank=_int(obj, "rank", where),
            world_size=_int(obj, "world_size", where),
            generation=_int(obj, "generation", where),
            layout=_str(obj, "layout", where), file=_str(obj, "file", where),
            chunks=_mapping(obj, "chunks", where, lambda key, v: _chunks(v, f"{where}: "
                                                                             f"chunks of {key!r}")),
            versions=_mapping(obj, "versions", where, lambda key, v: _is(v, str, where)),
            ram=tuple(_is(n, str, where) for n in _is(obj.get("ram", []), list, where)),
            skeletons=None if obj.get("skeletons") is None else _is(obj["skeletons"], dict,
                                                                     where),
            catalog=None if catalog is None else _mapping(
                obj, "catalog", where, lambda key, v: _spec(v, f"{where}: catalog {key!r}")),
            replicas={} if "replicas" not in obj else _mapping(
                obj, "replicas", where, lambda key, v: _crc(v, f"{where}: replicas {key!r}")),
        )


def json_size(obj: object) -> int:
    """The bytes of ``obj`` as compact JSON (what a coordinator counts as handled)."""
    return len(json.dumps(obj, separators=(",", ":")))


def _is(value: object, kind: type[V], where: str) -> V:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {kind.__name__}, got {json_kind(value)} "
                         f"{short_repr(value)}")
    return value


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    if key not in obj:
        raise ValueError(f"{where}: no {key!r}")
    return _is(obj[key], int, f"{where}: {key}")


def _str(obj: dict[str, Any], key: str, where: str) -> str:
    if key not in obj:
        raise ValueError(f"{where}: no {key!r}")
    return _is(obj[key], str, f"{where}: {key}")


def _mapping(obj: dict[str, Any], key: str, where: str,
             value: Callable[[str, Any], V]) -> dict[str, V]:
    if key not in obj:
        raise ValueError(f"{where}: no {key!r}")
    entries = _is(obj[key], dict, f"{where}: {key}")
    return {k: value(k, v) for k, v in entries.items()}


def _chunks(value: object, where: str) -> tuple[ChunkRecord, ...]:
    try:
        return tuple(ChunkRecord.from_json(c) for c in _is(value, list, where))
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as err:
        raise ValueError(f"{where}: a malformed chunk ({type(err).__name__}: "
                         f"{short_repr(err)})") from None


def _crc(value: object, where: str) -> int:
    crc = _is(value, int, where)
    if not 0 <= crc < 2**32:
        raise ValueError(f"{where}: {crc} is no crc32")
    return crc


def _spec(value: object, where: str) -> TensorSpec:
    entry = _is(value, dict, where)
    shape = _is(entry.get("shape"), list, f"{where}: shape")
    return TensorSpec(dtype=_is(entry.get("dtype"), str, f"{where}: dtype"),
                      shape=tuple(_is(n, int, f"{where}: shape") for n in shape))


def manifest_from_receipts(
    step: int,
    world_size: int,
    generation: int,
    receipts: dict[int, Receipt],
    *,
    block_bytes: int,
    versions: dict[str, str],
) -> tuple[Manifest, bytes]:
    """The manifest of ``step`` from its ranks' receipts, checked (module docstring)."""
    head = receipts.get(0)
    if head is None or head.catalog is None:
        raise ValueError(f"step {step}: rank 0's receipt lacks the tensor catalog")
    if head.skeletons is None:
        raise ValueError(f"step {step}: rank 0's receipt lacks the state skeletons")
    tensors = {k: TensorRecord(dtype=v.dtype, shape=v.shape) for k, v in head.catalog.items()}
    files = []
    for rank in sorted(receipts):
        receipt = receipts[rank]
        if receipt.versions != head.versions:
            raise ValueError(
                f"step {step}: rank {rank} runs {receipt.versions}, "
                f"rank 0 runs {head.versions}; install the same Baton "
                "on every node"
            )
        if receipt.file != shard_filename(rank, world_size, generation):
            raise ValueError(
                f"step {step}: rank {rank} wrote {receipt.file!r}, not its "
                f"generation-{generation} shard"
            )
        files.append(receipt.file)
        for key, chunks in receipt.chunks.items():
            if key not in tensors:
                raise ValueError(f"step {step}: rank {rank} wrote unknown tensor {key!r}")
            tensors[key].chunks.extend(chunks)
    _check_replicas(step, receipts)
    for key, rec in tensors.items():
        covered = sum(math.prod(c.shape) for c in rec.chunks)
        if covered != math.prod(rec.shape):
            raise ValueError(
                f"step {step}: chunks of {key!r} cover {covered} of {math.prod(rec.shape)} elements"
            )
    manifest = Manifest(
        step=step,
        world_size=world_size,
        layout=head.layout,
        block_bytes=block_bytes,
        tensors=tensors,
        state=head.skeletons,
        files=files,
        versions={**versions, **head.versions},
    )
    data = manifest.to_bytes()
    try:
        check_manifest(json.loads(data), f"step {step}", step)
    except ManifestError as err:
        raise ValueError(str(err)) from None
    return manifest, data


def _check_replicas(step: int, receipts: dict[int, Receipt]) -> None:
    """Refuse the step when a rank's checksum of a replicated tensor is not rank 0's."""
    head = receipts[0].replicas
    keys = set(head).union(*(r.replicas for r in receipts.values()))
    for key in sorted(keys):
        differ = [rank for rank, r in sorted(receipts.items())
                  if r.replicas.get(key) != head.get(key)]
        if differ:
            raise ValueError(divergence_message(key, step, [0, *differ]))
