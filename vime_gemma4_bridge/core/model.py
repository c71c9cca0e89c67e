"""The Gemma 4 MoE text model as megatron-core modules (leaves of :mod:`vime_gemma4_bridge.core.spec`).

Each class extends the megatron-core module it replaces and changes only what Gemma 4 computes
differently (``transformers``' ``Gemma4TextDecoderLayer`` is the reference):

* :class:`Gemma4RMSNorm` — HF's RMSNorm expression (``x * pow(mean(x²) + eps, -0.5) * w`` in fp32).
* :class:`Gemma4SelfAttention` — per-layer shapes (full layers: ``global_head_dim``, and with
  ``attention_k_eq_v`` the global KV heads and V taken from the raw K projection), V normalised
  without scale, the layer's own RoPE, and torch_dist keys split per layer type (the two types
  have different shapes, so each is its own stack of layers).
* :class:`Gemma4TopKRouter` — HF's router input (scaleless RMSNorm × ``scale`` × hidden⁻½), top-k
  weights renormalised and scaled per expert.
* :class:`Gemma4MoELayer` — the dense MLP (megatron-core's shared expert) and the routed experts
  read differently normalised inputs, and each output has its own post-norm.
* :class:`Gemma4TransformerLayer` — the three MoE inputs, the post-FFN norm, and the per-layer
  ``layer_scalar``: a frozen *parameter*, not a buffer, so that every weight the bridge converts is
  among ``named_parameters()`` (vime's weight sync looks weights up there; a persistent buffer
  would be missing from it).
* :class:`Gemma4RotaryEmbedding` — sliding layers rotate the whole head at the local base; full
  layers use HF's "proportional" RoPE (zero frequencies beyond ``partial_rotary_factor``).
* :class:`Gemma4LanguageModelEmbedding` and :class:`Gemma4OutputLayer` — ``sqrt(hidden)`` rounded
  to the embedding dtype, and final logit softcapping.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import make_viewless_tensor
from torch import Tensor, nn

from vime_gemma4_bridge.compat.layer_hooks import TransformerLayerHooks
from vime_gemma4_bridge.core.layer_pattern import (
    is_kv_shared_layer,
    is_kv_source_layer,
    is_sliding_layer,
    layer_group_rank,
)


def rms_norm(hidden_states: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Hugging Face Gemma 4's RMSNorm, expression for expression (fp32 math, result in the input dtype)."""
    x = hidden_states.float()
    normed = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        normed = normed * weight.float()
    return normed.type_as(hidden_states)


def _replicated_over_sequence(parameter: nn.Parameter, config: TransformerConfig) -> nn.Parameter:
    """Mark a replicated parameter whose gradient megatron-core must all-reduce under sequence parallelism."""
    parameter.sequence_parallel = bool(config.sequence_parallel)
    return parameter


class Gemma4RMSNorm(nn.Module):
    """RMSNorm with HF Gemma 4's numerics; the weight is kept in ``params_dtype`` (bitwise export)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float | None = None) -> None:
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = _replicated_over_sequence(
            nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype)), config
        )

    def forward(self, hidden_states: Tensor) -> Tensor:
        return rms_norm(hidden_states, self.weight, self.eps)


def attention_config(config: TransformerConfig, layer_number: int) -> TransformerConfig:
    """The config one attention layer is built with: full layers take the global head dim and KV heads."""
    if is_sliding_layer(config, layer_number):
        return config
    layer_config = copy.copy(config)
    layer_config.kv_channels = config.global_head_dim
    layer_config.num_query_groups = config.num_global_key_value_heads
    return layer_config


class OwnLayerStack:
    """Mixin: torch_dist stacks this module's tensors with the layers of its own group only.

    megatron-core stacks a module's tensors over all layers (key ``decoder.layers.<name>.*``, layer
    axis of size ``num_layers``). Modules whose shapes differ between layers (sliding vs full
    attention, KV-shared attention without K/V, the double-wide MLP) cannot share one stack: each
    group is its own, keyed ``<name><suffix>`` with the group's size on the layer axis. The layer
    axis is handed in, so megatron-core builds every entry (factories and objects included); the
    returned dict keeps the module's own names, which loading matches against the model.
    """

    #: ``(key suffix, index in the group, group size)``; ``None``: megatron-core's stack over all layers.
    layer_stack: tuple[str, int, int] | None = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        stack = self.layer_stack
        layer_axis = len(sharded_offsets) == 1 and sharded_offsets[0][0] == 0
        if stack is None or not layer_axis or not prefix.endswith("."):  # per-layer keys: nothing is stacked
            return super().sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        suffix, index, count = stack
        grouped = f"{prefix[:-1]}{suffix}."
        state = super().sharded_state_dict(prefix=grouped, sharded_offsets=((0, index, count),), metadata=metadata)
        return {prefix + key[len(grouped) :] if key.startswith(grouped) else key: value for key, value in state.items()}


class Gemma4AttentionBase(OwnLayerStack):
    """What every Gemma 4 attention does: its layer's RoPE, and its torch_dist stack per layer type."""

    def _gemma4_layer(self, config: TransformerConfig, layer_number: int) -> None:
        self.is_sliding = is_sliding_layer(config, layer_number)
        index, count = layer_group_rank(
            config, layer_number, lambda n: (config.layer_types[n - 1], is_kv_shared_layer(config, n))
        )
        suffix = "_sliding" if self.is_sliding else "_global"
        self.layer_stack = (suffix + ("_kv_shared" if is_kv_shared_layer(config, layer_number) else ""), index, count)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor, *args: Any, **kwargs: Any):
        # megatron-core's "dual RoPE" convention (kept by its full-recompute path): a (sliding, full) pair.
        sliding, full = kwargs["rotary_pos_emb"]
        kwargs["rotary_pos_emb"] = sliding if self.is_sliding else full
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


