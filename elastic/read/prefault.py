"""Faulting a fresh tensor's pages in before a read syscall fills it.

Contract
--------
``prefault(tensor)`` makes sure the pages of a contiguous CPU tensor of at least
``MIN_BYTES`` are resident before ``preadv`` writes into them: on Linux it asks the kernel
which pages are (``mincore``, ~0.3 ms per 370 MB) and, unless all of them are, zeroes the
tensor. Elsewhere, for smaller tensors, or when the kernel does not answer, it does nothing
(or zeroes, when ``mincore`` fails: then it cannot tell). The values it leaves are
unspecified (the read overwrites them). ``resident_pages(tensor)`` is the question it asks:
one bool per page, or None when the kernel cannot tell.

Why: a page fault taken inside ``preadv`` (the kernel faulting each destination page in
while it copies from the page cache) costs about twice what the same fault costs when a
memset in user space takes it. Measured here, 0.37 GB read from the page cache into fresh
memory: 189 ms straight, 101 + 37 ms zeroed first. A restarted worker's restore fills only
fresh memory. Memory the allocator recycles is resident already and is left alone: zeroing
it would cost a memset (17 ms per 0.37 GB) for nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import torch

MIN_BYTES = 1 << 20  # below this a tensor's few page faults are not worth a syscall


@functools.cache
def _mincore() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mincore.restype = ctypes.c_int
    return mincore


def resident_pages(tensor: torch.Tensor) -> torch.Tensor | None:
    """One bool per page the CPU tensor's bytes touch: whether it is resident; None when
    the kernel cannot tell (not Linux, or ``mincore`` failed)."""
    mincore = _mincore()
    if mincore is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) * page
    residency = torch.empty((end - start) // page, dtype=torch.uint8)
    if mincore(start, end - start, residency.data_ptr()) != 0:
        return None
    return residency.bitwise_and_(1).bool()  # bit 0: resident; the others are undefined


def prefault(tensor: torch.Tensor) -> None:
    """See the module contract."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < MIN_BYTES or _mincore() is None or tensor.device.type != "cpu":
        return
    resident = resident_pages(tensor)
    if resident is None or not bool(resident.all()):  # None: cannot tell, so touch it
        tensor.zero_()
