"""``baton snapshots ls|show|verify|export|rewind|restore-quarantined`` — a run's snapshots.

Contract: ``register(subparsers)`` adds the ``snapshots`` group; each command takes a run
URI (local path or ``s3://bucket/prefix/run``), prints to stdout and returns 0 on success,
1 when a snapshot is missing or corrupt or storage fails (the message names it on stderr),
2 for bad input: an empty run URI, another scheme than a local path or ``s3://``, a run
directory that does not exist, an ``--out`` that cannot be written, that resolves (links
included) inside any run or dataset directory, or that exists and is not what the format
writes (a device, a FIFO or a directory where a file goes: ``elastic.storage.outputs``).
An export is written beside ``--out`` and renamed over it at the end: a link there is
replaced, never written through, and a failure (a full disk) leaves nothing behind. Every
error is one line ``error: ...`` on stderr, never a traceback. A run URI may also be a
snapshot's directory, ``RUN/snapshots/000001200`` (what a ``ray.train.Checkpoint`` of the run
points at): the command reads run ``RUN`` at that step (``elastic.snapshot_ref``).
``rewind RUN --to STEP`` sets every committed snapshot newer than STEP aside (into
``quarantine/``, after verifying STEP) and says which and how to bring them back;
``restore-quarantined RUN [STEP]`` brings set-aside snapshots back when they verify and
nothing newer was committed since (``elastic.set_aside``; both hold the run lease, so a live
driver's run is refused in one line, exit 1). ``ls`` lists quarantined snapshots and step
entries refused as links too.
``ls`` and ``show`` accept ``--json`` for machine-readable output. ``export --format hf``
writes a Hugging Face model directory (``trainer.train.hf.export_hf``) for runs of an HF model and
refuses, in one line, a run of the built-in GPT. ``export --format npz`` writes every logical
tensor and the JSON state into one ``.npz`` file; ``--format orbax`` the run's JAX train state
(Flax params, AdamW moments and count) as an Orbax checkpoint in a new directory, with
``baton.json`` (data cursor, seed, AdamW settings, learning rates): ``trainer.on_jax.export``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable

from safetensors import SafetensorError

from elastic.catalog import describe, export_model, resolve_step, snapshot_rows, verify
from elastic.lease import LeaseHeldError, LeaseLostError
from elastic.snapshot_ref import split_snapshot_dir
from elastic.storage import (
    directory_output_problem,
    file_output_problem,
    merged_directory,
    replaced_file,
    storage_errors,
)
from elastic.store import SnapshotStore


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("snapshots", help="list, show, verify and export snapshots")
    sub = group.add_subparsers(dest="snapshots_command", metavar="ACTION", required=True)

    p = sub.add_parser("ls", help="list the snapshots of a run")
    p.add_argument("run_uri")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_guarded(_ls))

    p = sub.add_parser("show", help="describe one snapshot (default: newest committed)")
    p.add_argument("run_uri")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_guarded(_show))

    p = sub.add_parser("verify", help="re-read a snapshot and check every checksum")
    p.add_argument("run_uri")
    p.add_argument("step", nargs="?", type=int)
    p.set_defaults(func=_guarded(_verify))

    p = sub.add_parser(
        "export", help="write the model weights as one safetensors file, (--format hf) a "
                       "Hugging Face model directory, (--format orbax) the JAX train state as "
                       "an Orbax checkpoint, or (--format npz) every tensor in one .npz file",
        description="Export a committed snapshot (default: the newest). safetensors: the "
                    "model weights for inference. hf: a Hugging Face model directory. orbax: "
                    "a new directory OUT holding OUT/state, an Orbax checkpoint of {params "
                    "(the Flax tree), opt_state {count, mu, nu} (the AdamW moments), step} "
                    "that orbax.checkpoint.StandardCheckpointer().restore(OUT/state) reads "
                    "with no Baton import, and OUT/baton.json (data cursor, seed, AdamW "
                    "settings and decay mask, learning rate of every update, recipe). npz: "
                    "one file holding every logical tensor under its snapshot key, in "
                    "PyTorch layout, plus __state__ (the snapshot's JSON state), read by "
                    "numpy.load(OUT) without pickle. See docs/jax.md.")
    p.add_argument("run_uri")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--out", required=True,
                   help="output FILE.safetensors; the model directory for --format hf; a new "
                        "directory for --format orbax; FILE.npz for --format npz")
    p.add_argument("--format", choices=("safetensors", "hf", "orbax", "npz"),
                   default="safetensors",
                   help="hf: config.json, model.safetensors and the dataset's tokenizer, "
                        "loadable with AutoModelForCausalLM.from_pretrained (runs of "
                        "[model] hf_config / init_from only; needs baton-train[hf]); "
                        "orbax: the JAX train state as an Orbax checkpoint in a new directory "
                        "(needs baton-train[jax]); npz: every tensor and the JSON state in one "
                        ".npz file")
    p.set_defaults(func=_guarded(_export))

    p = sub.add_parser("rewind", help="set aside every committed snapshot newer than --to "
                                      "(they stay in quarantine/, restorable)")
    p.add_argument("run_uri")
    p.add_argument("--to", dest="to_step", type=int, required=True, metavar="STEP",
                   help="the committed step the run goes back to (it is verified first)")
    p.set_defaults(func=_guarded(_rewind))

    p = sub.add_parser("restore-quarantined",
                       help="move quarantined snapshots back when they verify and nothing "
                            "newer was committed since they were set aside")
    p.add_argument("run_uri")
    p.add_argument("step", nargs="?", type=int)
    p.set_defaults(func=_guarded(_restore_quarantined))


def _fail(err: Exception | str, code: int = 1) -> int:
    print(f"error: {' '.join(str(err).split())}", file=sys.stderr)  # one line: logs are parsed
    return code


def _bad_input(args: argparse.Namespace) -> str | None:
    """What is wrong with the run URI (or ``--out``) before any command reads it, or None."""
    uri = args.run_uri
    if not uri:
        return "the run URI is empty: pass a run directory (a local path or s3://bucket/prefix/run)"
    scheme, sep, _ = uri.partition("://")
    if sep and scheme not in ("s3", "file"):
        return (f"{uri}: unsupported scheme {scheme}://; snapshots are read from local paths "
                "and s3:// only")
    store = SnapshotStore(uri)
    if not store.isdir(store.root):
        if store.isfile(store.root):
            return f"{uri} is a file, not a run directory"
        return f"run directory {uri} does not exist"
    out = getattr(args, "out", None)
    if out is not None:
        return _out_problem(out, getattr(args, "format", "safetensors"))
    return None


def _out_problem(out: str, fmt: str) -> str | None:
    """What is wrong with ``--out`` for ``--format fmt`` (``elastic.storage.outputs``: never
    inside any run or dataset directory, never through a link, never over a device, FIFO or
    directory where a file goes), or None."""
    if not out:
        return "--out is empty: name the file (or, with --format hf, the directory) to write"
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        return f"--out {out}: directory {parent} does not exist or is not writable"
    problem = (file_output_problem(out) if fmt in ("safetensors", "npz")
               else directory_output_problem(out, new=fmt == "orbax"))
    return f"--out {problem}" if problem else None


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[..., int]:
    """``command`` with its input checked first (exit 2) and storage errors as one line
    (exit 1) instead of a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        named = split_snapshot_dir(args.run_uri or "")
        if named is not None:  # a snapshot's directory (a ray.train.Checkpoint's): its run
            given = getattr(args, "step", None)
            if given is not None and given != named[1]:
                return _fail(f"{args.run_uri} is snapshot {named[1]} but step {given} was "
                             "given: pass the run directory with a step, or the snapshot's", 2)
            args.run_uri = named[0]
            if hasattr(args, "step"):
                args.step = named[1]
        try:
            problem = _bad_input(args)
        except storage_errors() as err:  # S3 credentials, endpoint, permissions
            return _fail(f"{args.run_uri}: cannot read the run directory "
                         f"({type(err).__name__}: {err})", 2)
        if problem:
            return _fail(problem, 2)
        failures: tuple[type[Exception], ...] = (ValueError, SafetensorError, LeaseHeldError,
                                                 LeaseLostError, *storage_errors())
        try:
            return command(args)
        except failures as err:
            return _fail(err)

    return run