class Gemma4SelfAttention(Gemma4AttentionBase, SelfAttention):
    """Self-attention of one Gemma 4 layer, sliding or full (see the module docstring).

    A K/V source layer (:func:`~vime_gemma4_bridge.core.layer_pattern.is_kv_source_layer`) keeps
    its normalised, not yet rotated K and V of the last forward in :attr:`kv_out` for its layer to
    hand on (the KV-shared layers rotate them as this layer does).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, **kwargs: Any) -> None:
        super().__init__(config=attention_config(config, layer_number), layer_number=layer_number, **kwargs)
        self._gemma4_layer(config, layer_number)
        # With attention_k_eq_v, full layers have no v_proj in HF: V is the raw (un-normalised) K.
        self.value_is_key = bool(config.attention_k_eq_v) and not self.is_sliding
        self.keeps_kv = is_kv_source_layer(config, layer_number)
        self.kv_out: tuple[Tensor, Tensor] | None = None

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ):
        if output_gate or not split_qkv:
            raise NotImplementedError("Gemma 4 attention has no output gate and normalises q, k and v itself")
        # megatron-core's projection and per-rank head selection; the split and the norms are Gemma 4's.
        mixed_qkv, split_sizes = super().get_query_key_value_tensors(hidden_states, key_value_states, split_qkv=False)
        query, key, value = torch.split(mixed_qkv, split_sizes, dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)
        groups = self.config.num_query_groups
        if groups < self.world_size:
            # mixed_qkv holds one whole KV group here (megatron-core gathered it): keep this rank's q heads.
            replicas = self.world_size // groups
            index = self.pg_collection.tp.rank() % replicas
            size = self.num_attention_heads_per_partition // replicas
            query = query[:, :, index * size : (index + 1) * size, :]
        if self.value_is_key:
            value = key
        query = self.q_layernorm(query)
        key = self.k_layernorm(key)
        value = rms_norm(value, None, self.config.layernorm_epsilon)
        if self.keeps_kv:
            self.kv_out = (key, value)
        return query, key, value


class Gemma4TopKRouter(TopKRouter):
    """megatron-core's top-k router with HF Gemma 4's input scaling and output weighting."""

    def __init__(self, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)
        dtype = config.params_dtype
        self.scale = _replicated_over_sequence(nn.Parameter(torch.ones(config.hidden_size, dtype=dtype)), config)
        self.per_expert_scale = _replicated_over_sequence(
            nn.Parameter(torch.ones(config.num_moe_experts, dtype=dtype)), config
        )

    def gating(self, input: Tensor) -> Tensor:  # noqa: A002 (megatron-core's name)
        scaled = rms_norm(input, None, self.config.layernorm_epsilon) * self.scale * self.config.hidden_size**-0.5
        return super().gating(scaled)

    def routing(self, logits: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        probs, routing_map = super().routing(logits, *args, **kwargs)
        # probs are dense [tokens, experts], zero outside each token's top-k: renormalise, then scale.
        probs = probs / probs.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        return probs * self.per_expert_scale.unsqueeze(0), routing_map


class Gemma4MoELayer(MoELayer):
    """Routed experts plus the dense MLP (as megatron-core's shared expert), each with its own norms."""

    def __init__(self, config: TransformerConfig, submodules: Any, **kwargs: Any) -> None:
        super().__init__(config=config, submodules=submodules, **kwargs)
        self.post_moe_layernorm = Gemma4RMSNorm(config, config.hidden_size)
        self.post_shared_expert_layernorm = Gemma4RMSNorm(config, config.hidden_size)

    def forward(self, *args: Any, **kwargs: Any):
        raise NotImplementedError("Gemma4MoELayer takes three inputs: call forward_with_separate_inputs")

    def forward_with_separate_inputs(
        self, expert_input: Tensor, shared_input: Tensor, router_input: Tensor, padding_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """MoE output from the routed-expert input, the dense-MLP input and the router's (raw) input."""
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()

        def compute(expert_input: Tensor, shared_input: Tensor, router_input: Tensor) -> tuple[Tensor, Tensor | None]:
            shared_output = self.shared_experts_compute(shared_input)
            probs, routing_map = self.route(router_input, padding_mask)
            dispatched, probs = self.preprocess(expert_input, probs, routing_map)
            dispatched, probs = self.dispatch(dispatched, probs)
            output, bias = self.routed_experts_compute(dispatched, probs)
            output = self.postprocess(self.combine(output), None)
            output = self.post_moe_layernorm(output)
            if shared_output is not None:
                output = output + self.post_shared_expert_layernorm(shared_output)
            return output, bias

        if self.moe_layer_recompute and self.training:
            return tensor_parallel.checkpoint(compute, False, expert_input, shared_input, router_input)
        return compute(expert_input, shared_input, router_input)


class Gemma4LayerBase(TransformerLayerHooks):
    """What every Gemma 4 layer adds to megatron-core's: the post-FFN norm and the frozen ``layer_scalar``.

    megatron-core's ``TransformerLayer``, through the compat class that names its feed-forward steps.
    """

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int = 1, **kwargs: Any) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        self.post_ffn_layernorm = Gemma4RMSNorm(config, config.hidden_size)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=config.params_dtype), requires_grad=False)

    def forward_post_mlp(self, mlp_output_with_bias: tuple[Tensor, Tensor | None], residual: Tensor) -> Tensor:
        output, bias = mlp_output_with_bias
        output = self.post_ffn_layernorm(output)
        if bias is not None:
            output = output + bias
        output = nn.functional.dropout(output, p=self.hidden_dropout, training=self.training)
        hidden_states = self._after_feed_forward(residual + output) * self.layer_scalar
        return make_viewless_tensor(inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True)

    def _after_feed_forward(self, hidden_states: Tensor) -> Tensor:
        """What the layer computes between the feed-forward residual and ``layer_scalar`` (nothing here)."""
        return hidden_states


