"""The dataset manifest: a small JSON file (`dataset.json`) at the root of a prepared dataset.

Contract: `DatasetManifest.from_json` accepts only what `to_json` writes (format
`baton.tokens/1`) and raises `DatasetError` naming the file and field otherwise. Loading is
plain JSON: nothing in a manifest is executed.

Layout of a prepared dataset:

    URI/dataset.json                    # this manifest, written last (its presence = complete)
    URI/train/part-00000.parquet        # Parquet shards, one column `tokens`
    URI/val/part-00000.parquet

Each Parquet row is one sequence: `tokens` is a FIXED_LEN_BYTE_ARRAY of `seq_len` tokens in
`token_dtype` (little-endian). `seq_len` counts stored tokens: a language model that predicts
token t+1 from tokens <= t (as `trainer/train/model.py` does) gets `seq_len - 1` predictions per
sequence.

`fingerprint(split)` is the dataset identity a data cursor is tied to. It hashes only what
defines the samples (format, tokenizer, dtype, seq_len, split, each shard's token checksum and
row count, and for a stored tokenizer its file's SHA-256), not where the dataset is stored
nor which library wrote the Parquet bytes, so a local copy and an S3 copy of the same dataset
share a fingerprint, and the same tokens read through another tokenizer do not.

A dataset made with a Hugging Face `tokenizers` tokenizer stores it next to the manifest
(`tokenizer_file`, a plain file name, normally `tokenizer.json`) with its SHA-256
(`tokenizer_sha256`) and special tokens (`special_tokens`, text -> id). The byte tokenizer
(`tokenizer = "bytes"`) stores no file. Manifests written before these fields existed read
as byte datasets with no stored tokenizer, and keep their fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic.storage import loads_json

FORMAT = "baton.tokens/1"
MANIFEST_NAME = "dataset.json"
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
SEQ_LEN_NOTE = (
    "seq_len counts stored tokens per sequence; next-token training on tokens[:, :-1] -> "
    "tokens[:, 1:] gets seq_len - 1 predictions per sequence"
)


class DatasetError(ValueError):
    """A prepared dataset is missing, corrupt or inconsistent; the message names the file."""


@dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the dataset root
    num_sequences: int
    num_bytes: int  # size of the Parquet file
    sha256: str  # of the Parquet file's bytes: detects corruption without decoding
    tokens_sha256: str  # of the decoded token bytes: the content, whatever wrote the file


@dataclass(frozen=True)
class SplitInfo:
    num_sequences: int
    num_tokens: int
    num_dropped_tokens: int  # the tail of the split's token stream that fills no sequence
    shards: tuple[ShardInfo, ...]


@dataclass(frozen=True)
class DatasetManifest:
    seq_len: int
    token_dtype: str
    tokenizer: str
    vocab_size: int
    eod_token: int | None  # appended after every source document; None if not used
    rows_per_group: int
    splits: dict[str, SplitInfo]
    sources: dict[str, Any] = field(default_factory=dict)  # files, checksums, split, skipped
    tokenizer_file: str | None = None  # stored tokenizer, relative to the root (None: bytes)
    tokenizer_sha256: str | None = None  # of the stored tokenizer file's bytes
    special_tokens: dict[str, int] = field(default_factory=dict)  # text -> id
    made_by: dict[str, Any] = field(default_factory=dict)  # tool, options, library versions
    format: str = FORMAT
    seq_len_note: str = SEQ_LEN_NOTE

    def split(self, name: str, *, where: str = MANIFEST_NAME) -> SplitInfo:
        if name not in self.splits:
            raise DatasetError(
                f"{where}: no split {name!r}; this dataset has {sorted(self.splits)}"
            )
        return self.splits[name]

    def fingerprint(self, split: str) -> str:
        info = self.split(split)
        identity = {
            "format": self.format,
            "tokenizer": self.tokenizer,
            "token_dtype": self.token_dtype,
            "seq_len": self.seq_len,
            "split": split,
            "shards": [[s.tokens_sha256, s.num_sequences] for s in info.shards],
        }
        if self.tokenizer_sha256 is not None:  # absent for bytes: old fingerprints stay valid
            identity["tokenizer_sha256"] = self.tokenizer_sha256
            identity["vocab_size"] = self.vocab_size
            identity["eod_token"] = self.eod_token
        blob = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:20]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = MANIFEST_NAME) -> DatasetManifest:
        try:  # bounded (size, depth, numbers): a crafted file is one line, never a traceback
            raw = loads_json(text, where)
        except ValueError as err:
            raise DatasetError(f"{err}: prepare the dataset again") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise DatasetError(f"{where}: format is {found!r}, expected {FORMAT!r}")
        try:
            splits = {
                name: SplitInfo(
                    num_sequences=_int(s, "num_sequences"),
                    num_tokens=_int(s, "num_tokens"),
                    num_dropped_tokens=_int(s, "num_dropped_tokens"),
                    shards=tuple(_shard(sh, where) for sh in s["shards"]),
                )
                for name, s in raw["splits"].items()
            }
            manifest = cls(
                seq_len=_int(raw, "seq_len"),
                token_dtype=str(raw["token_dtype"]),
                tokenizer=str(raw["tokenizer"]),
                vocab_size=_int(raw, "vocab_size"),
                eod_token=raw.get("eod_token"),
                rows_per_group=_int(raw, "rows_per_group"),
                splits=splits,
                sources=dict(raw.get("sources", {})),
                tokenizer_file=_optional_str(raw, "tokenizer_file"),
                tokenizer_sha256=_optional_str(raw, "tokenizer_sha256"),
                special_tokens={
                    str(k): _int({"id": v}, "id")
                    for k, v in dict(raw.get("special_tokens", {})).items()
                },
                made_by=dict(raw.get("made_by", {})),
            )
        except (KeyError, TypeError, AttributeError) as err:
            raise DatasetError(f"{where}: missing or malformed field ({err!r})") from None
        manifest.validate(where=where)
        return manifest

    def validate(self, *, where: str = MANIFEST_NAME) -> None:
        if self.seq_len < 2:
            raise DatasetError(f"{where}: seq_len must be >= 2, got {self.seq_len}")
        if self.token_dtype not in TOKEN_DTYPES:
            raise DatasetError(
                f"{where}: token_dtype {self.token_dtype!r} is not one of {TOKEN_DTYPES}"
            )
        if self.rows_per_group < 1:
            raise DatasetError(f"{where}: rows_per_group must be >= 1")
        capacity = 1 << int(self.token_dtype[4:])  # "uint16" -> 65536 ids
        if not 1 <= self.vocab_size <= capacity:
            raise DatasetError(
                f"{where}: vocab_size {self.vocab_size} does not fit token_dtype "
                f"{self.token_dtype} (1..{capacity})"
            )
        if self.eod_token is not None and not (
            isinstance(self.eod_token, int) and 0 <= self.eod_token < self.vocab_size
        ):
            raise DatasetError(
                f"{where}: eod_token {self.eod_token!r} is not a token id below vocab_size "
                f"{self.vocab_size}"
            )
        if (self.tokenizer_file is None) != (self.tokenizer_sha256 is None):
            raise DatasetError(f"{where}: tokenizer_file and tokenizer_sha256 go together")
        if self.tokenizer_file is not None and not _plain_name(self.tokenizer_file):
            # Untrusted input (P8): the stored tokenizer is a file in the dataset's own root.
            raise DatasetError(
                f"{where}: tokenizer_file {self.tokenizer_file!r} must be a plain file name "
                "inside the dataset directory"
            )
        if any(not 0 <= i < self.vocab_size for i in self.special_tokens.values()):
            raise DatasetError(f"{where}: a special token id is outside vocab_size")
        for name, info in self.splits.items():
            total = sum(s.num_sequences for s in info.shards)
            if total != info.num_sequences:
                raise DatasetError(
                    f"{where}: split {name!r} lists {info.num_sequences} sequences but its "
                    f"shards hold {total}"
                )
            if info.num_tokens != info.num_sequences * self.seq_len:
                raise DatasetError(
                    f"{where}: split {name!r} num_tokens {info.num_tokens} != "
                    f"num_sequences * seq_len ({info.num_sequences} * {self.seq_len})"
                )


def _int(raw: dict[str, Any], key: str) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _optional_str(raw: dict[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{key} must be a string or null, got {value!r}")
    return value


def _shard(raw: Any, where: str) -> ShardInfo:
    """A shard entry, every field typed; its path stays inside the dataset directory (P8)."""
    if not isinstance(raw, dict) or set(raw) != _SHARD_FIELDS:
        raise DatasetError(f"{where}: a shard entry must have exactly the fields "
                           f"{sorted(_SHARD_FIELDS)}; got {raw!r:.200}")
    path = raw["path"]
    if not isinstance(path, str) or "\0" in path \
            or not all(_plain_name(part) for part in path.split("/")):
        raise DatasetError(f"{where}: shard path {path!r:.200} must be a relative path of plain "
                           "names inside the dataset directory (like 'train/part-00000.parquet')")
    for key in ("sha256", "tokens_sha256"):
        if not isinstance(raw[key], str) or not _SHA256_HEX.fullmatch(raw[key]):
            raise DatasetError(f"{where}: shard {path}: {key} must be 64 lowercase hex digits")
    try:
        return ShardInfo(path=path, num_sequences=_int(raw, "num_sequences"),
                         num_bytes=_int(raw, "num_bytes"), sha256=raw["sha256"],
                         tokens_sha256=raw["tokens_sha256"])
    except TypeError as err:
        raise DatasetError(f"{where}: shard {path}: {err}") from None


_SHARD_FIELDS = {"path", "num_sequences", "num_bytes", "sha256", "tokens_sha256"}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _plain_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")
