"""Writing a snapshot: the first half of its life (capture, then persist).

* ``capture``: at a step boundary, copy the chunks this rank owns into one reusable CPU file
  image; the copies overlap the next forward/backward (``Capturer``, ``CaptureHandle``).
* ``replica_sums``: at world size > 1, the capture's crc32 of every replicated tensor,
  whole, so that the commit refuses replicas that differ anywhere.
* ``persist``: one background thread per worker writes the image to storage (and a copy to
  the RAM tier) and reports a receipt to the coordinator (``Persister``).

What happens next is ``elastic.coord`` (the commit); reading it back is ``elastic.read``.
"""

from __future__ import annotations

from elastic.write.capture import CaptureHandle, Capturer
from elastic.write.persist import Persister

__all__ = ["CaptureHandle", "Capturer", "Persister"]
