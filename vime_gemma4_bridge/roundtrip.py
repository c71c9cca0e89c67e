"""``vime-gemma4 roundtrip``: HF → Megatron (at a topology) → HF, proven bitwise.

This is the check that would have caught the original bug report (experts copied across EP
boundaries at TP2·PP2·EP4): every language-model tensor must come back ``torch.equal`` to the
source, with the same name, dtype and shape, nothing missing, nothing extra, and the experts on
both sides of every EP boundary distinct and in place.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.distributed import (
    Topology,
    add_launch_arguments,
    is_reporting_process,
    launch,
    requested_world_size,
)

DESCRIPTION = """\
Load a Gemma 4 HF checkpoint into the Megatron model at the given parallel topology (gloo CPU
ranks with --nproc, or the ranks of torchrun), export it back to HF through Megatron-Bridge,
and compare every language-model tensor bitwise with the source. With --output, also write the
exported model as a complete HF checkpoint (non-language tensors, config, tokenizer and
processor files copied from the source). Exit status: 0 iff every tensor is bitwise identical,
1 if any differs, 2 on bad input."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "roundtrip",
        help="HF -> Megatron -> HF at a topology; exit 0 iff bitwise identical",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="source Gemma 4 HF checkpoint")
    Topology.add_arguments(parser)
    add_launch_arguments(parser)
    parser.add_argument("--output", metavar="DIR", help="also write the round-tripped model as a HF checkpoint")
    parser.add_argument("--force", action="store_true", help="replace --output if it exists")
    parser.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard of --output (default 5GB)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def roundtrip_job(
    hf_checkpoint: str, topology: Topology, output: str | None, force: bool, max_shard_size: int
) -> dict[str, Any]:
    """Runs on every rank. Returns rank 0's comparison (as a dict) on all ranks."""
    from vime_gemma4_bridge import convert, hf_io, report
    from vime_gemma4_bridge.distributed import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    exported = convert.collect_on_rank0(bridge, model)
    result: dict[str, Any] | None = None
    if convert.is_rank0():
        source = hf_io.HFCheckpoint(hf_checkpoint)
        reference = source.load(source.language_model_names())
        comparison = report.compare(reference, exported, ep=topology.ep)
        result = comparison.as_dict()
        result["report"] = report.format_report(comparison, f"round trip at {topology}")
        result["total"] = vars(comparison.total)
        if output is not None:
            if not comparison.identical:
                result["output"] = None  # never write a checkpoint we know is wrong
            else:
                written = hf_io.write_hf_checkpoint(
                    output, exported, source, max_shard_size=max_shard_size, force=force
                )
                result["output"] = str(written)
    return convert.broadcast_from_rank0(result)


def run(args: argparse.Namespace) -> int:
    from vime_gemma4_bridge import convert, hf_io, preflight

    try:
        topology = Topology.from_args(args)
        topology.validate(requested_world_size(args.nproc))
        source = hf_io.HFCheckpoint(args.hf_checkpoint)
        convert.validate_model_topology(source.config, topology)
        if args.output:
            hf_io.refuse_overlap(args.output, "--output", {"--hf-checkpoint": source.path})
            hf_io.prepare_output(args.output, force=args.force)
        max_shard_size = hf_io.parse_size(args.max_shard_size, "--max-shard-size")
        preflight.check_language_model(source)
    except ValueError as error:
        print(f"vime-gemma4 roundtrip: error: {error}", file=sys.stderr)
        return 2
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
