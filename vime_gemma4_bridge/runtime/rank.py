"""The inside of a :class:`~vime_gemma4_bridge.runtime.world.LocalWorld` rank process.

:func:`bootstrap` is the process's target. torch, megatron and transformers read thread settings,
the torchrun variables and logging configuration when they are first imported, so all of that is set
before any of them is: this module imports the standard library only, and what spawn imports to
reach it (the package's ``__init__``, ``runtime/``) imports neither torch nor megatron. The rank then
joins the world and runs job functions until its parent closes it (:func:`serve`).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from vime_gemma4_bridge.runtime.memory import release_garbage

if TYPE_CHECKING:
    import multiprocessing.connection


def bootstrap(rank_kwargs: dict[str, Any]) -> None:
    """First code of a rank process: own process group, parent watch, environment, logging; then :func:`serve`.

    ``rank_kwargs`` is what :meth:`LocalWorld.start` passes: ``rank``, ``world_size``, ``host``,
    ``port``, ``backend``, ``conn``, ``parent_pid``, ``environ``, ``preload``, ``verbose``, ``start_timeout``.
    """
    kw = rank_kwargs
    # Own process group: the parent kills the rank together with anything it spawned.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    from vime_gemma4_bridge.runtime.group import watch_parent

    watch_parent(_end_with_owner, owner_pid=kw["parent_pid"])

    # The owner's environment as it was at start-up: a forked rank would otherwise keep its fork
    # server's, which dates from the first world.
    os.environ.clear()
    os.environ.update(kw["environ"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // kw["world_size"])
    os.environ.setdefault("MKL_NUM_THREADS", str(threads))
    os.environ.update(
        RANK=str(kw["rank"]),
        LOCAL_RANK=str(kw["rank"]),
        WORLD_SIZE=str(kw["world_size"]),
        LOCAL_WORLD_SIZE=str(kw["world_size"]),
        MASTER_ADDR=kw["host"],
        MASTER_PORT=str(kw["port"]),
    )
    # Ranks share the parent's stdout/stderr: tag log lines, and unless verbose drop import-time
    # noise. A root handler installed now also turns megatron.training's import-time
    # basicConfig(level=INFO) into a no-op.
    logging.basicConfig(
        level=logging.INFO if kw["verbose"] else logging.WARNING,
        format=f"[rank {kw['rank']}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    if not kw["verbose"]:
        from vime_gemma4_bridge.compat import quiet

        quiet.install()
    serve(threads=threads, **kw)


def _end_with_owner() -> None:
    # A rank blocked in a collective never reads its pipe again; once the world's owner is gone
    # without closing it (SIGKILL, crash), take the rank and its own children down with it. A spawned
    # rank's parent is the owner; a forked one's is the fork server, which exits with the owner.
    try:
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(1)


def prepare_imports(preload: Sequence[str]) -> None:
    """Import torch and ``preload`` behind the TE guard (what every rank needs before it joins).

    Run by each rank, and ahead of time by the fork server that CPU ranks fork from
    (:mod:`vime_gemma4_bridge.runtime.warm`), where it makes the ranks' own call a no-op.
    """
    from vime_gemma4_bridge.compat import te_guard

    te_guard.install()
    import torch  # noqa: F401

    # tqdm (progress bars of transformers / Megatron-Bridge) would create a multiprocessing lock,
    # a named semaphore; ranks end with os._exit, so the resource tracker would report it leaked.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    for module in preload:
        importlib.import_module(module)


def serve(
    *,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    conn: multiprocessing.connection.Connection,
    preload: Sequence[str],
    start_timeout: float,
    threads: int,
    **_: Any,
) -> None:
    """Join the world, then run the job functions the parent sends until it says exit (or goes away).

    Messages: ``("run", task_id, pickled (fn, args, kwargs))`` → ``("ok", task_id, pickled result)``
    or ``("error", task_id, traceback)``; start-up answers ``("ready", pid)`` or ``("start_error", traceback)``.
    """
    try:
        prepare_imports(preload)
        import torch
        import torch.distributed as dist

        from vime_gemma4_bridge.runtime.group import join_process_group

        torch.set_num_threads(threads)
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=start_timeout),
        )
        join_process_group(backend, rank=rank, world_size=world_size, local_rank=rank, store=store)
    except BaseException:
        conn.send(("start_error", traceback.format_exc()))
        flush_and_exit(1)
    conn.send(("ready", os.getpid()))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            flush_and_exit(0)  # the parent closed the world
        if message[0] != "run":
            flush_and_exit(0)
        _, task_id, payload = message
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = pickle.dumps(fn(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            reply = ("error", task_id, traceback.format_exc())
        else:
            reply = ("ok", task_id, result)
        fn = args = kwargs = None
        # A rank serves job after job, and a job's model outlived it until the cyclic collector ran (a
        # round trip of 26B-A4B's published widths cut to 2 layers at TP2·PP2·EP4 left 1.1 GB a rank,
        # and the next job's load came on top of it): given back before the next job.
        release_garbage()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            flush_and_exit(0)


def flush_and_exit(code: int) -> NoReturn:
    """Flush, then ``os._exit``: skip atexit hooks of torch/megatron that may block on a broken process group."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
