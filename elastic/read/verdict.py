"""The verdict of a restore attempt, as every rank agrees on it.

Contract
--------
``Verdict`` is an ``IntEnum`` because ranks agree on one by an all-reduce MAX of its value
(``elastic.collectives.agree_max``): the larger value wins, so the numeric order *is* the
precedence and must not change. From least to most decisive:

* ``OK``: read and verified.
* ``MISFIT``: the state does not fit the live components (maybe the code's fault; never
  quarantined on its own).
* ``CORRUPT``: a definite integrity failure (checksum, malformed manifest, a missing file
  on a store that answered); the snapshot is quarantined and the previous one tried.
* ``UNREACHABLE``: storage did not answer: doubt, which changes no snapshot.
* ``NO_MEMORY``: a rank could not allocate what the restore needs (the worker's fault):
  it fails the restore and touches no snapshot.
* ``OTHER``: an unexpected error during a group read; it fails the read on every rank.
"""

from __future__ import annotations

from enum import IntEnum


class Verdict(IntEnum):
    """A restore verdict; a larger value outranks a smaller one (module docstring)."""

    OK = 0
    MISFIT = 1
    CORRUPT = 2
    UNREACHABLE = 3
    NO_MEMORY = 4
    OTHER = 5
