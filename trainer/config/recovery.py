"""The recipe's `[recovery]` section: what happens to the survivors when a worker is lost.

Contract: a dataclass documented per field and validated in `__post_init__` (types first,
`checks.check_types`); a bad value raises one `ConfigError` naming the dotted field and the
fix. `elastic.recovery` and `trainer.on_ray.replica_groups` read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.checks import check_types, require


@dataclass
class RecoveryConfig:
    """In-process recovery: survivors of a lost worker keep their processes and state."""

    # Survivors of a lost worker keep their processes and re-form their group: DDP trains on,
    # redoing at most the interrupted step; FSDP2 restores the newest commit in-process. A
    # replacement joins at a step boundary. false: the whole worker group restarts from the
    # newest snapshot.
    in_process: bool = True
    # A collective of the training group (the gradient all-reduce, a state transfer) waits at
    # most this long for a member that hangs without failing; the member is then left out.
    collective_timeout_s: float = 10.0
    # A survivor that cannot reach the run's coordinator (on the head node) for this long stops
    # recovering in-process: the whole worker group restarts from the newest snapshot.
    coordinator_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_types(self, "recovery")
        require(self.collective_timeout_s > 0, "recovery.collective_timeout_s", "must be > 0")
        require(self.coordinator_timeout_s > 0, "recovery.coordinator_timeout_s", "must be > 0")
