"""Reading a snapshot back: check, plan, read, verify, load — resharded to this rank.

* ``restore``: the plan (``check_compatible`` → ``plan_targets`` → ``read_tensors``) and its
  rule for what a failed restore leaves.
* ``byte_source``: where the bytes come from (``ByteSource``: the RAM tier or the store).
* ``read_batches``: planned byte ranges read into tensors in bounded batches, every checksum
  block verified on a thread pool.
* ``device_stage``: tensors the reader cannot write directly (a GPU's), through bounded pinned
  staging buffers.
* ``group_read``: a process group reads each byte once and exchanges what several ranks need.
* ``prefault``: a fresh tensor's pages faulted in before a read fills it.
* ``verdict``: ``Verdict``, what the ranks agree on about a read (all-reduce MAX).
* ``newest``: the newest committed snapshot every rank can read, falling back past corrupt
  ones (``restore_newest``; ``Snapshotter.restore`` calls it).

Imports ``elastic.state``, ``elastic.store``, ``elastic.format`` and below, and of the commit
(``elastic.coord``) only the coordinator's interface (``newest``: which snapshots are
committed, quarantining one); nothing of writing.
"""

from __future__ import annotations

from elastic.read.byte_source import ByteSource
from elastic.read.newest import restore_newest
from elastic.read.restore import collector_paused, read_tensors

__all__ = ["ByteSource", "collector_paused", "read_tensors", "restore_newest"]
