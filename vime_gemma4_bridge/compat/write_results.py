"""megatron-core's synchronous torch_dist save without its cross-process results queue (docs/UPSTREAM.md 27).

``FileSystemWriterAsync`` hands its write results over a ``multiprocessing.Manager`` queue (from
``filesystem_async.get_write_results_queue``), made for an asynchronous save whose writer may be
another process. A synchronous save writes and collects in this process, yet still spawns that
manager, whose server unpickles the first ``WriteResult`` and so imports torch: ~2 s, paid by every
``import`` run. While :func:`in_process_write_results` is active the save gets a plain
``queue.Queue`` instead; where this megatron-core has no such function, nothing changes.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator


@contextlib.contextmanager
def in_process_write_results() -> Iterator[None]:
    """While active, megatron-core's torch_dist writer passes its results through an in-process queue.

    Only for saves executed synchronously (``dist_checkpointing.save`` without ``async_sharded_save``):
    an asynchronous save's writer may run in another process, which a thread queue cannot reach.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        yield
        return
    original = getattr(filesystem_async, "get_write_results_queue", None)
    if not callable(original):
        yield
        return
    local: queue.Queue = queue.Queue()
    filesystem_async.get_write_results_queue = lambda *args, **kwargs: local
    try:
        yield
    finally:
        filesystem_async.get_write_results_queue = original
