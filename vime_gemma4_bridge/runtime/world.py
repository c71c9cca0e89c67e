"""A persistent world of local rank processes that runs job functions on demand.

Importing ``megatron.bridge`` costs ~1 GB RSS and ~10 s of CPU per process, so a test suite or a
sweep over topologies reuses the processes: :class:`LocalWorld` starts N ranks **once** (on a CPU
host as forks of a fork server that did the imports, see :func:`_rank_context`), each joins
``torch.distributed`` (gloo on CPU, nccl with a GPU per rank), and every :meth:`LocalWorld.run`
calls a job function on all of them. The ranks' side is :mod:`vime_gemma4_bridge.runtime.rank`.

This module imports neither torch nor megatron at module level.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import pickle
import signal
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from vime_gemma4_bridge.compat import quiet
from vime_gemma4_bridge.runtime.group import LOCALHOST, default_backend
from vime_gemma4_bridge.runtime.rank import bootstrap

log = logging.getLogger(__name__)

#: Modules every rank imports before it joins the process group, so jobs start warm.
DEFAULT_PRELOAD: tuple[str, ...] = ("megatron.core", "megatron.core.parallel_state", "megatron.bridge")
#: The module the fork server of CPU ranks imports first: it runs the rank's imports ahead of time.
WARM_PRELOAD = "vime_gemma4_bridge.runtime.warm"
#: Seconds :meth:`LocalWorld.run` waits for all ranks before it declares the world hung.
DEFAULT_TIMEOUT: float = 1800.0
#: Seconds to wait for the other ranks once one rank has failed (they may be stuck in a collective).
DEFAULT_ERROR_GRACE: float = 5.0
#: Set to "1" (``--verbose``) to keep upstream's import-time logging and warnings in rank processes.
VERBOSE_ENV = "VIME_GEMMA4_VERBOSE"


class RankError(RuntimeError):
    """A job function raised (or its rank process died) on one or more ranks of a :class:`LocalWorld`.

    ``failures`` maps rank → traceback text; ``unfinished`` lists ranks that had not answered when the
    world was killed (usually stuck in a collective with the failed rank).
    """

    def __init__(self, what: str, failures: dict[int, str], unfinished: Sequence[int] = (), note: str = "") -> None:
        self.failures = dict(sorted(failures.items()))
        self.unfinished = tuple(sorted(unfinished))
        ranks = ", ".join(str(r) for r in self.failures)
        lines = [f"{what} failed on rank(s) {ranks}"]
        if self.unfinished:
            lines[0] += (
                f"; rank(s) {', '.join(map(str, self.unfinished))} had not finished (likely waiting in a collective)"
            )
        if note:
            lines[0] += f"; {note}"
        for rank, text in self.failures.items():
            lines.append(f"----- rank {rank} -----")
            lines.append(text.rstrip())
        super().__init__("\n".join(lines))
        self._init_args = (what, failures, tuple(unfinished), note)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._init_args)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks that failed."""
        return tuple(self.failures)


