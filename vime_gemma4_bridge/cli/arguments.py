"""The arguments the commands share, in one place; torch-free, as every parser must be (``--help`` is cheap)."""

from __future__ import annotations

import argparse

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.launch import add_launch_arguments


def add_job_arguments(
    parser: argparse.ArgumentParser,
    *,
    hf_help: str,
    replaces: str | None = None,
    json_help: str = "print the report as JSON",
) -> None:
    """The arguments every command that runs a job on ranks takes, and the pre-flight reads.

    ``--hf-checkpoint`` (``hf_help`` says what it is to this command), the topology flags and
    ``--nproc`` (read by :func:`vime_gemma4_bridge.cli.preflight.command_inputs`); ``--force`` when
    the command writes an output (``replaces``: which one); ``--json``.
    """
    parser.add_argument("--hf-checkpoint", required=True, metavar="HF", help=hf_help)
    Topology.add_arguments(parser)
    add_launch_arguments(parser)
    if replaces is not None:
        parser.add_argument("--force", action="store_true", help=f"replace {replaces} if it exists")
    parser.add_argument("--json", action="store_true", help=json_help)