def _ls(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.run_uri)
    # Quarantined snapshots (rejected, never deleted) are listed with their reason too.
    rows = sorted(snapshot_rows(store) + [
        {"step": q["step"], "committed": False, "quarantined": True, "where": q["where"],
         "time": q["time"], "note": f"quarantined: {q['reason'] or '(no reason.json)'}"}
        for q in store.quarantined()], key=lambda r: r["step"])
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{args.run_uri}: no snapshots")
        return 0
    print(f"{'step':>10}  {'state':<11} {'world':>5}  {'layout':<6} {'MiB':>9}  note")
    for r in rows:
        state = ("quarantined" if r.get("quarantined") else "refused" if r.get("refused")
                 else "committed" if r["committed"] else "incomplete")
        mib = f"{r['bytes'] / 2**20:9.2f}" if "bytes" in r else " " * 9
        print(f"{r['step']:>10}  {state:<11} {r.get('world_size', ''):>5}  "
              f"{r.get('layout', ''):<6} {mib}  {r.get('note', '')}")
    return 0


def _rewind(args: argparse.Namespace) -> int:
    from elastic.lease import held_lease
    from elastic.set_aside import rewind

    store = SnapshotStore(args.run_uri)
    with held_lease(store) as lease:  # renewed: verifying a large snapshot may outlast the ttl
        moved = rewind(store, args.to_step, lease)
    print(f"rewound {args.run_uri} to snapshot {args.to_step}: set aside "
          + ", ".join(f"{step} (in {where})" for step, where in moved)
          + f"; bring them back with: baton snapshots restore-quarantined {args.run_uri}")
    return 0


