"""Synthetic Gemma 4 checkpoints: of a given size with 26B-A4B's proportions (the bench's input), and at
the members' published widths (``tiny --preset``: :data:`~vime_gemma4_bridge.testing.spec.PUBLISHED`).

Why not the tiny factory (:mod:`vime_gemma4_bridge.testing.tiny`): its distinctness checks and
``save_pretrained`` of a materialised model would dominate at hundreds of MB. This is a Gemma 4 VL MoE
checkpoint with 26B-A4B's proportions (128 experts, top-8, expert width hidden/4, dense MLP
3·hidden/4, one full-attention layer in six, experts ~90% of the bytes, the embedding ~3%), written
straight from a meta-device transformers model (exact names, shapes and config; random values). It
has no tokenizer: conversion never reads one. Doubling the size (the bench's ``--scaling``) doubles
the layers and the vocabulary, keeping every tensor shape but the embedding's.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tokenizer import MIN_VOCAB_SIZE

__all__ = [
    "dense_spec_for_size",
    "largest_tensor_bytes",
    "layer_experts_bytes",
    "spec_bytes",
    "spec_for_size",
    "write_synthetic_checkpoint",
]


#: 26B-A4B's hidden size: the synthetic model uses it when the size allows :data:`MIN_LAYERS` layers.
FULL_HIDDEN = 2816


MIN_LAYERS = 2


def spec_for_size(size_bytes: int, *, layers: int | None = None, hidden: int | None = None) -> TinySpec:
    """A 26B-A4B-shaped MoE spec of about ``size_bytes`` (bf16).

    Per layer 26B-A4B holds ~94% of its bytes in the 128 stacked experts (width hidden/4), a dense
    MLP of width 3·hidden/4 and small attention; the embedding is ~3% of the model. With ``hidden``
    fixed, bytes grow linearly in the layer count (the vocabulary grows with it, keeping the
    embedding's share), so the layer count is solved for. ``hidden`` defaults to 26B-A4B's own
    (2816) or, for smaller sizes, the largest multiple of 64 that still gives :data:`MIN_LAYERS`
    layers: per-tensor sizes then stay realistic (a 26B expert weight is 4 MB; per-tensor costs of
    a converter would otherwise dominate a small benchmark and say nothing about the real model).
    ``layers`` overrides the solve (used to double a size).
    """
    if size_bytes <= 0:
        raise ValueError(f"size must be positive, got {size_bytes} bytes")
    if hidden is None:
        # ~200·hidden² bytes per layer (experts 192·h², dense MLP 4.5·h², attention the rest).
        fitting = 64 * math.floor(math.sqrt(size_bytes / (MIN_LAYERS * 200)) / 64)
        hidden = max(128, min(FULL_HIDDEN, fitting))
    if layers is None:
        # Six layers are one period of the sliding/full pattern, so bytes(6·k) is exactly linear in k.
        six, twelve = spec_bytes(_shaped_spec(hidden, 6)), spec_bytes(_shaped_spec(hidden, 12))
        per_layer = (twelve - six) / 6
        # At least 2 layers: a model without sliding layers makes transformers warn about unused RoPE keys.
        layers = max(2, round((size_bytes - (six - 6 * per_layer)) / per_layer))
    return _shaped_spec(hidden, layers)


def _shaped_spec(hidden: int, layers: int) -> TinySpec:
    """26B-A4B's proportions at ``hidden``: 16 heads of ~3·hidden/32, 8 KV heads, 2 global KV heads of twice the dim."""
    head_dim = max(8, 4 * round(3 * hidden / 32 / 4))
    # One full-attention layer in six, the last one full (transformers forces it), as in 26B-A4B.
    layer_types = tuple("full" if (layers - 1 - i) % 6 == 0 else "sliding" for i in range(layers))
    return TinySpec(
        layers=layers,
        layer_types=layer_types,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 4,
        moe_intermediate_size=hidden // 4,
        experts=128,
        top_k=8,
        heads=16,
        kv_heads=8,
        global_kv_heads=2,
        head_dim=head_dim,
        global_head_dim=2 * head_dim,
        attention_k_eq_v=True,
        sliding_window=128,
        # 3·layers·hidden rows keep the embedding at ~3% of the bytes; +5 keeps it off a multiple of 128.
        vocab_size=max(MIN_VOCAB_SIZE, 3 * layers * hidden + 5),
        dtype="bfloat16",
        moe=True,
        causal_lm=False,
    )


def dense_spec_for_size(size_bytes: int, *, layers: int = 12, hidden: int | None = None) -> TinySpec:
    """An E4B-shaped dense spec of about ``size_bytes`` (bf16): the PLE table is the largest tensor.

    E4B (hidden 2560, 42 layers, 8 heads of 256 and 2 KV heads, global heads of 512, MLP 4·hidden,
    PLE 256 per layer over a 262,144-row vocabulary, the last 18 layers KV-shared): its PLE table,
    5.6 GB in one bf16 tensor, is ~a third of the checkpoint and four times the embedding. Kept:
    head dim = PLE width = hidden/10, vocabulary ~102·hidden, 18/42 of the layers shared. Bytes grow
    as hidden², so ``hidden`` (a multiple of 64) is solved for at ``layers``.
    """
    if size_bytes <= 0:
        raise ValueError(f"size must be positive, got {size_bytes} bytes")
    if hidden is None:
        per_square = spec_bytes(_dense_shaped(640, layers)) / 640**2
        hidden = max(128, 64 * round(math.sqrt(size_bytes / per_square) / 64))
    return _dense_shaped(hidden, layers)


def _dense_shaped(hidden: int, layers: int) -> TinySpec:
    """E4B's proportions at ``hidden`` (see :func:`dense_spec_for_size`)."""
    head_dim = max(8, 8 * round(hidden / 10 / 8))
    layer_types = tuple("full" if (layers - 1 - i) % 6 == 0 else "sliding" for i in range(layers))
    return TinySpec(
        moe=False,
        layers=layers,
        layer_types=layer_types,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        heads=8,
        kv_heads=2,
        global_kv_heads=2,
        head_dim=head_dim,
        global_head_dim=2 * head_dim,
        attention_k_eq_v=False,
        sliding_window=128,
        per_layer_input_size=head_dim,
        kv_shared_layers=max(1, round(layers * 18 / 42)),
        vocab_size=max(MIN_VOCAB_SIZE, 102 * hidden + 5),
        dtype="bfloat16",
    )


def largest_tensor_bytes(hf_checkpoint: str | os.PathLike) -> tuple[str, int]:
    """``(name, bytes)`` of the checkpoint's largest language-model tensor, from the file headers."""
    from safetensors import safe_open

    from vime_gemma4_bridge.io import hf as hf_io

    source = hf_io.HFCheckpoint(hf_checkpoint)
    sizes = {}
    for name in source.language_model_names():
        with safe_open(source.path / source.weight_map[name], framework="pt") as handle:
            piece = handle.get_slice(name)
            sizes[name] = math.prod(piece.get_shape()) * hf_io.DTYPE_BYTES[piece.get_dtype()]
    name = max(sizes, key=sizes.__getitem__)
    return name, sizes[name]


def _meta_tensors(spec: TinySpec) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(name, shape, dtype)`` of every tensor ``save_pretrained`` would write for ``spec`` (tied aliases dropped)."""
    import torch
    import transformers

    from vime_gemma4_bridge.compat import seams
    from vime_gemma4_bridge.testing.weights import on_disk

    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = getattr(transformers, spec.architecture)(spec.hf_config())
    tied = seams.tied_weights_keys(model)
    out = []
    for name, tensor in on_disk(model, {n: t for n, t in model.state_dict().items() if n not in tied}).items():
        dtype = spec.torch_dtype if tensor.is_floating_point() else tensor.dtype
        out.append((name, tuple(tensor.shape), dtype))
    return out


def spec_bytes(spec: TinySpec) -> int:
    """Tensor bytes of the checkpoint :func:`write_synthetic_checkpoint` writes for ``spec``."""
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in _meta_tensors(spec))


def layer_experts_bytes(hf_checkpoint: str | os.PathLike) -> int:
    """Bytes of one layer's stacked experts (``gate_up_proj`` + ``down_proj`` of layer 0), from the file headers."""
    from safetensors import safe_open

    from vime_gemma4_bridge.io import hf as hf_io

    source = hf_io.HFCheckpoint(hf_checkpoint)
    total = 0
    for suffix in ("gate_up_proj", "down_proj"):
        name = f"{source.prefix}layers.0.experts.{suffix}"
        with safe_open(source.path / source.weight_map[name], framework="pt") as handle:
            piece = handle.get_slice(name)
            total += math.prod(piece.get_shape()) * hf_io.DTYPE_BYTES[piece.get_dtype()]
    return total


def write_synthetic_checkpoint(
    out: str | os.PathLike, spec: TinySpec, *, shards: int = 4, seed: int = 0, show_progress: bool = False
) -> tuple[Path, int]:
    """Write a loadable Gemma 4 HF checkpoint for ``spec`` with random values; return (path, tensor bytes).

    Names, shapes and ``config.json`` are transformers' own (a meta-device model of ``spec``, tied
    ``lm_head`` dropped as ``save_pretrained`` does). Tensors are drawn one at a time, as the one shard
    writer (:func:`~vime_gemma4_bridge.io.hf_write.write_shards`) asks for them, into about ``shards``
    safetensors files with an index, like a published checkpoint, so memory stays at one tensor. Norm
    weights are drawn near one and ``layer_scalar`` positive, so the model is sane. An existing ``out``
    is replaced once the new checkpoint is complete.
    """
    import torch
    from transformers import GenerationConfig

    from vime_gemma4_bridge.io.commit import atomic_directory
    from vime_gemma4_bridge.io.hf import LazyTensor
    from vime_gemma4_bridge.io.hf_write import progress, write_shards

    tensors = _meta_tensors(spec)
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in tensors)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def drawn(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[], Iterator[torch.Tensor]]:
        def pieces() -> Iterator[torch.Tensor]:
            if name.endswith("layer_scalar"):
                value = 0.5 + torch.rand(shape, generator=gen)
            elif len(shape) <= 1:
                value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            else:
                value = torch.randn(shape, generator=gen, dtype=dtype) * (shape[-1] ** -0.5)
            yield value.to(dtype)

        return pieces

    lazy = [(name, LazyTensor(shape, dtype, drawn(name, shape, dtype))) for name, shape, dtype in tensors]
    with atomic_directory(out) as tmp:
        with progress(f"Writing {Path(out).name}", len(lazy), show_progress) as advance:
            write_shards(tmp, lazy, max(1, math.ceil(total / max(1, shards))), always_index=True, advance=advance)
        config = spec.hf_config()
        config.dtype = spec.torch_dtype
        config.save_pretrained(tmp)
        GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(tmp)
    return Path(out), total
