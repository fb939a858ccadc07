"""S3 multipart uploads: a large object goes up in parallel parts, and appears whole or not at all.

A leaf of the storage layer (the standard library only): ``elastic.storage.storage_io`` hands it
``request``, which runs one S3 API call on the object under the layer's deadlines and retries.

``multipart_upload(request, data, *, part_bytes, concurrency, exclusive=False, mid_write=None)``:

* **Parts in parallel.** ``data`` (any buffer) is cut into parts of ``part_bytes`` (grown past
  S3's 10,000-part limit), uploaded by ``concurrency`` threads, each one ``upload_part`` call
  with its own retries (a transient failure re-sends that part only). Memory: one ``bytes``
  copy per part in flight (botocore wants ``bytes``), at most ``concurrency x part_bytes``
  besides ``data``, never a copy of the object.
* **Atomic.** The object appears only at ``complete_multipart_upload``. Any failure before (a
  part failing definitely or past the deadline, ``mid_write`` raising, an interrupt) stops the
  parts not yet started, waits for those in flight, aborts the upload
  (``abort_multipart_upload``, best effort: the original error is raised) and raises: no object,
  no parts left behind. A crashed process leaves an invisible incomplete upload, which only a
  bucket lifecycle rule (``AbortIncompleteMultipartUpload``) removes.
* **Create-only** (``exclusive``): an object already there is refused before any part is sent
  (``FileExistsError``, from a HEAD), and the completion carries ``If-None-Match: *`` (AWS S3
  and moto refuse it atomically when the key exists). A completion whose answer was lost is
  retried; a retry refused because the object exists, or the upload is gone (S3 completed it),
  counts as ours only if the object's ETag is the one our parts make (``multipart_etag``: the
  MD5 of the parts' MD5s, "-N"); otherwise the refusal is raised.
* ``mid_write`` (a fault-injection hook) is called once half of the parts are uploaded; if it
  raises, the upload is aborted as above.
"""

from __future__ import annotations

import errno
import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

# One S3 API call on the object being written: (operation, params) -> response. The caller
# fills in Bucket and Key and runs it under deadlines and retries.
Request = Callable[..., dict[str, Any]]

# S3's limits: every part but the last is at least 5 MiB, and an upload has at most 10,000.
MIN_PART_BYTES = 5 << 20
MAX_PARTS = 10_000


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of the parts of a ``size``-byte object (at most ``MAX_PARTS``)."""
    part = max(part_bytes, MIN_PART_BYTES, -(-size // MAX_PARTS))
    return [(start, min(size, start + part)) for start in range(0, max(size, 1), part)]


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives an object completed from parts with these ETags (their MD5s)."""
    digests = b"".join(bytes.fromhex(e.strip('"')) for e in part_etags)
    return f'"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(part_etags)}"'


def multipart_upload(request: Request, data: Any, *, part_bytes: int, concurrency: int,
           exclusive: bool = False, mid_write: Callable[[], None] | None = None) -> None:
    """Upload ``data`` as one object in parallel parts; see the module contract."""
    view = memoryview(data).cast("B")
    if exclusive and _exists(request):  # refused before any byte is sent
        raise FileExistsError(errno.EEXIST, "exists (checked before the upload)")
    upload_id = str(request("create_multipart_upload")["UploadId"])
    try:
        etags = _upload_parts(request, view, upload_id, part_bytes=part_bytes,
                              concurrency=max(1, concurrency), mid_write=mid_write)
        _complete(request, upload_id, etags, exclusive=exclusive)
    except BaseException:
        try:
            request("abort_multipart_upload", UploadId=upload_id)
        except Exception:  # the original failure is what the caller needs
            pass
        raise


def _upload_parts(request: Request, view: memoryview, upload_id: str, *, part_bytes: int,
                  concurrency: int, mid_write: Callable[[], None] | None) -> list[str]:
    ranges = part_ranges(len(view), part_bytes)
    etags: list[str] = [""] * len(ranges)
    stop = threading.Event()  # set on failure: parts not yet started are skipped

    def send(number: int) -> None:
        if stop.is_set():
            return
        start, end = ranges[number - 1]
        body = view[start:end].tobytes()
        answer = request("upload_part", UploadId=upload_id, PartNumber=number, Body=body)
        etags[number - 1] = str(answer["ETag"])

    with ThreadPoolExecutor(max_workers=concurrency,
                            thread_name_prefix="baton-s3-part") as pool:
        pending: set[Future[None]] = {pool.submit(send, n) for n in range(1, len(ranges) + 1)}
        done_count, hooked = 0, mid_write is None
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
                done_count += len(done)
                if not hooked and done_count * 2 >= len(ranges):
                    hooked = True
                    assert mid_write is not None
                    mid_write()
        except BaseException:
            stop.set()
            for future in pending:
                future.cancel()
            raise  # leaving the with-block waits for the parts in flight
    return etags


def _complete(request: Request, upload_id: str, etags: list[str], *, exclusive: bool) -> None:
    parts = {"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]}
    match = {"IfNoneMatch": "*"} if exclusive else {}
    try:
        request("complete_multipart_upload", UploadId=upload_id, MultipartUpload=parts,
                **match)
    except (FileExistsError, FileNotFoundError):
        # Refused because the key exists, or the upload is gone: an earlier attempt of
        # this completion may have landed with its answer lost. Ours only if the object
        # is made of our parts.
        if _head(request).get("ETag") != multipart_etag(etags):
            raise


def _head(request: Request) -> dict[str, Any]:
    """The object's HEAD answer, or ``{}`` when it is absent."""
    try:
        return request("head_object")
    except FileNotFoundError:
        return {}


def _exists(request: Request) -> bool:
    return bool(_head(request))
