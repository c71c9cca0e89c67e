"""``vime-gemma4 roundtrip``: HF → Megatron (at a topology) → HF, proven bitwise; exit 0 iff identical."""

from __future__ import annotations

import argparse
import json

from vime_gemma4_bridge.cli import errors
from vime_gemma4_bridge.cli.arguments import add_job_arguments
from vime_gemma4_bridge.runtime.launch import is_reporting_process, launch
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

    try:
        inputs = preflight.command_inputs(args, output="--output", size="--max-shard-size")
    except ValueError as error:
        return errors.refuse(PROG, error)
    topology = inputs.topology
    results = launch(
        args.nproc,
        roundtrip_job,
        str(inputs.source.path),
        topology,
        args.output,
        args.force,
        inputs.size,
    )
    result = results[0]
    if not is_reporting_process():
        return 0 if result["identical"] else 1
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "report"}, indent=2))
    else:
        print(result["report"])
        total = result["total"]
        verdict = "OK" if result["identical"] else "FAILED"
        print(
            f"roundtrip {verdict}: {total['equal']}/{total['count']} language-model tensors bitwise identical "
            f"at {topology} on {inputs.world_size} rank(s)"
        )
        if args.output:
            print(f"wrote {result['output']}" if result.get("output") else "no output written: tensors differ")
    return 0 if result["identical"] else 1
