"""``vime-gemma4 roundtrip``: HF → Megatron (at a topology) → HF, proven bitwise; exit 0 iff identical."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime_gemma4_bridge.cli import errors
from vime_gemma4_bridge.cli.arguments import add_job_arguments
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.launch import is_reporting_process, launch, requested_world_size
from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

PROG = "vime-gemma4 roundtrip"
DESCRIPTION = """\
Load a Gemma 4 HF checkpoint into the Megatron model at the given parallel topology (gloo CPU
ranks with --nproc, or the ranks of torchrun), export it back to HF through Megatron-Bridge,
and compare every language-model tensor bitwise with the source. With --output, also write the
exported model as a complete HF checkpoint (non-language tensors, config, tokenizer and
processor files copied from the source). Exit status: 0 iff every tensor is bitwise identical,
1 if any differs, 2 on bad input."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 roundtrip``."""
    parser = subparsers.add_parser(
        "roundtrip",
        help="HF -> Megatron -> HF at a topology; exit 0 iff bitwise identical",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(parser, hf_help="source Gemma 4 HF checkpoint", replaces="--output")
    parser.add_argument("--output", metavar="DIR", help="also write the round-tripped model as a HF checkpoint")
    parser.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard of --output (default 5GB)"
    )
    parser.set_defaults(func=run, output_arg="output")


def run(args: argparse.Namespace) -> int:
    """Every refusal before ranks start (exit 2); then the round trip: exit 0 iff bitwise identical."""
    from vime_gemma4_bridge.cli import preflight
    from vime_gemma4_bridge.io import hf as hf_io

    def output_checks(topology: Topology, source: hf_io.HFCheckpoint) -> int:
        if args.output:
            hf_io.refuse_overlap(args.output, "--output", {"--hf-checkpoint": source.path})
            hf_io.prepare_output(args.output, force=args.force)
        return hf_io.parse_size(args.max_shard_size, "--max-shard-size")

    try:
        topology, _, max_shard_size = preflight.command_inputs(args, output_checks)
    except ValueError as error:
        return errors.refuse(PROG, error)
    results = launch(
        args.nproc,
        roundtrip_job,
        str(Path(args.hf_checkpoint)),
        topology,
        args.output,
        args.force,
        max_shard_size,
    )
    result = results[0]
    if not is_reporting_process():
        return 0 if result["identical"] else 1
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=2))
    else:
        print(result["report"])
        total = result["total"]
        world = requested_world_size(args.nproc)
        verdict = "OK" if result["identical"] else "FAILED"
        print(
            f"roundtrip {verdict}: {total['equal']}/{total['count']} language-model tensors bitwise identical "
            f"at {topology} on {world} rank(s)"
        )
        if args.output:
            print(f"wrote {result['output']}" if result.get("output") else "no output written: tensors differ")
    return 0 if result["identical"] else 1
