"""Reading single stored chunks of a torch_dist checkpoint in place: PyTorch DCP files, by key and offset.

Why not megatron-core's loader: the streaming export (:mod:`vime_gemma4_bridge.convert.stream_export`)
reads each routed expert straight from the files into the HF shard, and megatron-core's load plan
is quadratic in the chunks of a key (7,680 expert chunks per key at 26B-A4B). The index is
PyTorch's own checkpoint metadata; a plain tensor item is located inside ``torch.save``'s zip
container and used over a memory mapping (no copy), anything else goes through ``torch.load``.
"""

from __future__ import annotations

import collections
import io
import math
import mmap
import os
import pickle
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.io.hf import release_pages

__all__ = ["TorchDistReader"]


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
    The index is PyTorch's own checkpoint metadata, read through an allow-list (:mod:`..io.safe_pickle`).
    """

    def __init__(self, iteration_dir: str | os.PathLike) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

        self.path = Path(iteration_dir)
        metadata = read_checkpoint_metadata(self.path)
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
        """Drop a used chunk's pages from this process (:func:`~vime_gemma4_bridge.io.hf.release_pages`)."""
        info = self._items[(key, tuple(offsets))]
        buffer = self._files.get(info.relative_path)
        if buffer is not None:
            release_pages(buffer, info.offset, info.length)

    def close(self) -> None:
        """Drop the mappings (a mapping still viewed by a tensor is unmapped when that tensor goes)."""
        self._files.clear()
