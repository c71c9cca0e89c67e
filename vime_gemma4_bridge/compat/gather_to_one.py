"""Megatron-Bridge's export delivered to one consuming rank, by the plugin's own mapping classes (UPSTREAM 60, 61).

Megatron-Bridge's export (``stream_weights_megatron_to_hf``, 0.6.2) broadcasts every weight over
PP (``MegatronParamMapping.broadcast_from_pp_rank``, param_mapping.py L346), all-gathers it over
TP / ETP (``gather_from_tp_ranks``, L618) and over EP (``gather_from_ep_ranks``, L727): every rank
of the world holds every full tensor, twice for a moment. That is what vime's weight sync needs
(each rank pushes to its own rollout engine), but a command whose only consumer is one rank
(``roundtrip`` compares on rank 0, ``export`` and ``export-live`` write there) pays it on every
rank: at 26B-A4B's widths on 8 ranks, about 43 GB for a 24 GB host.

:class:`ToOneConsumer` is a mixin of the plugin's mapping classes (compat/mappings.py, the only
mappings the Gemma 4 bridge builds): inside :func:`gathered_to`, a ``ContextVar`` the job enters,
its three collectives deliver to the ranks that feed the consumer; outside it (vime's and miles'
sync, every other model's bridge) they are upstream's, untouched. Nothing of upstream is replaced:

* PP: the owning stage sends its shard to the consumer's stage only (``send`` / ``recv``; the
  buffer where :func:`~vime_gemma4_bridge.compat.cuda.on_host` says: gloo takes CPU tensors only);
* TP / ETP: the shards are gathered (point to point) to the one member that feeds the consumer:
  the consumer itself, or, for an expert weight, the member of the consumer's EP group; its own
  shard is not copied, and a column-parallel weight's shards are received into the full tensor in
  place (compat/mappings.ColumnParallelMapping);
* EP: upstream's naming of the gathered experts (param_mapping.py L727-819: ``num_experts_per_rank``
  broadcast over PP, the local index from ``extract_expert_number_from_param``, ``local + k ·
  per_rank`` for EP rank ``k``, stacked and squeezed as there), the tensors gathered to the consumer,
  a fused HF tensor's experts each received into its place of the stack (UPSTREAM 74).

Every other rank gets shape-only (``meta``) tensors of the same shapes and dtypes, so the rest of
the export (splits, concatenations, the expert stacks, the tied and padding hooks) runs unchanged
and costs nothing there. The consumer's tensors are upstream's, byte for byte: tests/test_memory.py
compares them with upstream's export at TP2·PP2·EP2·ETP2 and TP2·PP2·VPP2·EP4, and round-trips 26B-A4B's
published widths at TP2·PP2·EP4 on 8 ranks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vime_gemma4_bridge.compat.cuda import on_host

__all__ = ["ToOneConsumer", "gathered_to", "receives_export", "receives_one_consumer_export"]

#: What the mixin takes over: each must be a method of the build's ``MegatronParamMapping``.
COLLECTIVES = ("broadcast_from_pp_rank", "gather_from_tp_ranks", "gather_from_ep_ranks")


@dataclass(frozen=True)
class _Consumer:
    """The consuming rank, its pipeline stage and its expert-parallel group (global ranks)."""

    rank: int
    stage: int
    ep_ranks: frozenset[int]


_consumer: ContextVar[_Consumer | None] = ContextVar("vime_gemma4_bridge_export_consumer", default=None)


class CannotTakeOver(RuntimeError):
    """A mapping of this build would gather to every rank: the one-consumer export refuses rather than half-apply."""


@contextlib.contextmanager
def gathered_to(rank: int, mappings: Iterable[Any] = ()) -> Iterator[bool]:
    """Within this block, the plugin's mappings deliver the export to global ``rank`` alone (collective).

    Yields whether this rank receives the export's tensors (:func:`receives_export` says the same):
    export with ``cpu=`` that value, since the other ranks' tensors are shape-only and cannot be copied.
    ``mappings`` (the bridge's mapping registry) are checked first: one that is not the plugin's,
    or a build whose ``MegatronParamMapping`` lacks one of :data:`COLLECTIVES` (feature detection),
    is refused with :class:`CannotTakeOver`, naming it.
    """
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping
    from megatron.core import parallel_state

    if _consumer.get() is not None:
        raise RuntimeError("gathered_to is already active in this context")
    missing = [name for name in COLLECTIVES if not callable(getattr(MegatronParamMapping, name, None))]
    if missing:
        raise CannotTakeOver(
            f"this Megatron-Bridge build's MegatronParamMapping has no {', '.join(missing)}: the export to one "
            "rank cannot take its mappings over; use a release that has them (0.6.2 and vime's fork do)"
        )
    # each mapping and the mappings it holds (a composite's delegates: QKV's, the gated experts')
    parts = [part for m in mappings for part in (m, *vars(m).values()) if isinstance(part, MegatronParamMapping)]
    foreign = sorted({type(part).__name__ for part in parts if not isinstance(part, ToOneConsumer)})
    if foreign:
        raise CannotTakeOver(
            f"mapping class(es) {', '.join(foreign)} would gather every tensor to every rank: the export to one "
            "rank takes over the plugin's mapping classes only (compat/mappings.py)"
        )
    box = [
        (parallel_state.get_pipeline_model_parallel_rank(), _ranks(parallel_state.get_expert_model_parallel_group()))
    ]
    dist.broadcast_object_list(box, src=rank)
    stage, ep_ranks = box[0]
    token = _consumer.set(_Consumer(rank, stage, frozenset(ep_ranks)))
    try:
        yield dist.get_rank() == rank
    finally:
        _consumer.reset(token)


def receives_export() -> bool:
    """Whether this rank gets real tensors from the export: always outside :func:`gathered_to`."""
    consumer = _consumer.get()
    return consumer is None or dist.get_rank() == consumer.rank


def receives_one_consumer_export() -> bool:
    """Whether an export to one consumer (:func:`gathered_to`) is running, on any rank (all ranks agree)."""
    return _consumer.get() is not None


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


def _feeding_member(consumer: _Consumer, group: Any, expert: bool) -> int | None:
    """The global rank of ``group`` whose gathered value reaches the consumer, or ``None``.

    A TP group feeds the consumer through the consumer itself; an expert TP group through the member
    that is in the consumer's EP group (that member's value is EP-gathered to the consumer next; expert
    TP and EP groups meet in one rank at most).
    """
    members = _ranks(group)
    if consumer.rank in members:
        return consumer.rank
    return next((member for member in members if expert and member in consumer.ep_ranks), None)


def _gathered(tensor: torch.Tensor, group: Any, size: int, destination: int | None) -> list[torch.Tensor]:
    """``tensor`` from every member of ``group``, in member order, on ``destination`` only; shape-only elsewhere.

    Point to point, not ``dist.gather``: a gather copies the destination's own tensor into a buffer of
    its own, and the mapping then concatenates the list into a third copy, so the destination held
    twice the gathered weight (2.96 GB for 26B-A4B's embedding at TP2). Here its own part is the
    tensor itself, and only the other members' parts are received.
    """
    if destination is None:
        return [_shape_only(tensor) for _ in range(size)]
    if dist.get_rank() != destination:
        dist.send(tensor.contiguous(), dst=destination, group=group)
        return [_shape_only(tensor) for _ in range(size)]
    gathered = []
    for member in _ranks(group):
        if member == destination:
            gathered.append(tensor)
        else:
            gathered.append(torch.empty_like(tensor, memory_format=torch.contiguous_format))
            dist.recv(gathered[-1], src=member, group=group)
    return gathered


def _gathered_rows(tensor: torch.Tensor, group: Any, destination: int | None) -> torch.Tensor:
    """The members' ``tensor`` concatenated along dim 0, in member order, received into place on ``destination``;
    a shape-only tensor of that shape elsewhere (what upstream's concatenation of shape-only parts gives)."""
    members = _ranks(group)
    rows = tensor.shape[0]
    shape = (rows * len(members), *tensor.shape[1:])
    if destination is None or dist.get_rank() != destination:
        if destination is not None:
            dist.send(tensor.contiguous(), dst=destination, group=group)
        return torch.empty(shape, dtype=tensor.dtype, device="meta")
    full = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    for index, member in enumerate(members):
        part = full[index * rows : (index + 1) * rows]
        if member == destination:
            part.copy_(tensor)
        else:
            dist.recv(part, src=member, group=group)
    return full


class ToOneConsumer:
    """Mixin (before the upstream mapping class): its export collectives deliver to :func:`gathered_to`'s rank.

    Outside :func:`gathered_to` each method is upstream's own (``super()``).
    """

    def broadcast_from_pp_rank(self, tensor: torch.Tensor | None, cache_key: str | None = None) -> Any:
        """Upstream's PP broadcast, or, for one consumer, the first owning stage sending to the consumer's stage.

        The source is upstream's (the lowest stage that holds the weight: tied embeddings are held twice);
        the stages' specs are exchanged and cached as upstream does (``_tensor_spec_output_cache``).
        """
        consumer = _consumer.get()
        if consumer is None or self.pp_size == 1:
            return super().broadcast_from_pp_rank(tensor, cache_key)
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
            received = _with_spec(specs[source], "cpu" if on_host() else "cuda")
            dist.recv(received, src=dist.get_global_rank(self.pp_group, source), group=self.pp_group)
            return received
        if here == source and here != consumer.stage:
            dist.send(tensor.contiguous(), dst=dist.get_global_rank(self.pp_group, consumer.stage), group=self.pp_group)
        return tensor if here in (source, consumer.stage) else _with_spec(specs[source], "meta")

    def gather_from_tp_ranks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Upstream's TP all-gather, or, for one consumer, a gather to the member that feeds it (TP-rank order)."""
        consumer = _consumer.get()
        if consumer is None or self.tp_size == 1:
            return super().gather_from_tp_ranks(tensor)
        destination = _feeding_member(consumer, self.tp_group, expert=self.is_expert)
        return _gathered(tensor, self.tp_group, self.tp_size, destination)

    def gather_rows_to_one(self, tensor: torch.Tensor) -> torch.Tensor:
        """For one consumer: the TP shards concatenated along dim 0 on the member that feeds it, each received
        into its place (``gather_from_tp_ranks`` and upstream's ``torch.cat`` hold the weight twice there:
        2.2 GB for 26B-A4B's 1.48 GB embedding at TP2, what tipped an 8-layer ``export-live`` over 24 GB)."""
        consumer = _consumer.get()
        assert consumer is not None, "gather_rows_to_one is for the one-consumer export"
        return _gathered_rows(tensor, self.tp_group, _feeding_member(consumer, self.tp_group, expert=self.is_expert))

    def gather_from_ep_ranks(
        self, megatron_weights: torch.Tensor, megatron_module: Any, hf_param_name: Any
    ) -> dict[str, torch.Tensor]:
        """Upstream's EP gather, or, for one consumer, upstream's expert names with the tensors gathered to it.

        The names, the stacking of a name given twice and the final ``squeeze`` are upstream's
        (param_mapping.py L779-819 at 0.6.2; the fork's at d063066b are the same at EP > 1). A fused HF
        tensor's name (every EP rank's expert under one name) is stacked as it is received, each
        rank's expert into its place: upstream's ``torch.cat`` of the parts is a second copy of them.
        """
        from megatron.bridge.utils.common_utils import extract_expert_number_from_param

        consumer = _consumer.get()
        if consumer is None or self.ep_size == 1:
            return super().gather_from_ep_ranks(megatron_weights, megatron_module, hf_param_name)
        per_rank = (
            None if megatron_module is None else self._get_config(megatron_module).num_moe_experts // self.ep_size
        )
        per_rank = self.broadcast_obj_from_pp_rank(per_rank, "num_experts_per_rank")
        local = extract_expert_number_from_param(self.megatron_param) % per_rank
        names = [
            re.sub(r"experts\.(\d+)", f"experts.{int(local) + per_rank * k}", str(hf_param_name))
            for k in range(self.ep_size)
        ]
        destination = consumer.rank if consumer.rank in _ranks(self.ep_group) else None
        if len(set(names)) == 1:  # one fused HF tensor (no expert number in its name): stacked in place
            stacked = _gathered_rows(megatron_weights.unsqueeze(0), self.ep_group, destination)
            return {names[0]: stacked.squeeze()}
        gathered = _gathered(megatron_weights, self.ep_group, self.ep_size, destination)
        stacked: dict[str, torch.Tensor] = {}
        for name, weight in zip(names, gathered, strict=True):
            one = weight.unsqueeze(0)
            stacked[name] = torch.cat([stacked[name], one], dim=0) if name in stacked else one
        return {name: weight.squeeze() for name, weight in stacked.items()}
