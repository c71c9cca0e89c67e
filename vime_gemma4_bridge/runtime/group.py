"""Joining ``torch.distributed``: torchrun's process group, or a one-rank group in this process.

Backends: gloo on CPU; nccl when the host has a GPU per local rank (rank i binds device i).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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
