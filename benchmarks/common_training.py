"""The training the benchmarks measure: model steps, validation and the corpus they share.

Contract:
- `Trainee(spec)`: one built-in GPT configuration (sketched or not), its AdamW (fused with
  `spec["fused"]`) and a fixed microbatch; `step()` takes one training step (under bf16
  autocast when `spec["dtype"] == "bf16"`: fp32 master weights) and returns its time (wall
  or process CPU; synchronised on CUDA), optionally recording the storages packed for backward;
  `peak_bytes()` is one step's peak CUDA memory above what was allocated before it.
- `autocast(device, dtype)`: the bf16 autocast context of a "bf16" run (none for "fp32").
- `train_step`, `evaluate`, `val_indices`, `saved_bytes_of`: one step under a sketch seed, the
  mean validation loss over fixed indices, an evenly spread fixed subset of the val split, and
  the bytes autograd saves for one microbatch's backward. Any model with `loss(tokens)` fits.
- `QUALITY_CORPUS` / `ensure_quality_corpus()`: the byte-level corpus the quality benchmarks
  train on (12 MB of Python's standard library, sequences of 257 tokens), prepared once.
- `training_tokens_per_s(ds, steps)`: tokens/s the built-in GPT (d_model 256, 4 layers, fp32
  AdamW, microbatch 8 x 256) trains on with `ds`'s vocabulary; what a loader must outrun.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from benchmarks.common import ROOT

QUALITY_CORPUS = ROOT / "data" / "quality-corpus"
QUALITY_SEQ, QUALITY_CORPUS_BYTES = 256, 12_000_000


class Trainee:
    """One configuration's model, optimizer and fixed microbatch, ready to take steps.
    `spec`: rank (0 = exact), include, checkpoint, mlp_recompute, fuse_norms, seq_len, batch,
    device, and optionally d_model, n_layers, n_heads, dtype ("fp32" or "bf16"), fused."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from sketch_ops import sketch_model
        from trainer.config import ModelConfig
        from trainer.train.model import GPT

        torch.manual_seed(0)
        cfg = ModelConfig(
            vocab_size=256,
            d_model=spec.get("d_model", 256),
            n_layers=spec.get("n_layers", 4),
            n_heads=spec.get("n_heads", 4),
            checkpoint_blocks=spec["checkpoint"],
            mlp_recompute=spec.get("mlp_recompute", "auto"),
            fuse_norms=spec.get("fuse_norms", True),
        )
        self.device = torch.device(spec.get("device", "cpu"))
        self.model = GPT(cfg, seq_len=spec["seq_len"]).to(self.device)
        if spec["rank"]:
            sketch_model(self.model, rank=spec["rank"], include=spec.get("include"))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4,
                                     fused=bool(spec.get("fused", False)))
        self.tokens = torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq_len"] + 1),
                                    device=self.device)
        self.dtype = spec.get("dtype", "fp32")
        self.num_steps = 0

    def step(self, saved: dict[int, int] | None = None, clock: str = "wall") -> float:
        """One training step, timed; with `saved`, record the storages packed for backward
        (parameters excluded)."""
        from sketch_ops import sketch_seed

        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if saved is not None and ptr not in params:
                saved[ptr] = t.untyped_storage().nbytes()
            return t

        census = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        timer = time.process_time if clock == "cpu" else time.perf_counter
        self.synchronize()
        start = timer()
        with sketch_seed(0, self.num_steps):
            with census if saved is not None else contextlib.nullcontext():
                with autocast(self.device, self.dtype):
                    loss = self.model.loss(self.tokens)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.num_steps += 1
        self.synchronize()
        return timer() - start

    def synchronize(self) -> None:
        """Wait for the GPU's queued work (a CUDA step is timed to its end, not its launch)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_bytes(self) -> int:
        """One step's peak CUDA memory above what was allocated before it (0 on a CPU)."""
        if self.device.type != "cuda":
            return 0
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.step()
        return int(torch.cuda.max_memory_allocated(self.device) - base)


def autocast(device: torch.device, dtype: str) -> Any:
    """bf16 autocast on `device` for a "bf16" run; a no-op context for "fp32"."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def train_step(model: Any, optimizer: Any, schedule: Any, tokens: Any, seed: int,
               step: int) -> float:
    """One training step on `tokens` under the sketch seed of (seed, step); its loss."""
    from sketch_ops import sketch_seed

    with sketch_seed(seed, step, 0):
        loss = model.loss(tokens)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    return float(loss.detach())


def val_indices(size: int, count: int) -> list[int]:
    """A fixed, evenly spread subset of the val split (it is ordered by file)."""
    count = min(count, size)
    return [i * size // count for i in range(count)]


def evaluate(model: Any, val: Any, indices: list[int]) -> float:
    """Mean loss over the val sequences at `indices`, in chunks of 16, without gradients."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(indices), 16):
            chunk = indices[start : start + 16]
            total += float(model.loss(val.batch(chunk))) * len(chunk)
    model.train()
    return total / len(indices)


def saved_bytes_of(model: Any, tokens: Any, seed: int) -> int:
    """Bytes of the distinct storages autograd saves for one microbatch's backward."""
    from sketch_ops import sketch_seed
    from sketch_ops.memory import saved_bytes

    with sketch_seed(seed, 10**6, 0):
        saved = saved_bytes(lambda: model.loss(tokens), model)
    model.zero_grad(set_to_none=True)
    return saved


def ensure_quality_corpus() -> None:
    """Prepare QUALITY_CORPUS unless it exists: QUALITY_SEQ + 1 tokens per sequence (inputs
    and their shifted targets)."""
    from data_state import prepare_corpus

    if not (QUALITY_CORPUS / "dataset.json").exists():
        prepare_corpus(None, str(QUALITY_CORPUS), seq_len=QUALITY_SEQ + 1,
                       max_bytes=QUALITY_CORPUS_BYTES)


def training_tokens_per_s(ds: Any, steps: int, seq_len: int = 256, microbatch: int = 8) -> float:
    """Tokens/s the built-in GPT trains on: median step time after a warm-up step."""
    from trainer.config import ModelConfig
    from trainer.train.model import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=ds.vocab_size, d_model=256, n_layers=4, n_heads=4),
                seq_len=seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    batch = torch.from_numpy(ds.read(range(microbatch)).astype("int64"))
    times = []
    for _ in range(steps + 1):  # the first step warms up allocators and kernels
        start = time.perf_counter()
        model.loss(batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return microbatch * seq_len / statistics.median(times[1:])
