"""``vime-gemma4 demo``: the project's main job on a built-in tiny Gemma 4, with no arguments.

Writes the default tiny checkpoint (a ``Gemma4ForConditionalGeneration`` MoE: text model plus a
minimal vision tower, every tensor distinct) and round-trips it HF → Megatron → HF at TP2·PP2·EP2
on 4 gloo CPU ranks — the kind of topology of the original bug report — writing HF2 next to it.
Exit status is the round trip's: 0 iff every language-model tensor came back bitwise identical.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="round-trip a built-in tiny Gemma 4 at TP2·PP2·EP2 on 4 CPU ranks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workdir", default="demo-out", metavar="DIR", help="where HF1 and HF2 are written (default: demo-out)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the tiny checkpoint, then round-trip it; the round trip's exit status."""
    from vime_gemma4_bridge.cli import roundtrip
    from vime_gemma4_bridge.testing.spec import TinySpec
    from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

    workdir = Path(args.workdir)
    hf1 = write_tiny_checkpoint(workdir / "hf1-tiny-gemma4", TinySpec(), force=True)
    print(f"demo: wrote tiny Gemma 4 checkpoint {hf1}")
    print("demo: HF1 -> Megatron (TP2·PP2·EP2·ETP1, 4 gloo CPU ranks) -> HF2, compared bitwise")
    # The round trip's own parser reads these, so its defaults (shard size, --json, ...) are the command's.
    parser = argparse.ArgumentParser(prog="vime-gemma4")
    roundtrip.add_parser(parser.add_subparsers())
    topology = ["--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1", "--nproc", "4"]
    output = ["--output", str(workdir / "hf2-roundtrip"), "--force"]
    roundtrip_args = parser.parse_args(["roundtrip", "--hf-checkpoint", str(hf1), *topology, *output])
    return roundtrip.run(roundtrip_args)
