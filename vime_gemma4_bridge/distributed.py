"""Parallel topologies and multi-rank execution for conversion jobs, on CPUs or GPUs.

Three ways to get ranks, one job function:

* :class:`LocalWorld` spawns N local rank processes **once** and runs many job functions in
  them. Importing ``megatron.bridge`` costs ~1 GB RSS and ~10 s per rank, so a test suite or
  a sweep over topologies must reuse the processes; megatron-core's parallel state is then
  re-initialised per topology with :func:`init_model_parallel`.
* under ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR in the environment) :func:`init_from_env`
  joins the job's process group and the job function runs on this rank directly;
* with neither, :func:`launch` makes a one-rank world in this process.

Backends: gloo on CPU; nccl when the host has a GPU per local rank (rank i binds device i).

This module imports neither torch nor megatron at module level. The package's ``__init__``
does (it registers the bridges with megatron.bridge), so rank processes start from a stdlib-only
bootstrap (``_RANK_BOOTSTRAP``) that sets thread counts and quiet logging before that import.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import inspect
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_PRELOAD",
    "DEFAULT_TIMEOUT",
    "LocalWorld",
    "RankError",
    "Topology",
    "WorldTimeoutError",
    "add_launch_arguments",
    "default_backend",
    "in_torchrun",
    "is_reporting_process",
    "init_from_env",
    "init_model_parallel",
    "launch",
    "parallel_layout",
    "requested_world_size",
    "reset_model_parallel",
    "run_ranks",
    "single_process_group",
]

log = logging.getLogger(__name__)

#: Modules every rank imports before it joins the process group, so jobs start warm.
DEFAULT_PRELOAD: tuple[str, ...] = ("megatron.core", "megatron.core.parallel_state", "megatron.bridge")
#: Seconds :meth:`LocalWorld.run` waits for all ranks before it declares the world hung.
DEFAULT_TIMEOUT: float = 1800.0
#: Seconds to wait for the other ranks once one rank has failed (they may be stuck in a collective).
DEFAULT_ERROR_GRACE: float = 5.0
_LOCALHOST = "127.0.0.1"


# --------------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Megatron parallel sizes of one run: tensor, pipeline, virtual pipeline, expert, expert-tensor.

    ``etp`` defaults to 1, not to ``tp`` as in megatron-core: expert layers then fit worlds
    such as TP2·PP2·EP2 on 4 ranks (megatron-core needs ETP·EP·PP to divide the world size).
    Data parallelism is whatever the world size leaves over.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp is not None:
            parts.append(f"VPP{self.vpp}")
        parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        return "·".join(parts)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the dense part of the model (TP·PP)."""
        return self.tp * self.pp

    @property
    def expert_parallel_size(self) -> int:
        """Ranks holding one copy of the expert layers (ETP·EP·PP)."""
        return self.etp * self.ep * self.pp

    @property
    def min_world_size(self) -> int:
        """Smallest world this topology fits: every valid world size is a multiple of it."""
        return math.lcm(self.model_parallel_size, self.expert_parallel_size)

    def validate(self, world_size: int) -> None:
        """Raise ``ValueError`` (one line: what is wrong, what to do) unless this fits ``world_size``."""
        for name in ("tp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a whole number >= 1, got {value!r}")
        if self.vpp is not None:
            if isinstance(self.vpp, bool) or not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(f"--vpp must be a whole number >= 1 or omitted, got {self.vpp!r}")
            if self.pp == 1:
                raise ValueError(f"--vpp {self.vpp} needs pipeline parallelism: set --pp to 2 or more, or omit --vpp")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world size must be a whole number >= 1, got {world_size!r}")
        hint = f"use a world size that is a multiple of {self.min_world_size} (e.g. --nproc {self.min_world_size})"
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"{self} does not fit {world_size} rank(s): TP·PP = {self.model_parallel_size} must divide "
                f"the world size; {hint} or lower --tp/--pp"
            )
        if world_size % self.expert_parallel_size:
            raise ValueError(
                f"{self} does not fit {world_size} rank(s): ETP·EP·PP = {self.expert_parallel_size} must divide "
                f"the world size; {hint} or lower --ep/--etp"
            )

    def data_parallel_size(self, world_size: int) -> int:
        """Copies of the dense model in a world of ``world_size`` ranks."""
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``parallel_state.initialize_model_parallel`` (and model providers)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        }

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add ``--tp --pp --vpp --ep --etp`` to ``parser`` (a group, so ``--help`` keeps them together)."""
        group = parser.add_argument_group("parallel topology")
        group.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default: 1)")
        group.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel size (default: 1)")
        group.add_argument(
            "--vpp",
            type=int,
            default=None,
            metavar="N",
            help="virtual pipeline stages per pipeline rank (interleaving; needs --pp >= 2; default: none)",
        )
        group.add_argument("--ep", type=int, default=1, metavar="N", help="expert-parallel size (default: 1)")
        group.add_argument(
            "--etp",
            type=int,
            default=1,
            metavar="N",
            help="expert tensor-parallel size (default: 1, not --tp, so that TP·PP·EP worlds stay small)",
        )
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Topology:
        """Topology from the options of :meth:`add_arguments` (missing ones take the defaults)."""
        return cls(
            tp=getattr(args, "tp", 1),
            pp=getattr(args, "pp", 1),
            vpp=getattr(args, "vpp", None),
            ep=getattr(args, "ep", 1),
            etp=getattr(args, "etp", 1),
        )


def add_launch_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--nproc N``: how many local rank processes :func:`launch` spawns."""
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help=(
            "spawn N local rank processes (gloo on CPU, nccl with N GPUs). Omit under torchrun, "
            "or to run as a single rank in this process"
        ),
    )
    return parser


