"""``vime-gemma4 rollout-check``: does a running vLLM or SGLang server serve this HF checkpoint's weights?"""

from __future__ import annotations

import argparse
import json

from vime_gemma4_bridge.cli import errors

PROG = "vime-gemma4 rollout-check"
DESCRIPTION = """\
What to run when rollouts look wrong. Sends fixed token-id prompts to a running vLLM
OpenAI-compatible server (/v1/completions) or SGLang server (/generate; found by its /model_info),
greedy with logprobs, scores the very same tokens with
transformers from the HF checkpoint, and says in one line whether the engine serves the
checkpoint's weights: the largest |logprob difference| and the first prompt and token where the
two disagree. transformers holds a decoder layer at a time (its peak RSS is about the embedding
plus two layers: a 26B-A4B checkpoint is scored in a login node's memory); --device cuda runs it
on the GPU. Default tolerance by the checkpoint's dtype: 1e-4 for float32, 0.2 for bf16/fp16.
Exit status: 0 iff every served token is within tolerance and transformers' greedy choice; 1 if
not; 2 when the server cannot be asked (down, wrong --model, another vocabulary) or HF is unreadable.
Example: vime-gemma4 rollout-check --hf-checkpoint /ckpt/gemma-4-26B-A4B --server http://127.0.0.1:8000"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 rollout-check``."""
    parser = subparsers.add_parser(
        "rollout-check",
        help="check a vLLM or SGLang server's generations against transformers on an HF checkpoint; exit 0 iff equal",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf-checkpoint", required=True, metavar="HF", help="the weights the server should serve")
    parser.add_argument(
        "--server", required=True, metavar="URL", help="the vLLM or SGLang server, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model", default=None, help="served model name (default: the one the server serves)")
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="number of fixed prompts")
    parser.add_argument("--prompt-len", type=int, default=8, metavar="L", help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=12, metavar="T", help="greedy tokens generated per prompt")
    parser.add_argument(
        "--tolerance", type=float, default=None, metavar="X", help="max |logprob difference| (default: by dtype)"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where transformers scores, a decoder layer in memory at a time (default: cpu)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Exit 0 iff the server serves the checkpoint's weights, 1 if not, 2 if it cannot be asked."""
    from vime_gemma4_bridge.verify.rollout import rollout_check

    for flag in ("prompts", "prompt_len", "max_tokens"):
        if getattr(args, flag) < 1:
            return errors.refuse(PROG, f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.device == "cuda" and not _cuda_available():
        no_cuda = "--device cuda: torch sees no CUDA device here; leave --device out to score on the CPU"
        return errors.refuse(PROG, no_cuda)
    try:
        check = rollout_check(
            args.hf_checkpoint,
            args.server,
            model=args.model,
            prompts=args.prompts,
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            tolerance=args.tolerance,
            device=args.device,
        )
    except (ValueError, OSError, KeyError) as error:
        return errors.refuse(PROG, error)
    if args.json:
        print(json.dumps({**vars(check), "ok": check.ok}, indent=2))
    print(check.summary_line())
    return 0 if check.ok else 1


def _cuda_available() -> bool:
    """Whether torch sees a CUDA device (imported here: ``--help`` stays fast)."""
    import torch

    return torch.cuda.is_available()
