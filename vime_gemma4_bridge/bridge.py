"""The Gemma 4 language-model bridge: mapping table, tied-embedding rule, registration.

Built on Megatron-Bridge's ``Gemma4Bridge``: every TP/PP/EP/ETP gather and scatter is done by
its mapping classes and conversion tasks. What this layer adds (each a gap listed in
docs/UPSTREAM.md):

* one bridge for ``Gemma4ForCausalLM`` (HF names under ``model.``) and for the language model of
  ``Gemma4ForConditionalGeneration`` (HF names under ``model.language_model.``), building a
  text-only ``GPTModel`` — the vision/audio towers never enter Megatron;
* a model that builds with or without Transformer Engine (:mod:`vime_gemma4_bridge.provider`);
* exact per-layer sliding/full attention (:mod:`vime_gemma4_bridge.layer_pattern`);
* Megatron weights in the checkpoint's own dtype (upstream forces bf16, which is lossy for fp32);
* the tied-embedding check before export and the completeness check of the mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import transformers
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import (
    MegatronModelBridge,
    register_bridge_implementation,
)
from megatron.bridge.models.conversion.param_mapping import (
    FusedExpertMapping,
    FusedGatedExpertMapping,
    GatedMLPMapping,
)
from megatron.bridge.models.gemma.gemma4_bridge import Gemma4Bridge, _Gemma4DenseQKVMapping, _Gemma4QKVMapping
from megatron.bridge.models.gemma.gemma4_provider import Gemma4DenseProvider
from megatron.core.models.gpt.gpt_model import GPTModel

from vime_gemma4_bridge.hf_io import LANGUAGE_MODEL_PREFIX
from vime_gemma4_bridge.layer_pattern import pattern_from_layer_types
from vime_gemma4_bridge.mappings import AutoMapping, ReplicatedMapping
from vime_gemma4_bridge.provider import Gemma4DenseTextModelProvider, Gemma4TextModelProvider
from vime_gemma4_bridge.tied import check_tied_embeddings

# ---------------------------------------------------------------------------------------------
# The mapping table of the MoE model. Megatron names are relative to the GPTModel; HF names are
# relative to the language-model prefix above; ``*`` is the layer index. A dict HF side fuses
# several HF tensors into one Megatron tensor. Tied embeddings: ``lm_head`` / ``output_layer``
# appear nowhere on purpose (see vime_gemma4_bridge/tied.py).
# ---------------------------------------------------------------------------------------------
MOE_MAPPING_TABLE: tuple[tuple[type, str, str | dict[str, str]], ...] = (
    (AutoMapping, "embedding.word_embeddings.weight", "embed_tokens.weight"),
    (AutoMapping, "decoder.final_layernorm.weight", "norm.weight"),
    # attention (sliding and global layers share names; shapes differ per layer type)
    (AutoMapping, "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", "layers.*.input_layernorm.weight"),
    (
        _Gemma4QKVMapping,  # tolerates the absent v_proj of attention_k_eq_v global layers
        "decoder.layers.*.self_attention.linear_qkv.weight",
        {
            "q": "layers.*.self_attn.q_proj.weight",
            "k": "layers.*.self_attn.k_proj.weight",
            "v": "layers.*.self_attn.v_proj.weight",
        },
    ),
    (AutoMapping, "decoder.layers.*.self_attention.q_layernorm.weight", "layers.*.self_attn.q_norm.weight"),
    (AutoMapping, "decoder.layers.*.self_attention.k_layernorm.weight", "layers.*.self_attn.k_norm.weight"),
    (AutoMapping, "decoder.layers.*.self_attention.linear_proj.weight", "layers.*.self_attn.o_proj.weight"),
    (
        AutoMapping,
        "decoder.layers.*.self_attention.linear_proj.post_layernorm.weight",
        "layers.*.post_attention_layernorm.weight",
    ),
    # feed-forward: dense MLP ("shared expert") beside the routed experts, each with its norms
    (
        ReplicatedMapping,
        "decoder.layers.*.pre_shared_expert_layernorm.weight",
        "layers.*.pre_feedforward_layernorm.weight",
    ),
    (
        GatedMLPMapping,
        "decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
        {"gate": "layers.*.mlp.gate_proj.weight", "up": "layers.*.mlp.up_proj.weight"},
    ),
    (AutoMapping, "decoder.layers.*.mlp.shared_experts.linear_fc2.weight", "layers.*.mlp.down_proj.weight"),
    (
        AutoMapping,
        "decoder.layers.*.mlp.post_shared_expert_layernorm.weight",
        "layers.*.post_feedforward_layernorm_1.weight",
    ),
    (AutoMapping, "decoder.layers.*.pre_mlp_layernorm.weight", "layers.*.pre_feedforward_layernorm_2.weight"),
    (AutoMapping, "decoder.layers.*.mlp.router.weight", "layers.*.router.proj.weight"),
    (ReplicatedMapping, "decoder.layers.*.mlp.router.scale", "layers.*.router.scale"),
    (ReplicatedMapping, "decoder.layers.*.mlp.router.per_expert_scale", "layers.*.router.per_expert_scale"),
    # routed experts: one Megatron tensor per expert <-> one stacked HF tensor [E, ...]
    (FusedGatedExpertMapping, "decoder.layers.*.mlp.experts.linear_fc1.weight*", "layers.*.experts.gate_up_proj"),
    (FusedExpertMapping, "decoder.layers.*.mlp.experts.linear_fc2.weight*", "layers.*.experts.down_proj"),
    (
        ReplicatedMapping,
        "decoder.layers.*.mlp.post_moe_layernorm.weight",
        "layers.*.post_feedforward_layernorm_2.weight",
    ),
    (ReplicatedMapping, "decoder.layers.*.post_ffn_layernorm.weight", "layers.*.post_feedforward_layernorm.weight"),
    (ReplicatedMapping, "decoder.layers.*.layer_scalar", "layers.*.layer_scalar"),
)


# The dense model (E2B/E4B/31B style): Megatron-Bridge's dense Gemma 4 layout, same conventions.
DENSE_MAPPING_TABLE: tuple[tuple[type, str, str | dict[str, str]], ...] = (
    (AutoMapping, "embedding.word_embeddings.weight", "embed_tokens.weight"),
    (AutoMapping, "decoder.final_layernorm.weight", "norm.weight"),
    # per-layer embeddings (PLE)
    (AutoMapping, "per_layer_embedding.weight", "embed_tokens_per_layer.weight"),
    (AutoMapping, "per_layer_model_proj.weight", "per_layer_model_projection.weight"),
    (ReplicatedMapping, "per_layer_proj_norm.weight", "per_layer_projection_norm.weight"),
    (ReplicatedMapping, "decoder.layers.*.per_layer_input_gate.weight", "layers.*.per_layer_input_gate.weight"),
    (ReplicatedMapping, "decoder.layers.*.per_layer_projection.weight", "layers.*.per_layer_projection.weight"),
    (
        ReplicatedMapping,
        "decoder.layers.*.post_per_layer_input_norm.weight",
        "layers.*.post_per_layer_input_norm.weight",
    ),
    # attention: kv-shared layers have no k/v projections in HF
    (AutoMapping, "decoder.layers.*.input_layernorm.weight", "layers.*.input_layernorm.weight"),
    (
        _Gemma4DenseQKVMapping,
        "decoder.layers.*.self_attention.linear_qkv.weight",
        {
            "q": "layers.*.self_attn.q_proj.weight",
            "k": "layers.*.self_attn.k_proj.weight",
            "v": "layers.*.self_attn.v_proj.weight",
        },
    ),
    (AutoMapping, "decoder.layers.*.self_attention.q_layernorm.weight", "layers.*.self_attn.q_norm.weight"),
    (AutoMapping, "decoder.layers.*.self_attention.k_layernorm.weight", "layers.*.self_attn.k_norm.weight"),
    (AutoMapping, "decoder.layers.*.self_attention.linear_proj.weight", "layers.*.self_attn.o_proj.weight"),
    (AutoMapping, "decoder.layers.*.post_self_attn_layernorm.weight", "layers.*.post_attention_layernorm.weight"),
    # MLP
    (AutoMapping, "decoder.layers.*.pre_mlp_layernorm.weight", "layers.*.pre_feedforward_layernorm.weight"),
    (
        GatedMLPMapping,
        "decoder.layers.*.mlp.linear_fc1.weight",
        {"gate": "layers.*.mlp.gate_proj.weight", "up": "layers.*.mlp.up_proj.weight"},
    ),
    (AutoMapping, "decoder.layers.*.mlp.linear_fc2.weight", "layers.*.mlp.down_proj.weight"),
    (AutoMapping, "decoder.layers.*.post_mlp_layernorm.weight", "layers.*.post_feedforward_layernorm.weight"),
    (ReplicatedMapping, "decoder.layers.*.layer_scalar", "layers.*.layer_scalar"),
)


def build_registry(table: Iterable[tuple[type, str, str | dict[str, str]]], hf_prefix: str) -> MegatronMappingRegistry:
    """Instantiate a mapping table for one HF class (prefix)."""
    mappings = []
    for mapping_cls, megatron_name, hf in table:
        if isinstance(hf, dict):
            mappings.append(mapping_cls(megatron_name, **{role: hf_prefix + name for role, name in hf.items()}))
        else:
            mappings.append(mapping_cls(megatron_param=megatron_name, hf_param=hf_prefix + hf))
    return MegatronMappingRegistry(*mappings)


class Gemma4LanguageModelBridge(Gemma4Bridge):
    """Gemma 4 language-model bridge (MoE and dense) for the CausalLM and the VL checkpoint."""

    def _architecture(self) -> str:
        architectures = getattr(self.hf_config, "architectures", None) or []
        for architecture in architectures:
            if architecture in LANGUAGE_MODEL_PREFIX:
                return architecture
        raise ValueError(f"not a Gemma 4 checkpoint: architectures={architectures}")

    def _text_config(self) -> Any | None:
        config = getattr(self, "hf_config", None)
        return getattr(config, "text_config", config)

    def _hf_layer_prefix(self) -> str:
        return LANGUAGE_MODEL_PREFIX[self._architecture()]

    def provider_bridge(self, hf_pretrained: Any) -> Gemma4TextModelProvider | Gemma4DenseProvider:
        self.hf_config = hf_pretrained.config
        text_config = self._text_config()
        dtype = _config_dtype(text_config) or _config_dtype(self.hf_config) or torch.float32
        if not getattr(text_config, "enable_moe_block", False):
            self._is_dense = True
            provider = Gemma4DenseTextModelProvider(**_init_fields(self._build_dense_provider(text_config)))
            # Upstream's dense build always pads the vocab to this multiple (default 128) while its
            # embedding mapping copies the HF table unpadded; a divisor of the vocab means no padding.
            provider.make_vocab_size_divisible_by = self.make_vocab_size_divisible_by(text_config.vocab_size)
            provider.num_global_query_groups = self._dense_num_global_query_groups = global_kv_heads(text_config)
        else:
            self._is_dense = False
            upstream = self._build_moe_provider(text_config)
            provider = Gemma4TextModelProvider(**_init_fields(upstream))
            provider.interleaved_attn_pattern = pattern_from_layer_types(text_config.layer_types)
            provider.num_global_key_value_heads = global_kv_heads(text_config)
        # Keep the checkpoint's dtype: a bf16 copy of an fp32 checkpoint cannot round-trip bitwise.
        provider.params_dtype = dtype
        provider.bf16 = dtype == torch.bfloat16
        provider.fp16 = dtype == torch.float16
        provider.autocast_dtype = dtype
        provider.pipeline_dtype = dtype
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        table = DENSE_MAPPING_TABLE if self._is_dense_config() else MOE_MAPPING_TABLE
        return build_registry(table, self._hf_layer_prefix())

    def build_conversion_tasks(self, hf_pretrained: Any, megatron_model: list, weight_dtype: Any = None) -> list:
        """Upstream's tasks, refusing silently skipped parameters (upstream only logs a warning)."""
        tasks = super().build_conversion_tasks(hf_pretrained, megatron_model, weight_dtype=weight_dtype)
        mapped = {task.param_name for task in tasks if task is not None and task.megatron_module is not None}
        registry = self.mapping_registry()
        for model in megatron_model:
            for name, _ in model.named_parameters():
                name = self._unwrap_name(name)
                if "output_layer" in name:
                    continue  # tied to the embedding, see tied.py
                if name not in mapped and registry.megatron_to_hf_lookup(name) is None:
                    raise ValueError(f"Megatron parameter {name!r} has no Gemma 4 mapping; the export would drop it")
        return tasks

    def stream_weights_megatron_to_hf(self, megatron_model: Any, hf_pretrained: Any, *args, **kwargs):
        """Upstream export, after proving the tied output layer still equals the embedding."""
        check_tied_embeddings(megatron_model)
        yield from super().stream_weights_megatron_to_hf(megatron_model, hf_pretrained, *args, **kwargs)


