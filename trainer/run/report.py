"""`baton report RUN_URI`: one PNG that tells the story of a run, plus a summary table.

Contract: `write_report(run_uri, out_png)` reads the run's metrics (`trainer.run.metrics`) and
draws four panels: training and validation loss per step (each worker-group attempt in its
own colour, so steps redone after a failure show as overlapping segments), tokens per
second, world size over wall time with each restart marked (red) and each in-process
recovery or join (blue, with the seconds it took), and a summary table. Returns
the `RunSummary`. Raises `ValueError` for a run URI that is empty or not a local path or
s3:// (the only schemes Baton supports), `FileNotFoundError` naming the run if it does not
exist or has no valid metrics yet, `OSError` naming `out_png` if it cannot be written, and
`ValueError` if `out_png` resolves (links included) inside any run or dataset directory
(an `--out` that is a link to a manifest would destroy a committed snapshot) or exists and is
not a regular file (a device, a FIFO): `elastic.storage.outputs`. The PNG is written beside
`out_png` and renamed over it: a link there is replaced, its target untouched.
Invalid metrics records are skipped with a warning (`trainer.run.metrics.read_records`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from elastic.storage import (  # noqa: E402
    Storage,
    file_output_problem,
    output_location,
    replaced_file,
    storage_errors,
)
from trainer.run.metrics import RunSummary, read_records, summarize  # noqa: E402
from trainer.run.terminal import summary_rows  # noqa: E402


def _check_run_uri(run_uri: str) -> None:
    """Refuse a run URI no Baton run can have: empty, another scheme, or nothing there."""
    if not run_uri:
        raise ValueError("run URI is empty: pass the run directory (a local path or "
                         "s3://bucket/prefix/NAME)")
    scheme, sep, _ = run_uri.partition("://")
    if sep and scheme not in ("s3", "file"):
        raise ValueError(f"run URI {run_uri!r}: unsupported scheme {scheme}://; Baton runs "
                         "live on local paths or s3:// only")
    try:
        io = Storage(run_uri)
        is_dir = io.isdir(io.root)
        is_file = not is_dir and io.isfile(io.root)
    except storage_errors() as err:  # S3 bucket, credentials, endpoint
        raise OSError(f"run {run_uri!r} cannot be read ({type(err).__name__}: {err})") from err
    if not is_dir:
        what = "is a file, not a run directory" if is_file else "does not exist"
        raise FileNotFoundError(f"run {run_uri!r} {what} (pass the --run-dir of a `baton fit`)")


def write_report(run_uri: str, out_png: str | Path) -> RunSummary:
    _check_run_uri(run_uri)
    out_png = str(out_png)
    problem = file_output_problem(out_png)  # links resolved, before any work
    if problem:
        raise ValueError(f"--out {problem}")
    records = read_records(run_uri)
    steps = [r for r in records if r["kind"] == "step"]
    if not steps:
        raise FileNotFoundError(f"run {run_uri!r} has no metrics yet (metrics/part-*.jsonl)")
    starts = [r for r in records if r["kind"] == "start"]
    summary = summarize(records)
    t0 = min(r["time"] for r in steps + starts)

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax_loss, ax_speed, ax_world, ax_table = axes.flat
    attempts = sorted({r["attempt"] for r in steps})
    colours = plt.get_cmap("tab10")
    for attempt in attempts:
        mine = [r for r in steps if r["attempt"] == attempt]
        colour = colours(attempt % 10)
        ax_loss.plot([r["step"] for r in mine], [r["loss"] for r in mine], color=colour,
                     label=f"train (attempt {attempt}, {mine[0]['world_size']} workers)")
        vals = [r for r in mine if r.get("val_loss") is not None]
        if vals:
            ax_loss.plot([r["step"] for r in vals], [r["val_loss"] for r in vals], "o--",
                         color=colour, label=f"val (attempt {attempt})")
        ax_speed.plot([r["step"] for r in mine], [r["tokens_per_s"] for r in mine], color=colour)
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    ax_loss.legend(fontsize=7)
    ax_speed.set(xlabel="step", ylabel="tokens / s", title="Throughput")

    # Start records mark the moment a group of a new size began, so include them.
    timeline = [r for r in records if "world_size" in r]
    ax_world.step([r["time"] - t0 for r in timeline], [r["world_size"] for r in timeline],
                  where="post", color="black")
    for start in starts[1:]:
        ax_world.axvline(start["time"] - t0, color="red", linestyle=":")
        ax_world.annotate(f"restart @ step {start['step']}", (start["time"] - t0, 0.5),
                          rotation=90, fontsize=7, color="red")
    for recovery in (r for r in records if r["kind"] == "recovery"):
        lost = recovery.get("reason") == "failure"
        ax_world.axvline(recovery["time"] - t0, color="tab:blue", linestyle="--")
        label = (f"lost, in-process @ step {recovery['step']} ({recovery['seconds']:.2f} s)"
                 if lost else f"joined @ step {recovery['step']}")
        ax_world.annotate(label, (recovery["time"] - t0, 0.5), rotation=90, fontsize=7,
                          color="tab:blue")
        ax_loss.axvline(recovery["step"], color="tab:blue", linestyle="--", linewidth=0.8)
    ax_world.set(xlabel="seconds since start", ylabel="workers", title="World size",
                 ylim=(0, max(r["world_size"] for r in steps) + 1))

    ax_table.axis("off")
    shown = ("steps", "final_loss", "final_val_loss", "restarts", "recovered_in_process",
             "steps_redone", "world_sizes", "mean_tokens_per_s")
    summary_dict = summary.to_dict()
    rows = summary_rows({key: summary_dict[key] for key in shown})  # as the terminal shows
    table = ax_table.table(cellText=[list(row) for row in rows], loc="center")
    table.scale(1, 1.6)
    fig.suptitle(f"Baton run {run_uri}")
    fig.tight_layout()
    try:
        Path(output_location(out_png)).parent.mkdir(parents=True, exist_ok=True)
        # Beside out_png, renamed over it at the end: a link there is replaced, not followed.
        with replaced_file(out_png) as scratch, open(scratch, "wb") as fh:
            fig.savefig(fh, format="png", dpi=100)
    except OSError as err:
        raise OSError(f"cannot write the report to {str(out_png)!r} "
                      f"({err.strerror or err}); choose another --out") from err
    finally:
        plt.close(fig)
    return summary
