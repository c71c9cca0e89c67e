"""``vime-gemma4 export-live`` and ``verify-update``: the live (training-time) export, driven and checked.

``export-live`` runs :func:`vime_gemma4_bridge.convert.live.export_live_job` at a topology, the stream
vime's ``--megatron-to-hf-mode bridge`` pushes to vLLM, written as chunk files like vime's disk
transport; ``verify-update`` checks such a directory with :func:`vime_gemma4_bridge.verify.update.verify_update`.
Thin: parsers, the pre-flight, the launch, the report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vime_gemma4_bridge.cli.arguments import add_job_arguments
from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV, EXPERT_LAYOUTS, PER_EXPERT, STACKED
from vime_gemma4_bridge.runtime.launch import is_reporting_process, launch

__all__ = ["add_export_live_parser", "add_verify_parser", "print_misfits"]


def add_export_live_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 export-live``."""
    parser = subparsers.add_parser(
        "export-live",
        help="drive the live (training-time) export at a topology; write each chunk as a safetensors file",
        description=(
            "Load a Gemma 4 HF checkpoint into the Megatron model at the given topology and stream it out "
            "through the live export path vime uses with --megatron-to-hf-mode bridge: (hf_name, tensor, "
            "megatron_name) for the language model only, in chunks below --buffer-size bytes (vime's rule; a "
            "larger tensor alone). Each chunk is written as one safetensors file, as vime's disk transport does, with "
            "an index and the checkpoint's side files; check the result with `vime-gemma4 verify-update`."
        ),
    )
    add_job_arguments(parser, hf_help="Gemma 4 HF checkpoint to load", replaces="--dump")
    parser.add_argument(
        "--buffer-size",
        required=True,
        metavar="BYTES",
        help="chunk bound (vime's --update-weight-buffer-size), e.g. 1GiB",
    )
    parser.add_argument("--dump", required=True, metavar="DIR", help="directory to write the chunk files into")
    parser.add_argument(
        "--expert-layout",
        choices=EXPERT_LAYOUTS,
        default=STACKED,
        help=(
            "routed experts as the checkpoint stacks them (experts.gate_up_proj [E, 2I, H], experts.down_proj; "
            "the default), or per-expert: experts.<e>.{gate,up,down}_proj.weight, each yielded as soon as it is "
            "gathered, so the export never holds a layer's stack (vLLM's Gemma 4 loader takes both; vime: set "
            f"{EXPERT_LAYOUT_ENV}=per-expert in the actor's environment)"
        ),
    )
    parser.add_argument(
        "--quantize",
        choices=("fp8",),
        help=(
            "fp8: block FP8 (128x128, e4m3 NAME + float32 NAME_scale_inv, scale = block amax / 448) for "
            "q/k/v/o, the MLP and every expert; embeddings, norms, router and layer_scalar bitwise. Implies "
            "--expert-layout per-expert"
        ),
    )
    parser.set_defaults(func=run_export_live, output_arg="dump")


def run_export_live(args: argparse.Namespace) -> int:
    """``export-live``: every refusal before ranks start (exit 2), then the job on every rank; exit 0."""
    from vime_gemma4_bridge.cli import errors, preflight
    from vime_gemma4_bridge.convert.live import export_live_job

    try:
        inputs = preflight.command_inputs(args, output="--dump", size="--buffer-size")
    except ValueError as error:
        return errors.refuse("vime-gemma4 export-live", error)
    topology, buffer_size = inputs.topology, inputs.size
    layout = PER_EXPERT if args.quantize else args.expert_layout
    result = launch(
        args.nproc,
        export_live_job,
        args.hf_checkpoint,
        topology,
        args.dump,
        buffer_size,
        args.force,
        layout,
        args.quantize,
    )[0]
    if not is_reporting_process():
        return 0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"export-live: {result['tensors']} tensors, {result['bytes']:,} bytes in {result['chunks']} chunk "
            f"file(s) (largest {result['largest_chunk_bytes']:,} bytes, buffer {buffer_size:,}) at {topology}, "
            f"experts {layout}{', fp8' if args.quantize else ''} -> {result['dump']}"
        )
        print_misfits(result["vllm_block_misfits"])
    return 0


def print_misfits(misfits: list[str] | None) -> None:
    """Say which FP8 weights vLLM's block loader will refuse (``convert/fp8.vllm_block_misfits``), if any."""
    if misfits:
        print(
            "note: vLLM's block-FP8 loader needs these multiples of 128 and will refuse this FP8 layout: "
            + ", ".join(misfits)
            + " (serve bf16, or quantize a model whose sizes divide by 128)"
        )


def add_verify_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 verify-update``."""
    parser = subparsers.add_parser(
        "verify-update",
        help="check a disk-transport weight update (chunk files) against the HF checkpoint, bitwise",
        description=(
            "Compare the tensors pushed to the rollout workers — a directory of safetensors chunk files as "
            "written by vime's disk transport (or `vime-gemma4 export-live`); a transport root with weight_v<N>/ "
            "directories is checked at its latest version — with the language model of the HF checkpoint: every "
            "tensor present once, same dtype and shape, bitwise equal. Every mismatch is named with fingerprints. "
            "Exit status: 0 iff all match, 1 otherwise, 2 on bad input."
        ),
    )
    parser.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="reference Gemma 4 HF checkpoint")
    parser.add_argument("--dump", required=True, metavar="DIR", help="directory of pushed chunk files")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    """``verify-update``: exit 0 iff every tensor matches, 1 otherwise, 2 on bad input."""
    from vime_gemma4_bridge.cli import errors
    from vime_gemma4_bridge.io.hf import CheckpointError
    from vime_gemma4_bridge.verify.update import verify_update

    try:
        if not Path(args.dump).is_dir():
            raise CheckpointError(f"--dump {args.dump} is not a directory")
        report = verify_update(args.hf_checkpoint, args.dump)
    except ValueError as error:
        return errors.refuse("vime-gemma4 verify-update", error)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for problem in report["problems"]:
            print(f"MISMATCH {problem}")
        verdict = "OK" if report["ok"] else "FAILED"
        layout = "" if report["expert_layout"] == STACKED else f", experts {report['expert_layout']} (restacked)"
        fp8 = ", fp8 (against the checkpoint quantized)" if report["fp8"] else ""
        print(
            f"verify-update {verdict}: {report['matched']}/{report['expected']} language-model tensors bitwise "
            f"identical in {report['files']} file(s) of {report['directory']}{layout}{fp8}"
        )
    return 0 if report["ok"] else 1
