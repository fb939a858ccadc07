"""Recovery after a node loss: Baton against Ray Train's standard checkpoint recipe (issue 5).

One run of this script, on a local multi-node Ray cluster (`trainer.on_ray.local_cluster`: a head
with no CPUs and 2 worker nodes of 1 logical CPU), trains the same model, data order,
optimizer and schedule with both tools on 2 workers (`num_workers=(1, 2)`), kills a worker
node ungracefully once step LOSE_AT is reached, and lets each run finish on 1 worker (no node
comes back). Per tool it measures, from time-stamped per-step records:

- recovery_s: from `remove_worker()` to the first step completed after the restart
  (split into restart_s, until the new worker group has restored its state, and the rest);
- steps_redone: last step reached before the loss minus the step restored;
- warm: whether the optimizer resumed with its moments (Baton: the AdamW step counters of
  the final snapshot equal the total steps; standard: the restored AdamW step counter
  equals the restored step) and the learning rate at the first step after the restart;
- the loss curve around the failure (PNG).

The standard recipe (`standard_train_fn` below) is what a typical Ray Train user writes:
`prepare_model` (DDP), every k = snapshot_every steps rank 0 `torch.save`s
{model state_dict, optimizer state_dict, step} into a temp dir and every rank calls
`ray.train.report(metrics, checkpoint=Checkpoint.from_directory(dir) on rank 0)`; on start
it restores those three from `ray.train.get_checkpoint()`. It does NOT save the LR schedule
(a fresh scheduler restarts its warmup) nor the data position (a fresh iterator starts the
epoch again), as most user loops do not. Its "model only" variant (`standard-model`) is the
classic loop that saves just the model's state_dict: after a restart AdamW starts cold (no
moments, step 0), which shows as a bump in the loss curve. The per-step metrics of both go to a
JSON-lines file from rank 0 (reporting every step would cap them at one step per Ray
health-check interval). For a like-for-like step, they use Baton's model builder (BASIS
layers and their per-microbatch seeds), optimizer, schedule function and loader order; only
what is saved and restored differs.

Ray's failure detection dominates recovery, so two settings are measured, each in its own
subprocess (fresh cluster and environment): "fast" (`LocalCluster(fast_failure_detection=
True)`, Baton's default: GCS health checks 1 s x 3, worker-group start timeout 15 s) and
"ray-defaults" (Ray's own). The table reports each tool with its own defaults (Baton fast,
standard on Ray defaults) and under identical settings (all fast; the model-only variant runs
only there). Baton runs on `trainer.fit` as a user gets it (its `LiveNodesElasticPolicy`
included); the standard recipes on a plain `TorchTrainer`.

    python benchmarks/recovery.py           # writes benchmarks/results/recovery.{json,png}
    python benchmarks/recovery.py --quick   # fewer steps (a few minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
RECIPE = ROOT / "recipes" / "default.toml"


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    lose_at: int  # the node is killed once rank 0 reports this step
    snapshot_every: int  # Baton's snapshot interval = the standard recipe's checkpoint interval
    pace_s: float  # sleep per step, so the loss lands mid-run on a fast machine


PLANS = {
    "full": Plan(steps=200, lose_at=85, snapshot_every=10, pace_s=0.2),
    "quick": Plan(steps=60, lose_at=25, snapshot_every=10, pace_s=0.2),
}


def _config(plan: Plan, run: Path, dataset: str) -> Any:
    from trainer.config import load_recipe

    return load_recipe(RECIPE, [
        f'snapshots.run_uri="{run}"', f'data.uri="{dataset}"', f"steps={plan.steps}",
        f"snapshots.snapshot_every={plan.snapshot_every}", "eval.every=0",
        "scaling.min_workers=1", "scaling.max_workers=2",
    ])


# --------------------------------------------------------------------------- standard recipe


def standard_train_fn(config: dict[str, Any]) -> None:
    """Ray Train's documented checkpoint recipe, on Baton's model, optimizer and data order.
    `config["model_only"]`: save and restore only the model (the optimizer restarts cold)."""
    import ray.train
    import ray.train.torch
    import torch
    from ray.train import Checkpoint

    from data_state import ResumableLoader, TokenDataset
    from sketch_ops import sketch_seed
    from trainer.loop import build_model, next_token_loss
    from trainer.optim import WarmupCosine, build_optimizer
    from trainer.parallel import all_reduce_sum, loss_weight

    cfg, log_path, pace_s = config["cfg"], Path(config["log"]), config["pace_s"]
    model_only = bool(config.get("model_only", False))
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    model = ray.train.torch.prepare_model(build_model(cfg))
    plain = model.module if hasattr(model, "module") else model
    optimizer = build_optimizer(model, cfg.optim)
    start, restored_opt_step = 0, 0.0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            state = torch.load(Path(directory) / "state.pt", weights_only=True)  # no pickle code
        plain.load_state_dict(state["model"])
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
            restored_opt_step = float(next(iter(optimizer.state.values()))["step"])
        start = int(state["step"])
    # Created after the restore and not saved: it restarts its warmup, as a user's does.
    schedule = WarmupCosine(optimizer, cfg.optim, cfg.steps)
    train_set = TokenDataset(cfg.data.uri, split="train")
    loader = ResumableLoader(  # a fresh iterator: the epoch starts again after a restart
        train_set, global_batch=cfg.data.global_batch, microbatch_size=cfg.data.microbatch_size,
        seed=cfg.seed, rank=rank, world_size=world_size,
    )

    def log(record: dict[str, Any]) -> None:
        if rank == 0:
            with log_path.open("a") as out:
                out.write(json.dumps(record) + "\n")

    attempt = sum(1 for line in log_path.open() if '"start"' in line) if log_path.exists() else 0
    log({"kind": "start", "attempt": attempt, "step": start, "world_size": world_size,
         "time": time.time(), "restored_opt_step": restored_opt_step})
    weight = loss_weight(world_size, cfg.data.num_microbatches)
    for step in range(start, cfg.steps):
        microbatches = loader.next_step()
        step_loss = 0.0
        for i, mb in enumerate(microbatches):
            last = i == len(microbatches) - 1
            # prepare_model wraps in DDP only for world_size > 1: sync on the last microbatch.
            with contextlib.nullcontext() if last or not hasattr(model, "no_sync") else (
                model.no_sync()
            ):
                with sketch_seed(cfg.seed, step, mb.index):
                    loss = next_token_loss(model, mb.tokens)
                (loss * weight).backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        lr = schedule.lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        loader.advance()
        (loss_sum,) = all_reduce_sum([step_loss], torch.device("cpu"))
        metrics = {"step": step + 1, "loss": loss_sum / cfg.data.num_microbatches}
        log({"kind": "step", "attempt": attempt, **metrics, "lr": lr,
             "world_size": world_size, "time": time.time()})
        if (step + 1) % cfg.snapshots.snapshot_every == 0 or step + 1 == cfg.steps:
            if rank == 0:
                with tempfile.TemporaryDirectory() as directory:
                    state = {"model": plain.state_dict(), "step": step + 1}
                    if not model_only:
                        state["optimizer"] = optimizer.state_dict()
                    torch.save(state, Path(directory) / "state.pt")
                    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
            else:
                ray.train.report(metrics)
        time.sleep(pace_s)
    loader.close()
    train_set.close()


# --------------------------------------------------------------------------- one run per tool


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _kill_during(cluster: Any, target: Any, current_step: Any, plan: Plan) -> float:
    """Run `target` on a thread, kill a worker node (main thread: Ray installs signal
    handlers) once `current_step()` reaches LOSE_AT, wait for the end; returns the kill time."""
    error: list[BaseException] = []

    def body() -> None:
        try:
            target()
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            error.append(err)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    _wait(lambda: current_step() >= plan.lose_at or not thread.is_alive(), 300,
          f"step {plan.lose_at}")
    killed_at = time.time()
    cluster.remove_worker()
    thread.join(timeout=900)
    if error:
        raise error[0]
    if thread.is_alive():
        raise TimeoutError("the run did not finish within 900 s of the node loss")
    return killed_at


def run_baton(cluster: Any, plan: Plan, work: Path, dataset: str, tag: str) -> dict[str, Any]:
    import ray
    from safetensors.torch import load_file

    from elastic.catalog import export_model
    from elastic.store import SnapshotStore
    from trainer.metrics import read_records
    from trainer.on_ray.monitor import get_monitor
    from trainer.on_ray.ray_fit import fit

    run = work / f"baton-{tag}"
    cfg = _config(plan, run, dataset)

    def current_step() -> int:
        try:
            return ray.get(get_monitor(cfg).latest.remote()).get("step", 0)
        except ValueError:  # the monitor does not exist yet
            return 0

    killed_at = _kill_during(
        cluster, lambda: fit(cfg, pace_s=plan.pace_s, storage_path=str(work / "ray")),
        current_step, plan,
    )
    store = SnapshotStore(str(run))
    final = max(store.committed_steps())
    export_model(store, final, str(work / f"{tag}-optim.safetensors"), component="optim")
    counters = sorted({float(v.item()) for k, v in
                       load_file(work / f"{tag}-optim.safetensors").items() if k.endswith("step")})
    result = analyse(read_records(str(run)), killed_at)
    result["warm"] = counters == [float(plan.steps)]
    result["warm_evidence"] = f"final snapshot {final}: AdamW step counters {counters}"
    return result


def run_standard(cluster: Any, plan: Plan, work: Path, dataset: str, tag: str,
                 model_only: bool = False) -> dict[str, Any]:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"standard{'-model' if model_only else ''}-{tag}"
    log = work / f"{name}.jsonl"
    cfg = _config(plan, work / name, dataset)
    trainer = TorchTrainer(
        standard_train_fn,
        train_loop_config={"cfg": cfg, "log": str(log), "pace_s": plan.pace_s,
                           "model_only": model_only},
        scaling_config=ScalingConfig(num_workers=(1, 2), resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=f"{name}-{int(time.time())}",
                             storage_path=str(work / "ray"),
                             failure_config=FailureConfig(max_failures=20)),
    )

    def records() -> list[dict[str, Any]]:
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]

    def current_step() -> int:
        return max((r["step"] for r in records() if r["kind"] == "step"), default=0)

    killed_at = _kill_during(cluster, trainer.fit, current_step, plan)
    result = analyse(records(), killed_at)
    restart = result.pop("_restart")
    result["warm"] = restart.get("restored_opt_step", 0) == restart["step"] > 0
    result["warm_evidence"] = (f"restored AdamW step counter {restart.get('restored_opt_step')} "
                               f"at restored step {restart['step']}")
    return result


def analyse(records: list[dict[str, Any]], killed_at: float) -> dict[str, Any]:
    """Recovery figures from `start`/`step` records (see `trainer.metrics`) and the kill time."""
    starts = [r for r in records if r["kind"] == "start"]
    steps = [r for r in records if r["kind"] == "step"]
    after = [s for s in starts if s["time"] > killed_at]
    if not after:
        raise RuntimeError("no worker group started after the node loss")
    restart = after[0]
    before = [r["step"] for r in steps if r["attempt"] < restart["attempt"]]
    resumed = [r for r in steps if r["attempt"] >= restart["attempt"]]
    first = min(resumed, key=lambda r: r["time"])
    reached = max(before, default=0)
    return {
        "kill_step": reached,
        "restored_step": restart["step"],
        "steps_redone": reached - restart["step"],
        "restart_s": restart["time"] - killed_at,
        "recovery_s": first["time"] - killed_at,
        "lr_first_step_after": first.get("lr"),
        "world_sizes": [s["world_size"] for s in starts],
        "final_step": max(r["step"] for r in steps),
        "curve": [[r["step"], r["loss"], r["attempt"]] for r in steps],
        "_restart": restart,
    }


def child(args: argparse.Namespace) -> None:
    """One tool in one setting, on a fresh cluster in this process. (A cluster is not reused
    across runs: after a node comes back, Ray Train's elastic policy may still see one CPU
    for a while and start the next run on 1 worker.)"""
    import ray

    from trainer.on_ray.local_cluster import LocalCluster
    from trainer.on_ray.monitor import NAMESPACE

    plan = PLANS[args.plan]
    cluster = LocalCluster(worker_nodes=2, fast_failure_detection=args.child == "fast")
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
        if args.tools == "baton":
            result = run_baton(cluster, plan, Path(args.work), args.data, args.child)
        else:
            result = run_standard(cluster, plan, Path(args.work), args.data, args.child,
                                  model_only=args.tools == "standard-model")
        result.pop("_restart", None)
        if result["world_sizes"][0] != 2:
            result["error"] = f"started on {result['world_sizes'][0]} workers, not 2: not valid"
    except Exception as err:  # noqa: BLE001 - reported in the table, the other runs go on
        result = {"error": f"{type(err).__name__}: {err}"}
    finally:
        ray.shutdown()
        cluster.shutdown()
    summary = {k: v for k, v in result.items() if k != "curve"}
    print(f"[{args.child}] {args.tools}: {summary}", flush=True)
    Path(args.out).write_text(json.dumps(result))


# --------------------------------------------------------------------------- driver


def _run_child(
    setting: str, tool: str, args: argparse.Namespace, work: Path, dataset: str
) -> dict[str, Any]:
    out = work / f"{setting}-{tool}.json"
    # Each run starts from Ray's defaults in a clean environment; LocalCluster adds its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_TRAIN_")}
    command = [sys.executable, __file__, "--child", setting, "--tools", tool, "--plan",
               args.plan, "--work", str(work), "--data", dataset, "--out", str(out)]
    started = time.monotonic()
    subprocess.run(command, env=env, check=False, timeout=3000)
    print(f"{tool} on {setting}: {time.monotonic() - started:.0f} s", flush=True)
    return json.loads(out.read_text()) if out.exists() else {"error": "the run wrote nothing"}


def _row(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {name} | failed: {r['error']} |"
    lr = r.get("lr_first_step_after")
    return (f"| {name} | {r['recovery_s']:.1f} | {r['restart_s']:.1f} | {r['kill_step']} -> "
            f"{r['restored_step']} | {r['steps_redone']} | {'yes' if r['warm'] else 'NO'} | "
            f"{lr:.2e} |")


def report(results: dict[str, Any], plan: Plan) -> str:
    fast, default = results["fast"], results["ray-defaults"]
    lines = [
        "| run | recovery s | restart s | step lost -> restored | steps redone | "
        "optimizer warm | lr after restart |",
        "|---|---|---|---|---|---|---|",
        _row("Baton (its defaults: fast detection)", fast.get("baton", {"error": "missing"})),
        _row("standard (Ray defaults)", default.get("standard", {"error": "missing"})),
        _row("standard (fast detection, as Baton)", fast.get("standard", {"error": "missing"})),
        _row("standard, model only (fast detection, as Baton)",
             fast.get("standard-model", {"error": "missing"})),
    ]
    if "baton" in default:
        lines.append(_row("Baton (Ray defaults)", default["baton"]))
    ratios = {}
    b = fast.get("baton", {})
    for key, other in (("own_defaults", default.get("standard", {})),
                       ("identical_settings", fast.get("standard", {})),
                       ("identical_settings_model_only", fast.get("standard-model", {}))):
        if "recovery_s" in b and "recovery_s" in other:
            ratios[key] = b["recovery_s"] / other["recovery_s"]
    results["recovery_ratio_baton_over_standard"] = ratios
    lines.append("")
    lines.append("recovery time ratio Baton / standard: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
                 + f" (target <= 0.5); steps redone target <= {plan.snapshot_every}")
    return "\n".join(lines)


def plot(results: dict[str, Any], plan: Plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fast, default = results["fast"], results["ray-defaults"]
    same = [("Baton", fast.get("baton"), "tab:blue"),
            ("standard", fast.get("standard"), "tab:red"),
            ("standard, model only", fast.get("standard-model"), "tab:orange")]
    around = (max(0, plan.lose_at - 20), min(plan.steps, plan.lose_at + 45))
    panels = [
        ("each tool with its own defaults", [("Baton", fast.get("baton"), "tab:blue"),
                                             ("standard", default.get("standard"), "tab:red")],
         None),
        ("identical Ray settings (fast detection)", same, None),
        # Step losses are noisy (each step its own batch): a 5-step moving average shows
        # the bump after a restart.
        ("identical settings, around the node loss (5-step mean)", same, around),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    for ax, (title, runs, xlim) in zip(axes, panels, strict=True):
        for name, r, color in runs:
            if not r or "curve" not in r:
                continue
            curve = r["curve"]
            for attempt in sorted({c[2] for c in curve}):
                pts = sorted((s, loss) for s, loss, a in curve if a == attempt)
                if xlim is not None:
                    pts = [(s, sum(p[1] for p in pts[max(0, i - 4):i + 1])
                            / len(pts[max(0, i - 4):i + 1]))
                           for i, (s, _) in enumerate(pts) if xlim[0] <= s <= xlim[1]]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.2,
                        ls="-" if attempt == 0 else "--",
                        label=f"{name}" + (" (after restart)" if attempt else ""))
            ax.axvline(r["kill_step"], color=color, lw=0.8, ls=":")
        if xlim is not None:
            ax.set_xlim(*xlim)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("training loss")
    fig.suptitle(f"Node loss at step ~{plan.lose_at} (dotted), 2 -> 1 workers, "
                 f"checkpoint/snapshot every {plan.snapshot_every} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--baton-ray-defaults", action="store_true",
                        help="also run Baton under Ray's default failure detection")
    parser.add_argument("--child", choices=["fast", "ray-defaults"], help=argparse.SUPPRESS)
    parser.add_argument("--tools", help=argparse.SUPPRESS)
    parser.add_argument("--plan", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    args.plan = "quick" if args.quick else "full"
    plan = PLANS[args.plan]
    from data_state import prepare_corpus
    from trainer.config import load_recipe

    recipe = load_recipe(RECIPE, ['snapshots.run_uri="unused"'])
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="baton-recovery-") as tmp:
        work = Path(tmp)
        dataset = str(work / "data")
        prepare_corpus(None, dataset, seq_len=recipe.data.seq_len,
                       max_bytes=recipe.data.max_corpus_bytes or None, progress=False)
        results: dict[str, Any] = {"plan": dataclasses.asdict(plan)}
        results["fast"] = {t: _run_child("fast", t, args, work, dataset)
                           for t in ("baton", "standard", "standard-model")}
        tools = ("standard", "baton") if args.baton_ray_defaults else ("standard",)
        results["ray-defaults"] = {t: _run_child("ray-defaults", t, args, work, dataset)
                                   for t in tools}
    table = report(results, plan)
    print(table)
    name = "recovery-quick" if args.quick else "recovery"
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=1))
    plot(results, plan, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / (name + '.json')} and {RESULTS / (name + '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
