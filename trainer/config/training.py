"""The recipe's training-side sections: `[data]`, `[optim]`, `[snapshots]`, `[scaling]`,
`[eval]`, `[logging]` and `[precision]`.

Contract: each section is a dataclass documented per field and validated in `__post_init__`
(types first, `checks.check_types`); a bad value raises one `ConfigError` naming the
dotted field and the fix. A field that applies to one optimizer or schedule only is refused,
not ignored, when set for another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from elastic.storage import absolute_uri
from trainer.config.checks import check_types, default_of, require

if TYPE_CHECKING:
    from elastic.settings import SnapshotSettings


@dataclass
class DataConfig:
    """Where the tokens come from and how a global step is cut into microbatches."""

    # Prepared dataset (local path or s3://; a relative path is made absolute against the
    # driver's working directory); "" = the embedded default corpus.
    uri: str = ""
    seq_len: int = 64  # tokens per stored sequence (the model predicts seq_len - 1 of them)
    global_batch: int = 16  # sequences per optimizer step, the same for any world size
    microbatch_size: int = 4  # sequences per forward/backward; global_batch / this = microbatches
    max_corpus_bytes: int = 0  # cap on text read when preparing the default corpus (0 = all)

    def __post_init__(self) -> None:
        check_types(self, "data")
        self.uri = absolute_uri(self.uri)  # workers run in another working directory
        require(self.seq_len >= 2, "data.seq_len", "must be >= 2 (a prediction needs 2 tokens)")
        require(self.microbatch_size >= 1, "data.microbatch_size", "must be >= 1")
        require(self.global_batch >= 1, "data.global_batch", "must be >= 1")
        require(
            self.global_batch % self.microbatch_size == 0,
            "data.global_batch",
            f"must be a multiple of data.microbatch_size ({self.microbatch_size}); "
            f"got {self.global_batch}",
        )
        require(self.max_corpus_bytes >= 0, "data.max_corpus_bytes", "must be >= 0")

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.microbatch_size


# The values of OptimConfig.name and OptimConfig.schedule (trainer.train.optim builds them).
OPTIMIZERS = ("adamw", "sgd", "adafactor")
SCHEDULES = ("cosine", "linear", "constant", "wsd")
# Fields that only one optimizer (or schedule) uses: set away from their default for another
# one, they are refused rather than silently ignored.
_OPTIMIZER_FIELDS = {"beta1": "adamw", "beta2": "adamw", "eps": "adamw", "momentum": "sgd",
                     "nesterov": "sgd", "beta2_decay": "adafactor"}
_SCHEDULE_FIELDS = {"decay_fraction": "wsd"}


@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule (`trainer.train.optim`): linear warmup over
    `warmup_steps`, then `schedule`. The schedule is a function of these fields and the run's
    `steps` only, so stopping early never changes it."""

    name: str = "adamw"  # one of OPTIMIZERS: "adamw", "sgd" or "adafactor" (torch.optim's)
    lr: float = 3e-3  # peak learning rate (adafactor: the cap of its relative step size)
    weight_decay: float = 0.1  # on matrices only (2-D+ parameters)
    beta1: float = 0.9  # adamw only
    beta2: float = 0.95  # adamw only
    eps: float = 1e-8  # adamw only
    momentum: float = 0.9  # sgd only, in [0, 1); 0 = plain SGD (no optimizer state)
    nesterov: bool = False  # sgd only
    beta2_decay: float = -0.8  # adafactor only: its second-moment decay exponent (<= 0)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # One of SCHEDULES after warmup: "cosine" (to min_lr_ratio * lr at `steps`), "linear" (the
    # same, linearly), "constant" (lr), "wsd" (warmup-stable-decay: lr, then linear to
    # min_lr_ratio * lr over the last decay_fraction of the steps).
    schedule: str = "cosine"
    warmup_steps: int = 10  # linear warmup from 0 to lr over these first steps
    min_lr_ratio: float = 0.1  # the floor of cosine, linear and wsd (constant has none)
    decay_fraction: float = 0.2  # wsd only: the share of `steps` spent decaying
    # A step whose loss is NaN or Inf (on any rank): false = the run stops in one line naming
    # the step, before its update, so it is never committed; true = its update is skipped
    # (no optimizer step; the data and the schedule move on) and training goes on.
    skip_nonfinite_loss: bool = False

    def __post_init__(self) -> None:
        check_types(self, "optim")
        for name, choices in (("name", OPTIMIZERS), ("schedule", SCHEDULES)):
            require(getattr(self, name) in choices, f"optim.{name}",
                     f"must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        require(self.lr > 0, "optim.lr", "must be > 0")
        require(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        for name in ("beta1", "beta2"):
            require(0 <= getattr(self, name) < 1, f"optim.{name}", "must be in [0, 1)")
        require(self.eps > 0, "optim.eps", "must be > 0")
        require(0 <= self.momentum < 1, "optim.momentum", "must be in [0, 1) (0: plain SGD)")
        require(not self.nesterov or self.momentum > 0, "optim.nesterov",
                 "needs optim.momentum > 0 (Nesterov momentum without momentum is plain SGD)")
        require(self.beta2_decay <= 0, "optim.beta2_decay", "must be <= 0 (e.g. -0.8)")
        require(self.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        require(0 < self.decay_fraction <= 1, "optim.decay_fraction", "must be in (0, 1]")
        for fields, chosen, what in ((_OPTIMIZER_FIELDS, self.name, "name"),
                                     (_SCHEDULE_FIELDS, self.schedule, "schedule")):
            for name, owner in fields.items():
                require(owner == chosen or getattr(self, name) == default_of(self, name),
                         f"optim.{name}", f'applies to optim.{what} = "{owner}" only (the recipe '
                         f'has "{chosen}"); remove it, or set optim.{what} = "{owner}"')

    def custom_fields(self) -> list[str]:
        """The optimizer-building fields set away from their defaults (what an
        `optimizer_factory` replaces)."""
        return [n for n in ("name", "weight_decay", *_OPTIMIZER_FIELDS)
                if getattr(self, n) != default_of(self, n)]


@dataclass
class SnapshotConfig:
    """Where the run lives and how often its state is snapshotted."""

    # Run directory (local path or s3://bucket/prefix/NAME; a relative path is made absolute
    # against the driver's working directory); required.
    run_uri: str = ""
    snapshot_every: int = 10  # steps between snapshots (plus on preemption or resize)
    # Committed snapshots kept; older ones are deleted, except the one the newest were
    # trained from (the newest of an older worker group): it stays until a later group
    # restores a newer one, so a snapshot the code that wrote the newer ones restores is left.
    keep_last: int = 3
    # Cap on each node's RAM store (MiB; 0 turns the RAM copies off): it holds copies of
    # other nodes' shards of the newest snapshot (plus one in flight). A shard that does not
    # fit is storage-only.
    ram_copy_mib: float = 4096.0
    # How many other nodes hold a RAM copy of each shard (the next ones in the sorted list of
    # live nodes; 0 = none). On a one-node cluster the copy is on that node.
    ram_replicas: int = 1
    # An in-flight snapshot not complete after this long is aborted and its files removed.
    pending_timeout_s: float = 600.0
    # S3: the total deadline of one storage call (a black-holed endpoint fails within it).
    storage_timeout_s: float = 30.0
    # How long transient storage errors (HTTP 5xx, throttling, timeouts) are retried in all;
    # at least storage_timeout_s.
    storage_retry_s: float = 120.0

    def __post_init__(self) -> None:
        check_types(self, "snapshots")
        self.run_uri = absolute_uri(self.run_uri)  # workers run in another working directory
        require(self.snapshot_every >= 1, "snapshots.snapshot_every", "must be >= 1")
        require(self.keep_last >= 1, "snapshots.keep_last", "must be >= 1")
        require(self.ram_copy_mib >= 0, "snapshots.ram_copy_mib", "must be >= 0 (0 = off)")
        require(self.ram_replicas >= 0, "snapshots.ram_replicas", "must be >= 0 (0 = off)")
        require(self.pending_timeout_s > 0, "snapshots.pending_timeout_s", "must be > 0")
        require(self.storage_timeout_s > 0, "snapshots.storage_timeout_s", "must be > 0")
        require(self.storage_retry_s >= self.storage_timeout_s, "snapshots.storage_retry_s",
                 f"must be >= snapshots.storage_timeout_s ({self.storage_timeout_s})")

    def snapshot_settings(self, layout: str) -> SnapshotSettings:
        """What a worker's ``Snapshotter`` is tuned with for this section and ``layout``
        ("ddp" or "fsdp", the model's): the RAM tier is off when ``ram_copy_mib`` or
        ``ram_replicas`` is 0, and ``ram_copy_mib`` caps an in-process RAM store."""
        from elastic.settings import SnapshotSettings  # loads torch: only a worker asks

        return SnapshotSettings(
            layout=layout, snapshot_every=self.snapshot_every, keep_last=self.keep_last,
            ram=self.ram_copy_mib != 0 and self.ram_replicas != 0,
            ram_cap_bytes=int(self.ram_copy_mib * 2**20),
            storage_timeout_s=self.storage_timeout_s, storage_retry_s=self.storage_retry_s)


@dataclass
class ScalingSettings:
    """How many Ray Train workers, and what each reserves."""

    min_workers: int = 1  # the smallest group Ray Train may run (it waits for this many)
    max_workers: int = 2  # the largest group; at most data.global_batch / microbatch_size
    cpus_per_worker: float = 1.0  # CPUs each worker reserves (checked against the nodes)
    use_gpu: bool = False  # one GPU per worker, NCCL; otherwise CPU and gloo
    resize_interval_s: float = 5.0  # how often Ray Train checks whether the group can grow
    # Worker-group restarts allowed after errors (-1 = unlimited). Finite by default: an
    # error that keeps coming back must end the run, not retry it forever. Preemptions
    # that committed their snapshot and node losses Ray Train sees as preemptions are
    # not counted (see trainer.on_ray.failures).
    max_failures: int = 10

    def __post_init__(self) -> None:
        check_types(self, "scaling")
        require(self.min_workers >= 1, "scaling.min_workers", "must be >= 1")
        require(
            self.max_workers >= self.min_workers,
            "scaling.max_workers",
            f"must be >= scaling.min_workers ({self.min_workers})",
        )
        require(self.cpus_per_worker > 0, "scaling.cpus_per_worker", "must be > 0")
        require(self.resize_interval_s > 0, "scaling.resize_interval_s", "must be > 0")
        require(self.max_failures >= -1, "scaling.max_failures", "must be >= -1")


@dataclass
class EvalConfig:
    """Validation loss on the held-out split every `every` steps (0 = never)."""

    every: int = 20  # steps between evaluations; 0 = never
    batches: int = 4  # microbatches of the val split per evaluation

    def __post_init__(self) -> None:
        check_types(self, "eval")
        require(self.every >= 0, "eval.every", "must be >= 0 (0 disables evaluation)")
        require(self.batches >= 1, "eval.batches", "must be >= 1")


@dataclass
class LoggingConfig:
    """Optional metrics sinks fed with rank 0's per-step records on the driver
    (`trainer.run.sinks`). Each needs its extra: `pip install baton-train[tensorboard]`,
    `baton-train[mlflow]`. They write under RUN/`dir`, so they need a local run directory."""

    tensorboard: bool = False  # TensorBoard event files in RUN/<dir>/tensorboard
    mlflow: bool = False  # an MLflow file store in RUN/<dir>/mlflow (one MLflow run per run)
    dir: str = "logs"  # relative to the run directory; also holds ray.log (Ray's messages)

    def __post_init__(self) -> None:
        check_types(self, "logging")
        parts = Path(self.dir).parts
        require(
            bool(self.dir) and not Path(self.dir).is_absolute() and ".." not in parts
            and "://" not in self.dir,
            "logging.dir",
            f"must be a relative path inside the run directory (e.g. \"logs\"), got {self.dir!r}",
        )
        import importlib.util  # locates the package without importing it

        for sink in ("tensorboard", "mlflow"):
            require(
                not getattr(self, sink) or importlib.util.find_spec(sink) is not None,
                f"logging.{sink}",
                f"needs the {sink} extra: pip install baton-train[{sink}] "
                f"(or set logging.{sink} = false)",
            )

    @property
    def any_sink(self) -> bool:
        return self.tensorboard or self.mlflow


# The values of PrecisionConfig.dtype (trainer.train.precision maps them to torch dtypes).
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class PrecisionConfig:
    """The dtype forward and backward compute in (`trainer.train.precision`). Master weights,
    optimizer state and snapshots stay fp32 in every dtype, so a run may be continued in
    another one."""

    # "fp32" (no casts), "bf16" (autocast under DDP, FSDP2's MixedPrecisionPolicy under
    # FSDP; gradients reduced in fp32) or "fp16" (the same, plus a dynamic loss scaler whose
    # state is in the snapshot). All three run on CPU and CUDA.
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        check_types(self, "precision")
        require(self.dtype in PRECISIONS, "precision.dtype",
                 f"must be one of {', '.join(PRECISIONS)}, got {self.dtype!r}")
