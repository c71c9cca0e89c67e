"""``vime-gemma4 import`` / ``export`` (and ``scripts/``): the command lines of the torch_dist conversion.

Thin: the parsers, the pre-flight (:func:`vime_gemma4_bridge.cli.preflight.command_inputs`: every refusal
that can be decided from the command line and the files on disk, before any rank starts), the launch of
the job (:mod:`vime_gemma4_bridge.convert.torch_dist_jobs`) and the report. Heavy modules are imported
inside the run functions, so ``--help`` and the parsers stay cheap.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from vime_gemma4_bridge.cli.arguments import add_job_arguments
from vime_gemma4_bridge.cli.live import print_misfits
from vime_gemma4_bridge.runtime.launch import is_reporting_process, launch

__all__ = ["add_parsers", "main_export", "main_import", "run_export", "run_import"]


#: Both commands' ``--json``: the report alone on stdout.
JSON_HELP = "print the final report as JSON (progress goes to stderr)"

IMPORT_DESCRIPTION = """\
Convert a Gemma 4 HF checkpoint to a Megatron torch_dist checkpoint at the given parallel topology
(gloo CPU ranks with --nproc, or the ranks of torchrun). Megatron-Bridge loads the language model
into the sharded Megatron model; megatron-core writes DIR/iter_0000000 and
DIR/latest_checkpointed_iteration.txt, with Megatron-Bridge's run_config.yaml and the source's HF
config beside it. The checkpoint loads at any other valid topology (vime-gemma4 export, or Megatron
with --no-load-optim --no-load-rng). DIR appears only when complete."""


EXPORT_DESCRIPTION = """\
Convert a Megatron torch_dist checkpoint (from vime-gemma4 import or a training run) back to a
complete HF checkpoint, at any valid topology: the one it was saved at does not matter. The HF
checkpoint it came from supplies the config, tokenizer and the non-language (vision) tensors and
must describe the same model (checked before ranks start). OUT is sharded by --max-shard-size with
a model.safetensors.index.json and appears only when complete.

