"""``vime-gemma4 tiny OUT``: write a tiny random Gemma 4 checkpoint (every tensor distinct) for conversion tests."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from vime_gemma4_bridge.cli import errors
from vime_gemma4_bridge.testing.spec import DENSE_SHAPES, DTYPES, PUBLISHED, TinySpec, preset
from vime_gemma4_bridge.testing.tokenizer import MIN_VOCAB_SIZE

PROG = "vime-gemma4 tiny"


def _layer_types_arg(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in ("sliding", "full")]
    if bad:
        raise argparse.ArgumentTypeError(f"layer types must be 'sliding' or 'full', got {bad}")
    return items


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``vime-gemma4 tiny OUT [options]``."""
    d = TinySpec()
    p = sub.add_parser(
        "tiny",
        help="write a tiny random Gemma 4 checkpoint (every tensor distinct) for conversion tests",
        description=(
            "Write a tiny, random, deterministic Gemma 4 checkpoint with transformers' own classes. Every saved "
            "tensor (norms, scales and layer_scalar included) is redrawn from a per-tensor generator so that no two "
            "tensors, experts or layers are equal: a conversion that mixes any of them up cannot round-trip. "
            "Defaults divide TP<=4, PP2xVPP2 and EP<=8."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("out", metavar="OUT", type=Path, help="output directory (must not exist or be empty)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    kind = p.add_argument_group("model kind")
    kind.add_argument(
        "--causal-lm",
        action="store_true",
        help="write Gemma4ForCausalLM (text only) instead of Gemma4ForConditionalGeneration (text + tiny vision)",
    )
    kind.add_argument(
        "--dense", action="store_true", help="dense text model (no router/experts); enables PLE and KV sharing knobs"
    )
    shape = kind.add_mutually_exclusive_group()
    shape.add_argument(
        "--like",
        choices=sorted(DENSE_SHAPES),
        default=None,
        help="a dense family member's tiny shape (what is special in it, docs/MODEL.md); 12b writes the 12B's own "
        "classes (Gemma4Unified*); only --causal-lm, --seed and --dtype still apply",
    )
    shape.add_argument(
        "--preset",
        choices=sorted(PUBLISHED),
        default=None,
        help="a published member at its real widths (random values, written tensor by tensor: the full 26b-a4b "
        "is 50 GB); --layers cuts it to its first layers (the last made full); only --causal-lm, --seed and "
        "--dtype still apply",
    )
    size = p.add_argument_group("sizes")
    size.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"decoder layers (PP x VPP must divide it; default {d.layers}, with --preset the published count)",
    )
    size.add_argument(
        "--layer-types",
        type=_layer_types_arg,
        default=None,
        help="comma list of sliding/full, one per layer, the last one full; None: alternate, ending with full",
    )
    size.add_argument("--hidden-size", type=int, default=d.hidden_size, help="text hidden size")
    size.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="dense MLP width")
    size.add_argument("--moe-intermediate-size", type=int, default=d.moe_intermediate_size, help="per-expert width")
    size.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer (EP must divide it)")
    size.add_argument("--top-k", type=int, default=d.top_k, help="experts routed per token")
    size.add_argument("--heads", type=int, default=d.heads, help="attention (query) heads")
    size.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads of sliding layers")
    size.add_argument(
        "--global-kv-heads",
        type=int,
        default=d.global_kv_heads,
        help="KV heads of full-attention layers (only used with --attention-k-eq-v, as in transformers)",
    )
    size.add_argument("--head-dim", type=int, default=d.head_dim, help="head dim of sliding layers")
    size.add_argument("--global-head-dim", type=int, default=d.global_head_dim, help="head dim of full layers")
    size.add_argument(
        "--attention-k-eq-v",
        action=argparse.BooleanOptionalAction,
        default=d.attention_k_eq_v,
        help="full layers reuse K as V (no v_proj, global KV heads), like 26B-A4B",
    )
    size.add_argument("--sliding-window", type=int, default=d.sliding_window, help="sliding attention window")
    size.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help=f"vocabulary size (>= {MIN_VOCAB_SIZE}; default deliberately not a multiple of 128)",
    )
    dense = p.add_argument_group("dense-only")
    dense.add_argument(
        "--per-layer-input-size",
        type=int,
        default=d.per_layer_input_size,
        help="per-layer-embedding width (hidden_size_per_layer_input); 0 disables PLE",
    )
    dense.add_argument(
        "--kv-shared-layers", type=int, default=d.kv_shared_layers, help="last N layers reuse earlier K/V"
    )
    dense.add_argument(
        "--double-wide-mlp", action="store_true", help="the KV-shared layers' MLP is twice as wide (as in E2B)"
    )
    out = p.add_argument_group("output")
    out.add_argument("--seed", type=int, default=d.seed, help="seed of every tensor draw")
    out.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="stored dtype")
    p.set_defaults(func=run, output_arg="out")
    return p


def spec_from_args(args: argparse.Namespace) -> TinySpec:
    """Turn parsed ``tiny`` arguments into a :class:`TinySpec` (raises ``ValueError`` if invalid)."""
    if getattr(args, "preset", None):
        spec = preset(args.preset, args.layers)
        return dataclasses.replace(spec, causal_lm=args.causal_lm, seed=args.seed, dtype=args.dtype)
    if getattr(args, "like", None):
        seed = args.seed if args.seed != TinySpec().seed else DENSE_SHAPES[args.like].seed
        return dataclasses.replace(DENSE_SHAPES[args.like], causal_lm=args.causal_lm, seed=seed, dtype=args.dtype)
    return TinySpec(
        layers=args.layers if args.layers is not None else TinySpec().layers,
        layer_types=args.layer_types,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        experts=args.experts,
        top_k=args.top_k,
        heads=args.heads,
        kv_heads=args.kv_heads,
        global_kv_heads=args.global_kv_heads,
        head_dim=args.head_dim,
        global_head_dim=args.global_head_dim,
        attention_k_eq_v=args.attention_k_eq_v,
        sliding_window=args.sliding_window,
        vocab_size=args.vocab_size,
        seed=args.seed,
        dtype=args.dtype,
        moe=not args.dense,
        causal_lm=args.causal_lm,
        per_layer_input_size=args.per_layer_input_size,
        kv_shared_layers=args.kv_shared_layers,
        double_wide_mlp=args.double_wide_mlp,
    )


def run(args: argparse.Namespace) -> int:
    """``tiny`` sub-command: 2 on a bad spec or a non-empty OUT, else write and print one summary line."""
    from vime_gemma4_bridge.testing.tiny import checkpoint_stats, is_empty_dir, write_tiny_checkpoint

    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        return errors.refuse(PROG, exc)
    out = Path(args.out)
    if out.exists() and not is_empty_dir(out) and not args.force:
        return errors.refuse(PROG, f"{out} exists and is not empty (use --force to replace it)")
    if args.preset:  # real widths: no model in memory, one tensor at a time
        from vime_gemma4_bridge.testing.synthetic import write_synthetic_checkpoint

        path, _ = write_synthetic_checkpoint(out, spec, seed=spec.seed, show_progress=True)
    else:
        path = write_tiny_checkpoint(out, spec, force=args.force)
    n_tensors, n_bytes = checkpoint_stats(path)
    print(f"tiny: {spec.describe()}: {n_tensors} tensors, {n_bytes} bytes -> {path}")
    return 0
