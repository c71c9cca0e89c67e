"""Joining ``torch.distributed``: torchrun's process group, or a one-rank group in this process.

Backends: gloo on CPU; nccl when the host has a GPU per local rank (rank i binds device i).
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: The address rank processes and their TCP store use on this host.
LOCALHOST = "127.0.0.1"


def default_backend(local_world_size: int) -> str:
    """``nccl`` when every local rank can have its own GPU, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size else "gloo"


def join_process_group(backend: str, *, rank: int, world_size: int, local_rank: int, **init_kwargs: Any) -> None:
    """``init_process_group``, binding rank ``local_rank``'s GPU first with nccl (its communicator needs it)."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        init_kwargs["device_id"] = device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **init_kwargs)


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher).

    Also true inside :class:`~vime_gemma4_bridge.runtime.world.LocalWorld` ranks, which export the
    same variables for code that reads them; :func:`~vime_gemma4_bridge.runtime.launch.launch`
    checks for an initialised process group first.
    """
    return all(os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


#: This process's parent when it started, as near as this module knows: it is imported before torch,
#: whose import takes seconds in which a launcher may already be gone.
PARENT_AT_START = os.getppid()
#: The parent :func:`watch_parent` watches (none before it is called).
_WATCHED: list[int] = []


def watch_parent(on_gone: Callable[[], object], *, parent: int | None = None, owner_pid: int | None = None) -> None:
    """Call ``on_gone`` (which ends the process) from a daemon thread once this process's parent is gone.

    Why: a rank blocked in a collective waits for peers, and a store, that its launcher's death
    (SIGKILL: no clean-up runs) took away; gloo and the TCP store give up only after their timeouts,
    with C++ stack traces. Re-parenting is the tell: ``parent`` (default: the parent now) is the one
    the process had; ``owner_pid`` (a process that is not the parent, e.g. behind a fork server) is
    watched too, in case it died before this started. A thread, not ``PR_SET_PDEATHSIG``: a signal's
    Python handler runs only when the main thread next runs Python code, which a rank blocked in a
    collective does not, and the kernel's death signal knows the parent alone, not an owner.
    """
    parent = os.getppid() if parent is None else parent
    _WATCHED[:] = [parent]

    def watch() -> None:
        _wait_until_gone(parent, owner_pid)
        on_gone()

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _wait_until_gone(parent: int, owner_pid: int | None) -> None:
    """Return once ``parent`` is no longer this process's parent or ``owner_pid`` has exited.

    On Linux the kernel says so: a pidfd of each becomes readable when the process exits, so the
    thread sleeps in ``poll`` until then (no wake-ups, no delay). Elsewhere (no ``os.pidfd_open``,
    or a kernel before 5.3) it looks every half second.
    """
    pids = [parent] if owner_pid is None else [parent, owner_pid]
    fds: list[int] = []
    try:
        for pid in pids:
            fds.append(os.pidfd_open(pid))
    except ProcessLookupError:
        return  # already gone
    except (AttributeError, OSError):
        while os.getppid() == parent and (owner_pid is None or _exists(owner_pid)):
            time.sleep(0.5)
        return
    try:
        if os.getppid() != parent:
            return  # died before its pidfd was opened: the number may be another process's by now
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll()
    finally:
        for fd in fds:
            os.close(fd)


def parent_gone() -> bool:
    """Whether this process's parent, watched by :func:`watch_parent`, has gone (maybe before the watch noticed)."""
    return bool(_WATCHED) and os.getppid() != _WATCHED[0]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it exists, under another user
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def init_from_env(backend: str | None = None) -> None:
    """Join the process group described by torchrun's environment (no-op when already joined).

    ``backend`` defaults to nccl when this node has a GPU per local rank (rank → ``LOCAL_RANK``
    device), else gloo.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not in_torchrun():
        raise RuntimeError("init_from_env() needs RANK, WORLD_SIZE and MASTER_ADDR (start the job with torchrun)")
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    join_process_group(
        backend or default_backend(local_world_size),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        init_method="env://",
    )


@contextlib.contextmanager
def single_process_group(backend: str | None = None) -> Iterator[None]:
    """A world of one rank in this process, torn down on exit (with any megatron parallel state).

    The TCP store listens on a port the OS picks (port 0), so concurrent jobs never collide.
    """
    import torch.distributed as dist

    from vime_gemma4_bridge.compat.parallel_state import reset_model_parallel

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    store = dist.TCPStore(LOCALHOST, 0, 1, is_master=True, wait_for_workers=False)
    join_process_group(backend or default_backend(1), rank=0, world_size=1, local_rank=0, store=store)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            reset_model_parallel()
        dist.destroy_process_group()
        del store