# --------------------------------------------------------------------------------------------
# megatron-core parallel state
# --------------------------------------------------------------------------------------------

# Globals of megatron.core.parallel_state that destroy_model_parallel() (megatron-core 0.19)
# leaves set. Most are overwritten by the next initialize_model_parallel(), but not all: e.g.
# _EMBEDDING_GLOBAL_RANKS is only written on ranks inside the new embedding group, so a middle
# pipeline stage of a PP4 world would keep the ranks of an earlier PP1/PP2 topology and
# is_rank_in_embedding_group() would answer True. Value: what it is reset to.
_STALE_PARALLEL_STATE: dict[str, Any] = {
    "_EMBEDDING_GLOBAL_RANKS": None,
    "_PIPELINE_GLOBAL_RANKS": None,
    "_DATA_PARALLEL_GLOBAL_RANKS": None,
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": None,
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": None,
    "_MODEL_PARALLEL_GLOBAL_RANKS": None,
    "_EXPERT_MODEL_PARALLEL_RANKS": None,
    "_MPU_DATA_PARALLEL_RANK": None,
    "_MPU_DATA_PARALLEL_WORLD_SIZE": None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": None,
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
}


def reset_model_parallel(*, destroy_groups: bool = True) -> None:
    """Forget megatron-core's parallel state so that another topology can be initialised.

    Beyond ``parallel_state.destroy_model_parallel()`` this clears the globals it forgets (see
    ``_STALE_PARALLEL_STATE``), the micro-batch calculator and, with ``destroy_groups``, shuts
    down the process groups megatron-core created: ``destroy_model_parallel`` only drops its
    references, so every re-initialisation would otherwise leak ~20 communicators (gloo: sockets
    and threads per group). Models built for the old topology must not be used afterwards.
    Must be called on all ranks (group shutdown order has to match for nccl).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    # Read before destroy_model_parallel() drops it. Also covers a half-initialised state left by
    # an initialize_model_parallel() that raised midway (destroy is safe to call in any state).
    groups = list(getattr(ps, "_global_process_group_list", None) or [])
    ps.destroy_model_parallel()
    for name, value in _STALE_PARALLEL_STATE.items():
        if hasattr(ps, name):
            setattr(ps, name, value)
    hybrid = getattr(ps, "_HYBRID_DP_CP_GROUPS", None)
    if isinstance(hybrid, dict):
        hybrid.clear()
    with contextlib.suppress(ImportError):
        from megatron.core import num_microbatches_calculator

        num_microbatches_calculator.destroy_num_microbatches_calculator()
    if destroy_groups and dist.is_initialized():
        pg_map = dist.distributed_c10d._world.pg_map
        world = dist.GroupMember.WORLD
        seen: set[int] = set()
        for group in groups:
            if group is None or group is world or id(group) in seen or pg_map.get(group) is None:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def init_model_parallel(
    topology: Topology, *, seed: int = 1234, destroy_groups: bool = True, keep_if_same: bool = False
) -> None:
    """(Re)initialise megatron-core's parallel state for ``topology`` in this rank.

    ``keep_if_same`` keeps the process groups when the parallel state already has exactly this
    topology (on every rank alike: the same sequence of calls runs everywhere); creating the groups
    again costs ~0.2 s, which a one-shot conversion that follows another one need not pay.

    ``torch.distributed`` must already be initialised (by :class:`LocalWorld`, :func:`init_from_env`
    or :func:`single_process_group`), and every rank must call this with the same topology: it
    creates process groups collectively. Any earlier topology is torn down first, see
    :func:`reset_model_parallel`. Torch's CPU RNG is seeded with ``seed`` on every rank so that
    CPU-initialised weights agree; with CUDA, megatron's model-parallel CUDA RNG tracker is seeded
    too (``model_parallel_cuda_manual_seed`` raises without a driver, hence only then).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: run inside LocalWorld/launch(), under torchrun after "
            "init_from_env(), or within single_process_group()"
        )
    topology.validate(dist.get_world_size())
    if not (keep_if_same and ps.model_parallel_is_initialized() and _current_topology() == topology):
        reset_model_parallel(destroy_groups=destroy_groups)
        ps.initialize_model_parallel(**topology.megatron_kwargs())
    _seed_everything(seed)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        from megatron.core.tensor_parallel import random as mrandom

        kwargs: dict[str, Any] = {}
        if "force_reset_rng" in inspect.signature(mrandom.model_parallel_cuda_manual_seed).parameters:
            kwargs["force_reset_rng"] = True
        mrandom.model_parallel_cuda_manual_seed(seed, **kwargs)


