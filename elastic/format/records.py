"""The snapshot format: manifest records, safetensors headers and chunk checksums.

Contract
--------
A snapshot of step ``s`` of a run lives in ``RUN/snapshots/{s:09d}/``:

* ``shard-{rank:05d}-of-{world_size:05d}-g{generation:06d}.safetensors`` (``shard_filename``
  writes it, ``parse_shard_name`` reads that grammar back, generations past 999,999 included;
  both bounded by ``MAX_GENERATION``) — plain safetensors files (8-byte little-endian
  header length, JSON header, raw little-endian bytes). Each entry is one *chunk*: a
  hyper-rectangle of a logical tensor, named ``"<tensor key>@<o0>,<o1>,..."`` after its
  offsets into the logical tensor.
* ``manifest.json`` — written last; its presence is the commit. It lists every logical
  tensor (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...) with its global shape, dtype
  and the chunks covering it (file, absolute byte range in the file, offsets, shape, crc32
  per ``block_bytes`` block), plus all non-tensor state as plain JSON (``state``: one JSON
  tree per registered component, tensors replaced by ``{"__tensor__": key}``).

This module holds the records, their serialisation and the safetensors header (built by
``build_header``, parsed untrusted by ``parse_header``). A manifest is untrusted input
(P8, docs/design.md): it is decoded and validated by
``elastic.format.manifest_check.parse_manifest``, whose contract lists every check; anything
malformed is one ``ManifestError`` line.

Everything here is pure data and pure functions: no torch.distributed, no storage, no Ray.
Nothing read from a snapshot is ever executed or unpickled; JSON and raw bytes only.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from elastic.errors import ManifestError, SnapshotIntegrityError

try:  # zlib-ng's crc32 is zlib's CRC-32, bit for bit, ~6x faster (carry-less multiply SIMD):
    # restore verifies every byte it reads, and at zlib's ~4 GB/s that alone is a third of
    # torch.load's time for the same state. Same values either way: the format does not change.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without a zlib-ng wheel
    from zlib import crc32

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "baton-snapshot"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
RECEIPT_SUFFIX = ".receipt.json"
# Checksums cover fixed-size blocks of a chunk so a worker that reads only part of a chunk
# (resharding) can still verify what it read, at the cost of reading at most two partial blocks.
DEFAULT_BLOCK_BYTES = 4 << 20
LAYOUTS = ("ddp", "fsdp")

# A safetensors header longer than this is refused before it is read, so a corrupt length
# fails clearly instead of as a huge read; a manifest's bounds live in
# elastic.format.manifest_check.
MAX_HEADER_BYTES = 100 << 20

# Tags of the JSON skeletons (elastic.state.registry encodes and decodes them).
TENSOR_TAG = "__tensor__"
TUPLE_TAG = "__tuple__"
ITEMS_TAG = "__items__"  # dicts whose keys are not all strings (e.g. int-keyed)

# Bytes per element of each safetensors dtype name a snapshot may use. A literal table, not
# torch's: this module is torch-free at import so that the framework-neutral reader
# (``elastic.portable``) shares it; the torch dtypes are mapped only where torch is used.
_ST_ITEMSIZE: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1,
}
# The safetensors dtype names a snapshot may use.
DTYPE_NAMES: frozenset[str] = frozenset(_ST_ITEMSIZE)


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """Safetensors name -> torch dtype (torch imported on first use only; built once: capture
    and restore look a dtype up per tensor)."""
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@functools.cache
def _torch_names() -> dict[torch.dtype, str]:
    return {dt: name for name, dt in _torch_dtypes().items()}


def dtype_to_str(dtype: torch.dtype) -> str:
    names = _torch_names()
    if dtype not in names:
        raise ValueError(f"dtype {dtype} cannot be snapshotted; supported: {list(names)}")
    return names[dtype]


def str_to_dtype(name: str) -> torch.dtype:
    dtypes = _torch_dtypes()
    if name not in dtypes:
        raise ManifestError(f"unknown dtype {name!r} in snapshot; known: {sorted(dtypes)}")
    return dtypes[name]


def itemsize(name: str) -> int:
    """Bytes per element of the safetensors dtype ``name`` (a validated, known name)."""
    return _ST_ITEMSIZE[name]


def step_dirname(step: int) -> str:
    return f"{step:09d}"


# Bounds of the numbers a shard file name carries: a name is written by shard_filename and
# read by parse_shard_name, one grammar. A run that somehow reaches MAX_GENERATION worker-group
# attempts is refused in one line (elastic.coord.generation), never named in a form no reader takes.
MAX_GENERATION = 999_999_999
MAX_NAMED_WORLD_SIZE = 9_999_999
# "-gNNNNNN" has at least six digits; the older form without it is what format version 1
# snapshots made before generations existed.
SHARD_NAME_RE = re.compile(r"shard-(\d{5,7})-of-(\d{5,7})(?:-g(\d{6,9}))?\.safetensors")


def generation_tag(generation: int) -> str:
    """The part of a file name that says which generation wrote it: ``-gNNNNNN.`` (receipts
    and temporary files of a shard carry it too)."""
    if not 0 <= generation <= MAX_GENERATION:
        raise ValueError(f"generation {generation} is outside [0, {MAX_GENERATION}]")
    return f"-g{generation:06d}."


def shard_filename(rank: int, world_size: int, generation: int) -> str:
    """A shard's file name carries the worker-group generation that wrote it, so a name is
    never reused: a redone step of a later generation writes other files."""
    if not 0 <= rank < world_size <= MAX_NAMED_WORLD_SIZE:
        raise ValueError(f"rank {rank} of world size {world_size} cannot be named (world "
                         f"sizes up to {MAX_NAMED_WORLD_SIZE})")
    return f"shard-{rank:05d}-of-{world_size:05d}{generation_tag(generation)}safetensors"


def parse_shard_name(name: object) -> tuple[int, int, int | None] | None:
    """``(rank, world_size, generation)`` of a shard file name exactly as ``shard_filename``
    writes it (generation None: the older form without one), else None."""
    if not isinstance(name, str):
        return None
    match = SHARD_NAME_RE.fullmatch(name)
    if match is None:
        return None
    rank, world = int(match.group(1)), int(match.group(2))
    generation = None if match.group(3) is None else int(match.group(3))
    canonical = (f"shard-{rank:05d}-of-{world:05d}.safetensors" if generation is None
                 else f"shard-{rank:05d}-of-{world:05d}-g{generation:06d}.safetensors")
    return (rank, world, generation) if canonical == name else None


def is_shard_name(name: object) -> bool:
    """Whether ``name`` may appear as a file of a manifest: a bare shard file name."""
    return parse_shard_name(name) is not None


def chunk_name(key: str, offsets: tuple[int, ...]) -> str:
    return f"{key}@{','.join(str(o) for o in offsets)}"


def crc32_blocks(data: memoryview | bytes, block_bytes: int) -> list[int]:
    """crc32 of each ``block_bytes`` block of ``data`` (the last block may be short)."""
    view = memoryview(data)
    if len(view) == 0:
        return [0]
    return [crc32(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes)]


def block_count(nbytes: int, block_bytes: int) -> int:
    """How many crc32 values ``crc32_blocks`` gives for ``nbytes`` bytes (at least one)."""
    return max(1, -(-nbytes // block_bytes))


@dataclass(frozen=True)
class ChunkRecord:
    """One rectangle of a logical tensor stored contiguously (row-major) in one file."""

    file: str
    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    byte_range: tuple[int, int]  # absolute [start, end) in `file`
    crc32: tuple[int, ...]  # one per block_bytes block of the chunk's bytes
    # Its tensor's dtype, as the parsed manifest says (a reader checks the values of a
    # floating chunk where it checks its bytes); not part of the chunk's JSON: "" when the
    # record did not come from a parsed manifest.
    dtype: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        del obj["dtype"]
        return obj

    @staticmethod
    def from_json(obj: dict[str, Any]) -> ChunkRecord:
        """A chunk from a worker's receipt (trusted: written by this run's own workers)."""
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

    def nbytes(self) -> int:
        return sum(c.byte_range[1] - c.byte_range[0] for t in self.tensors.values()
                   for c in t.chunks)


# ---------------------------------------------------------------------------- messages


def json_kind(value: object) -> str:
    """The JSON name of ``value``'s type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    for typ, name in ((int, "int"), (float, "float"), (str, "str"), (list, "list"),
                      (dict, "object")):
        if isinstance(value, typ):
            return name
    return type(value).__name__


