"""One error formatter for every command: a failure is one line on stderr, its traceback only with ``--debug``.

Exit status: 1 for a failure (:func:`report`), 2 for input refused before any rank started
(:func:`refuse`), 130 / 143 when SIGINT / SIGTERM interrupted the command (:func:`run_command`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import NoReturn

#: Our refusal types: their message is the whole story, the exception name adds nothing.
_REFUSALS = (
    "CheckpointError",
    "ConversionError",
    "TopologyError",
    "PreflightError",
    "UnsupportedCheckpoint",
    "OutputTaken",
    "DamagedCheckpoint",
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds (and cleans up) as on Ctrl-C."""


def interrupted_status(interrupt: KeyboardInterrupt) -> int:
    """Exit status of an interrupted command: 143 for SIGTERM, 130 for SIGINT (128 + signal number)."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def exit_program(status: int) -> NoReturn:
    """End the program with a finished command's exit status; a SIGINT / SIGTERM from now on changes nothing.

    The command's outcome is decided and reported (its output committed or removed, its ranks gone);
    Python's default SIGINT handling would still raise in the interpreter's teardown and end the
    process by the signal, with no word (exit -2), after a complete, reported run.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(status)


def one_line(error: BaseException) -> str:
    """What went wrong, in one line: a refusal's message; otherwise the exception type and message.

    For a failure inside ranks (``RankError``) it is the last line of the first failing rank's
    traceback: the exception that ended it, not the harness's summary.
    """
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        text = next(iter(failures.values())).strip()
        last = text.splitlines()[-1] if text else type(error).__name__
        name, _, message = last.partition(": ")
        return message if name.rsplit(".", 1)[-1] in _REFUSALS and message else last
    message = str(error).strip()
    if type(error).__name__ in _REFUSALS or isinstance(error, ValueError):
        return message or type(error).__name__
    first = message.splitlines()[0] if message else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def refuse(prog: str, error: BaseException | str) -> int:
    """Print ``prog: error: <message>`` for input refused before any rank started; return exit status 2.

    The message is the refusal's own, whole (a pre-flight lists one problem per line).
    """
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


def report(prog: str, error: BaseException, *, debug: bool) -> int:
    """Print ``prog: error: <one line>`` (after the traceback, with ``debug``); return exit status 1."""
    if debug:
        if getattr(error, "failures", None):
            print(str(error), file=sys.stderr)  # every rank's traceback
        else:
            traceback.print_exception(error, file=sys.stderr)
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
    return 1


def add_output_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--debug`` and ``--verbose`` on a command (a command's own ``--verbose`` is kept: it means more output too)."""
    group = parser.add_argument_group("output")
    group.add_argument("--debug", action="store_true", help="show the traceback of a failure (default: one line)")
    if "--verbose" not in parser._option_string_actions:
        group.add_argument(
            "--verbose", action="store_true", help="keep upstream's import-time logging and warnings (default: quiet)"
        )
    return parser


def run_command(prog: str, args: argparse.Namespace) -> int:
    """Run a parsed command: quiet unless ``--verbose``; a failure is one line unless ``--debug``.

    SIGINT and SIGTERM unwind the command (its partial output is removed on the way) and exit
    130 / 143; the rank processes of a local world end with it. A signal that arrives once the
    output was committed (``args.output_arg`` names the command's output argument) is no failure:
    the output is complete and stays, the command exits 0 and says so.

    A torchrun rank whose torchrun is killed removes the partials it named before it ends
    (:func:`~vime_gemma4_bridge.runtime.launch.at_launcher_gone`: the launcher knows no outputs). After
    an interrupt or a failure (any non-zero status) the partials of the output whose writer is gone are
    removed (:func:`~vime_gemma4_bridge.io.commit.remove_stale_partials`): a rank that named and wrote
    its own partial (``export-live``'s rank 0) was killed with its world and could not clean up itself.
    """
    from vime_gemma4_bridge.compat import quiet
    from vime_gemma4_bridge.io.commit import committed_since, identity, remove_own_partials, remove_stale_partials
    from vime_gemma4_bridge.runtime.launch import at_launcher_gone
    from vime_gemma4_bridge.runtime.world import VERBOSE_ENV

    at_launcher_gone(remove_own_partials)  # a torchrun rank whose launcher died removes what it was writing
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # rank processes keep their noise too
    else:
        quiet.install()
    output = getattr(args, getattr(args, "output_arg", None) or "", None)
    before = identity(output) if output is not None else None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        status = None
        try:
            status = int(args.func(args) or 0)
            return status
        finally:
            if output is not None and status != 0:  # the local ranks are gone (LocalWorld kills them first)
                remove_stale_partials(output)
    except KeyboardInterrupt as interrupt:
        if output is not None and committed_since(output, before):
            print(f"{prog}: interrupted after {output} was complete; it is kept", file=sys.stderr)
            return 0
        print(f"{prog}: interrupted; {output or 'nothing'} was not written", file=sys.stderr)
        return interrupted_status(interrupt)
    except SystemExit:
        raise
    except BaseException as error:  # every failure ends as one line and exit 1 (PyTorch's checkpoint errors too)
        return report(prog, error, debug=getattr(args, "debug", False))
    finally:
        signal.signal(signal.SIGTERM, previous)
