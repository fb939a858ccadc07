"""Retry one storage call under a deadline: backoff, and which failures a retry may fix.

A leaf module (it imports only ``elastic.storage.errors``), so it knows nothing of the run
directory; the storage layer (``elastic.storage.storage_io``) runs every S3 request through it.

Contract
--------
* **Deadline.** ``call_with_retries(attempt, ..., policy, attempt_s, extra_s)`` calls
  ``attempt(timeout)`` until it succeeds, fails definitely, or ``policy.deadline_s +
  extra_s`` has passed, and the whole call, retries included, ends within about that
  deadline: each attempt gets ``attempt_s`` seconds cut to what is left of the deadline
  (but at least ``_MIN_ATTEMPT_S``, or ``attempt_s`` if less), and no backoff sleep is
  started that would end past it. ``attempt`` itself must honour its ``timeout``.
* **Backoff.** ``RetryPolicy``: exponential backoff with full jitter (a random fraction of
  ``min(cap_s, base_s * 2**retry)``); its clock, sleep and random source are injectable so
  tests run it on a fake clock.
* **Transient or definite.** ``is_transient`` says whether a retry may fix a failure:
  HTTP 5xx, 429, SlowDown/throttling and the other S3 codes in ``_TRANSIENT_CODES``,
  connection refused/reset, timeouts, transport errors of aiohttp/botocore/urllib3, and a
  response cut short (``ShortReadError``) are transient, judged along the whole
  ``__cause__``/``__context__`` chain. ``FileNotFoundError`` / ``FileExistsError`` /
  ``PermissionError`` from a store that answered, and ``SnapshotIntegrityError``, are
  definite; so is anything unrecognised (a programming error is never retried). A definite
  failure is raised at once, as is; when the deadline passes with transient failures only,
  ``StorageUnavailableError`` (an ``OSError``) names the path and the last error.
* The S3 stack (aiohttp, botocore, urllib3) is imported lazily: a local-only install need
  not have it.
"""

from __future__ import annotations

import errno
import functools
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from elastic.storage.errors import (
    ShortReadError,
    SnapshotIntegrityError,
    StorageUnavailableError,
)

T = TypeVar("T")

# The last attempt before the deadline still gets at least this long (or attempt_s if less).
_MIN_ATTEMPT_S = 1.0


@dataclass
class RetryPolicy:
    """Exponential backoff with full jitter under a total deadline; time is injectable."""

    deadline_s: float = 60.0
    base_s: float = 0.05
    cap_s: float = 2.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = field(default_factory=lambda: random.Random().random)

    def delay(self, retry: int) -> float:
        return self.rand() * min(self.cap_s, self.base_s * 2.0 ** retry)


def call_with_retries(attempt: Callable[[float], T], *, what: str, path: str,
                      policy: RetryPolicy, attempt_s: float, extra_s: float = 0.0) -> T:
    """Run ``attempt(timeout)`` until it succeeds, fails definitely, or the deadline
    (``policy.deadline_s + extra_s``) passes.

    Each attempt gets ``attempt_s`` seconds, cut to what is left of the deadline (but at
    least ``_MIN_ATTEMPT_S``), so the whole call ends within about the deadline."""
    start = policy.clock()
    deadline = policy.deadline_s + extra_s
    tries = 0
    while True:
        left = deadline - (policy.clock() - start)
        tries += 1
        try:
            return attempt(max(min(attempt_s, left), min(attempt_s, _MIN_ATTEMPT_S)))
        except Exception as err:  # classified below; anything definite propagates as is
            if not is_transient(err):
                raise
            last = err
        pause = policy.delay(tries - 1)
        if policy.clock() - start + pause >= deadline:
            raise StorageUnavailableError(
                f"{path}: {what} failed after {tries} attempt(s) in "
                f"{policy.clock() - start:.1f}s (deadline {deadline:.1f}s); last error: "
                f"{type(last).__name__}: {last}") from last
        policy.sleep(pause)


_DEFINITE = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
             NotADirectoryError, SnapshotIntegrityError)
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable",
    "InternalError", "RequestLimitExceeded", "TooManyRequests", "OperationAborted",
    "ConditionalRequestConflict", "RequestTimeTooSkewed",
})
# s3fs turns 500/InternalError into EREMOTEIO and 503/SlowDown/409 into EBUSY, and in some
# paths (HEAD) drops the botocore cause, so the errno is all that is left to go by.
_TRANSIENT_ERRNOS = frozenset({getattr(errno, "EREMOTEIO", errno.EIO), errno.EBUSY,
                               errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                               errno.EPIPE, errno.ECONNABORTED})
_CODE_IN_MESSAGE = re.compile(r"An error occurred \((\w+)\)")


@functools.cache
def _transport_errors() -> tuple[type[BaseException], ...]:
    # Imported lazily: a local-only install need not have the S3 stack.
    found: list[type[BaseException]] = [TimeoutError, ConnectionError, ShortReadError]
    try:
        import aiohttp
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
        from botocore.parsers import ResponseParserError
        from urllib3.exceptions import IncompleteRead
    except ImportError:
        return tuple(found)
    return (*found, aiohttp.ClientError, BotoConnectionError, HTTPClientError,
            ResponseParserError, IncompleteRead)


@functools.cache
def storage_errors() -> tuple[type[Exception], ...]:
    """The errors a storage call answers with when the place cannot be read or written:
    OSError, and botocore's base error (S3 credentials, endpoint) where the S3 stack is
    installed. For the CLIs' one-line messages: `except storage_errors() as err`."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:  # a local-only install
        return (OSError,)
    return (OSError, BotoCoreError)


def is_transient(err: BaseException) -> bool:
    """True for failures a retry may fix; False for definite answers and programming errors."""
    if isinstance(err, _DEFINITE):
        return False
    transport = _transport_errors()
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, transport):
            return True
        code, status = http_error(current)
        if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return True
        if type(current) is OSError and current.errno in _TRANSIENT_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    return False


def http_error(err: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError or of its translated message;
    ``("", 0)`` when ``err`` carries neither."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        code = str((response.get("Error") or {}).get("Code", ""))
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0
        return code, int(status)
    match = _CODE_IN_MESSAGE.search(str(err))
    if match is None:
        return "", 0
    code = match.group(1)
    return code, int(code) if code.isdigit() else 0
