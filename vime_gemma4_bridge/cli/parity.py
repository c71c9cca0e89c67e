"""``vime-gemma4 parity``: Megatron forward vs transformers forward on the same weights; exit 0 iff logits match."""

from __future__ import annotations

import argparse
import json

from vime_gemma4_bridge.cli import errors
from vime_gemma4_bridge.cli.arguments import add_job_arguments
from vime_gemma4_bridge.runtime.launch import is_reporting_process, launch
from vime_gemma4_bridge.verify.parity import DEFAULT_BATCH, DTYPE_NAMES, ParityResult, default_seq_len, parity_job

PROG = "vime-gemma4 parity"
DESCRIPTION = """\
Load a Gemma 4 HF checkpoint into the Megatron model at the given parallel topology (gloo CPU
ranks with --nproc, or the ranks of torchrun), run one forward pass over fixed deterministic
token ids (pipelined over PP/VPP stages, logits gathered over TP), run transformers' forward
(eager attention) on the same ids with the same weights, and compare the logits over the real
vocabulary. --dtype casts the checkpoint weights to that dtype on both sides. The last line is
'max|dlogit|=<x> mean|dlogit|=<y> argmax_agreement=<z>'. Exit status: 0 iff within tolerance
(float32: max |dlogit| <= 2e-5 for MoE, 5e-5 for dense, or --fp32-max-abs, and argmax agreement
1.0; bfloat16: argmax agreement >= 0.99),
1 otherwise, 2 on bad input."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 parity``."""
    parser = subparsers.add_parser(
        "parity",
        help="Megatron forward vs transformers forward on the same weights; exit 0 iff logits match",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_job_arguments(
        parser, hf_help="Gemma 4 HF checkpoint", json_help="print the figures as JSON before the last line"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default="float32",
        help="cast the checkpoint weights to this dtype on both sides (default: float32)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="L",
        help="tokens per sequence (default: 3 x sliding_window rounded up to a multiple of 8)",
    )
    parser.add_argument(
        "--batch", type=int, default=DEFAULT_BATCH, metavar="B", help=f"sequences (default: {DEFAULT_BATCH})"
    )
    parser.add_argument(
        "--fp32-max-abs",
        type=float,
        default=None,
        metavar="X",
        help="float32 bound on max |dlogit| (default: 2e-5 for MoE, 5e-5 for dense; deep models may need more)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Every refusal before ranks start (exit 2); then both forwards: exit 0 iff within tolerance."""
    from vime_gemma4_bridge.cli import preflight
    from vime_gemma4_bridge.core.hf_layout import text_config_dict

    try:
        inputs = preflight.command_inputs(args)
        text = text_config_dict(inputs.source.config)
        seq_len = args.seq_len if args.seq_len is not None else default_seq_len(text)
        if seq_len < 1:
            raise ValueError(f"--seq-len must be a whole number >= 1, got {seq_len}")
        if args.batch < 1:
            raise ValueError(f"--batch must be a whole number >= 1, got {args.batch}")
    except ValueError as error:
        return errors.refuse(PROG, error)
    topology, world = inputs.topology, inputs.world_size
    job_args = (str(inputs.source.path), topology, args.dtype, seq_len, args.batch)
    results = launch(args.nproc, parity_job, *job_args, fp32_max_abs=args.fp32_max_abs)
    result = results[0]
    if is_reporting_process():
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            verdict = "OK" if result["passed"] else "FAILED"
            print(
                f"parity {verdict}: Megatron vs transformers logits, {args.dtype}, {topology} on {world} rank(s), "
                f"batch {args.batch} x {seq_len} tokens, vocab {result['vocab_size']} "
                f"(Megatron pads to {result['padded_vocab_size']})"
            )
        print(ParityResult(**result).summary_line())
    return 0 if result["passed"] else 1
