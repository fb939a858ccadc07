"""In-process recovery: survivors of a lost worker keep their processes and state.

The room's face: ``InProcessRecovery`` (what a ``Session`` runs, ``inprocess``),
``Recovered``, ``RecoveryFailedError``, ``FencedError``, ``LeftBehindError`` and
``MemberSettings`` (``member``).
Inside: ``group`` (the reconfigurable process group), ``grad_sync`` (a DDP model's gradient
all-reduce on it), ``transfer`` (a live member's state to the members that lack it),
``member`` (the worker's side of ``elastic.coord.membership``).
"""

from elastic.recovery.inprocess import InProcessRecovery, Recovered
from elastic.recovery.member import (
    FencedError,
    LeftBehindError,
    MemberSettings,
    RecoveryFailedError,
)

__all__ = ["FencedError", "InProcessRecovery", "LeftBehindError", "MemberSettings",
           "Recovered", "RecoveryFailedError"]
