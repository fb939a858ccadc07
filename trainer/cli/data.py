"""`baton data ...`: prepare a corpus, inspect a prepared dataset.

Contract: `register(subparsers)` adds the `data` group with two commands; each sets
`func(args) -> int` (0 on success). Errors in user input print one line on stderr naming the
field or file and return 2 (a `--out` that cannot be written, that resolves (links
included) inside a local source, a Baton run directory other than its `data/` or another
dataset directory, or that exists and is not a directory, is found before any source is
read; a URI that is not a prepared dataset directory, an unsupported scheme or an unknown
split is named as such); nothing here executes code from a dataset.

    baton data prepare --out URI [--seq-len N] [--val-fraction F] [--max-bytes N]
                       [--tokenizer PATH | --train-tokenizer VOCAB] [--eos-token TEXT]
                       [--text-field NAME] [--text-column NAME] [--workers N] [--ray]
                       [--overwrite] [--quiet] [SOURCE ...]
    baton data inspect URI [--split NAME] [--verify] [--show K] [--json]

`--ray` (or `RAY_ADDRESS` set, unless `--no-ray`) tokenizes on the Ray cluster.
`inspect --show` decodes sequences with the dataset's stored tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any

from data_state import (
    DatasetManifest,
    TokenDataset,
    join_uri,
    prepare_corpus,
    read_manifest,
    resolve_uri,
    write_atomic,
)
from elastic.storage import (
    DATASET_MARKER,
    RUN_MARKERS,
    dataset_output_problem,
    output_problem,
    storage_errors,
)


def register(subparsers: Any) -> None:
    data = subparsers.add_parser("data", help="prepare and inspect token datasets")
    commands = data.add_subparsers(dest="data_command", metavar="COMMAND")

    _add_prepare(commands)
    _add_inspect(commands)
    data.set_defaults(func=lambda _args: (data.print_help(), 2)[1])


def _add_prepare(commands: Any) -> None:
    """`data prepare SOURCE... --out URI`: documents -> Parquet token shards."""
    prepare = commands.add_parser(
        "prepare",
        help="text, JSON Lines, Parquet or save_to_disk inputs -> Parquet token shards",
        description="Tokenize documents into fixed-length token sequences and write Parquet "
        "shards plus dataset.json to URI (a local path or s3://bucket/prefix). A document is "
        "a text file, or a row of a .jsonl/.parquet file or of a datasets save_to_disk "
        "directory. Nothing is downloaded.",
    )
    prepare.add_argument(
        "paths",
        nargs="*",
        metavar="SOURCE",
        help="files, directories, globs or s3:// URIs; none = the embedded default corpus",
    )
    prepare.add_argument("--out", required=True, help="dataset URI (directory or s3://...)")
    prepare.add_argument(
        "--seq-len",
        type=int,
        default=256,
        help="tokens stored per sequence (gives seq_len-1 predictions)",
    )
    prepare.add_argument(
        "--val-fraction",
        type=float,
        default=0.05,
        help="share of source bytes (whole files) held out as the val split",
    )
    prepare.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="use only the first files (sorted by name) up to this many bytes",
    )
    tokenizer = prepare.add_mutually_exclusive_group()
    tokenizer.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="PATH",
        help="a tokenizer.json (Hugging Face tokenizers) or a local model directory holding "
        "one; default: bytes (vocab 256). Never downloaded",
    )
    tokenizer.add_argument(
        "--train-tokenizer",
        type=int,
        default=None,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB ids on the train split and store it",
    )
    prepare.add_argument(
        "--eos-token",
        default=None,
        metavar="TEXT",
        help="end-of-document token of --tokenizer (default: its own EOS)",
    )
    prepare.add_argument("--text-field", default="text", help="JSON Lines: the text field")
    prepare.add_argument("--text-column", default="text", help="Parquet/Arrow: the text column")
    prepare.add_argument(
        "--workers", type=int, default=1, help="tokenize in N processes (same output for any N)"
    )
    prepare.add_argument(
        "--ray",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tokenize on a Ray cluster with Ray Data (default: when RAY_ADDRESS is set)",
    )
    prepare.add_argument("--overwrite", action="store_true", help="replace a dataset at --out")
    prepare.add_argument("--quiet", action="store_true", help="no progress output")
    prepare.set_defaults(func=_prepare)


def _add_inspect(commands: Any) -> None:
    """`data inspect URI`: a dataset's summary, its checks, its first sequences."""
    inspect = commands.add_parser("inspect", help="summarise (and optionally verify) a dataset")
    inspect.add_argument("uri", help="dataset URI (directory or s3://...)")
    inspect.add_argument("--split", default=None, help="only this split (default: all)")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="read every shard and check its file and token checksums",
    )
    inspect.add_argument(
        "--show", type=int, default=0, metavar="K", help="print the first K sequences as text"
    )
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.set_defaults(func=_inspect)