At the default topology (no topology flags, or all of them 1: the fast path) the routed experts
stream from the torch_dist files to the HF shards, one expert in memory at a time, when the
checkpoint stores them whole (saved at --etp 1); the rest goes through Megatron-Bridge as always.
Any other topology loads the checkpoint into the Megatron model at that topology first (slower; a
check that it loads there)."""


def build_import_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_job_arguments(parser, hf_help="source Gemma 4 HF checkpoint", replaces="--save", json_help=JSON_HELP)
    parser.add_argument("--save", required=True, metavar="DIR", help="torch_dist checkpoint directory to create")
    parser.set_defaults(func=run_import, prog=parser.prog, output_arg="save")
    return parser


def build_export_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--load", required=True, metavar="DIR", help="torch_dist checkpoint (DIR or DIR/iter_*)")
    add_job_arguments(
        parser,
        hf_help="HF checkpoint of the same model: config, tokenizer, non-language tensors",
        replaces="--output",
        json_help=JSON_HELP,
    )
    parser.add_argument("--output", required=True, metavar="OUT", help="HF checkpoint directory to create")
    parser.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard of OUT (default 5GB)"
    )
    parser.add_argument(
        "--quantize",
        choices=("fp8",),
        help=(
            "fp8: write the block-FP8 checkpoint vLLM serves: q/k/v/o, the MLP and every routed expert (per expert: "
            "experts.<e>.{gate,up,down}_proj.weight) as float8_e4m3fn NAME plus float32 NAME_scale_inv "
            "(128x128 blocks, scale = block amax / 448); embeddings, norms, router, layer_scalar and the vision/audio "
            "towers bitwise; config.json gets the quantization_config (dynamic activations, the bf16 modules listed)"
        ),
    )
    parser.set_defaults(func=run_export, prog=parser.prog, output_arg="output")
    return parser


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 import`` and ``vime-gemma4 export``."""
    build_import_parser(
        subparsers.add_parser(
            "import",
            help="HF -> Megatron torch_dist checkpoint at a topology",
            description=IMPORT_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    build_export_parser(
        subparsers.add_parser(
            "export",
            help="Megatron torch_dist checkpoint -> HF, at any topology",
            description=EXPORT_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def _report(args: argparse.Namespace, result: Mapping[str, Any]) -> None:
    if not is_reporting_process():
        return
    if args.json:
        print(json.dumps(result, indent=2))
        return
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result["phases"].items())
    head = (
        f"{result['command']} OK: {result['tensors']} language-model tensors, {result['bytes']:,} bytes, "
        f"at {result['topology']} on {result['world_size']} rank(s), {result['seconds']:.1f} s "
        f"({phases}), {result['gb_per_s']:.3f} GB/s"
    )
    print(head)
    if result["command"] == "import":
        ckpt = result["checkpoint"]
        print(f"wrote torch_dist {ckpt['iteration_dir']}: {ckpt['files']} files, {ckpt['bytes']:,} bytes")
    else:
        hf = result["hf_output"]
        print(
            f"wrote HF {result['output']}: {hf['tensors']} tensors in {hf['shards']} safetensors shard(s), "
            f"{hf['files']} files, {hf['bytes']:,} bytes{' (block FP8)' if result.get('quantize') else ''}"
        )
        print_misfits(result.get("vllm_block_misfits"))


def run_import(args: argparse.Namespace) -> int:
    """``import``: every refusal before ranks start; exit 0 on success, 1 if a rank failed, 2 on bad input."""
    from vime_gemma4_bridge.cli import errors, preflight
    from vime_gemma4_bridge.convert.torch_dist_jobs import import_job
    from vime_gemma4_bridge.io.commit import partial_path

    try:
        inputs = preflight.command_inputs(args, output="--save")
    except ValueError as error:
        return errors.refuse(args.prog, error)
    out = inputs.output
    partial = partial_path(out)
    try:
        locations = (str(inputs.source.path), str(out), str(partial))
        results = launch(args.nproc, import_job, *locations, inputs.topology, replace=args.force)
        _report(args, results[0])
    except KeyboardInterrupt:  # SIGINT or SIGTERM: errors.run_command says whether the output was complete
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except BaseException as error:  # noqa: BLE001 (a rank failed; the world is gone)
        shutil.rmtree(partial, ignore_errors=True)
        return errors.report(args.prog, error, debug=args.debug)
    return 0


def run_export(args: argparse.Namespace) -> int:
    """``export``: every refusal before ranks start; exit 0 on success, 1 if a rank failed, 2 on bad input."""
    from vime_gemma4_bridge.cli import errors, preflight
    from vime_gemma4_bridge.convert.torch_dist_jobs import export_job

    try:
        # The HF checkpoint agrees with itself, then the torch_dist one with it (the pre-flight's order).
        inputs = preflight.command_inputs(args, output="--output", size="--max-shard-size", torch_dist="--load")
    except ValueError as error:
        return errors.refuse(args.prog, error)
    try:
        locations = (str(inputs.torch_dist.path), str(inputs.source.path), str(inputs.output))
        results = launch(args.nproc, export_job, *locations, inputs.topology, args.force, inputs.size, args.quantize)
        _report(args, results[0])
    except KeyboardInterrupt:  # errors.run_command says whether the output was complete
        raise
    except BaseException as error:  # a rank failed; the world is gone
        return errors.report(args.prog, error, debug=args.debug)
    return 0


def main_import(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``scripts/convert_hf_to_torch_dist.py``: the ``import`` command as a standalone program."""
    parser = argparse.ArgumentParser(
        prog=prog, description=IMPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from vime_gemma4_bridge.cli.errors import add_output_options, run_command

    args = add_output_options(build_import_parser(parser)).parse_args(argv)
    return run_command(args.prog, args)


def main_export(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``scripts/convert_torch_dist_to_hf.py``: the ``export`` command as a standalone program."""
    parser = argparse.ArgumentParser(
        prog=prog, description=EXPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from vime_gemma4_bridge.cli.errors import add_output_options, run_command

    args = add_output_options(build_export_parser(parser)).parse_args(argv)
    return run_command(args.prog, args)