def short_repr(value: object, limit: int = 60) -> str:
    """A one-line, bounded rendering of an untrusted value for an error message."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]  # relative to the start of the data section


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: where the data section starts and each entry by name."""

    data_start: int  # absolute: 8 + header length
    entries: dict[str, HeaderEntry]


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


def header_length(first8: bytes, where: str) -> int:
    """The JSON header's length from a file's first 8 bytes (bounded)."""
    if len(first8) < 8:
        raise SnapshotIntegrityError(f"{where}: file shorter than a safetensors header; "
                                     "truncated")
    (n,) = struct.unpack("<Q", first8[:8])
    if n > MAX_HEADER_BYTES:
        raise SnapshotIntegrityError(f"{where}: header length {n} is implausible; corrupt file")
    return int(n)


def parse_header(data: bytes, where: str) -> SafetensorsHeader:
    """Parse a safetensors header from a file's first bytes (the 8-byte length and at least
    the whole JSON header). Untrusted: a malformed header is ``SnapshotIntegrityError``."""
    n = header_length(data, where)
    if len(data) < 8 + n:
        raise SnapshotIntegrityError(f"{where}: header is {n} bytes but only {len(data) - 8} "
                                     "were given")
    try:
        obj = json.loads(data[8: 8 + n])
    except (ValueError, RecursionError) as err:
        raise SnapshotIntegrityError(f"{where}: safetensors header is not JSON; corrupt") \
            from err
    if not isinstance(obj, dict):
        raise SnapshotIntegrityError(f"{where}: safetensors header is not a JSON object")
    entries: dict[str, HeaderEntry] = {}
    for name, e in obj.items():
        if name == "__metadata__":
            continue
        entry = _header_entry(name, e)
        if entry is None:
            raise SnapshotIntegrityError(f"{where}: safetensors header entry "
                                         f"{short_repr(name)} is malformed; corrupt file")
        entries[name] = entry
    return SafetensorsHeader(data_start=8 + n, entries=entries)


def _header_entry(name: str, e: object) -> HeaderEntry | None:
    if not isinstance(e, dict):
        return None
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or not _int_list(shape) or not _int_list(offs):
        return None
    assert isinstance(shape, list) and isinstance(offs, list)
    if len(offs) != 2 or not 0 <= offs[0] <= offs[1]:
        return None
    return HeaderEntry(name=name, dtype=dtype, shape=tuple(shape),
                       data_offsets=(offs[0], offs[1]))


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
