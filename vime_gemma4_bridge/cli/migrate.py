"""``vime-gemma4 migrate``: a torch_dist checkpoint's keys rewritten for another Gemma 4 implementation."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vime_gemma4_bridge.runtime.launch import add_launch_arguments, is_reporting_process, launch

PROG = "vime-gemma4 migrate"
DESCRIPTION = """\
Rewrite a Gemma 4 torch_dist checkpoint in the layout another implementation loads, bitwise:
model weights, and optimizer state where it is keyed by name (no distributed optimizer, or
--dist-ckpt-optim-fully-reshardable); common state (args, iteration) and RNG are copied.

  ours         the plugin's (what vime-gemma4 import writes, and the plugin's model loads)
  upstream     upstream Megatron-Bridge's Gemma 4: for the MoE model the same keys (the plugin
               writes the TE norms' _extra_state objects upstream's load asks for); its dense
               models (31B, E4B, E2B) have their own norm names, stacks and KV-shared attention
  vime-native  vime's native Gemma 4 (vime @3c06ae51, slime PR #2135): one key per layer; MoE
               and 31B (it builds no per-layer embeddings or KV sharing)

A dense checkpoint needs --hf-checkpoint. What the target holds and the source lacks (upstream's
K/V rows and key norms of KV-shared layers, _extra_state objects) is written as the target's own
code writes it, and dropped on the way back; each weight takes the dtype the target's code holds
it in (upstream's dense layer_scalar, PLE gates and final norm, vime-native's layer_scalar: float32).

The source layout is read from its keys. Positional optimizer state (dp_reshardable) cannot be
moved by names and is refused. A vision-language source (language_model.*) is read as ours: the
prefix is dropped, the towers are kept under their keys.
Layer types come from --hf-checkpoint when given, else from the checkpoint (vime's native rule:
one full-attention layer every L/F layers). Each rank moves the layers N % nproc == rank; the
output appears only when complete. docs/INTERCHANGE.md has every layout and what each command reads.
Exit status: 0 on success, 1 if a rank failed, 2 on bad input."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 migrate``."""
    parser = subparsers.add_parser(
        "migrate",
        help="rewrite a torch_dist checkpoint for upstream Megatron-Bridge or vime's native Gemma 4 (and back)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--load", required=True, metavar="DIR", help="the torch_dist checkpoint to rewrite")
    parser.add_argument("--to", required=True, choices=("ours", "upstream", "vime-native"), help="the target layout")
    parser.add_argument("--save", required=True, metavar="OUT", help="where the rewritten checkpoint goes")
    parser.add_argument(
        "--hf-checkpoint",
        metavar="HF",
        help="an HF checkpoint of the model: its layer types (a dense model's also its KV sharing and heads; required)",
    )
    add_launch_arguments(parser)
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Every refusal before ranks start; exit 0 on success, 1 if a rank failed, 2 on bad input."""
    from vime_gemma4_bridge.cli import errors
    from vime_gemma4_bridge.convert.migrate import make_plan, migrate_job
    from vime_gemma4_bridge.io import hf
    from vime_gemma4_bridge.io.commit import partial_path
    from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint

    try:
        checkpoint = TorchDistCheckpoint(args.load)
        checkpoint.check_files()
        text_config = None
        if args.hf_checkpoint:
            config = hf.HFCheckpoint(args.hf_checkpoint).config
            text_config = config.get("text_config") or config
        make_plan(checkpoint, args.to, text_config)
        hf.refuse_overlap(args.save, "--save", {"--load": checkpoint.path})
        out = hf.prepare_output(args.save, force=args.force)
    except ValueError as error:
        return errors.refuse(PROG, error)
    partial = partial_path(out)
    try:
        result = launch(args.nproc, migrate_job, str(checkpoint.path), str(out), str(partial), args.to, text_config)[0]
    except KeyboardInterrupt:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    except BaseException as error:  # noqa: BLE001 (a rank failed; the world is gone)
        shutil.rmtree(partial, ignore_errors=True)
        return errors.report(PROG, error, debug=args.debug)
    if is_reporting_process():
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(
                f"migrate OK: {result['from']} -> {result['to']}, {result['tensors']} tensors and {result['objects']} "
                f"objects ({result['created']} created as the target's code writes them) on "
                f"{result['world_size']} rank(s), "
                f"{result['seconds']:.1f} s"
            )
            print(f"wrote torch_dist {Path(result['save'])}")
    return 0
