"""``vime-gemma4 probe``: follow weights through Megatron-Bridge's export stage by stage; flag the first bad one."""

from __future__ import annotations

import argparse
import json

from vime_gemma4_bridge.cli import errors
from vime_gemma4_bridge.cli.arguments import add_job_arguments
from vime_gemma4_bridge.runtime.launch import is_reporting_process, launch

PROG = "vime-gemma4 probe"
DESCRIPTION = """\
Load a Gemma 4 HF checkpoint into the Megatron model at the given parallel topology (gloo CPU
ranks with --nproc, or the ranks of torchrun) and follow chosen weights through Megatron-Bridge's
own export, stage by stage. Each stage's fingerprint is checked against what it must hold, derived
from the HF source, and the first stage that differs is flagged.

MoE checkpoints: routed experts, through the rank-local shard, the PP broadcast, the ETP gather,
the EP gather and the final stacked HF tensor. Default experts: both sides of every EP boundary
plus the first and last expert.

Dense checkpoints (31B, E4B, E2B): each layer's MLP, whose two weights are split over TP the two
ways a dense weight is (gate/up column halves, down rows), through the rank-local shard, the PP
broadcast, the TP gather and the final HF gate_proj / up_proj / down_proj.

Exit status: 0 iff every stage matches, 1 otherwise, 2 on bad input."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 probe``."""
    parser = subparsers.add_parser(
        "probe",
        help="follow experts (dense: MLPs) through the HF -> Megatron -> HF export; flag the first bad stage",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(
        parser, hf_help="source Gemma 4 HF checkpoint (MoE or dense)", json_help="print the result as JSON"
    )
    parser.add_argument(
        "--experts",
        metavar="LIST",
        help="MoE only: expert ids, e.g. 0,31,32 or 0-3 (default: both sides of each EP boundary)",
    )
    parser.add_argument("--layers", metavar="LIST", help="layer ids, e.g. 0,5 or 0-3 (default: all layers)")
    parser.set_defaults(func=run)


def parse_id_list(text: str, limit: int, flag: str) -> list[int]:
    """``"0,7-9"`` → ``[0, 7, 8, 9]``; every id must be below ``limit``."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            low, _, high = part.partition("-")
            first, last = int(low), int(high) if high else int(low)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a number or a range like 0-3") from None
        if first < 0 or last >= limit or first > last:
            raise ValueError(f"{flag}: {part!r} is out of range; ids go from 0 to {limit - 1}")
        ids.update(range(first, last + 1))
    if not ids:
        raise ValueError(f"{flag}: no ids given")
    return sorted(ids)


def run(args: argparse.Namespace) -> int:
    """Validate everything before starting ranks (bad input: one line on stderr, exit 2); exit 0 iff all ok."""
    from vime_gemma4_bridge.cli import preflight
    from vime_gemma4_bridge.core.hf_layout import text_config_dict
    from vime_gemma4_bridge.verify.probe import format_probe, probe_job

    try:
        inputs = preflight.command_inputs(args)
        text = text_config_dict(inputs.source.config)
        if args.experts and not text.get("enable_moe_block"):
            raise ValueError(
                "--experts: this checkpoint is dense (no enable_moe_block), it has no experts; "
                "drop --experts and the probe follows each layer's MLP"
            )
        experts = parse_id_list(args.experts, int(text["num_experts"]), "--experts") if args.experts else None
        layers = parse_id_list(args.layers, int(text["num_hidden_layers"]), "--layers") if args.layers else None
    except ValueError as error:
        return errors.refuse(PROG, error)
    result = launch(args.nproc, probe_job, str(inputs.source.path), inputs.topology, experts, layers)[0]
    if is_reporting_process():
        print(json.dumps(result, indent=2) if args.json else format_probe(result))
    return 0 if result["ok"] else 1
