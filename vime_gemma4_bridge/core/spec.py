"""The Gemma 4 MoE decoder block spec: megatron-core's GPT MoE spec with Gemma 4's leaves swapped in.

Start from ``get_gpt_decoder_block_spec`` (TE modules where Transformer Engine imports, local ones
otherwise) and replace, in every layer, what Gemma 4 computes differently
(:mod:`vime_gemma4_bridge.core.model`); without TE, the TE-only leaves become their CPU twins
(:mod:`vime_gemma4_bridge.core.cpu_modules`), which keep TE's parameter names. Parameter names,
shapes and torch_dist keys are the same on both hosts (table in docs/MODEL.md).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core import cpu_modules
from vime_gemma4_bridge.core.model import (
    Gemma4MoELayer,
    Gemma4RMSNorm,
    Gemma4SelfAttention,
    Gemma4TopKRouter,
    Gemma4TransformerLayer,
)


def gemma4_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """The decoder block spec of a Gemma 4 MoE model for this rank's stage ``vp_stage``."""
    use_te = seams.te_available()
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    block_spec.layer_norm = Gemma4RMSNorm
    if use_te:
        from vime_gemma4_bridge.core.te_modules import Gemma4TEDotProductAttention, TERowParallelLinearLayerNorm

        core_attention, linear_proj = Gemma4TEDotProductAttention, TERowParallelLinearLayerNorm
    else:
        core_attention, linear_proj = cpu_modules.Gemma4DotProductAttention, cpu_modules.RowParallelLinearLayerNorm
    for layer_spec in block_spec.layer_specs:
        layer_spec.module = Gemma4TransformerLayer
        layer = layer_spec.submodules
        layer.pre_mlp_layernorm = Gemma4RMSNorm  # HF pre_feedforward_layernorm_2 (routed experts)
        layer.self_attention.module = Gemma4SelfAttention
        attention = layer.self_attention.submodules
        attention.core_attention = core_attention
        attention.linear_proj = linear_proj  # HF post_attention_layernorm lives inside, as post_layernorm
        attention.q_layernorm = Gemma4RMSNorm
        attention.k_layernorm = Gemma4RMSNorm
        if not use_te:
            layer.input_layernorm = IdentityOp  # fused into linear_qkv (layer_norm_weight), as with TE
            attention.linear_qkv = cpu_modules.LayerNormColumnParallelLinear
        moe = _moe_submodules(layer)
        moe.router = Gemma4TopKRouter
        if not use_te:
            moe.experts = partial(
                TEGroupedMLP,  # megatron-core's grouped experts; only its linears are TE in the TE spec
                submodules=GroupedMLPSubmodules(
                    linear_fc1=cpu_modules.ColumnParallelGroupedLinear, linear_fc2=cpu_modules.RowParallelGroupedLinear
                ),
            )
        layer.mlp = partial(Gemma4MoELayer, submodules=moe)
    return block_spec


def _moe_submodules(layer: Any) -> Any:
    """The ``MoESubmodules`` of a layer spec's MLP, whichever form megatron-core built it in."""
    mlp = layer.mlp
    if isinstance(mlp, ModuleSpec):
        return mlp.submodules
    if isinstance(mlp, partial) and "submodules" in mlp.keywords:
        return mlp.keywords["submodules"]
    raise TypeError(f"expected a MoE layer spec (every Gemma 4 layer is MoE), got {mlp!r}")
