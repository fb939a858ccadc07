"""How close does a JAX continuation of a Baton run land to the PyTorch run? And the reverse.

The built-in GPT of recipes/tiny.toml (fp32, exact backprop, AdamW with warmup, cosine decay,
weight decay on matrices and gradient clipping) trains with Baton's worker loop:

(a) 15 steps in PyTorch (the reference);
(b) 10 steps in PyTorch, then 5 in JAX/Optax from the step-10 snapshot
    (``trainer.on_jax.load_train_state``);
(c) 5 steps in PyTorch, 5 in JAX committed as snapshot 10 (``save_train_state``), then 5 more
    in PyTorch.

(b)'s JAX state is committed as snapshot 15 of its run and read back like the others.

Printed: ||x - x_ref|| / ||x_ref|| over the parameters, over exp_avg and over exp_avg_sq at
step 15, and the wall time of the JAX load, 5 JAX steps (jit included) and the save. The tests
(tests/jax/test_jax_continue.py) assert 1e-5.

    python -m benchmarks.jax_continue.run [--workdir DIR]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import ROOT, arg_parser
from data_state import prepare_corpus
from elastic.portable import PortableRun
from trainer.config import load_recipe
from trainer.on_jax import JaxTrainState, load_train_state, save_train_state
from trainer.train.loop import WorkerEnv, run_worker


def train(run: Path, data: str, stop_after: int | None) -> None:
    cfg = load_recipe(ROOT / "recipes" / "tiny.toml", [
        f'snapshots.run_uri="{run}"', f'data.uri="{data}"', "steps=15", "eval.every=0",
        "sketch.rank=0", "snapshots.snapshot_every=5"])
    run_worker(cfg, WorkerEnv(stop_after=stop_after))


def jax_steps(state: JaxTrainState, steps: int) -> None:
    loader = state.loader()
    for _ in range(steps):
        state.train_step(np.concatenate([mb.tokens for mb in loader.next_step()]))
        loader.advance()
    state.data = loader.state_dict()
    loader.close()


def relative(ref: dict[str, np.ndarray], got: dict[str, np.ndarray], pick: str) -> float:
    keys = sorted(k for k in ref if (k.startswith("model.") if pick == "params"
                                     else k.endswith(f".{pick}")))
    x = np.concatenate([ref[k].ravel().astype(np.float64) for k in keys])
    y = np.concatenate([got[k].ravel().astype(np.float64) for k in keys])
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def main() -> None:
    parser = arg_parser(__doc__, __spec__)
    parser.add_argument("--workdir", default=None, help="where runs go (default: a temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="baton-jax-"))
    data = str(work / "corpus")
    prepare_corpus(None, data, seq_len=32, max_bytes=1_000_000, progress=False)
    train(work / "reference", data, None)
    train(work / "forward", data, 10)
    train(work / "reverse", data, 5)
    started = time.perf_counter()
    state = load_train_state(str(work / "forward"))
    loaded = time.perf_counter()
    jax_steps(state, 5)
    stepped = time.perf_counter()
    forward_dir = work / "forward"
    save_train_state(str(forward_dir), state)  # commits step 15 into the run it came from
    saved = time.perf_counter()
    back = load_train_state(str(work / "reverse"))
    jax_steps(back, 5)
    save_train_state(str(work / "reverse"), back)
    train(work / "reverse", data, None)
    ref = PortableRun(str(work / "reference")).read(15).tensors
    rows = {"10 PyTorch + 5 JAX": PortableRun(str(forward_dir)).read(15).tensors,
            "5 PyTorch + 5 JAX + 5 PyTorch": PortableRun(str(work / "reverse")).read(15).tensors}
    print("| continuation | params | exp_avg | exp_avg_sq |\n|---|---|---|---|")
    for name, got in rows.items():
        print(f"| {name} | " + " | ".join(f"{relative(ref, got, p):.1e}"
                                         for p in ("params", "exp_avg", "exp_avg_sq")) + " |")
    print(f"\nJAX load {loaded - started:.2f} s, 5 JAX steps {stepped - loaded:.2f} s (jit "
          f"included), save {saved - stepped:.2f} s")


if __name__ == "__main__":
    main()
