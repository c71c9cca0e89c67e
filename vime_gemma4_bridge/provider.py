"""Gemma 4 MoE text model provider that builds with Transformer Engine on GPU and without it on CPU.

It is Megatron-Bridge's ``Gemma4ModelProvider`` with one change of layer spec. With TE the
spec is upstream's, untouched. Without TE, upstream's spec is built with megatron-core's local
modules and the TE-only pieces are swapped for the twins in :mod:`vime_gemma4_bridge.modules`,
which keep the TE parameter names; the result has the same parameter names, shapes, TP/EP
partitioning and torch_dist keys on both hosts (table in docs/MODEL.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from megatron.bridge.models.gemma.gemma4_provider import Gemma4ModelProvider
from megatron.bridge.models.gemma.modeling_gemma4 import Gemma4RMSNorm, _gemma4_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

from vime_gemma4_bridge.modules import (
    ColumnParallelGroupedLinear,
    Gemma4DotProductAttention,
    LayerNormColumnParallelLinear,
    RowParallelGroupedLinear,
    RowParallelLinearLayerNorm,
)
from vime_gemma4_bridge.te_guard import te_available


def gemma4_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Gemma 4 MoE decoder block spec: upstream's with TE, TE-named megatron-core twins without."""
    if te_available():
        return _gemma4_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    block_spec = _gemma4_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    for layer_spec in block_spec.layer_specs:
        layer = layer_spec.submodules
        # TE fuses the input norm into linear_qkv (``layer_norm_weight``); so does the twin.
        layer.input_layernorm = IdentityOp
        layer.pre_mlp_layernorm = Gemma4RMSNorm
        attention = layer.self_attention.submodules
        attention.linear_qkv = LayerNormColumnParallelLinear
        attention.linear_proj = RowParallelLinearLayerNorm
        attention.core_attention = Gemma4DotProductAttention
        attention.q_layernorm = Gemma4RMSNorm
        attention.k_layernorm = Gemma4RMSNorm
        moe = layer.mlp.keywords["submodules"]  # partial(Gemma4MoELayer, submodules=MoESubmodules)
        moe.experts = partial(
            TEGroupedMLP,  # megatron-core's grouped experts; only its linears are TE in the TE spec
            submodules=GroupedMLPSubmodules(
                linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear
            ),
        )
    return block_spec


@dataclass
class Gemma4TextModelProvider(Gemma4ModelProvider):
    """Megatron-Bridge's Gemma 4 MoE provider with a layer spec that also builds on CPU hosts."""

    transformer_layer_spec: Any = field(default_factory=lambda: gemma4_block_spec)

    def finalize(self) -> None:
        if not te_available():
            # Settings that need TE or CUDA kernels; the values chosen compute the same function.
            self.moe_permute_fusion = False
            self.moe_token_dispatcher_type = "allgather"
            self.moe_grouped_gemm = True  # grouped experts (``weight<K>``) are the TE layout we mirror
            self.gradient_accumulation_fusion = False
            self.bias_activation_fusion = False
            self.bias_dropout_fusion = False
            self.masked_softmax_fusion = False
            self.apply_rope_fusion = False
            self.persist_layer_norm = False
        super().finalize()
