"""CPU-safe variants of two Megatron-Bridge mapping classes (docs/UPSTREAM.md 4).

Megatron-Bridge's ``ReplicatedMapping.hf_to_megatron`` (0.6.2 and vime's fork alike) moves the HF
tensor to ``torch.cuda.current_device()`` before the TP broadcast whenever TP > 1, which raises on
a host without a GPU driver. Everything else on the load path (PP broadcast, TP scatter, EP
gather) runs on CPU tensors over gloo. These subclasses keep upstream's behaviour for CUDA
parameters and skip only that device move for CPU parameters. ``AutoMapping`` is subclassed so
that the replicated delegate it picks at run time is the CPU-safe one.

Seam: 0.6.2 keeps the process-group collection on each mapping (``_pg_collection``) and hands it
to the delegate; the fork keeps none (its delegates read megatron-core's parallel state), so the
delegate gets the collection only where the build has one.
"""

from __future__ import annotations

import torch
from megatron.bridge.models.conversion import param_mapping
from torch import nn


class ReplicatedMapping(param_mapping.ReplicatedMapping):
    """Upstream ``ReplicatedMapping`` that also loads into CPU parameters at TP > 1."""

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: nn.Module) -> torch.Tensor:
        target = getattr(megatron_module, "weight", None)
        device = target.device if target is not None else next(megatron_module.parameters()).device
        if device.type != "cpu" or self.tp_size == 1:
            return super().hf_to_megatron(hf_weights, megatron_module)
        hf_weights = hf_weights.to(device=device)
        if self.tp_rank > 0:
            hf_weights = torch.empty_like(hf_weights)
        return self.broadcast_tensor_to_tp_ranks(hf_weights, src_rank=0)


class AutoMapping(param_mapping.AutoMapping):
    """Upstream ``AutoMapping`` whose replicated delegate is the CPU-safe :class:`ReplicatedMapping`."""

    def _get_or_create_mapping(self, parallelism_type: str) -> param_mapping.MegatronParamMapping:
        if parallelism_type != "replicated":
            return super()._get_or_create_mapping(parallelism_type)
        mapping = ReplicatedMapping(self.megatron_param, self.hf_param)
        pg_collection = getattr(self, "_pg_collection", None)
        if pg_collection is not None:
            mapping.set_process_groups_from_pg_collection(pg_collection)
        return mapping
