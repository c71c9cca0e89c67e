"""Block FP8 exports for rollout engines: the layout of :mod:`vime_gemma4_bridge.core.block_fp8`, which vLLM loads.

Training stays bf16; the rollout engine can serve FP8.

What is quantized: the linear projections a rollout engine runs as FP8 GEMMs — attention q/k/v/o,
the dense MLP's gate/up/down (the MoE's shared MLP too) and every routed expert's gate/up/down, in
the per-expert layout (:mod:`vime_gemma4_bridge.core.hf_layout`). Everything else passes through
bitwise: embeddings, every norm, the router (``router.proj`` / ``scale`` / ``per_expert_scale``),
``layer_scalar``, the per-layer-embedding projections, vision and audio towers.

Quantization runs on the tensor the stream yields, after Megatron-Bridge's gather, one band of 128
rows at a time: besides its output (half the weight's bytes) it holds one band in float32.
Megatron-Bridge's own FP8 export covers weights TE already holds in FP8 only (UPSTREAM 45).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from vime_gemma4_bridge.core.block_fp8 import BLOCK, FP8_DTYPE, FP8_MAX, SCALE_SUFFIX, quantize_block_fp8
from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX, STACK_NAME, STACK_PROJECTIONS, per_expert_name
from vime_gemma4_bridge.io.hf import LazyTensor, NamedTensor

__all__ = [
    "BLOCK",
    "config_fields",
    "FP8_DTYPE",
    "FP8_MAX",
    "QUANTIZATIONS",
    "SCALE_SUFFIX",
    "check_quantize",
    "dequantize_block_fp8",
    "ignored_layers",
    "is_quantized",
    "quantization_config",
    "quantize_block_fp8",
    "quantize_stream",
    "vllm_block_misfits",
    "quantized_checkpoint",
]

#: HF names of the weights that are quantized: the language model's (a tower's layers are not).
QUANTIZED = re.compile(
    rf"^({'|'.join(re.escape(prefix) for prefix in LANGUAGE_MODEL_PREFIX.values())})layers\.\d+\."
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.(gate|up|down)_proj)\.weight$"
)


#: The ``quantize`` values the streams and the export take (``None``: bf16 as trained).
QUANTIZATIONS = ("fp8",)


def check_quantize(quantize: str | None) -> str | None:
    """``quantize`` if it is ``None`` or one of :data:`QUANTIZATIONS`; a one-line refusal otherwise."""
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ValueError(f"quantize {quantize!r}: expected one of {', '.join(QUANTIZATIONS)}")
    return quantize


def is_quantized(hf_name: str) -> bool:
    """Whether ``hf_name`` is one of the weights FP8 export quantizes."""
    return QUANTIZED.match(hf_name) is not None


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` block by block, in ``dtype`` (for checks; the rollout engine does this in its GEMMs)."""
    scales = scale_inv.repeat_interleave(BLOCK, dim=0)[: q.shape[0]].repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]
    return (q.to(torch.float32) * scales).to(dtype)


def quantize_stream(weights: Iterable[tuple[Any, ...]]) -> Iterator[tuple[Any, ...]]:
    """A stream of ``(hf_name, tensor, *rest)`` with every quantized weight as ``NAME`` (e4m3) and ``NAME_scale_inv``.

    The scale keeps the weight's other fields (``megatron_name`` in the live stream). Stacked experts
    are refused: vLLM loads FP8 experts per expert (export them in the per-expert layout).
    """
    for name, tensor, *rest in weights:
        if STACK_NAME.match(name):
            raise ValueError(f"{name}: FP8 export needs the per-expert expert layout, not stacked experts")
        if not is_quantized(name):
            yield (name, tensor, *rest)
            continue
        q, scale_inv = quantize_block_fp8(tensor)
        yield (name, q, *rest)
        yield (name + SCALE_SUFFIX, scale_inv, *rest)


def config_fields(source: Any) -> dict[str, Any]:
    """The ``config.json`` fields of an FP8 export of ``source`` (an ``HFCheckpoint``): its ``quantization_config``."""
    return {"quantization_config": quantization_config(ignored_layers(source.shapes()))}


#: Output rows vLLM's block-FP8 loader splits a fused layer at, by HF weight (the last shard, ``v_proj`` /
#: ``up_proj``, is exempt; k_eq_v layers repeat ``k_proj`` as ``v_proj``, so ``k_proj`` is never last).
_SHARD_ROWS = re.compile(r"\.(self_attn\.[qk]_proj|mlp\.gate_proj|experts\.\d+\.gate_proj)\.weight$")


