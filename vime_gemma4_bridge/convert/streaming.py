"""The plan both streaming paths share: which routed experts bypass the model, and where their bytes are.

Why shared: the streaming export (:mod:`~vime_gemma4_bridge.convert.stream_export`) and import
(:mod:`~vime_gemma4_bridge.convert.stream_import`) rest on the same fact — at TP = ETP = 1 the HF
tensor ``layers.N.experts.gate_up_proj`` [E, 2I, H] is, byte for byte, Megatron's experts
``linear_fc1.weight0 .. weight{E-1}`` one after the other — and on the same proof that a model's
experts are laid out that way (upstream's fused expert mapping, no permutation or transpose, a
sharded description that tiles each parameter in memory order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StreamedExpert", "StreamedExperts", "memory_ordered_pieces", "plan_streamed_experts", "stored_shape"]


@dataclass
class StreamedExpert:
    """One Megatron expert weight: its conversion task and the stored chunks that make it, in byte order."""

    task: Any  # Megatron-Bridge WeightConversionTask
    pieces: list[Any]  # megatron-core ShardedTensors, views of task.param_weight in memory order


@dataclass
class StreamedExperts:
    """The expert weights of one model that the export reads itself, grouped by HF tensor."""

    groups: dict[str, list[StreamedExpert]]  # HF name -> experts 0..E-1

    def modules(self) -> dict[str, list[str]]:
        """Module state-dict prefix -> torch_dist keys read for it (``load_torch_dist``'s ``streamed``)."""
        out: dict[str, set[str]] = {}
        for experts in self.groups.values():
            for expert in experts:
                module = expert.task.param_name.rpartition(".")[0]
                out.setdefault(module, set()).update(piece.key for piece in expert.pieces)
        return {module: sorted(keys) for module, keys in out.items()}


def plan_streamed_experts(
    tasks: Sequence[Any], state: Mapping[str, Any], usable: Callable[[Any], bool]
) -> StreamedExperts | None:
    """The experts to stream (none for a dense model), or ``None`` when any cannot be (then nothing is streamed).

    ``tasks`` are Megatron-Bridge's conversion tasks of a TP1/PP1/EP1 model and ``state`` its flat
    ``sharded_state_dict``. An expert streams when its mapping is upstream's fused expert mapping
    without permutation or transpose, its sharded description tiles the parameter in memory order,
    and ``usable`` accepts each such chunk (the export: it is stored as is in the checkpoint). The
    import (:mod:`~vime_gemma4_bridge.convert.stream_import`) and the export share this plan.
    """
    from megatron.bridge.models.conversion import param_mapping
    from megatron.bridge.utils.common_utils import extract_expert_number_from_param

    from vime_gemma4_bridge.compat import mappings

    plain = (
        param_mapping.FusedExpertMapping,
        param_mapping.FusedGatedExpertMapping,
        mappings.FusedGatedExpertMapping,
        mappings.RowParallelFusedExpertMapping,
    )
    groups: dict[str, dict[int, StreamedExpert]] = {}
    for task in tasks:
        mapping = task.mapping
        if not getattr(mapping, "is_grouped_export", False):
            continue
        if type(mapping) not in plain:
            return None
        if mapping.permute_dims or mapping.transpose_on_export:
            return None
        pieces = memory_ordered_pieces(state.get(task.param_name), task.param_weight)
        if pieces is None or not all(usable(piece) for piece in pieces):
            return None
        number = extract_expert_number_from_param(task.global_param_name)
        groups.setdefault(mapping.group_key, {})[number] = StreamedExpert(task, pieces)
    ordered: dict[str, list[StreamedExpert]] = {}
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            return None
        ordered[name] = [experts[i] for i in range(len(experts))]
    return StreamedExperts(ordered)  # a dense model: no experts, every weight takes the streamed path


def stored_shape(piece: Any) -> tuple[int, ...]:
    """Shape of a ShardedTensor's chunk as stored: its local shape behind a 1 per prepended (layer/expert) axis."""
    return (1,) * piece.prepend_axis_num + tuple(piece.local_shape)


def memory_ordered_pieces(entry: Any, param: torch.Tensor | None) -> list[Any] | None:
    """The ShardedTensors of ``entry`` if, in memory order, they are ``param``'s bytes exactly once."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if param is None or not param.is_contiguous():
        return None
    if isinstance(entry, ShardedTensorFactory):
        built = list(nested_values(entry.build()))
    elif isinstance(entry, ShardedTensor):
        built = [entry]
    else:
        return None
    pieces = sorted(built, key=lambda p: p.data.data_ptr() if isinstance(p, ShardedTensor) else -1)
    cursor, itemsize = param.data_ptr(), param.element_size()
    for piece in pieces:
        if (
            not isinstance(piece, ShardedTensor)
            or piece.flattened_range is not None
            or not piece.data.is_contiguous()
            or tuple(piece.data.shape) != tuple(piece.local_shape)
            or piece.data.data_ptr() != cursor
        ):
            return None
        cursor += piece.data.numel() * itemsize
    return pieces if cursor == param.data_ptr() + param.numel() * itemsize else None
