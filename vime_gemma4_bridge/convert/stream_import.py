"""``import`` at the default topology: every weight streams from the HF shards into torch_dist items.

The mirror of :mod:`vime_gemma4_bridge.convert.stream_export`. Through the general path, every weight
goes into the model (Megatron-Bridge's import cache keeps every layer's HF experts until the load
ends) and megatron-core's save stages a copy of every tensor and plans with PyTorch's pairwise
chunk-overlap check (7,680 expert chunks per key at 26B-A4B): memory grows with the model, twice.
With one tensor-parallel rank (TP = ETP = 1) the model is not needed to hold anything: torch_dist
stores global tensors, and each chunk megatron-core would save is a byte range of a converted
weight. So, when :func:`plan_import` accepts the model (every weight's sharded description tiles it
in memory order, the experts are plain stacks):

* the model is built without random initialisation and its weights are never touched (they cost
  address space, not memory);
* every non-expert weight is converted by its Megatron-Bridge task (the bridge's
  ``maybe_modify_loaded_hf_weight`` hook, then the mapping's ``hf_to_megatron``), one at a time,
  from a memory mapping of its shard (no read copy; a weight passed through is written from it),
  and written as the torch_dist items megatron-core would write (key, global offset and shape from
  the model's own ``sharded_state_dict``; ``torch.save`` per item, as PyTorch's writer does);
* the routed experts are byte ranges of the HF tensor ``layers.N.experts.gate_up_proj`` [E, 2I, H]
  (Megatron's ``linear_fc1.weight0 .. weight{E-1}`` one after the other): two threads copy them
  from the shards into items meanwhile, three chunks in memory at a time. **Expert 0 of every layer**
  also goes through its mapping, from a memory mapping of the shard, and must equal those bytes;
* megatron-core saves the rest (``_extra_state`` objects, persistent buffers, common state), and
  the checkpoint's ``.metadata`` gets the entries its planner would have made for the items.

Memory is one converted weight plus three chunks per writer thread, whatever the model's size. The
checkpoint loads with megatron-core's own loader at every topology (tests compare its metadata
and every chunk with megatron-core's save of the same model). Gap recorded in docs/UPSTREAM.md
(``load_weights_hf_to_megatron`` takes no task list and caches every grouped HF tensor).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import inspect
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.convert.streaming import (
    StreamedExperts,
    memory_ordered_pieces,
    plan_streamed_experts,
    stored_shape,
)
from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.io.digests import HashingWriter, held_up
from vime_gemma4_bridge.io.hf import HFCheckpoint, TensorLocation, release_pages
from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata
from vime_gemma4_bridge.io.torch_dist import write_failure
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError, sharded_state_dict

__all__ = ["ImportPlan", "plan_import"]


@dataclass
class ImportPlan:
    """What the streaming import writes, and through which Megatron-Bridge tasks."""

    experts: StreamedExperts  # routed experts, written as byte ranges of their HF tensors
    converted_tasks: list[Any]  # every other task, and expert 0 of every HF expert tensor (checked)
    pieces: dict[str, list[Any]]  # parameter name -> its ShardedTensors in memory order
    locations: dict[str, TensorLocation]  # HF tensor name (language model, with the experts) -> its bytes in the shard

    def streamed_params(self) -> set[str]:
        """Parameter names whose torch_dist items this plan writes (megatron-core saves the rest)."""
        return set(self.pieces)

    @contextlib.contextmanager
    def streaming(self, iteration_dir: str | os.PathLike, *, threads: int = 2) -> Iterator[_Stream]:
        """Write the experts in ``threads`` threads while the body runs; index every item after.

        The body converts the other weights (:meth:`_Stream.convert`) and runs megatron-core's
        save of the rest into ``iteration_dir``. Items are written beside ``iteration_dir`` (which
        megatron-core wants empty when it starts) and move in after the body, when their entries
        join the checkpoint's ``.metadata``. One rank only. A failure stops the threads before it
        propagates, so the caller can remove what was written.
        """
        directory = Path(iteration_dir)
        stop = threading.Event()
        parts = _balanced(list(self.experts.groups), lambda name: self.locations[name].nbytes, threads)
        stream = _Stream(self, directory.parent / f".{_FILE_PREFIX}{len(parts)}.distcp")
        try:
            with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="vime-gemma4-experts") as pool:
                futures = [
                    pool.submit(self._write_experts, directory.parent / f".{_FILE_PREFIX}{i}.distcp", names, stop)
                    for i, names in enumerate(parts)
                ]
                try:
                    yield stream
                except BaseException:
                    stop.set()
                    raise
                stream.written += [item for future in futures for item in future.result()]
                written = stream.written
            for i in range(len(parts) + 1):
                os.replace(directory.parent / f".{_FILE_PREFIX}{i}.distcp", directory / f"{_FILE_PREFIX}{i}.distcp")
            metadata = read_checkpoint_metadata(directory)
            _index(metadata, written)
            staged = directory / ".metadata.vime-gemma4"
            with open(staged, "wb") as handle:
                pickle.dump(metadata, handle)
            os.replace(staged, directory / ".metadata")
        except OSError as error:
            if error.errno not in _WRITE_ERRNOS:
                raise
            # One line, as megatron-core's own write failures are reported (io.torch_dist.save_torch_dist).
            raise ConversionError(
                f"writing torch_dist to {directory} failed: {error.strerror or error} ({error.filename or directory})"
            ) from None
        except RuntimeError as error:
            if "inline_container" not in str(error):
                raise
            # torch.save reports a failed write as its own position check: ask the file system why.
            why = write_failure(directory.parent)
            raise ConversionError(f"writing torch_dist to {directory} failed: {why}") from None

    def _write_experts(self, path: Path, names: list[str], stop: threading.Event) -> list[_Written]:
        """Write the expert chunks of HF tensors ``names`` to ``path`` as torch_dist items, in order.

        Each chunk is written straight from a private memory mapping of the shard (a tensor over
        exactly its bytes, so ``torch.save`` stores just them), and its pages are dropped from this
        process once written and hashed: no copy in memory, three chunks resident. An item is hashed
        on a thread beside this one while the next ones are written (``HashingWriter.item(after=...)``),
        and its digest collected :data:`_HASHED_BEHIND` items later: waiting for each hash as it was
        written held the bench's 3 GB import up ~0.25 s on 2 cores, an item later ~0.06 s, two ~0.015 s.
        """
        written: list[_Written] = []
        hashing: collections.deque = collections.deque()

        def settle() -> None:  # the oldest item's digest; then its chunk's pages can go
            piece, item, mapping, position, nbytes = hashing.popleft()
            with held_up():
                item["digest"] = item["digest"].result()
            written.append(_Written.of(piece, path, item))
            release_pages(mapping, position, nbytes)

        with open(path, "wb") as handle:
            out = HashingWriter(handle)
            for name in names:
                location = self.locations[name]
                with open(location.file, "rb") as shard:
                    mapping = mmap.mmap(shard.fileno(), 0, access=mmap.ACCESS_COPY)
                position = location.offset
                for expert in self.experts.groups[name]:
                    if stop.is_set():
                        return written
                    for piece in expert.pieces:
                        nbytes = piece.data.numel() * piece.dtype.itemsize
                        hashing.append((piece, _save_chunk(out, mapping, position, piece), mapping, position, nbytes))
                        if len(hashing) > _HASHED_BEHIND:
                            settle()
                        position += nbytes
            while hashing:
                settle()
        return written


#: Expert items a writer thread writes before it collects an earlier one's digest (each keeps its chunk).
_HASHED_BEHIND = 2


def _save_chunk(out: HashingWriter, mapping: mmap.mmap, position: int, piece: Any) -> dict[str, Any]:
    """One expert chunk at ``position`` of ``mapping`` as an item; its digest is hashed from the mapping, after."""
    count = piece.data.numel()
    chunk = torch.frombuffer(mapping, dtype=piece.dtype, count=count, offset=position)
    with memoryview(mapping)[position : position + count * piece.dtype.itemsize] as memory:
        with out.item(after=memory) as item:
            torch.save(chunk.view(stored_shape(piece)), out)  # what PyTorch's writer stores per item
    return item


@dataclass(frozen=True)
class _Written:
    """One item as written: its ShardedTensor, file (relative to the checkpoint), byte range and digest."""

    piece: Any
    file: str
    offset: int
    length: int
    digest: str

    @classmethod
    def of(cls, piece: Any, path: Path, item: Mapping[str, Any]) -> _Written:
        """The item :meth:`~vime_gemma4_bridge.io.digests.HashingWriter.item` recorded, in staged file ``path``."""
        return cls(piece, path.name.lstrip("."), item["offset"], item["length"], item["digest"])


class _Stream:
    """The main thread's part of a streaming import: every non-expert weight through its mapping, as items."""

    def __init__(self, plan: ImportPlan, path: Path) -> None:
        self.plan = plan
        self.path = path
        self.written: list[_Written] = []

    def convert(self, model_bridge: Any, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Megatron-Bridge's load loop at TP1·PP1 over the plan's tasks, into items instead of the model.

        Per task, as ``load_weights_hf_to_megatron`` does (it takes no task list): the bridge's hook,
        the mapping's ``hf_to_megatron``, a shape check; then the converted weight's bytes are cut
        into its chunks and written. Expert 0 of each HF expert tensor is checked, not written: its
        conversion must equal the bytes the expert threads copy.
        """
        plan = self.plan
        state = _MappedState(hf_state, plan.locations)
        firsts = {id(group[0].task): name for name, group in plan.experts.groups.items()}
        with open(self.path, "wb") as handle, torch.no_grad():
            out = HashingWriter(handle)
            for task in plan.converted_tasks:
                weights = model_bridge.maybe_modify_loaded_hf_weight(task.mapping.hf_param, state)
                converted = task.mapping.hf_to_megatron(weights, task.megatron_module)
                if converted is None:  # "not on this rank": at TP1·PP1·EP1 every rank holds every weight
                    raise ConversionError(f"Megatron-Bridge converted nothing for {task.param_name} at TP1")
                param = task.param_weight
                if tuple(converted.shape) != tuple(param.shape) or converted.dtype != param.dtype:
                    raise ConversionError(
                        f"{task.mapping.hf_param} converts to {converted.dtype} {list(converted.shape)} but "
                        f"Megatron's {task.param_name} is {param.dtype} {list(param.shape)}"
                    )
                flat = converted.reshape(-1)
                name = firsts.get(id(task))
                if name is not None:
                    if not same_bytes(flat, plan.locations[name].mapped()[0].reshape(-1)):
                        raise ConversionError(
                            f"Megatron-Bridge's mapping of {task.param_name} is not a plain slice of {name}; "
                            "import with an explicit topology (e.g. --tp 1 --ep 1) instead"
                        )
                    continue
                pieces, start = plan.pieces[task.param_name], 0
                for piece in pieces:
                    count = piece.data.numel()
                    chunk = flat[start : start + count]
                    if len(pieces) > 1 or chunk.untyped_storage().nbytes() != count * chunk.element_size():
                        chunk = chunk.clone()  # torch.save stores a view's whole storage: give it one of its own
                    chunk = chunk.view(stored_shape(piece))
                    start += count
                    with out.item() as item:
                        torch.save(chunk, out)
                    self.written.append(_Written.of(piece, self.path, item))


#: Failures of a write itself (not of reading the sources): reported as the torch_dist write's.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EIO, errno.EACCES, errno.EPERM}

#: Our files' names: PyTorch's writer names its files ``__{rank}_{n}.distcp``, never so.
_FILE_PREFIX = "__0_streamed_"


def _balanced(names: list[str], size: Callable[[str], int], parts: int) -> list[list[str]]:
    """``names`` in order, cut into at most ``parts`` consecutive runs of about equal total ``size``."""
    total = sum(size(name) for name in names)
    runs: list[list[str]] = [[]]
    done = 0
    for name in names:
        if runs[-1] and len(runs) < parts and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(name)
        done += size(name)
    return runs


class _MappedState(Mapping):
    """The HF state, each tensor over a private memory mapping of its shard instead of read into memory.

    A weight a mapping passes through unchanged (any replicated one at TP1) is then written to its
    item straight from the page cache, and one that is converted costs its conversion only: no read
    copy, and nothing left in the heap (a mapping is released with the tensor).
    """

    def __init__(self, state: Mapping[str, torch.Tensor], locations: Mapping[str, TensorLocation]) -> None:
        self._state = state
        self._locations = locations

    def __getitem__(self, name: str) -> torch.Tensor:
        location = self._locations.get(name)
        return location.mapped() if location is not None else self._state[name]

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)

    def __contains__(self, name: object) -> bool:
        return name in self._state


def _index(metadata: Any, written: list[_Written]) -> None:
    """Add the written chunks to PyTorch's checkpoint metadata as its save planner would have."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    storage_info = seams.storage_info_class()
    plans = getattr(metadata, "all_local_plans", None)  # megatron-core keeps rank plans for save reuse
    new_items = []
    for item in written:
        piece = item.piece
        properties = TensorProperties(dtype=piece.dtype)
        size = torch.Size(piece.global_shape)
        entry = metadata.state_dict_metadata.setdefault(
            piece.key, TensorStorageMetadata(properties=properties, size=size, chunks=[])
        )
        if entry.size != size or entry.properties.dtype != piece.dtype:
            raise ConversionError(f"torch_dist key {piece.key} is already saved with another shape or dtype")
        chunk = ChunkStorageMetadata(offsets=torch.Size(piece.global_offset), sizes=torch.Size(stored_shape(piece)))
        where = MetadataIndex(piece.key, chunk.offsets)
        entry.chunks.append(chunk)
        metadata.storage_data[where] = storage_info(item.file, item.offset, item.length)
        tensor_data = TensorWriteData(chunk=chunk, properties=properties, size=size)
        new_items.append(WriteItem(index=where, type=WriteItemType.SHARD, tensor_data=tensor_data))
    if plans:
        plans[0] = type(plans[0])(**{**vars(plans[0]), "items": [*plans[0].items, *new_items]})


def plan_import(bridge: Any, model: list[torch.nn.Module], source: HFCheckpoint) -> ImportPlan | None:
    """The streaming plan for a one-chunk TP1 model built from ``bridge`` (an ``AutoBridge``), or ``None``.

    ``None`` (the general path) when the model has several chunks, a weight's sharded description
    does not tile it in memory order, an expert is not a plain stack (:func:`plan_streamed_experts`),
    an HF expert tensor is not the stack of its experts' shapes and dtype, or this Megatron-Bridge
    build's bridge has no ``maybe_modify_loaded_hf_weight``.
    """
    if len(model) != 1:
        return None
    model_bridge = seams.model_bridge_of(bridge)  # the registered Gemma 4 bridge
    hook = getattr(model_bridge, "maybe_modify_loaded_hf_weight", None)
    if hook is None or len(inspect.signature(hook).parameters) != 2:
        return None
    tasks = [task for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, model) if task is not None]
    state = sharded_state_dict(model)[0]["model"]
    experts = plan_streamed_experts(tasks, state, lambda piece: True)
    if experts is None:
        return None
    pieces: dict[str, list[Any]] = {}
    for task in tasks:
        ordered = memory_ordered_pieces(state.get(task.param_name), task.param_weight)
        if ordered is None:
            return None
        pieces[task.param_name] = ordered
    locations = source.locations(source.language_model_names())
    for name, group in experts.groups.items():
        param = group[0].task.param_weight
        location = locations.get(name)
        if location is None or location.shape != (len(group), *param.shape) or location.dtype != param.dtype:
            return None
    copied = {id(expert.task) for group in experts.groups.values() for expert in group[1:]}
    return ImportPlan(experts, [task for task in tasks if id(task) not in copied], pieces, locations)
