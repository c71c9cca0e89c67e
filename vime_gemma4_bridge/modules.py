"""CPU twins of the Transformer-Engine modules in Megatron-Bridge's Gemma 4 MoE layer spec.

Upstream's Gemma 4 MoE spec (``megatron.bridge.models.gemma.modeling_gemma4._gemma4_block_spec``)
is TE-only: its parameter names come from TE modules (``linear_qkv.layer_norm_weight``,
``linear_proj.post_layernorm.weight``, ``experts.linear_fc1.weight<K>``) and its core attention
subclasses ``TEDotProductAttention``. The classes here are megatron-core modules that keep
exactly those parameter names, shapes, TP/EP partitioning and torch_dist keys, and compute what
Hugging Face's Gemma 4 computes, so one checkpoint and one mapping table serve both hosts.

Each twin is named after the TE class it stands in for, minus the ``TE`` prefix, and registered
with Megatron-Bridge's ``AutoMapping`` so the bridge picks the same parallel mapping for both.
"""

from __future__ import annotations

import copy

import torch
from megatron.bridge.models.conversion.param_mapping import AutoMapping
from megatron.bridge.models.gemma.modeling_gemma4 import Gemma4RMSNorm, _gemma4_rms_norm
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

from vime_gemma4_bridge.layer_pattern import is_sliding_layer


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

    def forward(self, input_: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
        return super().forward(_gemma4_rms_norm(input_, self.layer_norm_weight, self.eps), **kwargs)


class RowParallelLinearLayerNorm(RowParallelLinear):
    """Twin of Megatron-Bridge's ``TERowParallelLinearLayerNorm``: row-parallel linear, then post-norm.

    Gemma 4 normalises the attention output before the residual add; TE keeps that norm inside
    ``linear_proj`` as ``post_layernorm``, and so does this twin.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs) -> None:
        kwargs.pop("name", None)
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = Gemma4RMSNorm(config, output_size, eps=config.layernorm_epsilon)

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(input_)
        if bias is not None:
            raise ValueError("RowParallelLinearLayerNorm requires add_bias_linear=False (post-norm before bias)")
        return self.post_layernorm(output), bias


class Gemma4DotProductAttention(DotProductAttention):
    """Twin of ``Gemma4TEDotProductAttention``: causal attention, sliding window on sliding layers.

    Megatron-core's local attention reads the window from the config; Gemma 4 decides it per
    layer from ``layer_types`` (see :mod:`vime_gemma4_bridge.layer_pattern`), so each layer gets a
    config copy with the HF window ``sliding_window`` expressed as Megatron's ``(W - 1, 0)``.
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


class _GroupedLinear(nn.Module):
    """One linear per local expert, stored as ``weight0 .. weight{K-1}`` like TE's ``GroupedLinear``.

    ``TEGroupedMLP`` (megatron-core) drives it with ``forward(tokens, tokens_per_expert)``; the
    torch_dist layout (one ShardedTensor per expert on an expert axis, ``_extra_state<k>`` objects)
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
            init_method(weight)
            set_tensor_model_parallel_attributes(weight, True, self.partition_dim, 1)
            weight.allreduce = not is_expert
            self.register_parameter(f"weight{k}", weight)

    def forward(self, x: Tensor, tokens_per_expert: list[int] | Tensor) -> tuple[Tensor, None]:
        splits = tokens_per_expert.tolist() if isinstance(tokens_per_expert, Tensor) else list(tokens_per_expert)
        chunks = torch.split(x, splits, dim=0)
        outputs = [torch.matmul(chunk, getattr(self, f"weight{k}").t()) for k, chunk in enumerate(chunks)]
        out = torch.cat(outputs, dim=0)
        if self.partition_dim == 1 and self.tp_group.size() > 1:
            torch.distributed.all_reduce(out, group=self.tp_group)
        return out, None

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


for _name in ("ColumnParallelGroupedLinear",):
    AutoMapping.register_module_type(_name, "column")
for _name in ("RowParallelGroupedLinear", "RowParallelLinearLayerNorm"):
    AutoMapping.register_module_type(_name, "row")
AutoMapping.register_module_type("Gemma4RMSNorm", "replicated")
AutoMapping.register_module_type("Gemma4DotProductAttention", "replicated")
