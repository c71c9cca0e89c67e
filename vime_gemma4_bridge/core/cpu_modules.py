"""CPU twins of the Transformer-Engine modules of the Gemma 4 layer spec (:mod:`vime_gemma4_bridge.core.spec`).

With TE, the spec's parameter names come from TE modules (``linear_qkv.layer_norm_weight``,
``linear_proj.post_layernorm.weight``, ``experts.linear_fc1.weight<K>``). The classes here are
megatron-core modules that keep exactly those parameter names, shapes, TP/EP partitioning and
torch_dist keys, and compute what Hugging Face's Gemma 4 computes, so one checkpoint and one
mapping table serve both hosts.

Each twin is named after the TE class it stands in for, minus the ``TE`` prefix. The bridge's
mapping table states each weight's parallelism, so no build has to guess it from these names.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch import Tensor, nn

from vime_gemma4_bridge.core.layer_pattern import is_sliding_layer
from vime_gemma4_bridge.core.model import Gemma4RMSNorm, rms_norm


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """Twin of ``TELayerNormColumnParallelLinear``: Gemma 4 RMSNorm, then a column-parallel linear.

    The norm weight is ``layer_norm_weight`` (replicated), as in TE, so the HF
    ``input_layernorm`` maps to the same Megatron name on both hosts.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs) -> None:
        kwargs.pop("name", None)
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = bool(config.sequence_parallel)
        self.return_layernorm_output = False  # TE's switch: an adapter reads the norm's output (core/lora.py)

    def forward(self, input_: Tensor, **kwargs) -> tuple[Tensor, Tensor | None] | tuple[tuple[Tensor, Tensor], None]:
        normed = rms_norm(input_, self.layer_norm_weight, self.eps)
        output, bias = super().forward(normed, **kwargs)
        return ((output, normed), bias) if self.return_layernorm_output else (output, bias)


class RowParallelLinearLayerNorm(RowParallelLinear):
    """Twin of :class:`~vime_gemma4_bridge.core.te_modules.TERowParallelLinearLayerNorm`: linear, then post-norm.

    Gemma 4 normalises the attention output before the residual add; TE keeps that norm inside
    ``linear_proj`` as ``post_layernorm``, and so does this twin.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs) -> None:
        kwargs.pop("name", None)
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = Gemma4RMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def linear_forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        """The linear alone, before the post-norm (where a LoRA adds its output: core/lora.py)."""
        output, bias = super().forward(input_)
        if bias is not None:
            raise ValueError("RowParallelLinearLayerNorm requires add_bias_linear=False (post-norm before bias)")
        return output, bias

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        output, bias = self.linear_forward(input_)
        return self.post_layernorm(output), bias


def causal_window_mask(sq: int, sk: int, window: tuple[int, int] | None, device: torch.device) -> Tensor:
    """Boolean mask ``[sq, sk]`` (True = masked) of causal attention, optionally limited to ``window``.

    Same positions as megatron-core's ``get_default_causal_mask`` / ``get_sliding_window_causal_mask``
    (window ``(left, right)``: a query attends to keys ``left`` before it up to ``right`` after it,
    here never past itself), built on ``device`` instead of a hard-coded ``"cuda"``. Queries are
    the last ``sq`` of ``sk`` positions, as in megatron-core.
    """
    query_pos = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    key_pos = torch.arange(sk, device=device).unsqueeze(0)
    masked = key_pos > query_pos
    if window is not None:
        masked = masked | (query_pos - key_pos > window[0]) | (key_pos - query_pos > window[1])
    return masked


class HostDotProductAttention(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` that runs on any device, CPU included.

    Upstream's forward takes its score buffer from ``get_global_memory_buffer()`` and its
    causal / sliding-window masks from helpers that all allocate on ``"cuda"``, so it cannot run
    on a CPU host. This class computes the same function (scores ``q·kᵀ × softmax_scale``, the
    torch path of the same ``FusedScaleMaskSoftmax`` for masking and the fp32 softmax, GQA by
    repeating KV heads) with tensors on the inputs' device, and applies the layer's window itself.
    """

    #: Sliding window ``(left, right)`` of this layer, or None for full causal attention.
    host_window: tuple[int, int] | None

    def _take_over_masking(self) -> None:
        """Move the window out of the softmax (which would build its mask on CUDA) into this module."""
        self.host_window = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences and attention bias need Transformer Engine's attention")
        # [s, b, heads, d]; repeat KV groups to the query heads (GQA), as megatron-core does.
        groups = query.size(2) // key.size(2)
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        sq, batch, heads, _ = query.shape
        sk = key.size(0)
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)) * self.softmax_scale
        # A given mask (e.g. padding) is honoured together with causality and the window; upstream
        # would replace it by the window mask on sliding layers.
        mask = causal_window_mask(sq, sk, self.host_window, query.device)
        if attention_mask is not None:
            mask = mask | attention_mask.to(device=query.device, dtype=torch.bool)
        # The torch path of megatron-core's softmax (fp32 softmax, masked_fill); its fused kernels are CUDA-only.
        probs = self.scale_mask_softmax.forward_torch_softmax(scores, mask, self.softmax_offset)
        probs = self.attention_dropout(probs)
        context = torch.matmul(probs.to(value.dtype), value.permute(1, 2, 0, 3))  # [b, heads, sq, d]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * value.size(-1))


