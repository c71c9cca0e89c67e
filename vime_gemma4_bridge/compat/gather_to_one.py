"""Megatron-Bridge's export delivered to one consuming rank (docs/UPSTREAM.md 60, 61).

Megatron-Bridge's export (``stream_weights_megatron_to_hf``, 0.6.2) broadcasts every weight over
PP (``MegatronParamMapping.broadcast_from_pp_rank``, param_mapping.py L346), all-gathers it over
TP / ETP (``gather_from_tp_ranks``, L618) and over EP (``gather_from_ep_ranks``, L727): every rank
of the world holds every full tensor, twice for a moment. That is what vime's weight sync needs
(each rank pushes to its own rollout engine), but a command whose only consumer is one rank
(``roundtrip`` compares on rank 0, ``export`` and ``export-live`` write there) pays it on every
rank: at 26B-A4B's widths on 8 ranks, about 43 GB for a 24 GB host.

:func:`gathered_to` swaps those three methods on ``MegatronParamMapping`` for the duration of such
a command's export only (restored on exit, never entered by vime's sync or the bridge for other
models): the same collectives' data flow, delivered to the ranks that feed the consumer:

* PP: the owning stage sends its shard to the consumer's stage only (``send`` / ``recv``);
* TP / ETP: the shards are gathered (``dist.gather``) to the one member that feeds the consumer:
  the consumer itself, or, for an expert weight, the member of the consumer's EP group;
* EP: the build's own ``gather_from_ep_ranks`` (its expert names and stacking), its ``all_gather``
  made a gather to the consumer for the span of that call.

Every other rank gets shape-only (``meta``) tensors of the same shapes and dtypes, so the rest of
the export (splits, concatenations, the expert stacks, the tied and padding hooks) runs unchanged
and costs nothing there. The consumer's tensors are upstream's, byte for byte: tests/test_memory.py
compares them with upstream's export at TP2·PP2·EP2·ETP2 and TP2·PP2·VPP2·EP4, and round-trips 26B-A4B's
published widths at TP2·PP2·EP4 on 8 ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vime_gemma4_bridge.compat.cuda import on_host

__all__ = ["gathered_to"]

_METHODS = ("broadcast_from_pp_rank", "gather_from_tp_ranks", "gather_from_ep_ranks")


@dataclass(frozen=True)
class _Consumer:
    """The consuming rank, its pipeline stage and its expert-parallel group (global ranks)."""

    rank: int
    stage: int
    ep_ranks: frozenset[int]


_active: _Consumer | None = None
_originals: dict[str, Any] = {}  # the build's own methods, while swapped


@contextlib.contextmanager
def gathered_to(rank: int) -> Iterator[bool]:
    """Within this block, Megatron-Bridge's export delivers to global ``rank`` alone (collective: every rank enters).

    Yields whether this rank receives the export's tensors: export with ``cpu=`` that value, since the
    other ranks' tensors are shape-only and cannot be copied.
    A build whose ``MegatronParamMapping`` does not define the three methods itself (feature detection;
    0.6.2 and vime's fork both do) keeps its own export: correct, at upstream's memory.
    """
    global _active
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping
    from megatron.core import parallel_state

    if _active is not None:
        raise RuntimeError("gathered_to is already active in this process")
    if not all(callable(MegatronParamMapping.__dict__.get(name)) for name in _METHODS):
        yield True  # a build without these seams: its own export, every rank getting every tensor
        return
    box = [
        (parallel_state.get_pipeline_model_parallel_rank(), _ranks(parallel_state.get_expert_model_parallel_group()))
    ]
    dist.broadcast_object_list(box, src=rank)
    stage, ep_ranks = box[0]
    _originals.update({name: MegatronParamMapping.__dict__[name] for name in _METHODS})
    _active = _Consumer(rank, stage, frozenset(ep_ranks))
    MegatronParamMapping.broadcast_from_pp_rank = _to_consumer_stage
    MegatronParamMapping.gather_from_tp_ranks = _tp_gathered_to_consumer
    MegatronParamMapping.gather_from_ep_ranks = _ep_gathered_to_consumer
    try:
        yield dist.get_rank() == rank
    finally:
        for name, method in _originals.items():
            setattr(MegatronParamMapping, name, method)
        _originals.clear()
        _active = None


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _spec(tensor: torch.Tensor | None) -> tuple | None:
    """Upstream's PP tensor spec: shape, dtype and the two TP attributes (``None`` where the stage holds none)."""
    if tensor is None:
        return None
    return (
        tensor.shape,
        tensor.dtype,
        getattr(tensor, "tensor_model_parallel", None),
        getattr(tensor, "partition_dim", None),
    )


def _with_spec(spec: tuple, device: str) -> torch.Tensor:
    """An uninitialised tensor of ``spec`` on ``device``, carrying its TP attributes as upstream's PP broadcast does."""
    shape, dtype, tensor_parallel, partition_dim = spec
    out = torch.empty(shape, dtype=dtype, device=device)
    for attribute, value in (("tensor_model_parallel", tensor_parallel), ("partition_dim", partition_dim)):
        if value is not None:
            setattr(out, attribute, value)
    return out


def _shape_only(like: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor with ``like``'s shape, dtype and TP attributes."""
    return _with_spec(_spec(like), "meta")


def _to_consumer_stage(self: Any, tensor: torch.Tensor | None, cache_key: str | None = None) -> torch.Tensor:
    """``broadcast_from_pp_rank`` delivering to the consumer's stage: the first owning stage sends there.

    The source is upstream's (the lowest stage that holds the weight: tied embeddings are held twice);
    the stages' specs are exchanged and cached as upstream does (``_tensor_spec_output_cache``).
    """
    consumer = _active
    assert consumer is not None
    if self.pp_size == 1:
        return tensor
    cache = self.__dict__.setdefault("_tensor_spec_output_cache", {})
    specs = cache.get(cache_key) if cache_key is not None else None
    if specs is None:
        specs = [None] * self.pp_size
        dist.all_gather_object(specs, _spec(tensor), group=self.pp_group)
        cache[cache_key] = specs
    source = next((stage for stage, spec in enumerate(specs) if spec is not None), None)
    if source is None:
        raise ValueError(f"{self.megatron_param}: no pipeline stage holds this weight")
    here = self.pp_rank
    if here == consumer.stage and here != source:
        # on the host (gloo ranks, even beside a GPU) send and recv take CPU tensors: compat.cuda.on_host
        received = _with_spec(specs[source], "cpu" if on_host() else "cuda")
        dist.recv(received, src=dist.get_global_rank(self.pp_group, source), group=self.pp_group)
        return received
    if here == source and here != consumer.stage:
        dist.send(tensor.contiguous(), dst=dist.get_global_rank(self.pp_group, consumer.stage), group=self.pp_group)
    return tensor if here in (source, consumer.stage) else _with_spec(specs[source], "meta")


def _feeding_member(group: Any, expert: bool) -> int | None:
    """The global rank of ``group`` whose gathered value reaches the consumer, or ``None``.

    A TP group feeds the consumer through the consumer itself; an expert TP group through the member
    that is in the consumer's EP group (that member's value is EP-gathered to the consumer next; expert
    TP and EP groups meet in one rank at most).
    """
    consumer = _active
    assert consumer is not None
    members = _ranks(group)
    if consumer.rank in members:
        return consumer.rank
    return next((member for member in members if expert and member in consumer.ep_ranks), None)


def _gathered(tensor: torch.Tensor, group: Any, size: int, destination: int | None) -> list[torch.Tensor]:
    """``tensor`` from every member of ``group``, in member order, on ``destination`` only; shape-only elsewhere."""
    if destination is None:
        return [_shape_only(tensor) for _ in range(size)]
    if dist.get_rank() != destination:
        dist.gather(tensor.contiguous(), None, dst=destination, group=group)
        return [_shape_only(tensor) for _ in range(size)]
    gathered = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(size)]
    dist.gather(tensor.contiguous(), gathered, dst=destination, group=group)
    return gathered


def _tp_gathered_to_consumer(self: Any, tensor: torch.Tensor) -> list[torch.Tensor]:
    """``gather_from_tp_ranks`` gathering to the member that feeds the consumer (list in TP-rank order)."""
    if self.tp_size == 1:
        return [tensor]
    return _gathered(tensor, self.tp_group, self.tp_size, _feeding_member(self.tp_group, expert=self.is_expert))


def _ep_gathered_to_consumer(
    self: Any, megatron_weights: torch.Tensor, megatron_module: Any, hf_param_name: Any
) -> dict[str, torch.Tensor]:
    """The build's own ``gather_from_ep_ranks`` (its expert names and stacking, whatever they are), its one
    ``all_gather`` made a ``dist.gather`` to the consumer for the span of the call.

    The consumer's method gets its real weight and fills its list; the others' get a shape-only one
    (so their lists, stacks and names cost nothing) and send their real weight from here.
    """
    consumer = _active
    assert consumer is not None
    original = _originals["gather_from_ep_ranks"]
    if self.ep_size == 1:
        return original(self, megatron_weights, megatron_module, hf_param_name)
    destination = consumer.rank if consumer.rank in _ranks(self.ep_group) else None
    receives = dist.get_rank() == destination

    def gather_to_consumer(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, **_: Any) -> None:
        if destination is not None:
            dist.gather(megatron_weights.contiguous(), tensor_list if receives else None, dst=destination, group=group)

    all_gather, dist.all_gather = dist.all_gather, gather_to_consumer
    try:
        weights = megatron_weights if receives else _shape_only(megatron_weights)
        return original(self, weights, megatron_module, hf_param_name)
    finally:
        dist.all_gather = all_gather