def _fail(command: str, message: object) -> int:
    """One line on stderr (logs are parsed line by line); exit code 2 (bad input)."""
    print(f"baton data {command}: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def _check_writable(out: str) -> None:
    """Raise `OSError`/`ValueError` unless a file can be created under `out`: write and
    delete a probe there, before minutes of reading sources. A local directory created
    just for the probe is removed again. Buckets are never created."""
    fs, root = resolve_uri(out)
    if fs.isfile(root):
        raise NotADirectoryError(f"{out} is a file, not a directory")
    created: list[str] = []  # local directories the probe makes, deepest first
    path = root
    while fs.is_local and not os.path.exists(path):
        created.append(path)
        path = os.path.dirname(path)
    probe = join_uri(root, f".baton-probe-{uuid.uuid4().hex[:8]}")
    write_atomic(fs, probe, b"ok")
    fs.remove(probe)
    for directory in created:
        os.rmdir(directory)


def _out_problem(out: str, sources: list[str]) -> str | None:
    """Why `--out` must not be written: it resolves (links included) inside a local source
    (the prepare would read what it writes), inside a Baton run directory anywhere but its
    `data/` (where `baton fit` prepares the default corpus), or inside another dataset
    directory; or it exists and is not a directory (`elastic.storage.outputs`). On S3 the
    run and dataset directories are found by their markers above `out`."""
    remote = "://" in out and not out.startswith("file://")
    if not remote:
        bases = [s.removeprefix("file://").split("*")[0].split("?")[0].split("[")[0]
                 for s in sources if "://" not in s or s.startswith("file://")]
        problem = output_problem(out, [b for b in bases if b], what="the source")
        return problem or dataset_output_problem(out)
    fs, root = resolve_uri(out)
    parts = root.split("/")
    # From the deepest ancestor up to the bucket: a run directory above `out` (unless `out`
    # is in its data/), a dataset directory strictly above it.
    for depth in range(len(parts), 0, -1):
        ancestor = "/".join(parts[:depth])
        below = parts[depth: depth + 1]
        shown = f"{out.split('://', 1)[0]}://{ancestor}"
        if below and fs.isfile(join_uri(ancestor, DATASET_MARKER)):
            return (f"{out} is inside the dataset directory {shown}; write the new dataset "
                    "elsewhere, outside every run and dataset directory")
        if below != ["data"] and any(fs.isfile(join_uri(ancestor, marker))
                                     for marker in RUN_MARKERS):
            return (f"{out} is inside the run directory {shown}, which holds only what Baton "
                    "writes there (a run's own dataset goes in its data/); write it elsewhere")
    return None


def _prepare(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        problem = _out_problem(args.out, args.paths)
        if problem:
            return _fail("prepare", f"--out {problem}")
        _check_writable(args.out)
    except ValueError as err:  # empty or unsupported URI
        return _fail("prepare", f"--out: {err}")
    except storage_errors() as err:  # S3 credentials, endpoint
        return _fail("prepare", f"--out {args.out!r} is not writable "
                                f"({type(err).__name__}: {getattr(err, 'strerror', None) or err}); "
                                "choose a directory you can write (or s3://bucket/prefix)")
    try:
        manifest = prepare_corpus(
            args.paths or None,
            args.out,
            seq_len=args.seq_len,
            val_fraction=args.val_fraction,
            max_bytes=args.max_bytes,
            tokenizer=args.tokenizer,
            train_tokenizer=args.train_tokenizer,
            eos_token=args.eos_token,
            text_field=args.text_field,
            text_column=args.text_column,
            workers=args.workers,
            use_ray=bool(os.environ.get("RAY_ADDRESS")) if args.ray is None else args.ray,
            overwrite=args.overwrite,
            progress=not args.quiet,
        )
    except ValueError as err:  # bad option, source, tokenizer or rows; pyarrow's ArrowInvalid
        return _fail("prepare", err)
    except OSError as err:  # a source that cannot be read, --out failing mid-way
        name = f" {err.filename!r}" if err.filename else ""
        return _fail("prepare", f"cannot read or write{name} "
                                f"({type(err).__name__}: {err.strerror or err})")
    except storage_errors() as err:  # an s3:// source: credentials, endpoint
        return _fail("prepare", f"cannot read the sources {' '.join(args.paths)} "
                                f"({type(err).__name__}: {err}); check the AWS credentials "
                                "and endpoint in the environment")
    elapsed = time.perf_counter() - started
    files, row_inputs = manifest.sources["files"], manifest.sources["row_inputs"]
    rows = sum(r["train_rows"] + r["val_rows"] for r in row_inputs)
    megabytes = (sum(f["bytes"] for f in files) + sum(r["bytes"] for r in row_inputs)) / 1e6
    bad_rows = manifest.sources["skipped_rows"]
    print(
        f"prepared {args.out} in {elapsed:.1f} s from {len(files)} files"
        + (f" and {rows:,} rows of {len(row_inputs)} inputs" if row_inputs else "")
        + f" ({megabytes:.1f} MB, {len(manifest.sources['skipped'])} files skipped"
        + "".join(f", {n:,} rows skipped: {reason}" for reason, n in bad_rows.items())
        + f"); tokenizer {_tokenizer_line(manifest)}"
    )
    for line in _split_lines(manifest):
        print(line)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    try:
        fs, root = resolve_uri(args.uri)
        if fs.isfile(root):
            return _fail("inspect", f"{args.uri} is a file, not a prepared dataset (pass the "
                                    "directory that holds dataset.json)")
        manifest = read_manifest(args.uri)
        if args.split and args.split not in manifest.splits:
            return _fail("inspect", f"--split {args.split!r}: {args.uri} has no such split; "
                                    f"splits: {', '.join(sorted(manifest.splits))}")
        splits = [args.split] if args.split else sorted(manifest.splits)
        summary: dict[str, Any] = {
            "uri": args.uri,
            "seq_len": manifest.seq_len,
            "tokenizer": manifest.tokenizer,
            "vocab_size": manifest.vocab_size,
            "token_dtype": manifest.token_dtype,
            "eod_token": manifest.eod_token,
            "tokenizer_sha256": manifest.tokenizer_sha256,
            "special_tokens": manifest.special_tokens,
            "splits": {},
        }
        for split in splits:
            with TokenDataset(args.uri, split) as ds:
                if args.verify:
                    ds.verify()
                summary["splits"][split] = {
                    "fingerprint": ds.fingerprint,
                    "sequences": len(ds),
                    "tokens": manifest.splits[split].num_tokens,
                    "shards": len(manifest.splits[split].shards),
                    "verified": bool(args.verify),
                    "first": [ds.decode(ds[i]) for i in range(min(args.show, len(ds)))],
                }
    except ValueError as err:  # DatasetError: absent, malformed, checksum mismatch
        return _fail("inspect", err)
    except storage_errors() as err:  # not a directory, permissions, S3 credentials
        reason = getattr(err, "strerror", None) or err
        return _fail("inspect", f"cannot read {args.uri!r} ({type(err).__name__}: "
                                f"{reason}); is it a prepared dataset?")
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print(
        f"{args.uri}: seq_len {manifest.seq_len}, tokenizer {_tokenizer_line(manifest)}, "
        f"{len(manifest.sources.get('files', []))} source files"
        + (f" and {len(manifest.sources['row_inputs'])} row inputs"
           if manifest.sources.get("row_inputs") else "")
    )
    for line in _split_lines(manifest, only=splits):
        print(line)
    for split in splits:
        entry = summary["splits"][split]
        print(
            f"  {split}: fingerprint {entry['fingerprint']}"
            + ("  checksums OK" if args.verify else "")
        )
        for i, text in enumerate(entry["first"]):
            print(f"--- {split}[{i}] ---\n{text}")
    return 0


def _split_lines(manifest: DatasetManifest, only: list[str] | None = None) -> list[str]:
    return [
        f"  {name}: {info.num_sequences:,} sequences x {manifest.seq_len} = "
        f"{info.num_tokens:,} tokens in {len(info.shards)} shard(s)"
        for name, info in sorted(manifest.splits.items())
        if only is None or name in only
    ]


def _tokenizer_line(manifest: DatasetManifest) -> str:
    stored = (f" ({manifest.tokenizer_file}, sha256 {manifest.tokenizer_sha256[:12]}...)"
              if manifest.tokenizer_sha256 else "")
    return (f"{manifest.tokenizer}{stored}, vocab {manifest.vocab_size:,} "
            f"({manifest.token_dtype}), end of document = id {manifest.eod_token}")
