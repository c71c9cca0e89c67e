"""Hugging Face checkpoints on disk: reading, the language-model filter, safe complete writes.

The language-model filter lives here, in :func:`language_model_prefix` and
:meth:`HFCheckpoint.language_model_names`: Gemma 4's text weights are the tensors under
``model.language_model.`` (VL checkpoint) or ``model.`` (CausalLM). Only those enter Megatron
and the live export; everything else (vision/audio towers and their embedders) is copied
unchanged from the source when a complete HF checkpoint is written.

:func:`save_safetensors` (behind :func:`write_shards`) is the one safetensors shard writer of the
package: the export, ``roundtrip``, ``export-live`` and the bench's synthetic checkpoint all write
through it, one tensor (or one piece of a :class:`LazyTensor`) at a time. Output directories are
committed by :mod:`vime_gemma4_bridge.io.commit`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX
from vime_gemma4_bridge.io.commit import atomic_directory, remove_stale_partials
from vime_gemma4_bridge.io.digests import (
    HEADER_KEY,
    HF_PREFIX,
    PLACEHOLDER,
    Hasher,
    Span,
    check_spans,
    damaged,
    header_digest,
    hf_spans,
    write_hashed,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
#: Weight files are rewritten; every other file of the source (config, generation config,
#: tokenizer, processor, chat template, ...) is copied as is.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5")


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
            path = self.path / file
            with open(path, "rb") as handle:
                header_size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(header_size))
            for name in file_names:
                begin, end = header[name]["data_offsets"]
                shape, dtype = tuple(header[name]["shape"]), TORCH_DTYPES[header[name]["dtype"]]
                found[name] = TensorLocation(path, 8 + header_size + begin, end - begin, shape, dtype)
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


def write_hf_checkpoint(
    out: str | os.PathLike,
    language_tensors: Mapping[str, torch.Tensor | LazyTensor],
    source: HFCheckpoint,
    *,
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
    show_progress: bool = False,
    rewrite: Callable[[list[NamedTensor]], list[NamedTensor]] | None = None,
    config_fields: Mapping[str, Any] | None = None,
    carried: Mapping[str, torch.Tensor | LazyTensor] | None = None,
    before_commit: Callable[[], None] = lambda: None,
) -> Path:
    """Write a complete HF checkpoint: ``language_tensors`` plus everything else copied from ``source``.

    ``carried``: tensors outside the language model written in place of ``source``'s (the towers a
    vision-language torch_dist checkpoint holds); each must be one of ``source``'s names.

    Tensors keep the source's order; ``show_progress`` draws a progress bar on stderr (lazy tensors
    are produced while written, so for a streaming export this is the long phase). The checkpoint
    is assembled in a temporary sibling directory and renamed into place only when complete, so an
    interrupted run leaves nothing that looks like a checkpoint; the source is only read.
    ``rewrite`` turns the complete, ordered list into another layout (FP8 export:
    ``convert/fp8.quantized_checkpoint``) and ``config_fields`` are set in its ``config.json``.
    ``before_commit`` runs when every file is written, before the rename; what it raises leaves
    nothing (an export settles the check of its sources' digests there, run while it wrote).
    """
    out = prepare_output(out, force=force)
    expected = set(source.language_model_names())
    if set(language_tensors) != expected:
        missing = sorted(expected - set(language_tensors))[:3]
        extra = sorted(set(language_tensors) - expected)[:3]
        raise CheckpointError(f"refusing to write an incomplete checkpoint: missing {missing}, unexpected {extra}")
    try:
        with atomic_directory(out, replace=force) as tmp:
            copy_side_files(source, tmp)
            if config_fields:
                update_config(tmp, config_fields)
            # Copied from the source shard as they are written, not loaded beforehand: the vision
            # tower costs no memory, whatever its size.
            other_tensors = {name: source.lazy(name) for name in source.names() if name not in expected}
            if set(carried or ()) - set(other_tensors):
                raise CheckpointError(f"refusing to carry tensors {sorted(set(carried) - set(other_tensors))[:3]}")
            other_tensors.update(carried or {})
            ordered = [
                (name, language_tensors[name] if name in expected else other_tensors[name]) for name in source.names()
            ]
            if rewrite is not None:
                ordered = rewrite(ordered)
            with progress(f"Writing {out.name}", len(ordered), show_progress) as advance:
                write_shards(tmp, ordered, max_shard_size, advance=advance)
            before_commit()
    except OSError as error:  # disk full, permission denied, read-only file system, ...
        raise write_failed(out, error) from None
    return out


def write_failed(out: Path, error: OSError) -> CheckpointError:
    """The one-line failure of an atomic write of ``out`` (disk full, read-only, ...): the path named, nothing
    left (``atomic_directory`` removed the partial). A bare ``OSError`` says neither."""
    return CheckpointError(
        f"writing {out} failed: {error.strerror or error} ({error.filename or out.parent}); nothing was written"
    )


def update_config(directory: Path, fields: Mapping[str, Any]) -> None:
    """Set ``fields`` at the top level of ``directory/config.json`` (an FP8 export's ``quantization_config``)."""
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}, indent=2) + "\n")


