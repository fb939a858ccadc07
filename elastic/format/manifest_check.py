"""Validation of an untrusted ``manifest.json``: from parsed JSON to a ``Manifest``.

Contract
--------
A manifest is untrusted input (P8, docs/design.md): it may be truncated, edited by hand or crafted.
``parse_manifest(data, where, step)`` decodes the JSON bytes and ``check_manifest(obj, where,
step)`` checks the decoded JSON; each returns a ``Manifest`` only for a well-formed one;
anything else raises ``ManifestError``, one line naming the snapshot (``where``), the field
and what is wrong:

* every field has its JSON type (an int is an int, not a bool, float or string); ``step >=
  0``, ``world_size >= 1``, ``layout`` in ``LAYOUTS``, ``1 <= block_bytes <= 1 GiB``;
* ``tensors`` is non-empty; every dtype is a known safetensors name; every shape is a list of
  non-negative ints with at most ``MAX_ELEMENTS`` elements; the chunks of a tensor lie inside
  it and cover it exactly once; a chunk's byte range starts at >= 0 and spans exactly
  prod(shape) x itemsize bytes, with one crc32 per ``block_bytes`` block of that range;
* every file name (in ``files`` and in chunks) is a bare shard name (``parse_shard_name``, no
  path separator) and every chunk's file is listed in ``files``;
* ``state`` is a tree of JSON values with well-formed tags; every ``{"__tensor__": name}``
  names a tensor of ``tensors`` under its own component (``"<component>.``...), and every
  tensor is referenced exactly once.

What the manifest cannot prove alone is checked when the files are read (``elastic.read.restore``
compares each used chunk with its file's safetensors header,
``elastic.format.records.parse_header``) and when the state is loaded (``StateRegistry.check_state``
compares it with the live components). Pure functions of the JSON: nothing is read, allocated per
element or executed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NoReturn

from elastic.errors import ManifestError
from elastic.format.records import (
    DTYPE_NAMES,
    FORMAT_NAME,
    FORMAT_VERSION,
    ITEMS_TAG,
    LAYOUTS,
    MANIFEST_NAME,
    TENSOR_TAG,
    TUPLE_TAG,
    ChunkRecord,
    Manifest,
    TensorRecord,
    block_count,
    chunk_name,
    is_shard_name,
    itemsize,
    json_kind,
    short_repr,
)
from elastic.storage import JSONBoundsError, loads_json

# Bounds of a sane manifest. They exist so a crafted manifest fails with a clear error
# instead of an allocation failure or an overflow deep inside torch or the OS.
MAX_ELEMENTS = 1 << 48  # per logical tensor (a 256 TiB fp8 tensor; far beyond any model)
MAX_DIMS = 32
MAX_BLOCK_BYTES = 1 << 30
MAX_WORLD_SIZE = 1 << 20
MAX_BYTE_OFFSET = 1 << 62
MAX_STATE_DEPTH = 64  # JSON nesting of one component's state (real ones are < 10 deep)
MAX_MANIFEST_BYTES = 1 << 30  # a manifest (or receipt) file; real ones: KiB to tens of MiB


def parse_manifest(data: bytes, where: str = MANIFEST_NAME, step: int | None = None
                   ) -> Manifest:
    """Decode (``elastic.storage.json_bounds``: size, depth and number bounds) and validate an
    untrusted ``manifest.json``; ``step``, when given, is the step the manifest must say it
    is."""
    try:  # a snapshot's JSON state may hold inf/nan (a user's sentinel): json.dumps wrote it
        obj = loads_json(data, where, max_bytes=MAX_MANIFEST_BYTES, nonfinite=True)
    except JSONBoundsError as err:
        raise ManifestError(f"{err}; the snapshot is corrupt") from err
    return check_manifest(obj, where, step)


def check_manifest(obj: object, where: str, step: int | None = None) -> Manifest:
    """The ``Manifest`` that the decoded JSON ``obj`` describes, once every check of the
    module contract holds; ``step``, when given, is the step it must say it is."""
    return _ManifestParser(where).parse(obj, step)


class _ManifestParser:
    """Validates one manifest's JSON; every failure is one ``ManifestError`` line."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, what: str) -> NoReturn:
        raise ManifestError(f"{self.where}: field {path}: {what}; the manifest is corrupt or "
                            "was edited")

    def get(self, obj: dict[str, Any], key: str, path: str) -> Any:
        if key not in obj:
            self.fail(f"{path}.{key}" if path else key, "missing")
        return obj[key]

    def int_(self, value: object, path: str, lo: int, hi: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"expected an int, got {json_kind(value)} {short_repr(value)}")
        if not lo <= value <= hi:
            self.fail(path, f"{value} is outside [{lo}, {hi}]")
        return value

    def str_(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            self.fail(path, f"expected a string, got {json_kind(value)} {short_repr(value)}")
        return value

    def list_(self, value: object, path: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {json_kind(value)} {short_repr(value)}")
        return value

    def dict_(self, value: object, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(path, f"expected an object, got {json_kind(value)} {short_repr(value)}")
        return value

    def file_name(self, value: object, path: str) -> str:
        name = self.str_(value, path)
        if not is_shard_name(name):
            self.fail(path, f"{short_repr(name)} is not a bare shard file name "
                            "(shard-NNNNN-of-NNNNN[-gNNNNNN].safetensors)")
        return name

    def ints(self, value: object, path: str, hi: int, length: int | None = None
             ) -> tuple[int, ...]:
        items = self.list_(value, path)
        if length is not None and len(items) != length:
            self.fail(path, f"has {len(items)} entries, expected {length}")
        if len(items) > MAX_DIMS:
            self.fail(path, f"has {len(items)} dimensions; at most {MAX_DIMS} are supported")
        return self.int_items(items, path, hi)

    def int_items(self, items: list[Any], path: str, hi: int) -> tuple[int, ...]:
        """Every item an int in [0, hi] (``int_``'s checks; the per-item paths and messages
        are built only for a bad list: a manifest holds one crc32 per MiB of state)."""
        if all(type(x) is int and 0 <= x <= hi for x in items):
            return tuple(items)
        return tuple(self.int_(x, f"{path}[{i}]", 0, hi) for i, x in enumerate(items))

    # ------------------------------------------------------------------ the manifest

    def parse(self, obj: object, step: int | None) -> Manifest:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise ManifestError(f"{self.where}: 'format' is not {FORMAT_NAME!r}; not a Baton "
                                "snapshot")
        version = self.get(obj, "version", "")
        if isinstance(version, int) and not isinstance(version, bool) \
                and version > FORMAT_VERSION:
            raise ManifestError(f"{self.where}: format version {version} is newer than this "
                                f"Baton ({FORMAT_VERSION}); upgrade Baton to read it")
        self.int_(version, "version", 1, FORMAT_VERSION)
        got_step = self.int_(self.get(obj, "step", ""), "step", 0, MAX_BYTE_OFFSET)
        if step is not None and got_step != step:
            self.fail("step", f"says {got_step} but the snapshot is step {step}; moved or edited")
        world_size = self.int_(self.get(obj, "world_size", ""), "world_size", 1, MAX_WORLD_SIZE)
        layout = self.str_(self.get(obj, "layout", ""), "layout")
        if layout not in LAYOUTS:
            self.fail("layout", f"{short_repr(layout)} is not one of {list(LAYOUTS)}")
        checksum = self.dict_(self.get(obj, "checksum", ""), "checksum")
        if self.get(checksum, "algo", "checksum") != "crc32":
            self.fail("checksum.algo", f"{short_repr(checksum['algo'])} is not 'crc32'")
        block_bytes = self.int_(self.get(checksum, "block_bytes", "checksum"),
                                "checksum.block_bytes", 1, MAX_BLOCK_BYTES)
        files = [self.file_name(f, f"files[{i}]")
                 for i, f in enumerate(self.list_(self.get(obj, "files", ""), "files"))]
        if len(set(files)) != len(files):
            self.fail("files", "lists a file twice")
        versions = self.dict_(obj.get("versions", {}), "versions")
        for k, v in versions.items():
            self.str_(v, f"versions.{k}")
        raw_tensors = self.dict_(self.get(obj, "tensors", ""), "tensors")
        if not raw_tensors:
            self.fail("tensors", "is empty; a snapshot holds at least one tensor")
        listed = set(files)
        tensors = {key: self.tensor(key, rec, block_bytes, listed)
                   for key, rec in raw_tensors.items()}
        self.unique_chunks(tensors)
        state = self.dict_(self.get(obj, "state", ""), "state")
        self.state(state, tensors)
        return Manifest(step=got_step, world_size=world_size, layout=layout,
                        block_bytes=block_bytes, tensors=tensors, state=state, files=files,
                        versions=dict(versions))

    def tensor(self, key: str, obj: object, block_bytes: int, files: set[str]) -> TensorRecord:
        path = f"tensors[{short_repr(key)}]"
        if not key or "." not in key:
            self.fail(path, "a tensor key is '<component>.<name>'")
        rec = self.dict_(obj, path)
        dtype = self.str_(self.get(rec, "dtype", path), f"{path}.dtype")
        if dtype not in DTYPE_NAMES:
            self.fail(f"{path}.dtype", f"unknown dtype {short_repr(dtype)}; known: "
                                        f"{sorted(DTYPE_NAMES)}")
        shape = self.ints(self.get(rec, "shape", path), f"{path}.shape", MAX_ELEMENTS)
        if math.prod(shape) > MAX_ELEMENTS:
            self.fail(f"{path}.shape", f"{list(shape)} has {math.prod(shape)} elements, more "
                                        f"than {MAX_ELEMENTS}")
        chunks = [self.chunk(key, c, f"{path}.chunks[{i}]", dtype, shape, block_bytes, files)
                  for i, c in enumerate(self.list_(self.get(rec, "chunks", path),
                                                   f"{path}.chunks"))]
        self.exact_cover(path, shape, chunks)
        return TensorRecord(dtype=dtype, shape=shape, chunks=chunks)

    def chunk(self, key: str, obj: object, path: str, dtype: str, tshape: tuple[int, ...],
              block_bytes: int, files: set[str]) -> ChunkRecord:
        c = self.dict_(obj, path)
        file = self.file_name(self.get(c, "file", path), f"{path}.file")
        if file not in files:
            self.fail(f"{path}.file", f"{file} is not listed in 'files'")
        offsets = self.ints(self.get(c, "offsets", path), f"{path}.offsets", MAX_ELEMENTS,
                            len(tshape))
        shape = self.ints(self.get(c, "shape", path), f"{path}.shape", MAX_ELEMENTS,
                          len(tshape))
        for d, (o, s, n) in enumerate(zip(offsets, shape, tshape, strict=True)):
            if o + s > n:
                self.fail(path, f"offsets {list(offsets)} + shape {list(shape)} leave the "
                                f"tensor's shape {list(tshape)} in dimension {d}")
        name = self.str_(self.get(c, "name", path), f"{path}.name")
        if name != chunk_name(key, offsets):
            self.fail(f"{path}.name", f"{short_repr(name)} is not "
                                      f"{chunk_name(key, offsets)!r} (key@offsets)")
        span = self.ints(self.get(c, "byte_range", path), f"{path}.byte_range",
                         MAX_BYTE_OFFSET, 2)
        nbytes = math.prod(shape) * itemsize(dtype)
        if span[1] - span[0] != nbytes:
            self.fail(f"{path}.byte_range", f"{list(span)} spans {span[1] - span[0]} bytes but "
                                            f"shape {list(shape)} of {dtype} needs {nbytes}")
        crcs = self.list_(self.get(c, "crc32", path), f"{path}.crc32")
        blocks = block_count(nbytes, block_bytes)
        if len(crcs) != blocks:
            self.fail(f"{path}.crc32", f"has {len(crcs)} checksums; {nbytes} bytes in blocks "
                                       f"of {block_bytes} need {blocks}")
        crc32 = self.int_items(crcs, f"{path}.crc32", 0xFFFFFFFF)
        return ChunkRecord(file=file, name=name, offsets=offsets, shape=shape,
                           byte_range=(span[0], span[1]), crc32=crc32, dtype=dtype)

    def exact_cover(self, path: str, shape: tuple[int, ...], chunks: list[ChunkRecord]
                    ) -> None:
        """Chunks inside the tensor (checked per chunk), pairwise disjoint and as many
        elements as the tensor: then they cover it exactly once (else a gap would be left
        uninitialised by a restore)."""
        covered = sum(math.prod(c.shape) for c in chunks)
        if covered != math.prod(shape):
            self.fail(f"{path}.chunks", f"cover {covered} of {math.prod(shape)} elements")
        boxes = [c for c in chunks if math.prod(c.shape) > 0]
        if all(c.offsets[1:] == (0,) * (len(shape) - 1) and c.shape[1:] == shape[1:]
               for c in boxes) and shape:
            # Row blocks (the common case): sorted by first row they must not overlap.
            rows = sorted((c.offsets[0], c.offsets[0] + c.shape[0]) for c in boxes)
            overlap = any(a[1] > b[0] for a, b in zip(rows, rows[1:], strict=False))
        else:
            overlap = any(_boxes_overlap(a, b) for i, a in enumerate(boxes)
                          for b in boxes[i + 1:])
        if overlap:
            self.fail(f"{path}.chunks", "overlap each other")

    def unique_chunks(self, tensors: dict[str, TensorRecord]) -> None:
        seen: set[tuple[str, str]] = set()
        for key, rec in tensors.items():
            for c in rec.chunks:
                if (c.file, c.name) in seen:
                    self.fail(f"tensors[{short_repr(key)}].chunks",
                              f"chunk {c.name} of {c.file} is listed twice")
                seen.add((c.file, c.name))

    # ------------------------------------------------------------------ the JSON state

    def state(self, state: dict[str, Any], tensors: dict[str, TensorRecord]) -> None:
        referenced: set[str] = set()
        for comp, tree in state.items():
            if not comp or "." in comp or comp.startswith("__"):
                self.fail(f"state[{short_repr(comp)}]", "is not a component key")
            for path, name in self.tensor_refs(tree, f"state.{comp}", 0):
                if name not in tensors:
                    self.fail(path, f"refers to tensor {short_repr(name)}, which is not in "
                                    "'tensors'")
                if not name.startswith(comp + "."):
                    self.fail(path, f"tensor {short_repr(name)} belongs to another component "
                                    f"than {comp!r}")
                if name in referenced:
                    self.fail(path, f"tensor {short_repr(name)} is referenced twice")
                referenced.add(name)
        unused = sorted(set(tensors) - referenced)
        if unused:
            self.fail("tensors", f"{short_repr(unused)} are referenced by no state")

    def tensor_refs(self, value: object, path: str, depth: int) -> Iterator[tuple[str, str]]:
        """(path, name) of every tensor reference in a state tree, checking its tags."""
        if depth > MAX_STATE_DEPTH:
            self.fail(path, f"is nested more than {MAX_STATE_DEPTH} levels deep")
        if isinstance(value, dict):
            tagged = [k for k in value if k in (TENSOR_TAG, TUPLE_TAG, ITEMS_TAG)]
            if tagged and len(value) != 1:
                self.fail(path, f"a {tagged[0]} object has other keys too")
            if TENSOR_TAG in value:
                yield path, self.str_(value[TENSOR_TAG], f"{path}.{TENSOR_TAG}")
            elif TUPLE_TAG in value:
                for i, v in enumerate(self.list_(value[TUPLE_TAG], f"{path}.{TUPLE_TAG}")):
                    yield from self.tensor_refs(v, f"{path}[{i}]", depth + 1)
            elif ITEMS_TAG in value:
                pairs = self.list_(value[ITEMS_TAG], f"{path}.{ITEMS_TAG}")
                for i, pair in enumerate(pairs):
                    where = f"{path}.{ITEMS_TAG}[{i}]"
                    if not isinstance(pair, list) or len(pair) != 2:
                        self.fail(where, "expected a [key, value] pair")
                    self.hashable_key(pair[0], where)
                    yield from self.tensor_refs(pair[1], f"{path}[{short_repr(pair[0])}]",
                                                depth + 1)
            else:
                for k, v in value.items():
                    if k.startswith("__"):
                        self.fail(f"{path}.{k}", "unknown tag")
                    yield from self.tensor_refs(v, f"{path}.{k}", depth + 1)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from self.tensor_refs(v, f"{path}[{i}]", depth + 1)

    def hashable_key(self, key: object, path: str) -> None:
        # A decoded key must be hashable: a scalar or a tuple of scalars.
        if isinstance(key, dict) and list(key) == [TUPLE_TAG] and isinstance(
                key[TUPLE_TAG], list):
            for k in key[TUPLE_TAG]:
                self.hashable_key(k, path)
            return
        if not (key is None or isinstance(key, (bool, int, float, str))):
            self.fail(path, f"key {short_repr(key)} is not a scalar")


def _boxes_overlap(a: ChunkRecord, b: ChunkRecord) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs
               in zip(a.offsets, a.shape, b.offsets, b.shape, strict=True))
