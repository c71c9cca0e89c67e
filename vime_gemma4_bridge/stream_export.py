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
  loaded by megatron-core's ``dist_checkpointing.load`` and exported by Megatron-Bridge's own
  conversion tasks, exactly as in the general path;
* each expert weight is read from its torch_dist chunk(s) and written straight into the HF shard
  (:class:`~vime_gemma4_bridge.hf_io.LazyTensor`), one expert in memory at a time.

Which bytes belong to which expert, and where they are stored, comes from the model's own
``sharded_state_dict`` (the same description megatron-core saves and loads with); that the HF
tensor is the stack of the Megatron weights is Megatron-Bridge's ``FusedGatedExpertMapping`` /
``FusedExpertMapping`` at TP = ETP = 1, and is *checked* on every run: expert 0 of every layer
goes through the mapping and must come out bit-identical. Anything else — experts split over ETP
in the checkpoint, another mapping class, permuted or transposed experts — is not streamed:
:func:`plan_streamed_experts` returns ``None`` and ``export`` takes the general path.
Gap recorded in docs/UPSTREAM.md (grouped expert export copies every expert three times).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import math
import mmap
import os
import pickle
import re
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.hf_io import SAFETENSORS_DTYPES, LazyTensor

_TORCH_DTYPES = {label: dtype for dtype, label in SAFETENSORS_DTYPES.items()}

__all__ = [
    "ExportPlan",
    "StreamedExperts",
    "TorchDistReader",
    "plan_export",
    "plan_streamed_experts",
    "streamed_export_tensors",
]


# torch.save's zip layout, as far as a plain tensor needs it (PKZIP APPNOTE 4.3.7 / 4.3.12 / 4.3.16).
_LOCAL_HEADER, _CENTRAL_HEADER, _END_RECORD = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


class _NotPlain(Exception):
    """A torch_dist item is not a plain contiguous tensor in an uncompressed zip: use ``torch.load``."""


def _rebuild_tensor_v2(storage: Any, offset: int, size: Any, stride: Any, *unused: Any) -> tuple:
    return storage, offset, tuple(size), tuple(stride)


