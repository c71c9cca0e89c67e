"""``Gemma4TextModelProvider``: the Gemma 4 MoE text model on Megatron-Bridge's generic GPT provider.

Every Gemma 4 setting is a dataclass field (so a ``run_config.yaml`` restores it), the layer spec
is :func:`vime_gemma4_bridge.core.spec.gemma4_block_spec`, and :meth:`provide` finishes the built
``GPTModel`` with Gemma 4's RoPE, embedding scale and logit softcapping. The same provider builds
the TE model on GPU hosts and the CPU twins elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.bridge.models.gpt_provider import GPTModelProvider
from megatron.core.activations import fast_gelu
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core.dense import CarriedLayout, Gemma4DenseEmbedding
from vime_gemma4_bridge.core.lora import with_gemma4_adapters
from vime_gemma4_bridge.core.model import Gemma4LanguageModelEmbedding, Gemma4OutputLayer, Gemma4RotaryEmbedding
from vime_gemma4_bridge.core.spec import gemma4_block_spec, gemma4_dense_block_spec


@dataclass
class Gemma4TextModelProvider(GPTModelProvider):
    """Gemma 4 MoE (26B-A4B and its kin): language model only, tied embeddings, sliding/full layers."""

    # Gemma 4's own settings (HF text-config names in the comments).
    layer_types: list[str] = field(default_factory=list)  # layer_types: sliding_attention / full_attention
    window_size: Any = 1024  # sliding_window (a token count; each sliding layer turns it into (W - 1, 0))
    global_head_dim: int = 512  # global_head_dim: head dim of full-attention layers
    num_global_key_value_heads: int = 2  # KV heads of full layers (num_global_key_value_heads with k_eq_v)
    attention_k_eq_v: bool = False  # attention_k_eq_v: full layers take V from the K projection
    global_rotary_percent: float = 0.25  # rope_parameters.full_attention.partial_rotary_factor
    rotary_base: float = 1_000_000.0  # rope_parameters.full_attention.rope_theta
    local_rotary_base: float = 10_000.0  # rope_parameters.sliding_attention.rope_theta
    final_logit_softcapping: float | None = None  # final_logit_softcapping

    # Fixed by the architecture.
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-6
    gated_linear_unit: bool = True
    activation_func: Callable = fast_gelu
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"
    share_embeddings_and_output_weights: bool = True
    qk_layernorm: bool = True
    softmax_scale: float = 1.0  # q and k are normalised instead of scaled
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    moe_layer_freq: int = 1  # every layer is MoE; its dense MLP is megatron-core's shared expert
    moe_shared_expert_overlap: bool = False  # the dense MLP reads its own normalised input
    moe_router_pre_softmax: bool = True  # softmax over all experts, then top-k (as HF)
    moe_router_dtype: str = "fp32"
    moe_grouped_gemm: bool = True  # grouped experts (``weight<K>``): the layout the mapping table names
    moe_aux_loss_coeff: float = 0.001
    moe_token_dispatcher_type: str = "alltoall"
    moe_permute_fusion: bool = True
    transformer_layer_spec: Any = gemma4_block_spec

    def finalize(self) -> None:
        unsupported = [
            what
            for what, on in (
                ("moe_shared_expert_overlap", self.moe_shared_expert_overlap),
                ("CUDA graphs", getattr(self, "cuda_graph_impl", "none") != "none"),
                ("moe_latent_size", bool(getattr(self, "moe_latent_size", None))),
                ("selective recompute of layernorm", "layernorm" in (getattr(self, "recompute_modules", None) or [])),
            )
            if on
        ]
        if unsupported:
            raise ValueError(f"Gemma 4's three-input MoE layer does not support: {', '.join(unsupported)}")
        if not seams.te_available():
            # Settings that need TE or CUDA kernels; the values chosen compute the same function.
            self.moe_permute_fusion = False
            if self.num_moe_experts and not self.variable_seq_lengths:
                # The alltoall dispatcher's CUDA stream has no CPU counterpart; allgather computes the same
                # function. megatron-core refuses allgather with variable_seq_lengths (miles sets it), so a
                # model built that way keeps alltoall, which megatron-core runs on the CPU when asked for it.
                self.moe_token_dispatcher_type = "allgather"
            self.gradient_accumulation_fusion = False
            self.bias_activation_fusion = False
            self.bias_dropout_fusion = False
            self.masked_softmax_fusion = False
            self.apply_rope_fusion = False
            self.persist_layer_norm = False
        super().finalize()

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        model.rotary_pos_emb = Gemma4RotaryEmbedding(
            head_dim=self.kv_channels,
            global_head_dim=self.global_head_dim,
            local_base=self.local_rotary_base,
            global_base=self.rotary_base,
            global_rotary_percent=self.global_rotary_percent,
            use_cpu_initialization=self.use_cpu_initialization or not torch.cuda.is_available(),
        )
        # Same parameters, Gemma 4's forward: swapping the class keeps names, shapes and ties.
        _become(getattr(model, "embedding", None), LanguageModelEmbedding, self.embedding_class)
        _become(getattr(model, "output_layer", None), ColumnParallelLinear, Gemma4OutputLayer)
        return model

    #: The class the embedding becomes (the dense model's also computes the per-layer inputs).
    embedding_class = Gemma4LanguageModelEmbedding

    @property
    def pre_wrap_hook(self) -> Callable[[list], list] | None:
        """The registered pre-wrap hooks (vime's LoRA among them), then Gemma 4's adapter placement (core/lora.py)."""
        hooks = super().pre_wrap_hook
        if hooks is None:
            return None

        def then_gemma4_adapters(model: list) -> list:
            with seams.peft_reads_module_attributes():  # a LoRA hook may wrap the CPU twins of TE's expert linears
                model = hooks(model)
            return with_gemma4_adapters(model)

        return then_gemma4_adapters


@dataclass
class Gemma4DenseTextModelProvider(Gemma4TextModelProvider):
    """Dense Gemma 4 (E2B, E4B, 31B, the 12B Unified): the MoE provider's attention, RoPE and embedding, a
    gated MLP per layer, per-layer embeddings and KV sharing (:mod:`vime_gemma4_bridge.core.dense`)."""

    hidden_size_per_layer_input: int = 0  # hidden_size_per_layer_input (0: no PLE)
    vocab_size_per_layer_input: int = 0  # vocab_size_per_layer_input
    num_kv_shared_layers: int = 0  # num_kv_shared_layers: the last layers read an earlier layer's K/V
    use_double_wide_mlp: bool = False  # use_double_wide_mlp: KV-shared layers have a 2x wide MLP
    num_moe_experts: int | None = None
    transformer_layer_spec: Any = gemma4_dense_block_spec
    embedding_class = Gemma4DenseEmbedding

    def finalize(self) -> None:
        carries = CarriedLayout.of(self) is not None
        if carries and self.context_parallel_size > 1:
            raise ValueError("dense Gemma 4 with per-layer inputs or KV sharing does not support context parallelism")
        if carries and self.pipeline_model_parallel_size > 1:
            # Stages exchange [hidden | carried] (core/dense.py): wider than hidden_size, so its shape is sent too.
            self.variable_seq_lengths = True
        super().finalize()

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        embedding = getattr(model, "embedding", None)
        if embedding is not None:
            embedding.add_carried_inputs()
        decoder = model.decoder
        if decoder.layers and not decoder.post_process:
            decoder.layers[-1].packs_output = True  # the next stage's first layer unpacks it
        return model


def _become(module: torch.nn.Module | None, expected: type, gemma4_class: type) -> None:
    """Give a just-built module Gemma 4's forward; refuse a class megatron-core did not build before."""
    if module is None:
        return
    if type(module) is not expected:
        raise TypeError(f"expected megatron-core's {expected.__name__}, got {type(module).__name__}")
    seams.become(module, gemma4_class)
