"""Variants of Megatron-Bridge mapping classes: CPU-safe, parallelism stated, copy-free (docs/UPSTREAM.md 5, 26, 29).

Megatron-Bridge's ``ReplicatedMapping.hf_to_megatron`` (0.6.2 and vime's fork alike) moves the HF
tensor to ``torch.cuda.current_device()`` before the TP broadcast whenever TP > 1, which raises on
a host without a GPU driver. Everything else on the load path (PP broadcast, TP scatter, EP
gather) runs on CPU tensors over gloo. These subclasses keep upstream's behaviour for CUDA
parameters and skip only that device move for CPU parameters. ``AutoMapping`` is subclassed so
that the replicated delegate it picks at run time is the CPU-safe one.

Seam: 0.6.2 keeps the process-group collection on each mapping (``_pg_collection``) and hands it
to the delegate; the fork keeps none (its delegates read megatron-core's parallel state), so the
delegate gets the collection only where the build has one.

Parallelism stated, not guessed: ``AutoMapping`` picks column / row / replicated from the
module's class name, and builds disagree on the rule (0.6.2 treats any class whose name contains
``LayerNormColumnParallelLinear`` as a fused norm + column linear; vime's fork matches two exact
TE class names only, so a CPU twin of that module falls to its "Norm in the name -> replicated"
rule and the TP>1 load calls CUDA). The plugin's own modules therefore never go through that
guess: every mapping class of their table states it (:class:`StatedParallelism`), the composite
ones included (QKV's TP delegate, the experts' ``linear_fc1`` / ``linear_fc2``).

``FusedGatedExpertMapping`` exports an expert's ``linear_fc1`` by splitting it into gate and up
halves, gathering each over ETP and EP, and concatenating them again: two copies of every expert
even when nothing is gathered. With the whole expert on this rank (ETP = EP = PP = 1) the
concatenation is the weight itself, so the variant hands the weight over as is; the grouped
export then copies it once, into its layer's stacked tensor. Anything else (a gather, a quantized
weight, permuted dims) takes upstream's path. The parallel sizes come from megatron-core's parallel
state, which every build keeps (the fork's mappings hold no process groups of their own).

Every class here, and every delegate one of them builds (``AutoMapping``'s column / row / replicated
mapping, the experts' gated mapping), is a :class:`~vime_gemma4_bridge.compat.gather_to_one.ToOneConsumer`:
inside ``gathered_to`` its export collectives deliver to one rank; outside, they are upstream's.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from megatron.bridge.models.conversion import param_mapping
from torch import nn

from vime_gemma4_bridge.compat.gather_to_one import ToOneConsumer, receives_one_consumer_export


class ReplicatedMapping(ToOneConsumer, param_mapping.ReplicatedMapping):
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


class ColumnParallelMapping(ToOneConsumer, param_mapping.ColumnParallelMapping):
    """Upstream ``ColumnParallelMapping``, the column delegate of the plugin's ``AutoMapping`` classes.

    For one consumer (``gather_to_one.gathered_to``) a non-expert weight's TP shards are received into
    the full tensor in place (:meth:`~vime_gemma4_bridge.compat.gather_to_one.ToOneConsumer.gather_rows_to_one`)
    instead of gathered into a list that upstream then concatenates (docs/UPSTREAM.md 73). The steps
    around it are upstream's, in its order (param_mapping.py L1029-1053 at 0.6.2: the PP broadcast,
    ``maybe_dequantize`` where the build has it, the gather); an expert weight (its EP gather follows),
    a single TP rank, and every export outside ``gathered_to`` take upstream's method. The commands
    that enter ``gathered_to`` build their models without FSDP.
    """

    def megatron_to_hf(
        self, megatron_weights: torch.Tensor | None, megatron_module: nn.Module | None
    ) -> dict[str, torch.Tensor]:
        if not receives_one_consumer_export() or self.tp_size == 1 or self.is_expert:
            return super().megatron_to_hf(megatron_weights, megatron_module)
        megatron_weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if megatron_weights is None:
            return {}
        dequantize = getattr(self, "maybe_dequantize", None)
        if dequantize is not None:
            megatron_weights = dequantize(megatron_weights)
        return {str(self.hf_param): self.gather_rows_to_one(megatron_weights)}


class RowParallelMapping(ToOneConsumer, param_mapping.RowParallelMapping):
    """Upstream ``RowParallelMapping``, the row delegate of the plugin's ``AutoMapping`` classes."""


class GatedMLPMapping(ToOneConsumer, param_mapping.GatedMLPMapping):
    """Upstream ``GatedMLPMapping`` (the dense MLP's and the shared expert's fused gate and up projections)."""


