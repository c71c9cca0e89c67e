"""``export`` at the default topology: the routed experts stream from torch_dist to HF shards.

Why: 90% of Gemma 4 26B-A4B's bytes are routed experts, and the general export path handles each
of them five times — megatron-core's load plan (quadratic in the chunks of a key: 7,680 expert
chunks per key at 26B), a copy into the model, Megatron-Bridge's per-expert gate/up split and
re-concatenation, its stack of 128 experts, and the shard write — while holding the whole model
and the whole HF checkpoint in memory (52 GB each at 26B). torch_dist stores *global* tensors,
so with one tensor-parallel rank (TP = ETP = 1) no resharding is involved at all, and the HF
tensor ``layers.N.experts.gate_up_proj`` [E, 2I, H] is, byte for byte, Megatron's experts
``linear_fc1.weight0 .. weight{E-1}`` one after the other, as stored in the torch_dist files.

So, when the checkpoint's expert chunks are whole experts (saved at ETP = 1, any TP/PP/EP):

* the Megatron model is built at TP1 *without* random initialisation (its expert weights are
  never touched, so they cost address space, not memory);
* every non-expert weight (attention, dense MLP, norms, router, embedding: ~10% of the bytes) is
  exported by Megatron-Bridge's own conversion tasks: when the checkpoint stores it whole (saved at
  TP = 1), one layer's weights at a time, assembled from their stored chunks as the HF writer
  reaches them (:meth:`ExportPlan.lazy_tensors`: the model is never filled); otherwise loaded by
  megatron-core's ``dist_checkpointing.load`` first, as in the general path;
* each expert weight is read from its torch_dist chunk(s) and written straight into the HF shard
  (:class:`~vime_gemma4_bridge.io.hf.LazyTensor`), one expert in memory at a time.

Which bytes belong to which expert, and where they are stored, comes from the model's own
``sharded_state_dict`` (the same description megatron-core saves and loads with); that the HF
tensor is the stack of the Megatron weights is Megatron-Bridge's ``FusedGatedExpertMapping`` /
``FusedExpertMapping`` at TP = ETP = 1, and is *checked* on every run: expert 0 of every layer
goes through the mapping and must come out bit-identical. Anything else — experts split over ETP
in the checkpoint, another mapping class, permuted or transposed experts — is not streamed:
:func:`~vime_gemma4_bridge.convert.streaming.plan_streamed_experts` returns ``None`` and ``export``
takes the general path.
Gap recorded in docs/UPSTREAM.md (grouped expert export copies every expert three times).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.convert.streaming import (
    StreamedExpert,
    StreamedExperts,
    memory_ordered_pieces,
    plan_streamed_experts,
    stored_shape,
)
from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.io.hf import SAFETENSORS_DTYPES, TORCH_DTYPES, LazyTensor
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError, refuse_unused_keys, sharded_state_dict
from vime_gemma4_bridge.io.torch_dist_reader import TorchDistReader

__all__ = ["ExportPlan", "plan_export", "streamed_export_tensors"]


@dataclass
class ExportPlan:
    """What the streaming export reads itself and what Megatron-Bridge exports.

    ``direct`` is set when every other weight is stored as whole chunks too (the checkpoint was
    saved at TP = ETP = 1, any PP/EP): then those are read straight from their chunks as well, and
    megatron-core's loader — its planning is most of an export at small sizes — is not needed.
    """

    experts: StreamedExperts
    other_tasks: list[Any]  # Megatron-Bridge WeightConversionTasks of every non-expert weight
    direct: dict[str, list[Any]] | None  # parameter name -> its ShardedTensors in memory order

    def check_direct(self, reader: TorchDistReader) -> None:
        """Refuse a checkpoint holding tensors this model does not use (nothing is read)."""
        assert self.direct is not None
        used = {piece.key for pieces in self.direct.values() for piece in pieces}
        used.update(key for keys in self.experts.modules().values() for key in keys)
        refuse_unused_keys(key for key in reader.tensor_keys() if key not in used)

    def lazy_tensors(
        self, bridge: Any, model: list[torch.nn.Module], reader: TorchDistReader, signature: Mapping[str, Any]
    ) -> dict[str, LazyTensor]:
        """HF name -> lazily exported non-expert tensor, one layer's weights in memory at a time.

        Each layer's (or the embedding's, the final norm's) tasks run through Megatron-Bridge's own
        export when the writer reaches the first of their HF tensors, on weights assembled from
        their stored chunks (``dataclasses.replace(task, param_weight=...)``: the model's own weights
        are never filled), and their outputs are dropped as they are written. So an export holds one
        layer's non-expert weights, whatever the number of layers. ``signature`` is the source's
        ``{name: (shape, dtype)}``; a produced tensor of another shape or dtype is refused.
        """
        assert self.direct is not None
        groups: dict[str, list[Any]] = {}
        owner: dict[str, str] = {}
        for task in self.other_tasks:
            match = re.match(r"decoder\.layers\.(\d+)\.", task.param_name)
            key = match.group(1) if match else task.param_name
            groups.setdefault(key, []).append(task)
            hf_param = task.mapping.hf_param
            for name in hf_param.values() if isinstance(hf_param, dict) else [hf_param]:
                if name in signature:
                    owner[name] = key
        ready: dict[str, dict[str, torch.Tensor]] = {}

        def produce(key: str) -> dict[str, torch.Tensor]:
            tasks = [dataclasses.replace(task, param_weight=self._assembled(task, reader)) for task in groups[key]]
            return {name: tensor for name, tensor in _export(bridge, model, tasks) if owner.get(name) == key}

        def pieces(name: str) -> Callable[[], Iterator[torch.Tensor]]:
            def one() -> Iterator[torch.Tensor]:
                key = owner[name]
                batch = ready.get(key)
                if batch is None:
                    batch = ready[key] = produce(key)
                tensor = batch.pop(name, None)
                done = not batch
                if done:
                    del ready[key]
                shape, dtype = signature[name]
                if tensor is None or list(tensor.shape) != list(shape) or SAFETENSORS_DTYPES[tensor.dtype] != dtype:
                    got = (
                        "nothing" if tensor is None else f"{SAFETENSORS_DTYPES.get(tensor.dtype)} {list(tensor.shape)}"
                    )
                    raise ConversionError(f"export of {name} produced {got}, the source has {dtype} {list(shape)}")
                yield tensor
                if done:  # written: the group's stored chunks may leave this process (the page cache keeps them)
                    for task in groups[key]:
                        for piece in self.direct[task.param_name]:
                            reader.release(piece.key, piece.global_offset)

            return one

        return {
            name: LazyTensor(tuple(signature[name][0]), TORCH_DTYPES[signature[name][1]], pieces(name))
            for name in owner
        }

    def _assembled(self, task: Any, reader: TorchDistReader) -> torch.Tensor:
        """``task``'s weight from its stored chunks; the model's own weight stays untouched.

        A weight stored as one chunk is that chunk, in place in the memory-mapped file (no copy);
        one stored as several (gate/up halves) is copied into a tensor of its own.
        """
        assert self.direct is not None
        pieces = self.direct[task.param_name]
        if len(pieces) == 1:
            piece = pieces[0]
            return reader.read(piece.key, piece.global_offset, stored_shape(piece)).view(task.param_weight.shape)
        weight = torch.empty_like(task.param_weight, memory_format=torch.contiguous_format)
        flat, start = weight.view(-1), 0
        for piece in pieces:
            count = piece.data.numel()
            flat[start : start + count].copy_(reader.read(piece.key, piece.global_offset, stored_shape(piece)).view(-1))
            start += count
        return weight


def _export(bridge: Any, model: list[torch.nn.Module], tasks: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge's export of ``tasks`` on this rank alone (TP1·PP1·EP1: no collective is involved)."""
    for item in bridge.export_hf_weights(model, cpu=True, show_progress=False, conversion_tasks=tasks):
        yield item[0], item[1]  # the fork's build yields a third field (the Megatron name)


