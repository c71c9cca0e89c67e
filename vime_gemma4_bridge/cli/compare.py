"""``vime-gemma4 compare A B``: where and how two Gemma 4 HF checkpoints diverge (the checkpoint doctor)."""

from __future__ import annotations

import argparse
import json

from vime_gemma4_bridge.cli import errors

PROG = "vime-gemma4 compare"
DESCRIPTION = """\
Compare two Gemma 4 HF checkpoints A (reference) and B tensor by tensor and say where and how
they diverge: missing/extra tensors, dtype and shape changes, bitwise equality, max |dx| and
cosine per tensor, fingerprints of every routed expert per layer, and a diagnosis of the faults
a broken conversion leaves (duplicated or shifted experts, gate/up halves swapped, q/k/v heads
permuted, k and v confused, tied lm_head disagreeing with the embedding, layers swapped).
The first line is 'IDENTICAL: N tensors' or 'DIFFERENT: <most likely cause>'. Exit status: 0 iff
identical (or every difference within --atol), 1 otherwise (a shard whose recorded
digests do not match its bytes too: named), 2 on bad input."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 compare``."""
    parser = subparsers.add_parser(
        "compare",
        help="say where and how two Gemma 4 HF checkpoints diverge; exit 0 iff identical",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", metavar="A", help="reference HF checkpoint (e.g. HF1)")
    parser.add_argument("b", metavar="B", help="HF checkpoint to examine (e.g. HF2 after a round trip)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        metavar="X",
        help="accept value differences up to max |dx| <= X (same names, dtypes, shapes); default: bitwise",
    )
    parser.add_argument(
        "--all-experts", action="store_true", help="list every expert's fingerprints, not just moved ones"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 iff identical (or within --atol), 1 if not, 2 on bad input (one line on stderr)."""
    from vime_gemma4_bridge.io.digests import DamagedCheckpoint
    from vime_gemma4_bridge.verify.doctor import compare_checkpoints

    try:
        report = compare_checkpoints(args.a, args.b, atol=args.atol)
    except DamagedCheckpoint as error:  # the bytes on disk are bad, not the command line: exit 1
        return errors.report(PROG, error, debug=args.debug)
    except (ValueError, OSError) as error:
        return errors.refuse(PROG, error)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.format(all_experts=args.all_experts))
    return 0 if report.identical else 1
