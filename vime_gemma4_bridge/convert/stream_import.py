"""``import`` at the default topology: the routed experts stream from the HF shards into torch_dist.

The mirror of :mod:`vime_gemma4_bridge.convert.stream_export`. Through the general path, every expert
byte is copied from the HF shard into Megatron-Bridge's import cache (which keeps every layer's
experts until the end), into the model, into megatron-core's save staging and into the file,
and megatron-core plans the save with PyTorch's pairwise overlap check of chunks (7,680 expert
chunks per key at 26B-A4B). With one tensor-parallel rank (TP = ETP = 1) none of that is
needed: the HF tensor ``layers.N.experts.gate_up_proj`` [E, 2I, H] is, byte for byte, Megatron's
``linear_fc1.weight0 .. weight{E-1}`` one after the other, and torch_dist stores global tensors.

So, when :func:`~vime_gemma4_bridge.convert.streaming.plan_streamed_experts` accepts the model:

* the model is built without random initialisation (its expert weights are never touched, so
  they cost address space, not memory);
* every non-expert weight goes through its Megatron-Bridge task into the model (the bridge's
  ``maybe_modify_loaded_hf_weight`` hook, then the mapping's ``hf_to_megatron``), and so does
  **expert 0 of every layer**, read from a memory mapping of the HF shard;
* megatron-core saves everything but the expert weights (their ``_extra_state`` included);
* each expert chunk megatron-core would have saved — key, global offset and shape from the
  model's own ``sharded_state_dict`` — is read from the HF shard into one buffer and written
  as a torch_dist item (``torch.save`` of the chunk, as PyTorch's writer does), and the
  checkpoint's ``.metadata`` gets the same entries megatron-core's planner would have made.

Expert 0's chunks, as written, must equal what the mapping put into the model, or the import
stops (:class:`~vime_gemma4_bridge.io.torch_dist_layout.ConversionError`). The checkpoint loads
with megatron-core's own loader at every topology. Gap recorded in docs/UPSTREAM.md
(``load_weights_hf_to_megatron`` takes no task list and caches every grouped HF tensor).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.convert.streaming import StreamedExperts, plan_streamed_experts, stored_shape
from vime_gemma4_bridge.io.hf import HFCheckpoint, TensorLocation
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError, sharded_state_dict

__all__ = ["ImportPlan", "plan_import"]


@dataclass
class ImportPlan:
    """What the streaming import writes itself and what goes through Megatron-Bridge's tasks."""

    experts: StreamedExperts
    loaded_tasks: list[Any]  # every non-expert task, and expert 0 of every HF expert tensor
    locations: dict[str, TensorLocation]  # HF expert tensor name -> its bytes in the shard

    def streamed_params(self) -> set[str]:
        """Parameter names whose torch_dist items this plan writes (megatron-core saves the rest)."""
        return {expert.task.param_name for group in self.experts.groups.values() for expert in group}

    def load(self, model_bridge: Any, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Every loaded task's HF weight(s) through the bridge's hook and the mapping, into the model.

        Megatron-Bridge's own loop (``load_weights_hf_to_megatron``) at TP1·PP1, over a task list
        it cannot take: the hook, ``hf_to_megatron``, a shape check, the copy. Expert tensors are
        read from a memory mapping, so expert 0 costs its own pages, not its layer's.
        """
        state = _MappedExperts(hf_state, self.locations)
        with torch.no_grad():
            for task in self.loaded_tasks:
                weights = model_bridge.maybe_modify_loaded_hf_weight(task.mapping.hf_param, state)
                converted = task.mapping.hf_to_megatron(weights, task.megatron_module)
                if converted is None:  # "not on this rank": at TP1·PP1·EP1 every rank holds every weight
                    raise ConversionError(f"Megatron-Bridge converted nothing for {task.param_name} at TP1")
                if tuple(converted.shape) != tuple(task.param_weight.shape):
                    raise ConversionError(
                        f"{task.mapping.hf_param} converts to {list(converted.shape)} but Megatron's "
                        f"{task.param_name} is {list(task.param_weight.shape)}"
                    )
                task.param_weight.copy_(converted)

    @contextlib.contextmanager
    def experts_written(self, iteration_dir: str | os.PathLike, *, threads: int = 2) -> Iterator[None]:
        """Write every expert chunk into new files for ``iteration_dir`` while the body runs; index them after.

        The body is megatron-core's save of everything else (its own writer process); the chunks
        are written meanwhile by ``threads`` threads, one file each (``torch.save`` computes a
        CRC per item, so one core alone would bound the write), beside ``iteration_dir`` (which
        megatron-core wants empty when it starts). After the body the files move in and the
        chunks join the checkpoint's ``.metadata``. One rank only. A failure in the body stops
        the threads before it propagates, so the caller can remove what was written.
        """
        directory = Path(iteration_dir)
        stop = threading.Event()
        parts = _balanced(list(self.experts.groups), lambda name: self.locations[name].nbytes, threads)
        with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="vime-gemma4-experts") as pool:
            futures = [
                pool.submit(self._write_file, directory.parent / f".{_FILE_PREFIX}{i}.distcp", names, stop)
                for i, names in enumerate(parts)
            ]
            try:
                yield
            except BaseException:
                stop.set()
                raise
            written = [item for future in futures for item in future.result()]
        for i in range(len(parts)):
            os.replace(directory.parent / f".{_FILE_PREFIX}{i}.distcp", directory / f"{_FILE_PREFIX}{i}.distcp")
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(directory)).read_metadata()
        _index(metadata, written)
        staged = directory / ".metadata.vime-gemma4"
        with open(staged, "wb") as handle:
            pickle.dump(metadata, handle)
        os.replace(staged, directory / ".metadata")

    def _write_file(self, path: Path, names: list[str], stop: threading.Event) -> list[_Written]:
        """Write the chunks of HF tensors ``names`` to ``path`` as torch_dist items, in order."""
        written: list[_Written] = []
        with open(path, "wb") as out:
            for name in names:
                location = self.locations[name]
                with open(location.file, "rb", buffering=0) as source:
                    source.seek(location.offset)
                    for number, expert in enumerate(self.experts.groups[name]):
                        if stop.is_set():
                            return written
                        for piece in expert.pieces:
                            chunk = _read_exactly(source, stored_shape(piece), piece.dtype, location)
                            if number == 0 and not torch.equal(chunk.view(piece.data.shape), piece.data):
                                raise ConversionError(
                                    f"Megatron-Bridge's mapping of {expert.task.param_name} is not a plain "
                                    f"slice of {name}; import with an explicit topology (e.g. --tp 1 --ep 1) "
                                    "instead"
                                )
                            start = out.tell()
                            torch.save(chunk, out)  # what PyTorch's writer stores per tensor item
                            written.append(_Written(piece, path.name.lstrip("."), start, out.tell() - start))
        return written


@dataclass(frozen=True)
class _Written:
    """One expert chunk as written: its ShardedTensor, file (relative to the checkpoint) and byte range."""

    piece: Any
    file: str
    offset: int
    length: int


#: Our expert files' names: PyTorch's writer names its files ``__{rank}_{n}.distcp``, never so.
_FILE_PREFIX = "__0_experts_"


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


class _MappedExperts(Mapping):
    """The HF state, with the expert tensors over memory mappings of their shards instead of read whole."""

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


def _read_exactly(source: Any, shape: tuple[int, ...], dtype: torch.dtype, location: TensorLocation) -> torch.Tensor:
    """The next ``shape``/``dtype`` bytes of ``source`` as a tensor of its own (its storage is the chunk)."""
    chunk = torch.empty(shape, dtype=dtype)
    raw = chunk.view(-1).view(torch.uint8).numpy()
    if source.readinto(raw) != raw.nbytes:
        raise ConversionError(f"{location.file} ends inside a tensor (bytes from {location.offset:,}): truncated?")
    return chunk


def _index(metadata: Any, written: list[_Written]) -> None:
    """Add the written chunks to PyTorch's checkpoint metadata as its save planner would have."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

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
        metadata.storage_data[where] = _StorageInfo(item.file, item.offset, item.length)
        tensor_data = TensorWriteData(chunk=chunk, properties=properties, size=size)
        new_items.append(WriteItem(index=where, type=WriteItemType.SHARD, tensor_data=tensor_data))
    if plans:
        plans[0] = type(plans[0])(**{**vars(plans[0]), "items": [*plans[0].items, *new_items]})


def plan_import(bridge: Any, model: list[torch.nn.Module], source: HFCheckpoint) -> ImportPlan | None:
    """The streaming plan for a one-chunk TP1 model built from ``bridge`` (an ``AutoBridge``), or ``None``.

    ``None`` (the general path) when the model has several chunks, an expert is not a plain
    stack (:func:`plan_streamed_experts`), an HF expert tensor is not the stack of its experts'
    shapes and dtype, or this Megatron-Bridge build's bridge has no ``maybe_modify_loaded_hf_weight``.
    """
    if len(model) != 1:
        return None
    model_bridge = bridge._model_bridge  # the registered Gemma 4 bridge (AutoBridge exposes no public getter)
    hook = getattr(model_bridge, "maybe_modify_loaded_hf_weight", None)
    if hook is None or len(inspect.signature(hook).parameters) != 2:
        return None
    tasks = [task for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, model) if task is not None]
    state = sharded_state_dict(model)[0]["model"]
    experts = plan_streamed_experts(tasks, state, lambda piece: True)
    if experts is None:
        return None
    locations: dict[str, TensorLocation] = {}
    for name, group in experts.groups.items():
        param = group[0].task.param_weight
        location = source.locate(name) if name in source.weight_map else None
        if location is None or location.shape != (len(group), *param.shape) or location.dtype != param.dtype:
            return None
        locations[name] = location
    streamed = {id(expert.task) for group in experts.groups.values() for expert in group[1:]}
    return ImportPlan(experts, [task for task in tasks if id(task) not in streamed], locations)
