"""``vime-gemma4`` command line: one sub-command per job, each command module owning its own arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from vime_gemma4_bridge.cli import errors


def build_parser() -> argparse.ArgumentParser:
    """The ``vime-gemma4`` parser: the sub-commands in ``--help`` order, each with ``--debug`` and ``--verbose``."""
    from vime_gemma4_bridge.cli import (
        bench,
        compare,
        demo,
        env,
        import_export,
        live,
        migrate,
        parity,
        probe,
        rollout_check,
        roundtrip,
        tiny,
        verify_checkpoint,
    )

    parser = argparse.ArgumentParser(
        prog="vime-gemma4",
        description="Gemma 4 <-> Megatron conversion through Megatron-Bridge, bitwise-checked, GPU optional.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tiny.add_parser(sub)
    demo.add_parser(sub)
    roundtrip.add_parser(sub)
    compare.add_parser(sub)
    probe.add_parser(sub)
    live.add_export_live_parser(sub)
    live.add_verify_parser(sub)
    verify_checkpoint.add_parser(sub)
    parity.add_parser(sub)
    rollout_check.add_parser(sub)
    import_export.add_parsers(sub)
    migrate.add_parser(sub)
    bench.add_parser(sub)
    env.add_parser(sub)
    for command in sub.choices.values():
        errors.add_output_options(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; its exit status (the console script ``vime-gemma4``)."""
    # megatron.training configures root logging to stdout when imported; claiming the root logger
    # first keeps stdout for reports (``--json`` stays parseable) and library chatter on stderr.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    return errors.run_command(f"vime-gemma4 {args.command}", args)


def program() -> None:
    """The ``vime-gemma4`` console script: :func:`main` on ``sys.argv``, then exit with its status."""
    errors.exit_program(main())