class WorldTimeoutError(TimeoutError):
    """Some ranks of a :class:`LocalWorld` gave no answer within the timeout; the world was killed."""

    def __init__(self, what: str, ranks: Sequence[int], timeout: float) -> None:
        self.ranks = tuple(sorted(ranks))
        self.timeout = timeout
        super().__init__(
            f"{what}: rank(s) {', '.join(map(str, self.ranks))} did not answer within {timeout:g} s; "
            "the world was killed and will be respawned by the next run()"
        )
        self._init_args = (what, tuple(ranks), timeout)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._init_args)


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _rank_environment(nproc: int, verbose: bool) -> dict[str, str]:
    """What the ranks' environment adds to this process's: thread limits and, unless verbose, warning filters."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // nproc))
    extra = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    if not verbose:
        filters = quiet.warning_filters()
        if os.environ.get("PYTHONWARNINGS"):
            filters.append(os.environ["PYTHONWARNINGS"])  # later entries win: the user's settings
        extra["PYTHONWARNINGS"] = ",".join(filters)
    return extra


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """``extra`` in this process's environment for the block, restored after: for new interpreters
    (spawned ranks, the fork server), or one job on a rank (tests: vime's actor environment)."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rank_context(backend: str, verbose: bool) -> multiprocessing.context.BaseContext:
    """Where the rank processes come from: forks of one warm server on a CPU host, else new interpreters.

    A rank's start-up is mostly importing megatron.bridge (~10 s of CPU each). Without a GPU, ranks
    fork from multiprocessing's fork server, which did those imports once (:mod:`.warm`), so an
    8-rank world starts in seconds instead of a minute on two cores, and its ranks share the pages.
    Spawn (a fresh interpreter per rank) where forking would not be right: CUDA initialised in a
    parent is unusable in a fork, and a verbose world shows the import-time output the server hides.
    """
    import torch

    if backend == "gloo" and not verbose and not torch.cuda.is_available():
        if "forkserver" in multiprocessing.get_all_start_methods():
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([WARM_PRELOAD])  # read when the server starts: once per process
            return ctx
    return multiprocessing.get_context("spawn")


_LIVE_WORLDS: weakref.WeakSet[LocalWorld] = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def _close_all_worlds() -> None:
    for world in list(_LIVE_WORLDS):
        with contextlib.suppress(Exception):
            world.close()


class LocalWorld:
    """N local rank processes, spawned once, that run job functions on demand.

    ``world.run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank (same
    processes each time, so imports and module state are reused) and returns the results in
    rank order. ``fn`` must be a module-level function; arguments and results travel pickled
    (tensors by value). Ranks are spawned lazily by the first :meth:`run` (or :meth:`start` /
    ``with``): each imports ``preload`` behind the TE guard, then joins ``torch.distributed``
    (gloo on CPU, nccl when there is a GPU per rank) through a TCP store hosted by this process
    on a port the OS picks.

    Failures kill the world, because ranks that are left may be stuck in a collective or hold
    half-finished communication: the next :meth:`run` transparently spawns a fresh one.

    * a rank raises → the other ranks get ``error_grace`` seconds to answer, then
      :class:`RankError` with the failing ranks and their tracebacks;
    * a rank process dies → :class:`RankError` with its exit code;
    * ranks do not answer within ``timeout`` → :class:`WorldTimeoutError` (a ``TimeoutError``)
      naming them.

    Rank processes are killed by :meth:`close`, ``__exit__``, at interpreter exit, and by
    themselves when this process dies. Their stdout/stderr is this process's; by default only
    warnings and errors are logged, tagged ``[rank N]``.
    """

    def __init__(
        self,
        nproc: int,
        *,
        backend: str | None = None,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        start_timeout: float = 600.0,
        error_grace: float = DEFAULT_ERROR_GRACE,
        verbose: bool | None = None,
    ) -> None:
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be a whole number >= 1, got {nproc!r}")
        self.nproc = nproc
        self.backend = backend
        self.preload = tuple(preload)
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self.verbose = os.environ.get(VERBOSE_ENV) == "1" if verbose is None else verbose
        self._owner_pid = os.getpid()
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._store: Any = None
        self._task_id = 0
        self._closed = False
        self.starts = 0  # how many times ranks were spawned (restarts after failures included)
        global _ATEXIT_REGISTERED
        _LIVE_WORLDS.add(self)
        if not _ATEXIT_REGISTERED:
            # Registered after multiprocessing's own exit hook, so it runs first (LIFO) and
            # the non-daemon rank processes are gone before multiprocessing joins them.
            atexit.register(_close_all_worlds)
            _ATEXIT_REGISTERED = True

    # -- state -------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether rank processes are running and ready for :meth:`run`."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the current rank processes (empty when none run)."""
        return [p.pid for p in self._procs if p.pid is not None]

    def __repr__(self) -> str:
        state = "alive" if self.alive else ("closed" if self._closed else "idle")
        return f"LocalWorld(nproc={self.nproc}, backend={self.backend!r}, {state})"

    def __enter__(self) -> LocalWorld:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._kill()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LocalWorld:
        """Spawn the ranks and wait until all joined the process group (no-op when alive)."""
        if self.alive:
            return self
        self._kill()
        self._closed = False
        import torch.distributed as dist

        backend = self.backend or default_backend(self.nproc)
        self._store = dist.TCPStore(
            LOCALHOST,
            0,
            self.nproc,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.start_timeout),
        )
        ctx = _rank_context(backend, self.verbose)
        extra = _rank_environment(self.nproc, self.verbose)
        environ = {**os.environ, **extra}
        self.starts += 1
        for rank in range(self.nproc):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            rank_kwargs = {
                "rank": rank,
                "world_size": self.nproc,
                "host": LOCALHOST,
                "port": self._store.port,
                "backend": backend,
                "conn": child_conn,
                "parent_pid": os.getpid(),
                "environ": environ,
                "preload": self.preload,
                "verbose": self.verbose,
                "start_timeout": self.start_timeout,
            }
            proc = ctx.Process(
                target=bootstrap,
                name=f"vime-rank-{rank}",
                args=(rank_kwargs,),
                daemon=False,  # ranks may start processes of their own; we kill them ourselves
            )
            try:
                with environment(extra):
                    proc.start()
            except BaseException:
                self._kill()
                raise
            finally:
                child_conn.close()  # so a dead rank shows as EOF on parent_conn
            self._procs.append(proc)
            self._conns.append(parent_conn)
        try:
            replies = self._collect(None, self.start_timeout, what="rank start-up", expect="ready")
        except BaseException:
            self._kill()
            raise
        log.debug("LocalWorld of %d rank(s) (%s) ready: pids %s", self.nproc, backend, replies)
        return self

    def close(self) -> None:
        """Stop all rank processes (politely, then SIGKILL) and release the store. Idempotent."""
        if os.getpid() != self._owner_pid:  # a forked copy of this object owns nothing
            return
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("exit",))
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        self._closed = True

    def _kill(self) -> None:
        if os.getpid() != self._owner_pid:
            return
        for proc in self._procs:
            if proc.pid is None:
                continue
            if proc.exitcode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the rank and whatever it spawned
                except (ProcessLookupError, PermissionError):
                    with contextlib.suppress(Exception):
                        proc.kill()
            # Also sweep the group if the rank already died but left children behind.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self._procs:
            proc.join(5.0)
            with contextlib.suppress(Exception):
                proc.close()
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._procs, self._conns = [], []
        self._store = None

    # -- running jobs ------------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``timeout`` (seconds, ``None`` for no limit) bounds the whole call; it is not passed to
        ``fn``. Raises :class:`RankError` or :class:`WorldTimeoutError` and kills the world on
        failure (the next call respawns it); ``TypeError`` if ``fn`` or its arguments cannot be
        pickled (nothing is sent then).
        """
        what = _describe(fn)
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot send {what} to the ranks: the function must be defined at module level and its "
                f"arguments picklable ({exc})"
            ) from exc
        self.start()
        self._task_id += 1
        task_id = self._task_id
        try:
            for conn in self._conns:
                try:
                    conn.send(("run", task_id, payload))
                except (BrokenPipeError, ConnectionResetError, OSError):
                    pass  # the rank died; _collect reports it
            replies = self._collect(task_id, timeout, what=what, expect="ok")
        except BaseException:
            self._kill()
            raise
        return [pickle.loads(replies[rank]) for rank in range(self.nproc)]

    def _collect(self, task_id: int | None, timeout: float | None, *, what: str, expect: str) -> dict[int, Any]:
        """Wait for one reply per rank; raise (after the grace period) on errors, deaths and timeouts."""
        start = time.monotonic()
        deadline = math.inf if timeout is None else start + timeout
        grace_deadline = math.inf
        pending = set(range(self.nproc))
        replies: dict[int, Any] = {}
        failures: dict[int, str] = {}
        conn_rank = {id(conn): rank for rank, conn in enumerate(self._conns)}
        sentinel_rank = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}

        def dead(rank: int) -> None:
            proc = self._procs[rank]
            proc.join(1.0)
            code = proc.exitcode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            failures[rank] = f"rank {rank} process ended ({how}) without answering {what}"
            pending.discard(rank)

        while pending:
            limit = min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables: list[Any] = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = multiprocessing.connection.wait(waitables, timeout=None if math.isinf(remaining) else remaining)
            for obj in ready:
                if isinstance(obj, int):  # a process sentinel: the rank exited
                    rank = sentinel_rank[obj]
                    if rank in pending and not self._conns[rank].poll():
                        dead(rank)
                    continue
                rank = conn_rank[id(obj)]
                if rank not in pending:
                    continue
                try:
                    message = obj.recv()
                except (EOFError, OSError):
                    dead(rank)
                    continue
                kind = message[0]
                if kind == "start_error":
                    failures[rank] = message[1]
                    pending.discard(rank)
                elif kind == "ready" and expect == "ready":
                    replies[rank] = message[1]
                    pending.discard(rank)
                elif kind in ("ok", "error") and message[1] == task_id:
                    if kind == "ok":
                        replies[rank] = message[2]
                    else:
                        failures[rank] = message[2]
                    pending.discard(rank)
                # anything else is a stale answer to an earlier, abandoned task: ignore it
            if failures and math.isinf(grace_deadline):
                grace_deadline = time.monotonic() + self.error_grace

        if failures:
            self._kill()
            raise RankError(
                what, failures, pending, note="the world was killed and will be respawned by the next run()"
            )
        if pending:
            self._kill()
            raise WorldTimeoutError(what, sorted(pending), float(timeout or 0.0))
        return replies


def run_ranks(nproc: int, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
    """Run ``fn`` once on a fresh :class:`LocalWorld` of ``nproc`` ranks, then close it."""
    with LocalWorld(nproc) as world:
        return world.run(fn, *args, timeout=timeout, **kwargs)
