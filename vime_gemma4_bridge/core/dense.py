"""The dense Gemma 4 text model (E2B / E4B / 31B) as megatron-core modules: what the MoE model lacks.

Reference: transformers' ``Gemma4TextModel`` / ``Gemma4TextDecoderLayer`` (5.12.1). A dense layer
is the MoE layer's attention with a plain gated MLP, plus, in the small members:

* **Per-layer embeddings (PLE).** The first stage computes one ``hidden_size_per_layer_input``-wide
  input per layer and token (a second, packed token table plus a projection of the embedding);
  each layer gates it into its output (:class:`Gemma4DenseEmbedding`, :class:`Gemma4DenseTransformerLayer`).
* **KV sharing.** The last ``num_kv_shared_layers`` layers have a query projection only and read
  the K/V of the last earlier layer of their type (:class:`Gemma4KVSharedAttention`); their MLP
  may be twice as wide (``use_double_wide_mlp``, :class:`Gemma4DenseMLP`).

Both are carried through the decoder as megatron-core carries a layer's ``context``: a tensor
beside the hidden states, ``[PLE of every layer | the shared K/V]`` (:class:`CarriedLayout`).
Between pipeline stages (and into the first layer) it travels packed beside the hidden states,
``[hidden | carried]`` along the last dimension, so megatron-core's point-to-point exchange moves
it with no change (its shapes are exchanged: ``variable_seq_lengths``). The PLE inputs are
computed once, on the first stage: recomputing them on later stages would need the token ids,
which megatron-core's schedules hand to the first and last stage only, and the embedding, which
only the first stage holds. Full activation recompute keeps working: the carried tensor is a
checkpointed input like the hidden states.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor, nn

from vime_gemma4_bridge.core.layer_pattern import (
    has_double_wide_mlp,
    is_kv_shared_layer,
    kv_shared_types,
    layer_group_rank,
)
from vime_gemma4_bridge.core.model import (
    Gemma4AttentionBase,
    Gemma4LanguageModelEmbedding,
    Gemma4LayerBase,
    Gemma4RMSNorm,
    OwnLayerStack,
    attention_config,
    rounded_embedding_scale,
)


@dataclass(frozen=True)
class CarriedLayout:
    """Where each carried value sits along the last dimension of the carried tensor (one TP rank's view).

    ``[PLE of layer 1 | ... | PLE of layer L | K,V of each shared type]``. Under sequence
    parallelism the carried tensor has the hidden states' rows (``seq / TP``) while K and V have
    the whole sequence: a K/V slot holds ``TP`` rows of them per carried row (a reshape, exact both ways).
    """

    per_layer_width: int  # hidden_size_per_layer_input (0: no PLE)
    num_layers: int
    kv_slots: tuple[tuple[str, int, int, int], ...]  # (layer type, offset, KV groups on this rank, head dim)
    rows_per_row: int  # K/V rows per carried row: TP under sequence parallelism, else 1
    width: int  # of the whole carried tensor

    @classmethod
    def of(cls, config: TransformerConfig) -> CarriedLayout | None:
        """The layout for ``config``; ``None`` when nothing is carried (no PLE, no KV sharing: e.g. 31B)."""
        per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        tp = config.tensor_model_parallel_size
        offset, slots = per_layer * config.num_layers, []
        for layer_type in kv_shared_types(config):
            layer_config = attention_config(config, 1 + config.layer_types.index(layer_type))
            groups = max(1, layer_config.num_query_groups // tp)
            slots.append((layer_type, offset, groups, layer_config.kv_channels))
            offset += 2 * groups * layer_config.kv_channels * (tp if config.sequence_parallel else 1)
        if not offset:
            return None
        return cls(per_layer, config.num_layers, tuple(slots), tp if config.sequence_parallel else 1, offset)

    def per_layer_input(self, carried: Tensor, layer_number: int) -> Tensor:
        """Layer ``layer_number``'s PLE input ``[rows, batch, hidden_size_per_layer_input]``."""
        start = (layer_number - 1) * self.per_layer_width
        return carried[..., start : start + self.per_layer_width]

    def _slot(self, layer_type: str) -> tuple[int, int, int]:
        _, offset, groups, dim = next(slot for slot in self.kv_slots if slot[0] == layer_type)
        return offset, groups, dim

    def kv(self, carried: Tensor, layer_type: str) -> tuple[Tensor, Tensor]:
        """The shared ``(key, value)`` of ``layer_type``, each ``[seq, batch, groups, head_dim]``."""
        offset, groups, dim = self._slot(layer_type)
        slot = carried[..., offset : offset + 2 * groups * dim * self.rows_per_row]
        key_value = slot.reshape(-1, carried.shape[1], 2, groups, dim)
        return key_value[:, :, 0], key_value[:, :, 1]

    def with_kv(self, carried: Tensor, layer_type: str, key: Tensor, value: Tensor) -> Tensor:
        """``carried`` with the ``layer_type`` slot holding ``key`` and ``value``."""
        offset, groups, dim = self._slot(layer_type)
        end = offset + 2 * groups * dim * self.rows_per_row
        slot = torch.stack((key, value), dim=2).reshape(carried.shape[0], carried.shape[1], -1)
        return torch.cat([carried[..., :offset], slot.to(carried.dtype), carried[..., end:]], dim=-1)


class Gemma4ReplicatedLinear(nn.Module):
    """A bias-free linear replicated over TP (the PLE projections: small, and HF applies them per token)."""

    def __init__(self, config: TransformerConfig, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        config.init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # tokens differ per TP rank: all-reduce grads

    def forward(self, hidden_states: Tensor) -> Tensor:
        return nn.functional.linear(hidden_states, self.weight)


class Gemma4KVSharedAttention(Gemma4AttentionBase, Attention):
    """Attention of a KV-shared layer: its own query projection, the K/V of its source layer.

    HF's shared layers have ``q_proj`` and ``q_norm`` only; so has this module (``linear_q``, with
    ``input_layernorm`` fused in as in ``linear_qkv``, and ``q_layernorm``): there is no K/V weight
    a conversion could leak. The source's K and V arrive normalised and not yet rotated
    (:attr:`kv_in`, set by the layer); megatron-core rotates K again at this layer's positions,
    which is the source's rotated K, bit for bit.
    """

    keeps_kv = False

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int, **kwargs: Any) -> None:
        layer_config = attention_config(config, layer_number)
        super().__init__(
            config=layer_config, submodules=submodules, layer_number=layer_number, attention_type="self", **kwargs
        )
        self._gemma4_layer(config, layer_number)
        self.linear_q = submodules.linear_qkv(
            self.config.hidden_size,
            self.query_projection_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.pg_collection.tp,
        )
        self.q_layernorm = submodules.q_layernorm(
            hidden_size=self.hidden_size_per_attention_head, config=self.config, eps=self.config.layernorm_epsilon
        )
        self.k_layernorm = None  # megatron-core's forward asks; K arrives normalised
        self.kv_in: tuple[Tensor, Tensor] | None = None

    def get_query_key_value_tensors(
        self,
        hidden_states: Tensor,
        key_value_states: Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ):
        if output_gate or not split_qkv:
            raise NotImplementedError("Gemma 4 attention has no output gate and normalises q, k and v itself")
        if self.kv_in is None:
            raise RuntimeError(f"KV-shared layer {self.layer_number} got no K/V from its source layer")
        query, _ = self.linear_q(hidden_states)
        heads, head_dim = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        query = query.view(*query.shape[:-1], heads, head_dim)
        key, value = self.kv_in
        return self.q_layernorm(query), key, value


class Gemma4DenseMLP(OwnLayerStack, MLP):
    """megatron-core's gated MLP; a double-wide one (E2B's KV-shared layers) is its own torch_dist stack."""

    def __init__(self, config: TransformerConfig, submodules: Any, ffn_hidden_size: int | None = None, **kwargs: Any):
        if ffn_hidden_size is not None and ffn_hidden_size != config.ffn_hidden_size:
            # megatron-core 0.19.2 sizes linear_fc2's input by config.ffn_hidden_size, not by the argument
            # (transformer/mlp.py, MLP.__init__): the layer's config carries its width (docs/UPSTREAM.md 42).
            config = copy.copy(config)
            config.ffn_hidden_size = ffn_hidden_size
        super().__init__(config=config, submodules=submodules, ffn_hidden_size=ffn_hidden_size, **kwargs)

    def set_layer_number(self, layer_number: int) -> None:  # megatron-core's TransformerLayer calls it
        config = self.config
        index, count = layer_group_rank(config, layer_number, lambda n: has_double_wide_mlp(config, n))
        self.layer_stack = ("_double_wide" if has_double_wide_mlp(config, layer_number) else "", index, count)


class Gemma4DenseTransformerLayer(Gemma4LayerBase):
    """A dense layer: megatron-core's (fused pre-norms, gated MLP) with Gemma 4's norms, PLE and KV sharing.

    Takes and returns the carried tensor as megatron-core's ``context`` (the module docstring);
    the first layer of a model chunk unpacks it from its input, and the last layer of a chunk that
    is not the model's last packs it into its output (:attr:`packs_output`, set by the provider).
    """

    packs_output = False

    def __init__(self, config: TransformerConfig, submodules: Any, layer_number: int = 1, **kwargs: Any) -> None:
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        self.carried = CarriedLayout.of(config)
        self.layer_type = config.layer_types[self.layer_number - 1]
        width = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if width:
            self.per_layer_input_gate = Gemma4ReplicatedLinear(config, config.hidden_size, width)
            self.per_layer_projection = Gemma4ReplicatedLinear(config, width, config.hidden_size)
            self.post_per_layer_input_norm = Gemma4RMSNorm(config, config.hidden_size)
        self._per_layer_input: Tensor | None = None

    def forward(self, hidden_states: Tensor, context: Tensor | None = None, **kwargs: Any):
        carried = self.carried
        if carried is None:
            return super().forward(hidden_states=hidden_states, context=context, **kwargs)
        if context is None:  # the chunk's input: [hidden | carried]
            hidden_states, context = hidden_states.split([self.config.hidden_size, carried.width], dim=-1)
            hidden_states = hidden_states.contiguous()
        attention = self.self_attention
        if carried.per_layer_width:
            self._per_layer_input = carried.per_layer_input(context, self.layer_number)
        if is_kv_shared_layer(self.config, self.layer_number):
            attention.kv_in = carried.kv(context, self.layer_type)
        try:
            output, _ = super().forward(hidden_states=hidden_states, context=None, **kwargs)
            if attention.keeps_kv:
                context = carried.with_kv(context, self.layer_type, *attention.kv_out)
        finally:
            self._per_layer_input = attention.kv_in = attention.kv_out = None
        if self.packs_output:
            return torch.cat([output, context.to(output.dtype)], dim=-1), None
        return output, context

    def _after_feed_forward(self, hidden_states: Tensor) -> Tensor:
        if self._per_layer_input is None:
            return hidden_states
        gated = self.config.activation_func(self.per_layer_input_gate(hidden_states)) * self._per_layer_input
        return hidden_states + self.post_per_layer_input_norm(self.per_layer_projection(gated))


class Gemma4DenseEmbedding(Gemma4LanguageModelEmbedding):
    """The token embedding, then the carried tensor packed beside it: the PLE inputs and empty K/V slots.

    PLE as transformers computes it (``get_per_layer_inputs`` / ``project_per_layer_inputs``):
    ``(norm(proj(embedding) · H^-½) + table(ids) · sqrt(P)) · 2^-½`` per layer. The token table
    is vocabulary-parallel like the embedding (and padded as Megatron pads it, :func:`per_layer_vocab_size`).
    """

    carried: CarriedLayout | None = None

    def add_carried_inputs(self) -> None:
        """Create the PLE modules (called once, by the provider, on the first stage's embedding)."""
        config = self.config
        self.carried = CarriedLayout.of(config)
        width = self.carried.per_layer_width if self.carried else 0
        if not width:
            return
        self.per_layer_embedding = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=per_layer_vocab_size(config),
            embedding_dim=config.num_layers * width,
            init_method=config.embedding_init_method,
            reduce_scatter_embeddings=self.reduce_scatter_embeddings,
            config=config,
            tp_group=self.tp_group,
        )
        self.per_layer_model_projection = Gemma4ReplicatedLinear(config, config.hidden_size, config.num_layers * width)
        self.per_layer_projection_norm = Gemma4RMSNorm(config, width)

    def forward(self, input_ids: Tensor, position_ids: Tensor, tokentype_ids: int | None = None) -> Tensor:
        embeddings = super().forward(input_ids, position_ids, tokentype_ids)
        carried = self.carried
        if carried is None:
            return embeddings
        parts = [embeddings]
        width = carried.per_layer_width
        if width:
            tokens = self.per_layer_embedding(input_ids)
            if not self.reduce_scatter_embeddings:
                tokens = tokens.transpose(0, 1)
                if self.config.sequence_parallel and self.scatter_to_sequence_parallel:
                    tokens = tensor_parallel.scatter_to_sequence_parallel_region(tokens, group=self.tp_group)
            tokens = tokens * rounded_embedding_scale(width, tokens.dtype)
            per_layer = (*embeddings.shape[:-1], carried.num_layers, width)
            projection = self.per_layer_model_projection(embeddings) * self.config.hidden_size**-0.5
            projection = self.per_layer_projection_norm(projection.reshape(per_layer))
            parts.append(((projection + tokens.reshape(per_layer)) * 2.0**-0.5).flatten(-2).to(embeddings.dtype))
        kv_width = carried.width - width * carried.num_layers
        parts.append(embeddings.new_zeros(*embeddings.shape[:-1], kv_width))
        return torch.cat(parts, dim=-1)


def per_layer_vocab_size(config: TransformerConfig) -> int:
    """Rows of the Megatron PLE table: ``vocab_size_per_layer_input`` padded as Megatron pads the vocabulary."""
    return calculate_padded_vocab_size(
        config.vocab_size_per_layer_input,
        config.make_vocab_size_divisible_by,
        config.tensor_model_parallel_size,
        logging_enabled=False,
    )