def copy_side_files(source: HFCheckpoint, directory: Path) -> None:
    """Copy every file of ``source`` that is not weights or their index (config, tokenizer, ...) into ``directory``."""
    for item in source.path.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != INDEX_NAME:
            shutil.copy2(item, directory / item.name)


@contextlib.contextmanager
def progress(description: str, total: int, show: bool) -> Iterator[Callable[[], None]]:
    """A step callback drawing a progress bar on stderr when ``show``, like Megatron-Bridge's (rich)."""
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        TextColumn("[progress.percentage]{task.percentage:>3.0f}%"),
        TimeRemainingColumn(),
        TextColumn("({task.completed}/{task.total})"),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:  # stdout is the report's
        task = bar.add_task(description, total=total)
        yield lambda: bar.update(task, advance=1)


def write_shards(
    directory: Path,
    tensors: Sequence[tuple[str, torch.Tensor | LazyTensor]],
    max_shard_size: int,
    *,
    always_index: bool = False,
    advance: Callable[[], None] = lambda: None,
) -> None:
    """Write ``tensors`` in order as safetensors shards of at most ``max_shard_size`` bytes, with an index.

    A tensor larger than the limit is a shard alone. One shard is ``model.safetensors`` without an
    index (as transformers writes it) unless ``always_index``; several are
    ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``.
    """
    shards: list[list[tuple[str, torch.Tensor | LazyTensor]]] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor_nbytes(tensor)
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1 and not always_index:
        save_safetensors(directory / SINGLE_NAME, shards[0], metadata=metadata, advance=advance)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(directory / file, shard, metadata=metadata, advance=advance)
        weight_map.update({name: file for name, _ in shard})
    total = sum(tensor_nbytes(t) for _, t in tensors)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


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


def save_safetensors(
    path: Path,
    tensors: Sequence[tuple[str, torch.Tensor | LazyTensor]],
    *,
    metadata: Mapping[str, str],
    advance: Callable[[], None] = lambda: None,
) -> None:
    """Write one safetensors file, streaming each tensor's bytes in order.

    The format is an 8-byte little-endian header length, a JSON header (names, dtypes, shapes,
    byte ranges; padded with spaces to 8 bytes) and the tensors' bytes back to back. safetensors'
    own ``save_file`` needs every tensor of the file in memory at once; this writer needs one
    piece of a :class:`LazyTensor` at a time, and writes eager tensors without a staging copy.
    The files read back with ``safetensors`` / transformers / vLLM like any other.

    Each tensor's digest is computed from the bytes as they are written (on a thread beside the write,
    :func:`~vime_gemma4_bridge.io.digests.write_hashed`) and recorded in the header
    metadata (:mod:`vime_gemma4_bridge.io.digests`): the header is written with placeholders of the
    same length first and rewritten in place at the end, so no byte is read or produced twice.
    """
    digests = {name: PLACEHOLDER for name, _ in tensors} | {HEADER_KEY: PLACEHOLDER}
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, tensor in tensors:
        nbytes = tensor_nbytes(tensor)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes

    def encoded_header() -> bytes:
        recorded = {(key if key == HEADER_KEY else HF_PREFIX + key): digest for key, digest in digests.items()}
        header["__metadata__"] = {**metadata, **recorded}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        return encoded + b" " * (-len(encoded) % 8)

    first = encoded_header()
    digests[HEADER_KEY] = header_digest(header)
    with open(path, "wb") as handle:
        handle.write(len(first).to_bytes(8, "little"))
        handle.write(first)
        for name, tensor in tensors:
            pieces = tensor.pieces() if isinstance(tensor, LazyTensor) else iter((tensor,))
            hasher, written = Hasher(), 0
            for piece in pieces:
                written += _write_bytes(handle, piece, hasher)
            if written != tensor_nbytes(tensor):
                raise CheckpointError(f"{name}: produced {written} bytes, expected {tensor_nbytes(tensor)}")
            digests[name] = hasher.hexdigest()
            advance()
        final = encoded_header()
        if len(final) != len(first):  # cannot happen: every digest has the placeholder's length
            raise CheckpointError(f"{path}: the header changed length when its digests were filled in")
        handle.seek(8)
        handle.write(final)


def _write_bytes(handle, tensor: torch.Tensor, hasher: Hasher) -> int:
    """Write a CPU tensor's bytes (row-major, native little-endian) without an intermediate copy when contiguous."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8).numpy() if flat.dtype != torch.bool else flat.numpy()
    return write_hashed(handle.write, raw.data, hasher)
