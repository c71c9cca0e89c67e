"""Hugging Face checkpoints on disk: reading, the language-model filter, safe complete writes.

The language-model filter lives here, in :func:`language_model_prefix` and
:meth:`HFCheckpoint.language_model_names`: Gemma 4's text weights are the tensors under
``model.language_model.`` (VL checkpoint) or ``model.`` (CausalLM). Only those enter Megatron
and the live export; everything else (vision/audio towers and their embedders) is copied
unchanged from the source when a complete HF checkpoint is written.

Writing is :mod:`vime_gemma4_bridge.io.hf_write`'s; this module holds what reads and writes share
(:class:`LazyTensor`, the dtype table, the checks of an output path).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX
from vime_gemma4_bridge.io.commit import remove_stale_partials
from vime_gemma4_bridge.io.digests import (
    Span,
    check_spans,
    damaged,
    hf_spans,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Weight files are rewritten; every other file of the source (config, generation config,
#: tokenizer, processor, chat template, ...) is copied as is.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, unreadable, or not Gemma 4."""


def language_model_prefix(config: Mapping) -> str:
    """The prefix of the language-model tensors for a HF ``config.json`` dict."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in LANGUAGE_MODEL_PREFIX:
            return LANGUAGE_MODEL_PREFIX[architecture]
    raise CheckpointError(
        f"not a Gemma 4 checkpoint: architectures={architectures} (expected one of {sorted(LANGUAGE_MODEL_PREFIX)})"
    )


def release_pages(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Drop the whole pages of ``[offset, offset + length)`` of a private mapping from this process.

    They stay in the page cache, and a later access faults the file's bytes back in (the mapping is
    never written), so this is safe even while a tensor still views them: RSS stays ~one chunk.
    """
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + length) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


