"""The snapshot format: manifest records, safetensors headers and chunk checksums.

Contract
--------
A snapshot of step ``s`` of a run lives in ``RUN/snapshots/{s:09d}/``:

* ``shard-{rank:05d}-of-{world_size:05d}.safetensors`` — plain safetensors files (8-byte
  little-endian header length, JSON header, raw little-endian bytes). Each entry is one
  *chunk*: a hyper-rectangle of a logical tensor, named ``"<tensor key>@<o0>,<o1>,..."``
  after its offsets into the logical tensor.
* ``manifest.json`` — written last; its presence is the commit. It lists every logical
  tensor (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...) with its global shape, dtype
  and the chunks covering it (file, absolute byte range in the file, offsets, shape, crc32
  per ``block_bytes`` block), plus all non-tensor state as plain JSON (``state``: one JSON
  tree per registered component, tensors replaced by ``{"__tensor__": key}``).

Everything here is pure data and pure functions: no torch.distributed, no storage, no Ray.
Nothing read from a snapshot is ever executed or unpickled; JSON and raw bytes only.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

FORMAT_NAME = "baton-snapshot"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
RECEIPT_SUFFIX = ".receipt.json"
# Checksums cover fixed-size blocks of a chunk so a worker that reads only part of a chunk
# (resharding) can still verify what it read, at the cost of reading at most two partial blocks.
DEFAULT_BLOCK_BYTES = 4 << 20

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_TO_ST.items()}


def dtype_to_str(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_TO_ST:
        raise ValueError(f"dtype {dtype} cannot be snapshotted; supported: {list(_DTYPE_TO_ST)}")
    return _DTYPE_TO_ST[dtype]


def str_to_dtype(name: str) -> torch.dtype:
    if name not in _ST_TO_DTYPE:
        raise ValueError(f"unknown dtype {name!r} in snapshot; known: {sorted(_ST_TO_DTYPE)}")
    return _ST_TO_DTYPE[name]


def step_dirname(step: int) -> str:
    return f"{step:09d}"


def shard_filename(rank: int, world_size: int, generation: int) -> str:
    """A shard's file name carries the worker-group generation that wrote it, so a name is
    never reused: a redone step of a later generation writes other files."""
    return f"shard-{rank:05d}-of-{world_size:05d}-g{generation:06d}.safetensors"


# The only file names a manifest may list (no directories, no path separators). The older
# form without "-gNNNNNN" is what format version 1 snapshots made before generations hold.
SHARD_NAME_RE = re.compile(r"shard-\d{5}-of-\d{5}(?:-g\d{6})?\.safetensors")


def chunk_name(key: str, offsets: tuple[int, ...]) -> str:
    return f"{key}@{','.join(str(o) for o in offsets)}"


def crc32_blocks(data: memoryview | bytes, block_bytes: int) -> list[int]:
    """crc32 of each ``block_bytes`` block of ``data`` (the last block may be short)."""
    view = memoryview(data)
    if len(view) == 0:
        return [0]
    return [zlib.crc32(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


@dataclass(frozen=True)
class ChunkRecord:
    """One rectangle of a logical tensor stored contiguously (row-major) in one file."""

    file: str
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    byte_range: tuple[int, int]  # absolute [start, end) in `file`
    crc32: tuple[int, ...]  # one per block_bytes block of the chunk's bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(obj: dict[str, Any]) -> ChunkRecord:
        return ChunkRecord(
            file=str(obj["file"]),
            name=str(obj["name"]),
            offsets=tuple(int(x) for x in obj["offsets"]),
            shape=tuple(int(x) for x in obj["shape"]),
            byte_range=(int(obj["byte_range"][0]), int(obj["byte_range"][1])),
            crc32=tuple(int(x) for x in obj["crc32"]),
        )


@dataclass
class TensorRecord:
    """A logical (unsharded) tensor and the chunks that cover it exactly once."""

    dtype: str
    shape: tuple[int, ...]
    chunks: list[ChunkRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunks": [c.to_json() for c in self.chunks],
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> TensorRecord:
        return TensorRecord(
            dtype=str(obj["dtype"]),
            shape=tuple(int(x) for x in obj["shape"]),
            chunks=[ChunkRecord.from_json(c) for c in obj["chunks"]],
        )


@dataclass
class Manifest:
    """Everything a reader needs; serialised as ``manifest.json``."""

    step: int
    world_size: int
    layout: str
    block_bytes: int
    tensors: dict[str, TensorRecord]
    state: dict[str, Any]  # component key -> JSON skeleton with {"__tensor__": key} leaves
    files: list[str]
    versions: dict[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        obj = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "layout": self.layout,
            "checksum": {"algo": "crc32", "block_bytes": self.block_bytes},
            "files": self.files,
            "versions": self.versions,
            "tensors": {k: v.to_json() for k, v in sorted(self.tensors.items())},
            "state": self.state,
        }
        return json.dumps(obj, indent=1).encode()

    @staticmethod
    def from_bytes(data: bytes, where: str = "manifest.json") -> Manifest:
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{where}: not valid JSON ({err}); the snapshot is corrupt") from err
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise ValueError(f"{where}: 'format' is not {FORMAT_NAME!r}; not a Baton snapshot")
        if int(obj.get("version", -1)) > FORMAT_VERSION:
            raise ValueError(
                f"{where}: format version {obj['version']} is newer than this Baton "
                f"({FORMAT_VERSION}); upgrade Baton to read it"
            )
        try:
            return Manifest(
                step=int(obj["step"]),
                world_size=int(obj["world_size"]),
                layout=str(obj["layout"]),
                block_bytes=int(obj["checksum"]["block_bytes"]),
                tensors={k: TensorRecord.from_json(v) for k, v in obj["tensors"].items()},
                state=dict(obj["state"]),
                files=[str(f) for f in obj["files"]],
                versions=dict(obj.get("versions", {})),
            )
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(f"{where}: missing or malformed field {err}; corrupt") from err

    def nbytes(self) -> int:
        return sum(c.byte_range[1] - c.byte_range[0] for t in self.tensors.values()
                   for c in t.chunks)


# ---------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]  # relative to the start of the data section


def build_header(entries: list[HeaderEntry]) -> bytes:
    """8-byte length + JSON header, padded with spaces so the data section is 8-aligned."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "baton"}}
    for e in entries:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": list(e.data_offsets),
        }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


def parse_header_length(first8: bytes, where: str) -> int:
    if len(first8) != 8:
        raise ValueError(f"{where}: file shorter than a safetensors header; truncated")
    (n,) = struct.unpack("<Q", first8)
    if n > 100 << 20:
        raise ValueError(f"{where}: header length {n} is implausible; corrupt file")
    return n


def parse_header(raw: bytes, where: str) -> dict[str, HeaderEntry]:
    """Parse the JSON header (without the 8-byte prefix) into entries by name."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{where}: safetensors header is not JSON ({err}); corrupt") from err
    out: dict[str, HeaderEntry] = {}
    for name, e in obj.items():
        if name == "__metadata__":
            continue
        out[name] = HeaderEntry(
            name=name,
            dtype=str(e["dtype"]),
            shape=tuple(int(x) for x in e["shape"]),
            data_offsets=(int(e["data_offsets"][0]), int(e["data_offsets"][1])),
        )
    return out
