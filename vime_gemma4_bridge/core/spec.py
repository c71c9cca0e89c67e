"""The Gemma 4 MoE decoder block spec: megatron-core's GPT MoE spec with Gemma 4's leaves swapped in.

Start from ``get_gpt_decoder_block_spec`` (TE modules where Transformer Engine imports, local ones
otherwise) and replace, in every layer, what Gemma 4 computes differently
(:mod:`vime_gemma4_bridge.core.model`); without TE, the TE-only leaves become their CPU twins
(:mod:`vime_gemma4_bridge.core.cpu_modules`), which keep TE's parameter names. Parameter names,
shapes and torch_dist keys are the same on both hosts (table in docs/MODEL.md).
"""

from __future__ import annotations

from dataclasses import replace
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
    """The decoder block spec of a Gemma 4 MoE model for this rank's stage ``vp_stage``.

    Built with ``dataclasses.replace`` from megatron-core's spec, never by assigning to it: a field a
    megatron-core build renamed raises ``TypeError`` here instead of being set beside the real one and
    ignored.
    """
    use_te = seams.te_available()
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    layers = [_moe_layer(layer_spec, use_te) for layer_spec in block_spec.layer_specs]
    return replace(block_spec, layer_norm=Gemma4RMSNorm, layer_specs=layers)


def _moe_layer(layer_spec: ModuleSpec, use_te: bool) -> ModuleSpec:
    """One MoE layer's spec with Gemma 4's leaves (``layer_spec`` itself is left as megatron-core built it)."""
    layer = layer_spec.submodules
    moe = _moe_submodules(layer)
    if not use_te:  # megatron-core's grouped experts; only its linears are TE in the TE spec
        grouped = GroupedMLPSubmodules(
            linear_fc1=cpu_modules.ColumnParallelGroupedLinear, linear_fc2=cpu_modules.RowParallelGroupedLinear
        )
        moe = replace(moe, experts=partial(TEGroupedMLP, submodules=grouped))
    submodules = replace(
        layer,
        pre_mlp_layernorm=Gemma4RMSNorm,  # HF pre_feedforward_layernorm_2 (routed experts)
        sharded_state_dict_keys_map=te_keys_map(layer.sharded_state_dict_keys_map),
        mlp=partial(Gemma4MoELayer, submodules=replace(moe, router=Gemma4TopKRouter)),
        **_gemma4_attention(layer, Gemma4SelfAttention, use_te),
    )
    return replace(layer_spec, module=Gemma4TransformerLayer, submodules=submodules)


def gemma4_dense_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """The decoder block spec of a dense Gemma 4 model (E2B / E4B / 31B) for this rank's stage ``vp_stage``.

    Layers differ (KV-shared attention, double-wide MLP), so each gets its own spec, chosen by its
    global layer number; built with ``dataclasses.replace`` as :func:`gemma4_block_spec` is.
    """
    use_te = seams.te_available()
    block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, vp_stage=vp_stage)
    layer_numbers = _global_layer_numbers(config, vp_stage)
    specs = []
    for layer_number, layer_spec in zip(layer_numbers, block_spec.layer_specs, strict=True):
        layer = layer_spec.submodules
        shared = is_kv_shared_layer(config, layer_number)
        mlp = _mlp_submodules(layer)
        if not use_te:
            mlp = replace(mlp, linear_fc1=cpu_modules.LayerNormColumnParallelLinear)
        width = config.ffn_hidden_size * (2 if has_double_wide_mlp(config, layer_number) else 1)
        submodules = replace(
            layer,
            pre_mlp_layernorm=IdentityOp,  # HF pre_feedforward_layernorm: fused into linear_fc1, as with TE
            mlp=partial(Gemma4DenseMLP.as_mlp_submodule, submodules=mlp, ffn_hidden_size=width),
            **_gemma4_attention(layer, Gemma4KVSharedAttention if shared else Gemma4SelfAttention, use_te),
        )
        specs.append(replace(layer_spec, module=Gemma4DenseTransformerLayer, submodules=submodules))
    return replace(block_spec, layer_norm=Gemma4RMSNorm, layer_specs=specs)


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


def _gemma4_attention(layer: Any, attention_class: type, use_te: bool) -> dict[str, Any]:
    """The layer fields that carry Gemma 4's attention (both models), for ``replace`` on ``layer``."""
    if use_te:
        from vime_gemma4_bridge.core.te_modules import Gemma4TEDotProductAttention, TERowParallelLinearLayerNorm

        core_attention, linear_proj = Gemma4TEDotProductAttention, TERowParallelLinearLayerNorm
    else:
        core_attention, linear_proj = cpu_modules.Gemma4DotProductAttention, cpu_modules.RowParallelLinearLayerNorm
    attention = replace(
        layer.self_attention.submodules,
        core_attention=core_attention,
        linear_proj=linear_proj,  # HF post_attention_layernorm lives inside, as post_layernorm
        q_layernorm=Gemma4RMSNorm,
        k_layernorm=Gemma4RMSNorm,
        **({} if use_te else {"linear_qkv": cpu_modules.LayerNormColumnParallelLinear}),
    )
    fields = {"self_attention": replace(layer.self_attention, module=attention_class, submodules=attention)}
    if not use_te:
        fields["input_layernorm"] = IdentityOp  # fused into linear_qkv (layer_norm_weight), as with TE
    return fields


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
