"""The Gemma 4 mapping tables: which Megatron parameter is which HF tensor, and how it splits over TP.

Declarative, as Megatron-Bridge's per-model bridges keep theirs: one row per Megatron parameter
pattern, its mapping class (the plugin's, each stating its parallelism: compat/mappings.py) and its
HF name(s). :func:`build_registry` instantiates a table for one HF class's language-model prefix.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

from vime_gemma4_bridge.compat.mappings import (
    ColumnParallel,
    ColumnParallelQKVMapping,
    FusedGatedExpertMapping,
    GatedMLPMapping,
    Replicated,
    RowParallel,
    RowParallelFusedExpertMapping,
)

MappingTable = tuple[tuple[type, str, str | dict[str, str]], ...]

# ---------------------------------------------------------------------------------------------
# Both models. Megatron names are relative to the GPTModel, HF names to the language-model prefix; ``*``
# is the layer index; a dict HF side fuses HF tensors into one Megatron tensor. Tied embeddings: no
# ``lm_head`` / ``output_layer`` on purpose (core/tied.py). Each row states its parallelism (column / row /
# replicated): builds disagree on how ``AutoMapping`` guesses it from a class name (compat/mappings.py).
# ---------------------------------------------------------------------------------------------
SHARED_MAPPING_ROWS: MappingTable = (
    (ColumnParallel, "embedding.word_embeddings.weight", "embed_tokens.weight"),
    (Replicated, "decoder.final_layernorm.weight", "norm.weight"),
    # attention (sliding and full layers share names; shapes differ per layer type)
    (
        ColumnParallelQKVMapping,
        "decoder.layers.*.self_attention.linear_qkv.weight",
        {
            "q": "layers.*.self_attn.q_proj.weight",
            "k": "layers.*.self_attn.k_proj.weight",
            "v": "layers.*.self_attn.v_proj.weight",
        },
    ),
    (Replicated, "decoder.layers.*.self_attention.q_layernorm.weight", "layers.*.self_attn.q_norm.weight"),
    (Replicated, "decoder.layers.*.self_attention.k_layernorm.weight", "layers.*.self_attn.k_norm.weight"),
    (Replicated, "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", "layers.*.input_layernorm.weight"),
    (RowParallel, "decoder.layers.*.self_attention.linear_proj.weight", "layers.*.self_attn.o_proj.weight"),
    (
        Replicated,
        "decoder.layers.*.self_attention.linear_proj.post_layernorm.weight",
        "layers.*.post_attention_layernorm.weight",
    ),
    (Replicated, "decoder.layers.*.post_ffn_layernorm.weight", "layers.*.post_feedforward_layernorm.weight"),
    (Replicated, "decoder.layers.*.layer_scalar", "layers.*.layer_scalar"),
)

# The MoE model: its modules are the plugin's (core/model.py, core/spec.py).
MOE_MAPPING_TABLE: MappingTable = (
    *SHARED_MAPPING_ROWS,
    # feed-forward: dense MLP ("shared expert") beside the routed experts, each with its norms
    (Replicated, "decoder.layers.*.pre_shared_expert_layernorm.weight", "layers.*.pre_feedforward_layernorm.weight"),
    (
        GatedMLPMapping,
        "decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
        {"gate": "layers.*.mlp.gate_proj.weight", "up": "layers.*.mlp.up_proj.weight"},
    ),
    (RowParallel, "decoder.layers.*.mlp.shared_experts.linear_fc2.weight", "layers.*.mlp.down_proj.weight"),
    (
        Replicated,
        "decoder.layers.*.mlp.post_shared_expert_layernorm.weight",
        "layers.*.post_feedforward_layernorm_1.weight",
    ),
    (Replicated, "decoder.layers.*.pre_mlp_layernorm.weight", "layers.*.pre_feedforward_layernorm_2.weight"),
    (Replicated, "decoder.layers.*.mlp.router.weight", "layers.*.router.proj.weight"),
    (Replicated, "decoder.layers.*.mlp.router.scale", "layers.*.router.scale"),
    (Replicated, "decoder.layers.*.mlp.router.per_expert_scale", "layers.*.router.per_expert_scale"),
    # routed experts: one Megatron tensor per expert <-> one stacked HF tensor [E, ...]
    (FusedGatedExpertMapping, "decoder.layers.*.mlp.experts.linear_fc1.weight*", "layers.*.experts.gate_up_proj"),
    (RowParallelFusedExpertMapping, "decoder.layers.*.mlp.experts.linear_fc2.weight*", "layers.*.experts.down_proj"),
    (Replicated, "decoder.layers.*.mlp.post_moe_layernorm.weight", "layers.*.post_feedforward_layernorm_2.weight"),
)


# The dense model (E2B / E4B / 31B): core/dense.py. KV-shared layers have a query projection
# only (``linear_q``); the per-layer embeddings (PLE) live in the embedding and in each layer.
DENSE_MAPPING_TABLE: MappingTable = (
    *SHARED_MAPPING_ROWS,
    (ColumnParallel, "decoder.layers.*.self_attention.linear_q.weight", "layers.*.self_attn.q_proj.weight"),
    (Replicated, "decoder.layers.*.self_attention.linear_q.layer_norm_weight", "layers.*.input_layernorm.weight"),
    (Replicated, "decoder.layers.*.mlp.linear_fc1.layer_norm_weight", "layers.*.pre_feedforward_layernorm.weight"),
    (
        GatedMLPMapping,
        "decoder.layers.*.mlp.linear_fc1.weight",
        {"gate": "layers.*.mlp.gate_proj.weight", "up": "layers.*.mlp.up_proj.weight"},
    ),
    (RowParallel, "decoder.layers.*.mlp.linear_fc2.weight", "layers.*.mlp.down_proj.weight"),
    # per-layer embeddings (PLE): the token table is vocabulary-parallel, the projections are replicated
    (ColumnParallel, "embedding.per_layer_embedding.weight", "embed_tokens_per_layer.weight"),
    (Replicated, "embedding.per_layer_model_projection.weight", "per_layer_model_projection.weight"),
    (Replicated, "embedding.per_layer_projection_norm.weight", "per_layer_projection_norm.weight"),
    (Replicated, "decoder.layers.*.per_layer_input_gate.weight", "layers.*.per_layer_input_gate.weight"),
    (Replicated, "decoder.layers.*.per_layer_projection.weight", "layers.*.per_layer_projection.weight"),
    (Replicated, "decoder.layers.*.post_per_layer_input_norm.weight", "layers.*.post_per_layer_input_norm.weight"),
)


#: HF tensors with one row per vocabulary entry (padded on the Megatron side) -> their text-config size.
VOCAB_TENSORS = {
    "embed_tokens.weight": "vocab_size",
    "lm_head.weight": "vocab_size",
    "embed_tokens_per_layer.weight": "vocab_size_per_layer_input",
}


def build_registry(table: Iterable[tuple[type, str, str | dict[str, str]]], hf_prefix: str) -> MegatronMappingRegistry:
    """Instantiate a mapping table for one HF class (prefix)."""
    mappings = []
    for mapping_cls, megatron_name, hf in table:
        if isinstance(hf, dict):
            mappings.append(mapping_cls(megatron_name, **{role: hf_prefix + name for role, name in hf.items()}))
        else:
            mappings.append(mapping_cls(megatron_param=megatron_name, hf_param=hf_prefix + hf))
    return MegatronMappingRegistry(*mappings)