class _TensorPickle(pickle.Unpickler):
    """Reads ``data.pkl`` of a torch.save'd plain tensor as (storage id, offset, size, stride); nothing else loads."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return name
        raise _NotPlain(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _plain_tensor_location(buffer: mmap.mmap, offset: int, length: int) -> tuple[int, torch.dtype, tuple[int, ...]]:
    """(absolute data offset, dtype, shape) of a torch.save'd contiguous tensor stored uncompressed, or raise.

    Why not ``torch.load``: it copies every byte out of the file and costs ~0.5 ms per call before
    that (zip reader set-up, a weights-only unpickler); 26B-A4B has 7,680 expert chunks, and at
    test sizes the per-call cost is most of an export. Located, the bytes are used in place (the
    file is memory-mapped), like safetensors does. The layout parsed is the zip container torch.save
    writes; anything unexpected (compression, zip64, views, non-contiguous strides, big-endian
    data, other objects) raises :class:`_NotPlain` and the caller uses ``torch.load``.
    """
    tail_start = offset + max(0, length - 4096)
    tail = buffer[tail_start : offset + length]
    end = tail.rfind(_END_RECORD)
    if end < 0 or len(tail) - end < 22:
        raise _NotPlain("no zip end record")
    entries, directory_size, directory_offset = struct.unpack_from("<10xHII", tail, end)
    if entries == 0xFFFF or 0xFFFFFFFF in (directory_size, directory_offset):
        raise _NotPlain("zip64 archive")
    directory = buffer[offset + directory_offset : offset + directory_offset + directory_size]
    records: dict[str, tuple[int, int]] = {}  # name in the archive -> (size, local header offset)
    pos = 0
    for _ in range(entries):
        if directory[pos : pos + 4] != _CENTRAL_HEADER:
            raise _NotPlain("bad zip directory")
        method, csize, usize, nlen, elen, clen, header = struct.unpack_from("<10xH8xIIHHH8xI", directory, pos)
        if method != 0 or csize != usize or 0xFFFFFFFF in (csize, header):
            raise _NotPlain("compressed or zip64 record")
        records[directory[pos + 46 : pos + 46 + nlen].decode().partition("/")[2]] = (usize, header)
        pos += 46 + nlen + elen + clen

    def record(name: str) -> tuple[int, int]:
        if name not in records:
            raise _NotPlain(f"no record {name}")
        size, header = records[name]
        start = offset + header
        if buffer[start : start + 4] != _LOCAL_HEADER:
            raise _NotPlain("bad local header")
        nlen, elen = struct.unpack_from("<HH", buffer, start + 26)
        return start + 30 + nlen + elen, size

    if "byteorder" in records:
        start, size = record("byteorder")
        if buffer[start : start + size] != b"little" or sys.byteorder != "little":
            raise _NotPlain("not little-endian")
    start, size = record("data.pkl")
    try:
        storage, storage_offset, shape, stride = _TensorPickle(io.BytesIO(buffer[start : start + size])).load()
    except (pickle.UnpicklingError, ValueError, TypeError, EOFError) as error:
        raise _NotPlain(str(error)) from error
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[0] == "storage"):
        raise _NotPlain("not a plain tensor")
    dtype, numel = _STORAGE_DTYPES[storage[1]], math.prod(shape)
    contiguous = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    if storage_offset != 0 or storage[4] != numel or (stride != contiguous and numel > 1):
        raise _NotPlain("a view, not a whole contiguous storage")
    data_start, data_size = record(f"data/{storage[2]}")
    if data_size != numel * dtype.itemsize:
        raise _NotPlain("record size differs from the tensor's")
    return data_start, dtype, shape


class TorchDistReader:
    """Reads single stored chunks of a torch_dist checkpoint (PyTorch DCP files) by key and offset.

    Only exact chunks: a request is served when a chunk with that key, global offset and shape was
    saved (:meth:`has`); assembling a region from chunks of another sharding is megatron-core's job.
    The index is PyTorch's own checkpoint metadata (``FileSystemReader.read_metadata``).
    """

    def __init__(self, iteration_dir: str | os.PathLike) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(iteration_dir)
        metadata = FileSystemReader(str(self.path)).read_metadata()
        self._tensors = {
            key: meta for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)
        }
        self._chunks = {
            (key, tuple(chunk.offsets)): tuple(chunk.sizes)
            for key, meta in self._tensors.items()
            for chunk in meta.chunks
        }
        self._items = {
            (index.fqn, tuple(index.offset)): info
            for index, info in metadata.storage_data.items()
            if index.offset is not None and not getattr(info, "transform_descriptors", None)
        }
        self._files: dict[str, mmap.mmap] = {}  # relative path -> the file, mapped copy-on-write

    def has(self, key: str, global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]) -> bool:
        """A chunk of exactly this place and shape is stored, untransformed, in a tensor of this global shape."""
        meta = self._tensors.get(key)
        where = (key, tuple(offsets))
        return (
            meta is not None
            and tuple(meta.size) == tuple(global_shape)
            and self._chunks.get(where) == tuple(shape)
            and where in self._items
        )

    def tensor_keys(self) -> list[str]:
        """Every tensor key stored in the checkpoint."""
        return list(self._tensors)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].properties.dtype

    def read(self, key: str, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
        """The stored chunk at ``offsets`` of ``key`` (call :meth:`has` first).

        A tensor over the memory-mapped file (no copy; the pages are the page cache's) when the item
        is a plain tensor, else what ``torch.load`` makes of it.
        """
        info = self._items[(key, tuple(offsets))]
        buffer = self._files.get(info.relative_path)
        if buffer is None:
            with open(self.path / info.relative_path, "rb") as handle:
                buffer = self._files[info.relative_path] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            try:
                start, dtype, stored = _plain_tensor_location(buffer, info.offset, info.length)
                count = math.prod(stored)
                flat = (
                    torch.frombuffer(buffer, dtype=dtype, count=count, offset=start)
                    if count
                    else torch.empty(0, dtype=dtype)
                )
                tensor = flat.view(stored)
            except _NotPlain:
                item = io.BytesIO(buffer[info.offset : info.offset + info.length])
                tensor = torch.load(item, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 (zip, pickle, EOF or buffer errors of damaged bytes)
            raise ValueError(
                f"torch_dist file {self.path / info.relative_path} is unreadable at {key} "
                f"(bytes {info.offset:,}..{info.offset + info.length:,}: {type(error).__name__}: {error}); "
                "the checkpoint is damaged: re-create it with vime-gemma4 import"
            ) from None
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != self.dtype(key):
            raise ValueError(f"torch_dist chunk {key}@{list(offsets)} holds {tensor.dtype}{list(tensor.shape)}")
        return tensor

    def release(self, key: str, offsets: Sequence[int]) -> None:
        """Drop a used chunk's pages from this process (they stay in the page cache): RSS stays ~one chunk.

        Safe even while a tensor still views them: the mapping is private and never written, so a
        later access faults the file's bytes back in.
        """
        info = self._items[(key, tuple(offsets))]
        buffer = self._files.get(info.relative_path)
        if buffer is None:
            return
        start = -(-info.offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (info.offset + info.length) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            buffer.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Drop the mappings (a mapping still viewed by a tensor is unmapped when that tensor goes)."""
        self._files.clear()


@dataclass
class _Expert:
    """One Megatron expert weight: its conversion task and the stored chunks that make it, in byte order."""

    task: Any  # Megatron-Bridge WeightConversionTask
    pieces: list[Any]  # megatron-core ShardedTensors, views of task.param_weight in memory order


@dataclass
class StreamedExperts:
    """The expert weights of one model that the export reads itself, grouped by HF tensor."""

    groups: dict[str, list[_Expert]]  # HF name -> experts 0..E-1

    def modules(self) -> dict[str, list[str]]:
        """Module state-dict prefix -> torch_dist keys read for it (for :func:`torch_dist.load_torch_dist`)."""
        out: dict[str, set[str]] = {}
        for experts in self.groups.values():
            for expert in experts:
                module = expert.task.param_name.rpartition(".")[0]
                out.setdefault(module, set()).update(piece.key for piece in expert.pieces)
        return {module: sorted(keys) for module, keys in out.items()}


@dataclass
class ExportPlan:
    """What the streaming export reads itself and what Megatron-Bridge exports.

    ``direct`` is set when every other weight is stored as whole chunks too (the checkpoint was
    saved at TP = ETP = 1, any PP/EP): then those are read straight into the model as well, and
    megatron-core's loader — its planning is most of an export at small sizes — is not needed.
    """

    experts: StreamedExperts
    other_tasks: list[Any]  # Megatron-Bridge WeightConversionTasks of every non-expert weight
    direct: dict[str, list[Any]] | None  # parameter name -> its ShardedTensors in memory order

    def check_direct(self, reader: TorchDistReader) -> None:
        """Refuse a checkpoint holding tensors this model does not use (nothing is read)."""
        from vime_gemma4_bridge.torch_dist_layout import refuse_unused_keys

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
        from vime_gemma4_bridge.torch_dist_layout import ConversionError

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
                if not batch:
                    del ready[key]
                shape, dtype = signature[name]
                if tensor is None or list(tensor.shape) != list(shape) or SAFETENSORS_DTYPES[tensor.dtype] != dtype:
                    got = (
                        "nothing" if tensor is None else f"{SAFETENSORS_DTYPES.get(tensor.dtype)} {list(tensor.shape)}"
                    )
                    raise ConversionError(f"export of {name} produced {got}, the source has {dtype} {list(shape)}")
                yield tensor

            return one

        return {
            name: LazyTensor(tuple(signature[name][0]), _TORCH_DTYPES[signature[name][1]], pieces(name))
            for name in owner
        }

    def _assembled(self, task: Any, reader: TorchDistReader) -> torch.Tensor:
        """``task``'s weight from its stored chunks, in a tensor of its own (the model's stays untouched)."""
        assert self.direct is not None
        weight = torch.empty_like(task.param_weight, memory_format=torch.contiguous_format)
        flat, start = weight.view(-1), 0
        for piece in self.direct[task.param_name]:
            count = piece.data.numel()
            flat[start : start + count].copy_(reader.read(piece.key, piece.global_offset, stored_shape(piece)).view(-1))
            reader.release(piece.key, piece.global_offset)
            start += count
        return weight


def _export(bridge: Any, model: list[torch.nn.Module], tasks: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge's export of ``tasks`` on this rank alone (TP1·PP1·EP1: no collective is involved)."""
    for item in bridge.export_hf_weights(model, cpu=True, show_progress=False, conversion_tasks=tasks):
        yield item[0], item[1]  # the fork's build yields a third field (the Megatron name)


def plan_export(bridge: Any, model: list[torch.nn.Module], reader: TorchDistReader) -> ExportPlan | None:
    """The streaming plan for a one-chunk TP1 model built from ``bridge`` (an ``AutoBridge``), or ``None``."""
    from vime_gemma4_bridge.torch_dist_layout import sharded_state_dict

    if len(model) != 1:
        return None
    model_bridge = bridge._model_bridge  # the registered Gemma 4 bridge (AutoBridge exposes no public getter)
    tasks = [task for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, model) if task is not None]
    state = sharded_state_dict(model)[0]["model"]
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


def plan_streamed_experts(
    tasks: Sequence[Any], state: Mapping[str, Any], usable: Callable[[Any], bool]
) -> StreamedExperts | None:
    """The experts to stream, or ``None`` when any of them cannot be (then nothing is streamed).

    ``tasks`` are Megatron-Bridge's conversion tasks of a TP1/PP1/EP1 model and ``state`` its flat
    ``sharded_state_dict``. An expert streams when its mapping is upstream's fused expert mapping
    without permutation or transpose, its sharded description tiles the parameter in memory order,
    and ``usable`` accepts each such chunk (the export: it is stored as is in the checkpoint). The
    import (:mod:`vime_gemma4_bridge.stream_import`) and the export share this plan.
    """
    from megatron.bridge.models.conversion import param_mapping
    from megatron.bridge.utils.common_utils import extract_expert_number_from_param

    from vime_gemma4_bridge.compat import mappings

    plain = (param_mapping.FusedExpertMapping, param_mapping.FusedGatedExpertMapping, mappings.FusedGatedExpertMapping)
    groups: dict[str, dict[int, _Expert]] = {}
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
        groups.setdefault(mapping.group_key, {})[number] = _Expert(task, pieces)
    ordered: dict[str, list[_Expert]] = {}
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            return None
        ordered[name] = [experts[i] for i in range(len(experts))]
    return StreamedExperts(ordered) if ordered else None


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


def streamed_export_tensors(experts: StreamedExperts, reader: TorchDistReader) -> dict[str, LazyTensor]:
    """HF name -> lazily written stack of its experts, after proving the stack is the mapping's output.

    The proof, per HF tensor: expert 0 is read into its Megatron parameter and converted by its own
    Megatron-Bridge mapping; the result must be exactly that parameter under exactly that HF name.
    """
    from vime_gemma4_bridge.torch_dist_layout import ConversionError

    out: dict[str, LazyTensor] = {}
    for name, group in experts.groups.items():
        first = group[0]
        param = first.task.param_weight
        with torch.no_grad():
            for piece in first.pieces:
                stored = reader.read(piece.key, piece.global_offset, stored_shape(piece))
                piece.data.copy_(stored.view(piece.data.shape))
        converted = first.task.mapping.megatron_to_hf(param, first.task.megatron_module)
        if list(converted) != [name] or not torch.equal(converted[name], param):
            raise ConversionError(
                f"Megatron-Bridge's mapping of {first.task.param_name} is not a plain stack of experts "
                f"(got {sorted(converted)}); export with an explicit topology (e.g. --tp 1 --ep 1) instead"
            )
        out[name] = LazyTensor((len(group), *param.shape), param.dtype, _pieces(group, reader))
    return out


def _pieces(group: list[_Expert], reader: TorchDistReader):
    def pieces() -> Iterator[torch.Tensor]:
        for expert in group:
            for piece in expert.pieces:
                yield reader.read(piece.key, piece.global_offset, stored_shape(piece))
                # The writer has written it and holds no reference: let its pages go from this process.
                reader.release(piece.key, piece.global_offset)

    return pieces