def vllm_block_misfits(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The quantized weights whose sizes vLLM's block-FP8 loader refuses at any TP: ``[]`` if it takes them all.

    vLLM (``fp8.py`` / ``fp8_utils.validate_fp8_block_shape`` at 45232a454, the base of the Gemma 4
    loader read at 001cabc1) needs every shard of a fused linear layer but the last, and a routed
    expert's intermediate size (``Fp8MoEMethod.create_weights``), to be a multiple of the 128-row block.
    Gemma 4 26B-A4B's experts (704) and dense MLP (2112) are not: its FP8 checkpoint is written all
    the same (the format is well defined), and the command says what vLLM will refuse.
    """
    misfits: dict[str, int] = {}
    for name, shape in shapes.items():
        stack = STACK_NAME.match(name)
        if stack and stack["stack"] == "gate_up_proj":  # the stacked layout: [E, 2I, H]
            name, shape = per_expert_name(name, 0, "gate_proj"), (shape[1] // 2, shape[2])
        match = _SHARD_ROWS.search(name)
        if match and len(shape) == 2 and shape[0] % BLOCK:
            kind = re.sub(r"experts\.\d+\.", "experts.<e>.", match[1])
            misfits.setdefault(kind, shape[0])
    return [f"{kind} ({rows} rows)" for kind, rows in sorted(misfits.items())]


def quantization_config(ignored_layers: Iterable[str]) -> dict[str, Any]:
    """The ``quantization_config`` of ``config.json`` that vLLM's FP8 method reads for this layout."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "ignored_layers": sorted(ignored_layers),
    }


Tensorish = torch.Tensor | LazyTensor


def quantized_checkpoint(tensors: Sequence[NamedTensor]) -> list[NamedTensor]:
    """A checkpoint's tensors in FP8 export's layout, produced while written (``export --quantize fp8``).

    Stacks become per-expert pairs; every quantized weight ``NAME`` is followed by ``NAME_scale_inv``;
    the rest is passed on as it is. Quantized tensors are lazy: each is quantized when the writer
    reaches it, and a lazy stack (the streaming export's experts) is read once, when its first
    expert is written, and dropped after its last.
    """
    out: list[NamedTensor] = []
    for name, tensor in tensors:
        if STACK_NAME.match(name):
            out.extend(_per_expert_pairs(name, tensor))
        elif is_quantized(name):
            out.extend(_QuantizedPair(_Once(tensor).get, tuple(tensor.shape)).entries(name))
        else:
            out.append((name, tensor))
    return out


def ignored_layers(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """The modules FP8 export leaves in bf16 (vLLM's ``ignored_layers``): that of every 2-D ``.weight`` not quantized.

    vLLM matches the names exactly, after its model's ``hf_to_vllm_mapper`` (``Fp8Config.apply_vllm_mapper``),
    so they are the checkpoint's module names; its Gemma 4 router (``GateLinear``) never quantizes anyway.
    """
    return [
        name.removesuffix(".weight")
        for name, shape in shapes.items()
        if name.endswith(".weight") and len(shape) == 2 and not is_quantized(name)
    ]


def _per_expert_pairs(stack_name: str, stack: Tensorish) -> Iterator[NamedTensor]:
    projections = STACK_PROJECTIONS[STACK_NAME.match(stack_name)["stack"]]
    experts, rows, cols = stack.shape[0], stack.shape[1] // len(projections), stack.shape[2]
    source = _Once(stack)
    for expert in range(experts):
        for index, projection in enumerate(projections):
            last = expert == experts - 1 and index == len(projections) - 1

            def weight(e: int = expert, i: int = index, last: bool = last) -> torch.Tensor:
                part = source.get()[e, i * rows : (i + 1) * rows]
                if last:
                    source.release()
                return part

            yield from _QuantizedPair(weight, (rows, cols)).entries(per_expert_name(stack_name, expert, projection))


class _Once:
    """A tensor, or a lazy tensor read into memory on first use (and held until :meth:`release`)."""

    def __init__(self, tensor: Tensorish) -> None:
        self._tensor = tensor
        self._loaded: torch.Tensor | None = tensor if isinstance(tensor, torch.Tensor) else None

    def get(self) -> torch.Tensor:
        if self._loaded is None:
            lazy = self._tensor
            loaded = torch.empty(lazy.shape, dtype=lazy.dtype)
            flat, offset = loaded.view(-1), 0
            for piece in lazy.pieces():
                flat[offset : offset + piece.numel()] = piece.reshape(-1)
                offset += piece.numel()
            self._loaded = loaded
        return self._loaded

    def release(self) -> None:
        self._loaded = None
        self._tensor = None


class _QuantizedPair:
    """``NAME`` (e4m3) and ``NAME_scale_inv`` as two lazy tensors; quantized once, when the first is written."""

    def __init__(self, weight: Callable[[], torch.Tensor], shape: tuple[int, int]) -> None:
        self._weight = weight
        self._shape = shape
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None

    def entries(self, name: str) -> list[tuple[str, LazyTensor]]:
        rows, cols = self._shape
        scales = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
        return [
            (name, LazyTensor(self._shape, FP8_DTYPE, lambda: self._pieces(0))),
            (name + SCALE_SUFFIX, LazyTensor(scales, torch.float32, lambda: self._pieces(1))),
        ]

    def _pieces(self, which: int) -> Iterator[torch.Tensor]:
        if self._pair is None:
            self._pair = quantize_block_fp8(self._weight())
        piece = self._pair[which]
        if which == 1:
            self._pair = None  # the scale is written after its weight: nothing of the pair is kept
        yield piece