class Gemma4TransformerLayer(Gemma4LayerBase):
    """The MoE layer: megatron-core's, with Gemma 4's three-input feed-forward (see the module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int = 1, **kwargs: Any) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        self.pre_shared_expert_layernorm = Gemma4RMSNorm(config, config.hidden_size)

    def forward_mlp(
        self,
        hidden_states: Tensor,
        inference_context: Any = None,
        padding_mask: Tensor | None = None,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        residual = hidden_states
        moe_input, padding_mask, mbs = self.unflatten_for_moe(hidden_states, padding_mask, packed_seq_params)
        output, bias = self.mlp.forward_with_separate_inputs(
            self.pre_mlp_layernorm(moe_input),  # HF pre_feedforward_layernorm_2: routed experts
            self.pre_shared_expert_layernorm(moe_input),  # HF pre_feedforward_layernorm: dense MLP
            moe_input,  # the router normalises its own input
            padding_mask=padding_mask,
        )
        output = self.reflatten_from_moe(output, packed_seq_params, mbs)
        return self.forward_post_mlp((output, bias), residual)


class Gemma4RotaryEmbedding(nn.Module):
    """Both RoPE tables of Gemma 4; ``forward`` returns the pair ``(sliding, full)``."""

    def __init__(
        self,
        *,
        head_dim: int,
        global_head_dim: int,
        local_base: float,
        global_base: float,
        global_rotary_percent: float,
        use_cpu_initialization: bool,
    ) -> None:
        super().__init__()
        common = {"rotary_percent": 1.0, "use_cpu_initialization": use_cpu_initialization}
        self.sliding = RotaryEmbedding(kv_channels=head_dim, rotary_base=local_base, **common)
        self.full = RotaryEmbedding(kv_channels=global_head_dim, rotary_base=global_base, **common)
        # HF "proportional" RoPE: the first pairs rotate at the usual frequencies of the whole head,
        # the rest at frequency zero (identity), so q and k keep their full width.
        rotated = int(global_rotary_percent * global_head_dim // 2)
        frequencies = self.full.inv_freq.clone()
        frequencies[rotated:] = 0.0
        self.full.inv_freq = frequencies

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None):
        return (
            self.sliding(max_seq_len, offset, packed_seq, cp_group),
            self.full(max_seq_len, offset, packed_seq, cp_group),
        )

    def get_rotary_seq_len(self, *args: Any, **kwargs: Any) -> int:
        return self.full.get_rotary_seq_len(*args, **kwargs)


def rounded_embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """``sqrt(hidden_size)`` as transformers' Gemma 4 applies it: a float32 scalar cast to ``dtype``."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype))


class Gemma4LanguageModelEmbedding(LanguageModelEmbedding):
    """Token embedding times ``sqrt(hidden_size)`` rounded to the embedding dtype, as transformers does.

    bf16 example: sqrt(2816) = 53.07 becomes 53.0; multiplying by the exact float would differ.
    """

    def forward(self, input_ids: Tensor, position_ids: Tensor, tokentype_ids: int | None = None) -> Tensor:
        embeddings = super().forward(input_ids, position_ids, tokentype_ids)
        return embeddings * rounded_embedding_scale(self.config.hidden_size, self.word_embeddings.weight.dtype)


class Gemma4OutputLayer(ColumnParallelLinear):
    """The output projection followed by Gemma 4's final logit softcapping ``c · tanh(logits / c)``."""

    def forward(self, *args: Any, **kwargs: Any):
        logits, bias = super().forward(*args, **kwargs)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits, bias