@dataclass(frozen=True)
class TensorLocation:
    """A tensor's bytes inside a safetensors shard: read directly, they cost one copy and no mapping."""

    file: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def in_file(cls, path: Path, names: Iterable[str]) -> dict[str, TensorLocation]:
        """Where each of ``names`` is in safetensors file ``path``, from its header (no data read)."""
        with open(path, "rb") as handle:
            header_size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_size))
        found = {}
        for name in names:
            begin, end = header[name]["data_offsets"]
            shape, dtype = tuple(header[name]["shape"]), TORCH_DTYPES[header[name]["dtype"]]
            found[name] = cls(path, 8 + header_size + begin, end - begin, shape, dtype)
        return found

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the tensor (dim 0), read now into memory of their own.

        Read, not mapped: a mapping keeps every page it touched in this process until it is closed,
        so a check reading a large tensor block by block through one would end up holding it whole.
        """
        row = self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0
        stop = min(stop, self.shape[0])
        out = torch.empty((max(0, stop - start), *self.shape[1:]), dtype=self.dtype)
        with open(self.file, "rb", buffering=0) as handle:
            handle.seek(self.offset + start * row)
            view = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
            if handle.readinto(view) != len(view):
                raise CheckpointError(f"{self.file} ends inside its tensor's bytes")
        return out

    def mapped(self) -> torch.Tensor:
        """The tensor over a private memory mapping of its shard: only the pages that are read are loaded."""
        with open(self.file, "rb") as handle:
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        count = math.prod(self.shape)
        if not count:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(buffer, dtype=self.dtype, count=count, offset=self.offset).view(self.shape)


class HFCheckpoint:
    """A local safetensors checkpoint (single file or sharded with an index), read lazily."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"HF checkpoint {self.path} is not a directory")
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{self.path} has no config.json; is it a Hugging Face checkpoint?")
        try:
            self.config: dict = json.loads(config_file.read_text())
        except json.JSONDecodeError as error:
            raise CheckpointError(f"{config_file} is not valid JSON: {error}") from error
        self.prefix = language_model_prefix(self.config)
        self.weight_map = self._read_weight_map()

    def _read_weight_map(self) -> dict[str, str]:
        index_file = self.path / INDEX_NAME
        if index_file.is_file():
            try:
                weight_map = dict(json.loads(index_file.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index_file} is not a valid safetensors index: {error}") from error
        elif (self.path / SINGLE_NAME).is_file():
            weight_map = {}
        else:
            raise CheckpointError(f"{self.path} has neither {SINGLE_NAME} nor {INDEX_NAME}")
        files = sorted(set(weight_map.values())) or [SINGLE_NAME]
        listed: dict[str, str] = {}
        for file in files:
            file_path = self.path / file
            if not file_path.is_file():
                raise CheckpointError(f"safetensors shard {file_path} is missing (named by {INDEX_NAME})")
            try:
                with safe_open(file_path, framework="pt") as handle:
                    for name in handle.keys():
                        listed[name] = file
            except Exception as error:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"safetensors shard {file_path} is unreadable or corrupt: {error}") from error
        for name, file in weight_map.items():
            if listed.get(name) != file:
                raise CheckpointError(f"{INDEX_NAME} names tensor {name!r} in {file}, but that file does not hold it")
        unindexed = [name for name in listed if weight_map and name not in weight_map]
        if unindexed:  # transformers and Megatron-Bridge load by the index: they would not see these
            raise CheckpointError(
                f"{INDEX_NAME} lacks tensor {unindexed[0]!r}, which {listed[unindexed[0]]} holds "
                f"({len(unindexed)} in all); readers that follow the index would not load it: fix the index"
            )
        return listed

    def digest_spans(self, names: Iterable[str] | None = None) -> list[tuple[Span, str]]:
        """Each tensor's bytes (all, or ``names``) with the digest its shard's header records (none if not ours)."""
        return hf_spans(self.path, self.by_shard(self.names() if names is None else names))

    def check_digests(self) -> int:
        """Refuse (:class:`DamagedCheckpoint`) a tensor whose bytes differ from their digest; the count checked."""
        spans = self.digest_spans()
        found = check_spans(spans)
        if found:
            raise damaged("HF", self.path, found)
        return len(spans)

    def names(self) -> list[str]:
        """All tensor names, in file order."""
        return list(self.weight_map)

    def language_model_names(self) -> list[str]:
        """The tensors that belong to Megatron (the language-model filter)."""
        return [name for name in self.weight_map if name.startswith(self.prefix)]

    def by_shard(self, names: Iterable[str]) -> dict[str, list[str]]:
        """``names`` grouped by the shard file that holds them (file order of first appearance)."""
        grouped: dict[str, list[str]] = {}
        for name in names:
            grouped.setdefault(self.weight_map[name], []).append(name)
        return grouped

    def shapes(self) -> dict[str, list[int]]:
        """Every tensor's shape, from the headers."""
        return {name: shape for name, (shape, _) in self.signatures(self.names()).items()}

    def signatures(self, names: Iterable[str]) -> dict[str, tuple[list[int], str]]:
        """``{name: (shape, safetensors dtype)}`` from the safetensors headers (no tensor data is read)."""
        wanted = list(names)
        found: dict[str, tuple[list[int], str]] = {}
        for file, file_names in self.by_shard(wanted).items():
            with safe_open(self.path / file, framework="pt") as handle:
                for name in file_names:
                    piece = handle.get_slice(name)
                    found[name] = (list(piece.get_shape()), str(piece.get_dtype()))
        return {name: found[name] for name in wanted}

    def locate(self, name: str) -> TensorLocation:
        """Where tensor ``name``'s bytes are: its shard, their byte range, its shape and dtype (header only)."""
        return self.locations([name])[name]

    def locations(self, names: Iterable[str]) -> dict[str, TensorLocation]:
        """:meth:`locate` for each of ``names``, reading each shard's header once."""
        found: dict[str, TensorLocation] = {}
        for file, file_names in self.by_shard(names).items():
            found.update(TensorLocation.in_file(self.path / file, file_names))
        return found

    def lazy(self, name: str) -> LazyTensor:
        """Tensor ``name`` as a :class:`LazyTensor` over a memory mapping of its shard (read only while written)."""
        location = self.locate(name)
        return LazyTensor(location.shape, location.dtype, lambda: iter((location.mapped(),)))

    def load(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Load the named tensors (all when ``names`` is None), opening each shard once."""
        wanted = self.names() if names is None else list(names)
        tensors: dict[str, torch.Tensor] = {}
        for file, file_names in self.by_shard(wanted).items():
            with safe_open(self.path / file, framework="pt") as handle:
                for name in file_names:
                    tensors[name] = handle.get_tensor(name)
        return {name: tensors[name] for name in wanted}


def parse_size(text: str, flag: str = "size") -> int:
    """``"5GB"``, ``"500MB"``, ``"1GiB"``, ``"1000000"`` → bytes; a bare number is bytes.

    A size means what it means to transformers' ``max_shard_size`` because transformers' own parser
    (``transformers.utils.hub.convert_file_size_to_int``) reads it: whole numbers of decimal KB/MB/GB
    or binary KiB/MiB/GiB. The unit is read upper-cased, so ``5gb`` is bytes on the command line as
    it always was here (transformers would read a lowercase ``b`` as bits). Raises ``ValueError``
    naming ``flag`` for anything that is not a positive size.
    """
    from transformers.utils.hub import convert_file_size_to_int

    value = text.strip().upper()
    try:
        size = int(value) if value.isdigit() else convert_file_size_to_int(value)
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not a size; use e.g. 5GB, 500MB or 1000000") from None
    if size < 1:
        raise ValueError(f"{flag} must be at least 1 byte, got {text!r}")
    return size


def refuse_overlap(output: str | os.PathLike, flag: str, sources: Mapping[str, str | os.PathLike]) -> None:
    """Refuse an output that is, contains or lies inside a source, ``--force`` or not: sources are never modified."""
    out = Path(output).resolve()
    for source_flag, source in sources.items():
        src = Path(source).resolve()
        if out == src or src in out.parents or out in src.parents:
            raise CheckpointError(
                f"{flag} {output} overlaps {source_flag} {source}; sources are never modified: choose another path"
            )


def prepare_output(path: str | os.PathLike, *, force: bool) -> Path:
    """Check an output directory may be written (a probe directory is made and removed); return it.

    The hidden partial directories (``.NAME.partial*``) a killed run may have left beside it are removed.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output {out} exists and is a file; choose a directory path")
    if out.exists() and any(out.iterdir()) and not force:
        raise CheckpointError(f"output {out} already exists and is not empty; pass --force to replace it")
    parent = out.parent if out.parent.exists() else next(p for p in out.parents if p.exists())
    probe = parent / f".{out.name}.write-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        raise CheckpointError(f"cannot write output {out}: {error.strerror} ({parent}); choose another path") from None
    remove_stale_partials(out)  # left by a run that was killed (SIGKILL) while writing
    return out


@dataclass(frozen=True)
class LazyTensor:
    """A tensor known by shape and dtype whose bytes are produced only while it is written.

    ``pieces()`` yields contiguous tensors whose bytes, concatenated, are the tensor's bytes in
    row-major order. The streaming export hands the routed experts over this way: their bytes go
    from the torch_dist files to the HF shard one expert at a time, never whole in memory.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


NamedTensor = tuple[str, torch.Tensor | LazyTensor]


def tensor_nbytes(tensor: torch.Tensor | LazyTensor) -> int:
    """Bytes of an eager or lazy tensor."""
    return tensor.nbytes if isinstance(tensor, LazyTensor) else tensor.numel() * tensor.element_size()


#: torch dtype -> safetensors dtype name, and each name's bytes per element: the one table of both.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",  # block-FP8 exports (convert/fp8.py)
}
DTYPE_BYTES = {name: dtype.itemsize for dtype, name in SAFETENSORS_DTYPES.items()}
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