class OwnDelegates:
    """Mixin for an ``AutoMapping`` (or subclass): the delegate it builds at run time is the plugin's class.

    Upstream's ``_get_or_create_mapping`` builds upstream's column / row / replicated mapping, whose
    export collectives the one-consumer export could not take over, and whose replicated load moves
    a CPU parameter to CUDA. Seam: 0.6.2 keeps the process-group collection on each mapping
    (``_pg_collection``) and hands it to the delegate; the fork keeps none.
    """

    _delegates: ClassVar[dict[str, type]] = {
        "column": ColumnParallelMapping,
        "row": RowParallelMapping,
        "replicated": ReplicatedMapping,
    }

    def _get_or_create_mapping(self, parallelism_type: str) -> param_mapping.MegatronParamMapping:
        if parallelism_type not in self._delegates:
            return super()._get_or_create_mapping(parallelism_type)
        mapping = self._delegates[parallelism_type](self.megatron_param, self.hf_param)
        pg_collection = getattr(self, "_pg_collection", None)
        if pg_collection is not None:
            mapping.set_process_groups_from_pg_collection(pg_collection)
        return mapping


class AutoMapping(OwnDelegates, ToOneConsumer, param_mapping.AutoMapping):
    """Upstream ``AutoMapping`` whose delegates are the plugin's (CPU-safe, deliverable to one consumer)."""


class StatedParallelism:
    """Mixin for an ``AutoMapping`` (or subclass): its parallelism is the class's ``parallelism``, never detected."""

    parallelism: ClassVar[str]

    def _detect_parallelism_type(self, module: nn.Module) -> str:
        return self.parallelism


class StatedAutoMapping(StatedParallelism, AutoMapping):
    """An ``AutoMapping`` whose parallelism the mapping table states, never guessed from a class name.

    Still an ``AutoMapping`` for everything else upstream does with one (the registry's aliases
    for separate-norm names, ``permute_dims``, its PP broadcast of the type on export).
    """


class ReadsOwnSlice:
    """Mixin for a stated column / row mapping of the table (the load hands it the HF tensor on every
    TP rank): each rank narrows the HF tensor to its own slice; nothing is scattered.

    Upstream's ``ColumnParallelMapping`` / ``RowParallelMapping.hf_to_megatron`` (param_mapping.py
    L962 / L1132 at 0.6.2) have TP rank 0 split the whole HF tensor and scatter the parts, each rank
    receiving its part into a buffer of its own before the load copies it into the parameter. The
    load's HF tensors are memory-mapped (safetensors' ``get_tensor``: a page costs memory once
    read), so rank 0 read every byte: 26B-A4B's 1.48 GB embedding put the TP-rank-0 ranks at 2.5x
    their shard over their idle RSS. A narrowed view is copied into the parameter by the load, which
    reads this rank's pages alone. Upstream's path where a slice would not be exact (padded
    vocabulary rows, a permutation, a CUDA parameter, a tensor without the split dimension): every
    TP rank decides alike, from shapes and devices they share (docs/UPSTREAM.md 72).
    """

    parallelism: ClassVar[str]

    def hf_to_megatron(self, hf_weights: torch.Tensor, megatron_module: nn.Module) -> torch.Tensor:
        own = self._own_slice(hf_weights, megatron_module)
        return super().hf_to_megatron(hf_weights, megatron_module) if own is None else own

    def _own_slice(self, hf_weights: torch.Tensor | None, megatron_module: nn.Module) -> torch.Tensor | None:
        from megatron.bridge.models.conversion.utils import get_module_and_param_from_name

        if hf_weights is None or self.tp_size == 1 or getattr(self, "permute_dims", None) is not None:
            return None
        _, target = get_module_and_param_from_name(
            megatron_module, self._normalize_expert_param_name(self.megatron_param)
        )
        dim = {"column": 0, "row": 1}[self.parallelism]
        if target.device.type != "cpu" or hf_weights.dim() != target.dim() or hf_weights.dim() <= dim:
            return None
        part = target.shape[dim]
        if hf_weights.shape[dim] != part * self.tp_size:
            return None
        return hf_weights.narrow(dim, self.tp_rank * part, part).to(target.dtype)


class ColumnParallel(ReadsOwnSlice, StatedAutoMapping):
    """Split along the output dimension (dim 0) over TP: column-parallel linears, the vocab-parallel embedding."""

    parallelism = "column"


class RowParallel(ReadsOwnSlice, StatedAutoMapping):
    """Split along the input dimension (dim 1) over TP: row-parallel linears."""

    parallelism = "row"


