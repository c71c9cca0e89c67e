"""The Gemma 4 MoE decoder block spec: megatron-core's GPT MoE spec with Gemma 4's leaves swapped in.

Start from ``get_gpt_decoder_block_spec`` (TE modules where Transformer Engine imports, local ones
otherwise) and replace, in every layer, what Gemma 4 computes differently
(:mod:`vime_gemma4_bridge.core.model`); without TE, the TE-only leaves become their CPU twins
(:mod:`vime_gemma4_bridge.core.cpu_modules`), which keep TE's parameter names. Parameter names,
shapes and torch_dist keys are the same on both hosts (table in docs/MODEL.md).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core import cpu_modules
from vime_gemma4_bridge.core.dense import Gemma4DenseMLP, Gemma4DenseTransformerLayer, Gemma4KVSharedAttention
from vime_gemma4_bridge.core.layer_pattern import has_double_wide_mlp, is_kv_shared_layer
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
    for layer_spec in block_spec.layer_specs:
        layer_spec.module = Gemma4TransformerLayer
        layer = layer_spec.submodules
        layer.pre_mlp_layernorm = Gemma4RMSNorm  # HF pre_feedforward_layernorm_2 (routed experts)
        layer.sharded_state_dict_keys_map = te_keys_map(layer.sharded_state_dict_keys_map)
        _gemma4_attention(layer, Gemma4SelfAttention, use_te)
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


def gemma4_dense_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """The decoder block spec of a dense Gemma 4 model (E2B / E4B / 31B) for this rank's stage ``vp_stage``.

    Layers differ (KV-shared attention, double-wide MLP), so each gets its own copy of the spec,
    chosen by its global layer number.
    """
    use_te = seams.te_available()
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    block_spec.layer_norm = Gemma4RMSNorm
    layer_numbers = _global_layer_numbers(config, vp_stage)
    specs = []
    for layer_number, shared_spec in zip(layer_numbers, block_spec.layer_specs, strict=True):
        layer_spec = copy.deepcopy(shared_spec)
        layer_spec.module = Gemma4DenseTransformerLayer
        layer = layer_spec.submodules
        shared = is_kv_shared_layer(config, layer_number)
        _gemma4_attention(layer, Gemma4KVSharedAttention if shared else Gemma4SelfAttention, use_te)
        mlp = _mlp_submodules(layer)
        layer.pre_mlp_layernorm = IdentityOp  # HF pre_feedforward_layernorm: fused into linear_fc1, as with TE
        if not use_te:
            mlp.linear_fc1 = cpu_modules.LayerNormColumnParallelLinear
        width = config.ffn_hidden_size * (2 if has_double_wide_mlp(config, layer_number) else 1)
        layer.mlp = partial(Gemma4DenseMLP.as_mlp_submodule, submodules=mlp, ffn_hidden_size=width)
        specs.append(layer_spec)
    block_spec.layer_specs = specs
    return block_spec


def te_keys_map(keys_map: dict[str, str]) -> dict[str, str]:
    """A MoE layer's ``sharded_state_dict_keys_map`` as the TE spec has it, on either host.

    megatron-core 0.19.2's local spec maps ``pre_mlp_layernorm.`` to ``mlp.linear_fc1.layer_norm_``
    (models/gpt/gpt_layer_specs.py L459-462, for its dense MLP, whose norm the TE spec fuses into
    ``linear_fc1``); the TE MoE spec maps only its op-fuser names (L157-167). Gemma 4's routed-expert
    pre-norm is a real ``pre_mlp_layernorm`` on both hosts, so the local map would store it under a key
    the TE model never asks for. Checkpoints that already hold it there still load
    (:data:`vime_gemma4_bridge.io.torch_dist_layout.FORMER_KEYS`).
    """
    return {old: new for old, new in keys_map.items() if old != "pre_mlp_layernorm."}


def _gemma4_attention(layer: Any, attention_class: type, use_te: bool) -> None:
    """Gemma 4's attention leaves in one layer spec (both models)."""
    if use_te:
        from vime_gemma4_bridge.core.te_modules import Gemma4TEDotProductAttention, TERowParallelLinearLayerNorm

        core_attention, linear_proj = Gemma4TEDotProductAttention, TERowParallelLinearLayerNorm
    else:
        core_attention, linear_proj = cpu_modules.Gemma4DotProductAttention, cpu_modules.RowParallelLinearLayerNorm
    layer.self_attention.module = attention_class
    attention = layer.self_attention.submodules
    attention.core_attention = core_attention
    attention.linear_proj = linear_proj  # HF post_attention_layernorm lives inside, as post_layernorm
    attention.q_layernorm = Gemma4RMSNorm
    attention.k_layernorm = Gemma4RMSNorm
    if not use_te:
        layer.input_layernorm = IdentityOp  # fused into linear_qkv (layer_norm_weight), as with TE
        attention.linear_qkv = cpu_modules.LayerNormColumnParallelLinear


def _global_layer_numbers(config: Any, vp_stage: int | None) -> list[int]:
    """The 1-based global numbers of the layers ``get_gpt_decoder_block_spec`` keeps for this stage.

    The same selection as megatron-core's (models/gpt/gpt_layer_specs.py, 0.19.2): the pipeline
    layout's layer ids when one is set, else ``get_num_layers_to_build`` layers from the offset.
    """
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType

        return [i + 1 for i in layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset + 1, offset + 1 + get_num_layers_to_build(config, vp_stage=vp_stage)))


def _mlp_submodules(layer: Any) -> Any:
    """The ``MLPSubmodules`` of a dense layer spec's MLP, whichever form megatron-core built it in."""
    mlp = layer.mlp
    if isinstance(mlp, ModuleSpec) and isinstance(mlp.submodules, MLPSubmodules):
        return mlp.submodules
    if isinstance(mlp, partial) and isinstance(mlp.keywords.get("submodules"), MLPSubmodules):
        return mlp.keywords["submodules"]
    raise TypeError(f"expected a dense MLP layer spec, got {mlp!r}")


def _moe_submodules(layer: Any) -> Any:
    """The ``MoESubmodules`` of a layer spec's MLP, whichever form megatron-core built it in."""
    mlp = layer.mlp
    if isinstance(mlp, ModuleSpec):
        return mlp.submodules
    if isinstance(mlp, partial) and "submodules" in mlp.keywords:
        return mlp.keywords["submodules"]
    raise TypeError(f"expected a MoE layer spec (every Gemma 4 layer is MoE), got {mlp!r}")
