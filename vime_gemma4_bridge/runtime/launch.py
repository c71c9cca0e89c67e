"""Running a command's job function the way it was asked to: ``--nproc`` local ranks, torchrun, or in process."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from vime_gemma4_bridge.runtime.group import (
    PARENT_AT_START,
    in_torchrun,
    init_from_env,
    parent_gone,
    single_process_group,
    watch_parent,
)
from vime_gemma4_bridge.runtime.world import run_ranks


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


#: What a torchrun rank runs before it ends because its launcher is gone (:func:`at_launcher_gone`).
_AT_LAUNCHER_GONE: list[Callable[[], object]] = []


def at_launcher_gone(cleanup: Callable[[], object]) -> None:
    """Have :func:`launch` call ``cleanup`` on a torchrun rank that ends because torchrun is gone.

    That end skips ``atexit`` and every ``finally``, so this is how a rank removes what it was
    writing. The launcher knows no outputs (runtime stands below the checkpoints on disk): whoever
    names them registers their removal, the command line its partial outputs. Registering the same
    function again changes nothing.
    """
    if cleanup not in _AT_LAUNCHER_GONE:
        _AT_LAUNCHER_GONE.append(cleanup)


def requested_world_size(nproc: int | None) -> int:
    """The world a command will run in: ``--nproc``, else torchrun's ``WORLD_SIZE``, else one rank."""
    return nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))


def is_reporting_process() -> bool:
    """Whether this process prints a command's report: the launcher, or global rank 0 under torchrun."""
    return os.environ.get("RANK", "0") == "0"


def launch(nproc: int | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> list:
    """Run a job function the way the command line was asked to; return the results this process saw.

    * ``nproc`` given → spawn that many local ranks (:func:`~vime_gemma4_bridge.runtime.world.run_ranks`):
      all ranks' results;
    * already inside a process group (a ``LocalWorld`` rank) → call ``fn`` here: ``[result]``;
    * under torchrun → :func:`~vime_gemma4_bridge.runtime.group.init_from_env`, call ``fn`` on this
      rank: ``[result]``; should torchrun die (SIGKILL), the rank runs what :func:`at_launcher_gone`
      registered (the command line: removing the output it was writing) and ends at once, silently
      (:func:`_end_without_launcher`);
    * otherwise → a one-rank world in this process
      (:func:`~vime_gemma4_bridge.runtime.group.single_process_group`): ``[result]``.

    ``fn`` must create its parallel state itself, so the same job runs unchanged in all four
    settings. No timeout applies: conversions of big models take long.
    """
    if nproc is not None:
        return run_ranks(nproc, fn, *args, **kwargs)
    import torch.distributed as dist

    if dist.is_initialized():
        return [fn(*args, **kwargs)]
    if in_torchrun():
        watch_parent(_end_without_launcher, parent=PARENT_AT_START)  # before init: the store is torchrun's
        init_from_env()
        try:
            return [fn(*args, **kwargs)]
        except BaseException:
            if parent_gone():  # a peer that ended with the launcher broke this rank's collective
                _end_without_launcher()
            raise
    with single_process_group():
        return [fn(*args, **kwargs)]


def _end_without_launcher() -> None:
    """torchrun is gone: nobody reads this rank's outcome, and its peers lose theirs as it did.

    Without this the ranks would finish the job (a run that was stopped commits its output), or wait
    in a collective for a peer or the store until gloo's timeout and print C++ stack traces.
    """
    try:
        for cleanup in _AT_LAUNCHER_GONE:
            cleanup()
    finally:
        os._exit(1)
