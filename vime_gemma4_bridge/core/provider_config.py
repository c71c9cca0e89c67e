"""The Megatron provider a Gemma 4 HF text config describes (MoE or dense), or the refusal of one it cannot.

What ``provider_bridge`` builds: Megatron-Bridge's own ``CONFIG_MAPPING`` for the settings it
translates, Gemma 4's own for the rest (layer pattern, sliding window, the global layers' head
width and KV heads, RoPE per layer type, logit softcapping).
"""

from __future__ import annotations

from typing import Any

from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

from vime_gemma4_bridge.core.hf_layout import global_kv_heads
from vime_gemma4_bridge.core.layer_pattern import FULL, SLIDING, pattern_from_layer_types
from vime_gemma4_bridge.core.provider import Gemma4DenseTextModelProvider, Gemma4TextModelProvider


class UnsupportedCheckpoint(ValueError):
    """The checkpoint is Gemma 4, but not one this plugin (on this Megatron-Bridge build) can convert."""


#: Provider settings Megatron-Bridge's own ``MegatronModelBridge.CONFIG_MAPPING`` translates from a
#: Gemma 4 text config (read in 0.6.2 and the fork at 1187a604 / d063066b: the same table).
UPSTREAM_MAPPED_SETTINGS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "layernorm_epsilon",
        "vocab_size",
        "seq_length",
        "init_method_std",
        "share_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_ffn_hidden_size",
    }
)


def upstream_config_kwargs(text: Any) -> dict[str, Any]:
    """:data:`UPSTREAM_MAPPED_SETTINGS` from ``text`` through Megatron-Bridge's ``CONFIG_MAPPING`` (first HF name wins).

    The table, not ``hf_config_to_provider_kwargs``: that method also maps fields Gemma 4 sets
    otherwise (dtype, activation, RoPE) and, on the fork, asserts a ``torch_dtype`` that a VL
    checkpoint's text config may not declare.
    """
    kwargs: dict[str, Any] = {}
    for hf_name, megatron_name in MegatronModelBridge.CONFIG_MAPPING:
        if megatron_name in UPSTREAM_MAPPED_SETTINGS and megatron_name not in kwargs and hasattr(text, hf_name):
            kwargs[megatron_name] = getattr(text, hf_name)
    return kwargs  # Gemma4TextConfig defines every one of them (transformers' defaults where config.json is silent)


def _common_settings(text: Any) -> dict[str, Any]:
    """The provider settings of every Gemma 4 member (HF names on the right)."""
    rope = getattr(text, "rope_parameters", None) or {}
    full, sliding = rope.get(FULL) or {}, rope.get(SLIDING) or {}
    for layer_type, params, expected in ((FULL, full, "proportional"), (SLIDING, sliding, "default")):
        if params.get("rope_type", expected) != expected or params.get("factor", 1.0) != 1.0:
            raise UnsupportedCheckpoint(
                f"Gemma 4 {layer_type} RoPE {params} is not supported (expected rope_type={expected!r}, no factor)"
            )
    return {
        **upstream_config_kwargs(text),
        "layer_types": pattern_from_layer_types(text.layer_types),
        "window_size": text.sliding_window,
        "global_head_dim": text.global_head_dim or text.head_dim,
        "num_global_key_value_heads": global_kv_heads(text),
        "attention_k_eq_v": bool(getattr(text, "attention_k_eq_v", False)),
        "global_rotary_percent": float(full.get("partial_rotary_factor", 1.0)),
        "rotary_base": float(full.get("rope_theta", 1_000_000.0)),
        "local_rotary_base": float(sliding.get("rope_theta", 10_000.0)),
        "final_logit_softcapping": getattr(text, "final_logit_softcapping", None),
    }


def moe_provider(text: Any) -> Gemma4TextModelProvider:
    """The MoE provider for a Gemma 4 text config."""
    return Gemma4TextModelProvider(
        **_common_settings(text),
        moe_router_topk=text.top_k_experts,
        moe_shared_expert_intermediate_size=text.intermediate_size,
    )


def dense_provider(text: Any) -> Gemma4DenseTextModelProvider:
    """The dense provider (E2B / E4B / 31B) for a Gemma 4 text config."""
    settings = _common_settings(text)
    settings.pop("num_moe_experts", None)  # Gemma4TextConfig defines it for every member; dense has none
    settings.pop("moe_ffn_hidden_size", None)
    per_layer = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
    return Gemma4DenseTextModelProvider(
        **settings,
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=int(getattr(text, "vocab_size_per_layer_input", 0) or 0) if per_layer else 0,
        num_kv_shared_layers=int(getattr(text, "num_kv_shared_layers", 0) or 0),
        use_double_wide_mlp=bool(getattr(text, "use_double_wide_mlp", False)),
    )