class _ColumnDelegate(StatedAutoMapping):
    """Column-parallel by statement, scattered from TP rank 0 as upstream does: the delegate of a mapping
    that builds the HF tensor on TP rank 0 alone (QKV merges there), so no other rank could slice it."""

    parallelism = "column"


class Replicated(StatedAutoMapping):
    """The same tensor on every TP rank: norms, the router, scalars."""

    parallelism = "replicated"


class ColumnParallelQKVMapping(ToOneConsumer, param_mapping.QKVMapping):
    """Upstream ``QKVMapping`` whose TP delegate is column-parallel by statement (a fused QKV always is).

    Upstream delegates to an ``AutoMapping`` that detects the parallelism from the module's class
    name, which differs between builds (module docstring). HF layers without ``v_proj`` (k_eq_v) or
    without k/v (KV sharing) are allowed: the bridge's hooks supply and drop those projections.
    """

    def __init__(self, megatron_param: str, q: str, k: str, v: str) -> None:
        super().__init__(megatron_param, q=q, k=k, v=v)
        self.allow_hf_name_mismatch = True
        self._tp_mapping = _ColumnDelegate(megatron_param, megatron_param)


class RowParallelFusedExpertMapping(StatedParallelism, OwnDelegates, ToOneConsumer, param_mapping.FusedExpertMapping):
    """Upstream ``FusedExpertMapping`` for a row-parallel expert weight (``linear_fc2``), stated, not detected."""

    parallelism = "row"


class _GatedExpertDelegate(ToOneConsumer, param_mapping._LooseGatedMLPMapping):
    """Upstream's gated delegate of ``FusedGatedExpertMapping`` (name validation loosened for expert names)."""


class FusedGatedExpertMapping(StatedParallelism, ToOneConsumer, param_mapping.FusedGatedExpertMapping):
    """Upstream ``FusedGatedExpertMapping`` without the split and re-concatenation when nothing is gathered.

    Column-parallel by statement: upstream converts through its gated delegate, but the class is
    an ``AutoMapping`` and a build that fell back to detection must not guess.
    """

    parallelism = "column"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # upstream's __init__ builds its gated delegate as param_mapping.py L2981-2985 (0.6.2) does here
        self._gated_mapping = _GatedExpertDelegate(
            megatron_param=self.megatron_param, gate=f"{self.hf_param}.gate", up=f"{self.hf_param}.up"
        )

    def megatron_to_hf(
        self, megatron_weights: torch.Tensor | None, megatron_module: nn.Module | None
    ) -> dict[str, torch.Tensor]:
        if (
            megatron_weights is not None
            and type(megatron_weights) in (torch.Tensor, nn.Parameter)
            and not getattr(self, "permute_dims", None)
            and _whole_experts_here()
        ):
            return {self.hf_param: megatron_weights.detach()}
        if receives_one_consumer_export() and self.tp_size == 1 and not getattr(self, "permute_dims", None):
            return self._whole_to_one(megatron_weights, megatron_module)
        return super().megatron_to_hf(megatron_weights, megatron_module)

    def _whole_to_one(
        self, megatron_weights: torch.Tensor | None, megatron_module: nn.Module | None
    ) -> dict[str, torch.Tensor]:
        """At ETP = 1, for one consumer: the expert's ``[gate; up]`` weight gathered whole over PP and EP.

        Upstream (param_mapping.py L2679-2724 and L3023-3041 at 0.6.2) splits it into gate and up
        (``torch.chunk``: at ETP = 1 each expert's fc1 is ``[gate; up]``), gathers each over EP, stacks
        each and concatenates them back: three copies of the layer's fc1 bytes on the consumer.
        Gathering the whole weight gives the same tensor under the same name with none of them. The
        condition is the same on every rank (the collectives must match); a stage that holds no
        expert receives it, as upstream's gated delegate does.
        """
        weights = self.broadcast_from_pp_rank(megatron_weights, cache_key=str(self.hf_param))
        if weights is None:
            return {}
        dequantized = getattr(self, "maybe_dequantize", lambda tensor: tensor)(weights)  # not in every build
        return self.gather_from_ep_ranks(dequantized, megatron_module, self.hf_param)


def _whole_experts_here() -> bool:
    """Every expert weight is whole on this rank and no pipeline stage needs it broadcast (ETP = EP = PP = 1)."""
    from megatron.core import parallel_state

    return (
        parallel_state.get_expert_tensor_parallel_world_size() == 1
        and parallel_state.get_expert_model_parallel_world_size() == 1
        and parallel_state.get_pipeline_model_parallel_world_size() == 1
    )