def plan_export(bridge: Any, model: list[torch.nn.Module], reader: TorchDistReader) -> ExportPlan | None:
    """The streaming plan for a one-chunk TP1 model built from ``bridge`` (an ``AutoBridge``), or ``None``."""
    if len(model) != 1:
        return None
    model_bridge = seams.model_bridge_of(bridge)  # the registered Gemma 4 bridge
    tasks = [task for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, model) if task is not None]
    state = sharded_state_dict(model, stored=set(reader.tensor_keys()))[0]["model"]
    experts = plan_streamed_experts(tasks, state, lambda piece: _stored_as_is(piece, reader))
    if experts is None:
        return None
    grouped = {id(expert.task) for group in experts.groups.values() for expert in group}
    others = [task for task in tasks if id(task) not in grouped]
    direct: dict[str, list[Any]] | None = {}
    for task in others:
        pieces = memory_ordered_pieces(state.get(task.param_name), task.param_weight)
        if pieces is None or not all(_stored_as_is(piece, reader) for piece in pieces):
            direct = None
            break
        direct[task.param_name] = pieces
    covered = set(direct or ()) | {expert.task.param_name for group in experts.groups.values() for expert in group}
    if direct is not None and {name for name, _ in model[0].named_parameters()} - covered:
        direct = None  # a weight without a task of its own (none in Gemma 4): leave it to megatron-core
    return ExportPlan(experts, others, direct)


def _stored_as_is(piece: Any, reader: TorchDistReader) -> bool:
    """The checkpoint holds exactly this ShardedTensor's chunk, with its global shape and dtype."""
    return reader.has(piece.key, piece.global_shape, piece.global_offset, stored_shape(piece)) and (
        reader.dtype(piece.key) == piece.dtype
    )


def streamed_export_tensors(experts: StreamedExperts, reader: TorchDistReader) -> dict[str, LazyTensor]:
    """HF name -> lazily written stack of its experts, after proving the stack is the mapping's output.

    The proof, per HF tensor: expert 0 is read into its Megatron parameter and converted by its own
    Megatron-Bridge mapping; the result must be exactly that parameter under exactly that HF name.
    """
    out: dict[str, LazyTensor] = {}
    for name, group in experts.groups.items():
        first = group[0]
        param = first.task.param_weight
        with torch.no_grad():
            for piece in first.pieces:
                stored = reader.read(piece.key, piece.global_offset, stored_shape(piece))
                piece.data.copy_(stored.view(piece.data.shape))
        converted = first.task.mapping.megatron_to_hf(param, first.task.megatron_module)
        if list(converted) != [name] or not same_bytes(converted[name], param):
            raise ConversionError(
                f"Megatron-Bridge's mapping of {first.task.param_name} is not a plain stack of experts "
                f"(got {sorted(converted)}); export with an explicit topology (e.g. --tp 1 --ep 1) instead"
            )
        out[name] = LazyTensor((len(group), *param.shape), param.dtype, _pieces(group, reader))
    return out


def _pieces(group: list[StreamedExpert], reader: TorchDistReader) -> Callable[[], Iterator[torch.Tensor]]:
    def pieces() -> Iterator[torch.Tensor]:
        for expert in group:
            for piece in expert.pieces:
                yield reader.read(piece.key, piece.global_offset, stored_shape(piece))
                # The writer has written it and holds no reference: let its pages go from this process.
                reader.release(piece.key, piece.global_offset)

    return pieces
