"""Freed memory given back to the system: glibc keeps what a process frees for its next allocations.

Why: an export delivers tensors of up to 1.5 GB to rank 0 one after another, with thousands of
allocations of one expert's size between them. glibc serves those from its heaps (its mmap
threshold rises to the size of the last large block freed, up to 32 MB) and keeps the freed pages,
so at 26B-A4B's published widths rank 0 kept 0.5-0.7 GB it no longer held by the second layer of
experts (measured with the RSS at each tensor the round trip's export yields). ``malloc_trim(0)``
returns every whole free page of every heap. Where the C library is not glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return the pages this process freed to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_garbage() -> None:
    """Collect what reference cycles keep (a Megatron model's modules reference each other, so a model
    outlives its last name until the cyclic collector runs), then :func:`release_freed_memory`."""
    gc.collect()
    release_freed_memory()