def global_kv_heads(text_config: Any) -> int:
    """KV heads of full-attention layers, as transformers builds them.

    ``num_global_key_value_heads`` applies only with ``attention_k_eq_v`` (transformers'
    ``use_alternative_attention``); otherwise full layers keep ``num_key_value_heads``. Upstream
    uses the global count whenever it is set, which mis-shapes k_proj of such checkpoints.
    """
    if getattr(text_config, "attention_k_eq_v", False) and getattr(text_config, "num_global_key_value_heads", None):
        return int(text_config.num_global_key_value_heads)
    return int(text_config.num_key_value_heads)


def _config_dtype(config: Any) -> torch.dtype | None:
    """The checkpoint dtype a HF config declares (VL configs declare it at the top level only)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else None


def _init_fields(provider: Any) -> dict[str, Any]:
    """Constructor arguments reproducing ``provider``, minus its (TE-only) layer spec."""
    return {
        f.name: getattr(provider, f.name)
        for f in dataclasses.fields(provider)
        if f.init and f.name != "transformer_layer_spec"
    }


class Gemma4CausalLMBridge(Gemma4LanguageModelBridge):
    """Registered for ``Gemma4ForCausalLM``."""


class Gemma4ConditionalGenerationBridge(Gemma4LanguageModelBridge):
    """Registered for ``Gemma4ForConditionalGeneration``: its language model only."""


_REGISTERED = False


def register() -> None:
    """Make ``AutoBridge`` dispatch both Gemma 4 classes to this plugin. Idempotent.

    Megatron-Bridge's own Gemma 4 bridges register under the class *names*; a later registration
    of the same name wins, and a registration under the transformers class itself wins over any
    name. Importing upstream's bridges first and then registering ours under both the name and
    the class makes the result independent of import order.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    import megatron.bridge.models.gemma.gemma4_bridge  # noqa: F401  (upstream registers first)
    import megatron.bridge.models.gemma_vl.gemma4_vl_bridge  # noqa: F401

    for bridge_cls, name in (
        (Gemma4CausalLMBridge, "Gemma4ForCausalLM"),
        (Gemma4ConditionalGenerationBridge, "Gemma4ForConditionalGeneration"),
    ):
        MegatronModelBridge.register_bridge(
            source=name, target=GPTModel, provider=Gemma4TextModelProvider, model_type="gemma4"
        )(bridge_cls)
        register_bridge_implementation(source=getattr(transformers, name), target=GPTModel, bridge_class=bridge_cls)
    _REGISTERED = True