def _restore_quarantined(args: argparse.Namespace) -> int:
    from elastic.lease import held_lease
    from elastic.set_aside import restore_quarantined

    store = SnapshotStore(args.run_uri)
    with held_lease(store) as lease:  # renewed: verifying a large snapshot may outlast the ttl
        restored, kept = restore_quarantined(store, args.step, lease)
    for step in restored:
        print(f"snapshot {step}: verified and committed again")
    for step, why in kept:
        print(f"snapshot {step}: stays quarantined: {why}")
    if not restored and not kept:
        print(f"{args.run_uri}: no quarantined snapshots")
    return 1 if kept else 0


def _show(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.run_uri)
    try:
        info = describe(store.load_manifest(resolve_step(store, args.step)))
    except ValueError as err:
        return _fail(err)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"snapshot {info['step']}: world_size {info['world_size']}, layout {info['layout']}, "
          f"{info['bytes'] / 2**20:.2f} MiB in {len(info['files'])} file(s)")
    for key, t in info["tensors"].items():
        print(f"  {key:<60} {t['dtype']:<5} {t['shape']}  chunks={t['chunks']}")
    for key, value in info["state"].items():
        text = json.dumps(value)
        print(f"  [{key}] {text[:200]}{'...' if len(text) > 200 else ''}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.run_uri)
    try:
        step = resolve_step(store, args.step)
        result = verify(store, step)
    except ValueError as err:
        return _fail(err)
    print(f"snapshot {step}: OK ({result['tensors']} tensors, {result['bytes']} bytes verified)")
    return 0


def _export(args: argparse.Namespace) -> int:
    store = SnapshotStore(args.run_uri)
    try:
        step = resolve_step(store, args.step)
        if args.format in ("orbax", "npz"):
            return _export_jax(args, step)
        if args.format == "hf":
            from trainer.train import export_hf  # the trainer's model side (optional extra)

            # Written beside --out, then moved in: no file of it is written through a link.
            with merged_directory(args.out) as scratch:
                n, tokenizer = export_hf(store, step, scratch)
            print(f"wrote snapshot {step} ({n} tensors) as a Hugging Face model with the "
                  f"{tokenizer} tokenizer to {args.out}")
            return 0
        with replaced_file(args.out) as scratch:  # renamed over --out (a link replaced)
            n = export_model(store, step, scratch)
    except ValueError as err:
        return _fail(err)
    print(f"wrote {n} tensors of snapshot {step} to {args.out}")
    return 0


def _export_jax(args: argparse.Namespace, step: int) -> int:
    """``--format npz`` (numpy only) or ``--format orbax`` (JAX's optional extra)."""
    from trainer.on_jax import export_npz, export_orbax

    if args.format == "npz":
        n = export_npz(args.run_uri, step, args.out)
        print(f"wrote {n} tensors and the state of snapshot {step} to {args.out}")
        return 0
    try:
        import orbax.checkpoint  # noqa: F401 - only to say what is missing, in one line
    except ImportError:
        return _fail("--format orbax needs JAX and Orbax: pip install 'baton-train[jax]'", 2)
    n = export_orbax(args.run_uri, step, args.out)
    print(f"wrote snapshot {step} ({n} parameter arrays, AdamW state) as an Orbax checkpoint "
          f"to {args.out}")
    return 0
