"""The storage layer's errors: what a failed read or write means, definite or doubt.

Contract
--------
* ``SnapshotIntegrityError`` (a ``ValueError``): stored bytes are *definitely* unusable —
  a checksum mismatch, a malformed file, an object that ends too early. Never retried. The
  snapshot vocabulary (``elastic.errors``) builds on it: ``ManifestError`` and the misfit are
  its subclasses, and a snapshot that raises it is rejected (restore falls back to the
  previous one). It lives here because the storage layer itself raises it for a truncated
  object (``TruncatedError``) and ``retry`` must know it is definite.
* ``TruncatedError``: an object ends before the bytes asked for (a ``SnapshotIntegrityError``).
* ``StorageUnavailableError`` (an ``OSError``): the store did not answer within its deadline
  after retries (HTTP 5xx, throttling, a black-holed endpoint). This is *doubt*, not proof.
* ``ShortReadError`` (an ``OSError``): a response carried fewer bytes than asked of an object
  long enough; transient, retried.

``elastic.errors`` re-exports the first three, so each class exists once.
"""

from __future__ import annotations


class SnapshotIntegrityError(ValueError):
    """A snapshot is definitely unusable (checksum, format, missing file)."""


class TruncatedError(SnapshotIntegrityError):
    """An object ends before the bytes asked for: definite, never retried."""


class StorageUnavailableError(OSError):
    """The store did not answer within its deadline; nothing is known about the data."""


class ShortReadError(OSError):
    """A response carried fewer bytes than asked for an object long enough: transient."""