class Gemma4DotProductAttention(HostDotProductAttention):
    """Twin of :class:`~vime_gemma4_bridge.core.te_modules.Gemma4TEDotProductAttention`: windowed on sliding layers.

    Megatron-core's local attention reads the window from the config; Gemma 4 decides it per
    layer from ``layer_types`` (see :mod:`vime_gemma4_bridge.core.layer_pattern`), so each layer gets a
    config copy with the HF window ``sliding_window`` expressed as Megatron's ``(W - 1, 0)``
    (a query sees itself and the ``W - 1`` tokens before it, as in transformers). Softmax scale
    1.0 comes from the provider (Gemma 4 normalises q and k instead of scaling).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType, **kwargs) -> None:
        config = copy.copy(config)
        if is_sliding_layer(config, layer_number):
            config.window_size = (config.window_size - 1, 0)
        else:
            config.window_size = None
        config.window_attn_skip_freq = None
        kwargs.pop("cp_comm_type", None)
        super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type, **kwargs)
        self._take_over_masking()


class _GroupedLinear(nn.Module):
    """One linear per local expert, stored as ``weight0 .. weight{K-1}`` like TE's ``GroupedLinear``.

    ``TEGroupedMLP`` (megatron-core) drives it with ``forward(tokens, tokens_per_expert)`` and
    does the expert-TP communication itself, as for TE; the torch_dist layout (one ShardedTensor
    per expert on an expert axis, ``_extra_state<k>`` objects)
    mirrors ``TEGroupedLinear._sharded_state_dict_grouped`` so checkpoints move between hosts.
    """

    partition_dim: int  # 0: column-parallel (output split), 1: row-parallel (input split)

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        pg_collection,
        **unused,
    ) -> None:
        super().__init__()
        if bias:
            raise ValueError("Gemma 4 experts have no bias")
        self.config = config
        self.num_gemms = num_gemms
        self.tp_group = pg_collection.expt_tp
        self.ep_group = pg_collection.ep
        self.expt_dp_group = pg_collection.expt_dp
        tp_size = self.tp_group.size()
        if self.partition_dim == 0:
            shape = (output_size // tp_size, input_size)
        else:
            shape = (output_size, input_size // tp_size)
        for k in range(num_gemms):
            weight = nn.Parameter(torch.empty(shape, dtype=config.params_dtype))
            if config.perform_initialization:  # as megatron-core's linears: skipped when weights are read next
                init_method(weight)
            set_tensor_model_parallel_attributes(weight, True, self.partition_dim, 1)
            weight.allreduce = not is_expert
            self.register_parameter(f"weight{k}", weight)
        # torch's public hook is called with the module first: the plain function takes it as ``self``.
        self.register_load_state_dict_pre_hook(type(self)._merge_extra_states)

    def adapter_attributes(self) -> dict[str, object]:
        """What Megatron-Bridge's LoRA transform asks of a linear (its ``AdapterAttributes``), as for TE's
        grouped linears: one adapter per local expert, expert-TP split like the weights, no TP communication."""
        tp, (rows, cols) = self.tp_group.size(), self.weight0.shape
        row_parallel = self.partition_dim == 1
        return {
            "input_is_parallel": row_parallel,
            "in_features": cols * (tp if row_parallel else 1),
            "out_features": rows * (1 if row_parallel else tp),
            "disable_tensor_parallel_comm": True,
            "disable_sequence_parallel_comm": True,
            "base_linear_is_parallel": True,
        }

    def _merge_extra_states(self, state_dict: dict, prefix: str, *args: object) -> None:
        """Take the torch_dist layout's per-expert ``_extra_state1 .. _extra_state{K-1}`` in, as TE does.

        A torch_dist checkpoint stores one ``_extra_state<k>`` per expert (``sharded_state_dict``),
        while ``state_dict()`` has the single ``_extra_state``; TE's grouped linear merges the
        others in a load pre-hook (megatron-core ``TEGroupedLinear.merge_extra_states``), so a strict
        ``load_state_dict`` (Megatron-LM's ``load_checkpoint(..., strict=True)``) sees no unexpected
        key. Without FP8 there is nothing to merge: the entries are only taken out.
        """
        for k in range(1, self.num_gemms):
            state_dict.pop(f"{prefix}_extra_state{k}", None)

    def forward(self, x: Tensor, tokens_per_expert: list[int] | Tensor) -> tuple[Tensor, None]:
        splits = tokens_per_expert.tolist() if isinstance(tokens_per_expert, Tensor) else list(tokens_per_expert)
        chunks = torch.split(x, splits, dim=0)
        outputs = [torch.matmul(chunk, getattr(self, f"weight{k}").t()) for k, chunk in enumerate(chunks)]
        # No reduction over expert-TP here: like TE's grouped linears for experts
        # (``explicit_expert_comm``), the row-parallel partial sums are reduced by megatron-core's
        # token dispatcher when it combines (reduce-scatter over the TP x EP group). Reducing here
        # as well multiplied the routed output by ETP, which Gemma 4's post-MoE RMSNorm hides up to eps.
        return torch.cat(outputs, dim=0), None

    def backward_dw(self) -> None:
        """Deferred weight-gradient hook of the TE interface; nothing is deferred here."""

    def get_extra_state(self) -> Tensor:
        # TE (>= 2.0) stores an empty uint8 tensor when no FP8 metadata exists.
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: object) -> None:
        """FP8 metadata from a TE checkpoint has no meaning on a non-FP8 CPU model."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        metadata = metadata or {}
        singleton_local_shards = metadata.get("singleton_local_shards", False)
        num_global_experts = self.ep_group.size() * self.num_gemms
        offset = self.ep_group.rank() * self.num_gemms
        ep_axis = len(sharded_offsets)
        result = {}
        for k in range(self.num_gemms):
            global_idx = offset + k
            local = {f"{k}.weight": getattr(self, f"weight{k}"), f"{k}._extra_state": self.get_extra_state()}
            if singleton_local_shards:
                expert_prefix, offsets = f"{global_idx}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, global_idx, num_global_experts))
            sub = make_sharded_tensors_for_checkpoint(
                local,
                "",
                {f"{k}.weight": self.partition_dim},
                offsets,
                tp_group=self.tp_group,
                dp_cp_group=metadata.get("dp_cp_group"),
            )
            replace_prefix_for_sharding(sub, f"{k}.", expert_prefix)
            result[f"{prefix}weight{k}"] = sub[f"{k}.weight"]
            result[f"{prefix}_extra_state{'' if k == 0 else k}"] = sub[f"{k}._extra_state"]
        # Replicas of an expert live across the expert-data-parallel group: elect one writer there.
        edp_rank = self.expt_dp_group.rank() if self.expt_dp_group is not None else 0
        for sharded in result.values():
            sharded.replica_id = (*sharded.replica_id[:2], edp_rank)
        return result


class ColumnParallelGroupedLinear(_GroupedLinear):
    """Twin of ``TEColumnParallelGroupedLinear`` (experts' ``linear_fc1``: output split over ETP)."""

    partition_dim = 0


class RowParallelGroupedLinear(_GroupedLinear):
    """Twin of ``TERowParallelGroupedLinear`` (experts' ``linear_fc2``: input split over ETP)."""

    partition_dim = 1
