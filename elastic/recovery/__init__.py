"""In-process recovery: survivors of a lost worker keep their processes and state.

The room's face: ``InProcessRecovery`` (what a ``Session`` runs, ``inprocess``),
``Recovered``, ``RecoveryFailedError``, ``FencedError``, ``LeftBehindError``, ``Member`` and
``MemberSettings`` (``member``), ``GroupUnavailableError`` (``group``), and what a sharded
run's survivors use (``default_group``: ``form_default_group``, ``peer_lost``, ``shard_mesh``).
Inside: ``group`` (the reconfigurable process group), ``grad_sync`` (a DDP model's gradient
all-reduce on it), ``transfer`` (a live member's state to the members that lack it),
``member`` (the worker's side of ``elastic.coord.membership``).
"""

from __future__ import annotations

from elastic.recovery.default_group import form_default_group, peer_lost, shard_mesh
from elastic.recovery.group import GroupUnavailableError
from elastic.recovery.inprocess import InProcessRecovery, Recovered
from elastic.recovery.member import (
    FencedError,
    LeftBehindError,
    Member,
    MemberSettings,
    RecoveryFailedError,
)

__all__ = ["FencedError", "GroupUnavailableError", "InProcessRecovery", "LeftBehindError",
           "Member", "MemberSettings", "Recovered", "RecoveryFailedError", "form_default_group",
           "peer_lost", "shard_mesh"]