def _current_topology() -> Topology:
    layout = parallel_layout()
    return Topology(tp=layout["tp"], pp=layout["pp"], vpp=layout["vpp"], ep=layout["ep"], etp=layout["etp"])


def parallel_layout() -> dict[str, int | None]:
    """This rank's sizes and ranks as megatron-core's parallel_state reports them (for checks and logs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "dp": ps.get_data_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "edp": ps.get_expert_data_parallel_world_size(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
    }


# --------------------------------------------------------------------------------------------
# Joining torch.distributed
# --------------------------------------------------------------------------------------------


def default_backend(local_world_size: int) -> str:
    """``nccl`` when every local rank can have its own GPU, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size else "gloo"


def _join_process_group(backend: str, *, rank: int, world_size: int, local_rank: int, **init_kwargs: Any) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        init_kwargs["device_id"] = device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **init_kwargs)


def requested_world_size(nproc: int | None) -> int:
    """The world a command will run in: ``--nproc``, else torchrun's ``WORLD_SIZE``, else one rank."""
    return nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))


def is_reporting_process() -> bool:
    """Whether this process prints a command's report: the launcher, or global rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0"


def in_torchrun() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher).

    Also true inside :class:`LocalWorld` ranks, which export the same variables for code that
    reads them; :func:`launch` checks for an initialised process group first.
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
    _join_process_group(
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

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    store = dist.TCPStore(_LOCALHOST, 0, 1, is_master=True, wait_for_workers=False)
    _join_process_group(backend or default_backend(1), rank=0, world_size=1, local_rank=0, store=store)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            reset_model_parallel()
        dist.destroy_process_group()
        del store


# --------------------------------------------------------------------------------------------
# LocalWorld
# --------------------------------------------------------------------------------------------


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


# First code a rank process runs (as the target of ``exec``, so that nothing of this package is
# imported yet). Importing ``vime_gemma4_bridge`` imports megatron.bridge (the package registers
# its bridges on import), which reads thread settings and logs/warns at import time, so all of
# this must come first. Stdlib only. ``rank_kwargs`` is bound in the globals by LocalWorld.start.
_RANK_BOOTSTRAP = r"""
import logging, os, signal, threading, time

kw = rank_kwargs
# Own process group: the parent kills the rank together with anything it spawned.
try:
    os.setpgid(0, 0)
except OSError:
    pass


def _watch_parent(parent_pid):
    # A rank blocked in a collective never reads its pipe again; if the parent dies without
    # closing the world (SIGKILL, crash), take the rank and its own children down with it.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            try:
                os.killpg(0, signal.SIGKILL)
            finally:
                os._exit(1)


threading.Thread(target=_watch_parent, args=(kw["parent_pid"],), name="parent-watch", daemon=True).start()

cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
threads = max(1, cores // kw["world_size"])
os.environ.setdefault("OMP_NUM_THREADS", str(threads))
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

from vime_gemma4_bridge.distributed import _rank_main

_rank_main(threads=threads, **kw)
"""


def _rank_main(
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
    """Body of one rank process after the bootstrap: join the world, then run tasks until told to exit."""
    try:
        from vime_gemma4_bridge.compat import te_guard

        te_guard.install()
        import importlib

        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        # tqdm (progress bars of transformers / Megatron-Bridge) would create a multiprocessing lock,
        # a named semaphore; ranks end with os._exit, so the resource tracker would report it leaked.
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
        for module in preload:
            importlib.import_module(module)
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=start_timeout),
        )
        _join_process_group(backend, rank=rank, world_size=world_size, local_rank=rank, store=store)
    except BaseException:
        conn.send(("start_error", traceback.format_exc()))
        _flush_and_exit(1)
    conn.send(("ready", os.getpid()))

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            _flush_and_exit(0)  # the parent closed the world
        if message[0] != "run":
            _flush_and_exit(0)
        _, task_id, payload = message
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = pickle.dumps(fn(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:
            reply = ("error", task_id, traceback.format_exc())
        else:
            reply = ("ok", task_id, result)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            _flush_and_exit(0)


def _flush_and_exit(code: int) -> None:
    # os._exit: skip atexit hooks of torch/megatron that may block on a broken process group.
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# Warning-message prefixes (PYTHONWARNINGS syntax) hidden in quiet ranks. Kept in the spawn
# environment as well as in _RANK_BOOTSTRAP because multiprocessing's spawn re-imports a script's
# __main__ module in each rank (so that job functions defined there unpickle) before any code of
# ours runs there; a script importing this package thus imports megatron in the rank first.
_QUIET_WARNING_PREFIXES = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "Only transformer-engine>=",
)


@contextlib.contextmanager
def _spawn_environment(nproc: int, verbose: bool) -> Iterator[None]:
    """Environment the rank processes inherit: thread limits and, unless verbose, warning filters."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = str(max(1, cores // nproc))
    extra = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    if not verbose:
        filters = [f"ignore:{prefix}" for prefix in _QUIET_WARNING_PREFIXES]
        if os.environ.get("PYTHONWARNINGS"):
            filters.append(os.environ["PYTHONWARNINGS"])  # later entries win: the user's settings
        extra["PYTHONWARNINGS"] = ",".join(filters)
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
            _LOCALHOST,
            0,
            self.nproc,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.start_timeout),
        )
        ctx = multiprocessing.get_context("spawn")
        self.starts += 1
        for rank in range(self.nproc):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            rank_kwargs = {
                "rank": rank,
                "world_size": self.nproc,
                "host": _LOCALHOST,
                "port": self._store.port,
                "backend": backend,
                "conn": child_conn,
                "parent_pid": os.getpid(),
                "preload": self.preload,
                "verbose": self.verbose,
                "start_timeout": self.start_timeout,
            }
            proc = ctx.Process(
                target=exec,  # see _RANK_BOOTSTRAP: no package import before the rank is set up
                name=f"vime-rank-{rank}",
                args=(_RANK_BOOTSTRAP, {"__name__": "__vime_rank__", "rank_kwargs": rank_kwargs}),
                daemon=False,  # ranks may start processes of their own; we kill them ourselves
            )
            try:
                with _spawn_environment(self.nproc, self.verbose):
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

    def restart(self) -> LocalWorld:
        """Kill the ranks (if any) and spawn fresh ones."""
        self._kill()
        return self.start()

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


def launch(nproc: int | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list:
    """Run a job function the way the command line was asked to; return the results this process saw.

    * ``nproc`` given → spawn that many local ranks (:func:`run_ranks`): all ranks' results;
    * already inside a process group (a :class:`LocalWorld` rank) → call ``fn`` here: ``[result]``;
    * under torchrun → :func:`init_from_env`, call ``fn`` on this rank: ``[result]``;
    * otherwise → a one-rank world in this process (:func:`single_process_group`): ``[result]``.

    ``fn`` must create its parallel state itself (:func:`init_model_parallel`), so the same job
    runs unchanged in all four settings. No timeout applies: conversions of big models take long.
    """
    if nproc is not None:
        return run_ranks(nproc, fn, *args, **kwargs)
    import torch.distributed as dist

    if dist.is_initialized():
        return [fn(*args, **kwargs)]
    if in_torchrun():
        init_from_env()
        return [fn(*args, **kwargs)]
    with single_process_group():
        return [fn(*args, **kwargs)]
