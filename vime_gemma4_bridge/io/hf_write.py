"""Writing HF checkpoints: safetensors shards laid out first, each tensor written into its place as it comes.

Why laid out first: an export at a topology receives the language model from Megatron-Bridge's
collectives one tensor at a time, in its task order, not the source's. Holding tensors until the
source's order comes round holds the whole language model in rank 0 (~48 GB at 26B-A4B). But a
safetensors file names every tensor's byte range in its header, and an output's layout is known
before any byte arrives: the source's names, shapes and dtypes (an FP8 export: its rewrite of
them). So :class:`Shards` writes each file's header first and each tensor's bytes at its place when
it comes: one tensor in memory at a time, and the files byte for byte those of a write in order.

:class:`Shards` is the one safetensors writer of the package: the export, ``roundtrip --output``,
``export-live``'s chunk files (:func:`save_safetensors`) and the bench's synthetic checkpoint
(:func:`write_shards`) all write through it, one tensor (or one piece of a :class:`LazyTensor`) at
a time. :func:`writing_hf_checkpoint` adds what makes the directory a complete checkpoint: the
source's other files and tensors, the layout checks, the atomic commit (:mod:`~vime_gemma4_bridge.io.commit`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.io.commit import atomic_directory
from vime_gemma4_bridge.io.digests import HEADER_KEY, HF_PREFIX, PLACEHOLDER, Hasher, header_digest, write_hashed
from vime_gemma4_bridge.io.hf import (
    INDEX_NAME,
    SAFETENSORS_DTYPES,
    SINGLE_NAME,
    TORCH_DTYPES,
    WEIGHT_SUFFIXES,
    CheckpointError,
    HFCheckpoint,
    LazyTensor,
    NamedTensor,
    prepare_output,
    tensor_nbytes,
)

#: A layout rewrite (FP8 export's ``convert/fp8.quantized_checkpoint``): entries in, the written ones out.
Rewrite = Callable[[Sequence[NamedTensor]], list[NamedTensor]]


def _signature(tensor: torch.Tensor | LazyTensor) -> str:
    return f"{SAFETENSORS_DTYPES.get(tensor.dtype, tensor.dtype)}{list(tensor.shape)}"


@dataclass
class _File:
    """One shard: its header (names, dtypes, shapes, byte ranges) and the digests filled in as tensors arrive."""

    path: Path
    metadata: dict[str, str]
    header: dict[str, Any] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)
    size: int = 0  # data bytes
    data_start: int = 0  # where the data begins: after the length and the header

    def add(self, name: str, tensor: torch.Tensor | LazyTensor) -> None:
        nbytes = tensor_nbytes(tensor)
        self.header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.size, self.size + nbytes],
        }
        self.digests[name] = PLACEHOLDER
        self.size += nbytes

    def encoded_header(self) -> bytes:
        recorded = {(key if key == HEADER_KEY else HF_PREFIX + key): digest for key, digest in self.digests.items()}
        encoded = json.dumps({"__metadata__": {**self.metadata, **recorded}, **self.header}, separators=(",", ":"))
        return encoded.encode() + b" " * (-len(encoded) % 8)

    def create(self) -> None:
        """Write the header, every digest a placeholder of its final length (the header's own is final)."""
        self.digests[HEADER_KEY] = PLACEHOLDER
        first = self.encoded_header()
        self.digests[HEADER_KEY] = header_digest(json.loads(first))
        self.data_start = 8 + len(first)
        with open(self.path, "wb") as handle:
            handle.write(len(first).to_bytes(8, "little"))
            handle.write(first)
            handle.truncate(self.data_start + self.size)

    def finish(self) -> None:
        """Rewrite the header with every digest in place (same length: nothing else moves)."""
        final = self.encoded_header()
        if 8 + len(final) != self.data_start:  # cannot happen: every digest has the placeholder's length
            raise CheckpointError(f"{self.path}: the header changed length when its digests were filled in")
        with open(self.path, "r+b") as handle:
            handle.seek(8)
            handle.write(final)


class Shards:
    """Safetensors files laid out from ``layout`` (names, shapes, dtypes in order), filled in any order.

    Files hold at most ``max_shard_size`` bytes each (a larger tensor is a file alone). One file is
    ``model.safetensors`` without an index (as transformers writes it) unless ``always_index``;
    several are ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``. Each
    tensor's digest is computed from its bytes as they are written
    (:func:`~vime_gemma4_bridge.io.digests.write_hashed`) and recorded in its file's header when the
    block ends; a tensor not put by then is refused (nothing is written if the block raises). The
    files read back with ``safetensors`` / transformers / vLLM like any other. ``what`` names the
    layout's origin in the refusals.
    """

    def __init__(
        self,
        directory: Path,
        layout: Sequence[NamedTensor],
        max_shard_size: float,
        *,
        always_index: bool = False,
        metadata: Mapping[str, str] | None = None,
        advance: Callable[[], None] = lambda: None,
        what: str = "the layout",
    ) -> None:
        self.directory, self.advance, self.what = directory, advance, what
        new_file = functools.partial(_File, Path(), dict({"format": "pt"} if metadata is None else metadata))
        self.files = [new_file()]
        self._where: dict[str, _File] = {}
        self._done: set[str] = set()
        for name, tensor in layout:
            if self.files[-1].header and self.files[-1].size + tensor_nbytes(tensor) > max_shard_size:
                self.files.append(new_file())
            self.files[-1].add(name, tensor)
            self._where[name] = self.files[-1]
        #: Whether an index names the files (several, or ``always_index``).
        self.index = len(self.files) > 1 or always_index
        for i, file in enumerate(self.files, start=1):
            file.path = directory / (
                f"model-{i:05d}-of-{len(self.files):05d}.safetensors" if self.index else SINGLE_NAME
            )

    @classmethod
    def one_file(cls, path: Path, layout: Sequence[NamedTensor], metadata: Mapping[str, str]) -> Shards:
        """All of ``layout`` in one file at ``path``, without an index."""
        shards = cls(path.parent, layout, max_shard_size=math.inf, metadata=metadata)
        shards.files[0].path = path
        return shards

    def __enter__(self) -> Shards:
        for file in self.files:
            file.create()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            return  # the caller's atomic directory removes what was written
        missing = [name for name in self._where if name not in self._done]
        if missing:
            raise CheckpointError(
                f"refusing to write an incomplete checkpoint: {missing[:3]} of {self.what} never came "
                f"({len(missing)} in all)"
            )
        for file in self.files:
            file.finish()
        if self.index:
            weight_map = {name: file.path.name for name, file in self._where.items()}
            index = {"metadata": {"total_size": sum(f.size for f in self.files)}, "weight_map": weight_map}
            (self.directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

    def accepts(self, name: str, tensor: torch.Tensor | LazyTensor) -> str | None:
        """Why ``put(name, tensor)`` would be refused (``None``: it would not)."""
        file = self._where.get(name)
        if file is None:
            return f"{name} is not a tensor of {self.what}"
        if name in self._done:
            return f"{name} came twice"
        planned = file.header[name]
        if [planned["dtype"], planned["shape"]] != [SAFETENSORS_DTYPES.get(tensor.dtype), list(tensor.shape)]:
            return f"{name} came as {_signature(tensor)} but {self.what} has {planned['dtype']}{planned['shape']}"
        return None

    def put(self, name: str, tensor: torch.Tensor | LazyTensor) -> None:
        """Write ``tensor`` (eager, or a lazy tensor's pieces in turn) at its place; refuse another layout."""
        refusal = self.accepts(name, tensor)
        if refusal:
            raise CheckpointError(f"{refusal}; refusing to write a checkpoint of another layout")
        file = self._where[name]
        start, end = file.header[name]["data_offsets"]
        hasher, written = Hasher(), 0
        with open(file.path, "r+b") as handle:
            handle.seek(file.data_start + start)
            for piece in tensor.pieces() if isinstance(tensor, LazyTensor) else (tensor,):
                written += _write_bytes(handle, piece, hasher)
                if written > end - start:
                    break
        if written != end - start:
            raise CheckpointError(f"{name}: produced {written} bytes, expected {end - start}")
        file.digests[name] = hasher.hexdigest()
        self._done.add(name)
        self.advance()


def _write_bytes(handle: Any, tensor: torch.Tensor, hasher: Hasher) -> int:
    """Write a CPU tensor's bytes (row-major, native little-endian) without an intermediate copy when contiguous."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8).numpy() if flat.dtype != torch.bool else flat.numpy()
    return write_hashed(handle.write, raw.data, hasher)


def write_shards(
    directory: Path,
    tensors: Sequence[NamedTensor],
    max_shard_size: int,
    *,
    always_index: bool = False,
    advance: Callable[[], None] = lambda: None,
) -> None:
    """Write ``tensors`` in order as safetensors shards of at most ``max_shard_size`` bytes (:class:`Shards`)."""
    with Shards(directory, tensors, max_shard_size, always_index=always_index, advance=advance) as shards:
        for name, tensor in tensors:
            shards.put(name, tensor)


def save_safetensors(path: Path, tensors: Sequence[NamedTensor], *, metadata: Mapping[str, str]) -> None:
    """Write one safetensors file at ``path``, streaming each tensor's bytes in order (:class:`Shards`).

    safetensors' own ``save_file`` needs every tensor of the file in memory at once; this needs one
    piece of a :class:`LazyTensor` at a time, and writes eager tensors without a staging copy.
    """
    with Shards.one_file(path, tensors, metadata) as shards:
        for name, tensor in tensors:
            shards.put(name, tensor)


class CheckpointWriter:
    """A complete HF checkpoint being written (:func:`writing_hf_checkpoint`): language-model tensors are
    :meth:`put` in any order, each written at once; ``tensors`` / ``nbytes`` count them."""

    def __init__(self, path: Path, shards: Shards, language: set[str], rewrite: Rewrite) -> None:
        self.path, self._shards, self._language, self._rewrite = path, shards, language, rewrite
        self.tensors = self.nbytes = 0

    def accepts(self, name: str, tensor: torch.Tensor | LazyTensor) -> str | None:
        """Why :meth:`put` would refuse it (``None``: it would not)."""
        if name not in self._language:
            return f"{name} is not a language-model tensor of {self._shards.what}"
        # what is written is the rewrite's entries (FP8 export: the e4m3 weight and its scales)
        return next(filter(None, (self._shards.accepts(*entry) for entry in self._rewrite([(name, tensor)]))), None)

    def put(self, name: str, tensor: torch.Tensor | LazyTensor) -> None:
        """Write one language-model tensor of the source's name, shape and dtype (refused otherwise)."""
        if name not in self._language:
            raise CheckpointError(f"{name} is not a language-model tensor of {self._shards.what}")
        self.write(name, tensor)  # each entry checked by Shards.put
        self.tensors += 1
        self.nbytes += tensor_nbytes(tensor)

    def write(self, name: str, tensor: torch.Tensor | LazyTensor) -> None:
        """Write any tensor of the layout, through the rewrite (the source's others: towers, embedders)."""
        for entry in self._rewrite([(name, tensor)]):
            self._shards.put(*entry)


def _planned(shape: Sequence[int], dtype: str) -> LazyTensor:
    """A tensor of the layout whose bytes come later (through :meth:`CheckpointWriter.put`)."""

    def not_yet() -> Iterator[torch.Tensor]:
        raise CheckpointError("a planned tensor was written before it came")

    return LazyTensor(tuple(shape), TORCH_DTYPES[dtype], not_yet)


@contextlib.contextmanager
def writing_hf_checkpoint(
    out: str | os.PathLike,
    source: HFCheckpoint,
    *,
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
    show_progress: bool = False,
    rewrite: Rewrite | None = None,
    config_fields: Mapping[str, Any] | None = None,
    carried: Mapping[str, torch.Tensor | LazyTensor] | None = None,
    before_commit: Callable[[], None] = lambda: None,
) -> Iterator[CheckpointWriter]:
    """A complete HF checkpoint at ``out``: the language-model tensors the block puts, in any order, plus
    everything else copied from ``source``; committed when the block ends with every one of them put.

    The layout is the source's (names, shapes, dtypes, order, shards by ``max_shard_size``), so the
    files are those a write in the source's order gives. ``carried``: tensors outside the language
    model written in place of ``source``'s (the towers a vision-language torch_dist checkpoint
    holds); each must be one of ``source``'s names. ``show_progress`` draws a progress bar on stderr.
    The checkpoint is assembled in a temporary sibling directory and renamed into place only when
    complete, so an interrupted run (or the block raising) leaves nothing that looks like a
    checkpoint; the source is only read. ``rewrite`` turns each entry into the entries of another
    layout (FP8 export: ``convert/fp8.quantized_checkpoint``) and ``config_fields`` are set in its
    ``config.json``. ``before_commit`` runs when every file is written, before the rename; what it
    raises leaves nothing (an export settles the check of its sources' digests there).
    """
    out = prepare_output(out, force=force)
    language = set(source.language_model_names())
    rewrite = rewrite or list
    signatures = source.signatures(language)
    try:
        with atomic_directory(out, replace=force) as tmp:
            copy_side_files(source, tmp)
            if config_fields:
                update_config(tmp, config_fields)
            # Copied from the source shard as they are written, not loaded beforehand: the vision
            # tower costs no memory, whatever its size.
            others = {name: source.lazy(name) for name in source.names() if name not in language}
            if set(carried or ()) - set(others):
                raise CheckpointError(f"refusing to carry tensors {sorted(set(carried) - set(others))[:3]}")
            others.update(carried or {})
            layout = [
                (name, others[name] if name in others else _planned(*signatures[name])) for name in source.names()
            ]
            planned = rewrite(layout)
            what = f"the source {source.path}"
            with progress(f"Writing {out.name}", len(planned), show_progress) as advance:
                with Shards(tmp, planned, max_shard_size, advance=advance, what=what) as shards:
                    writer = CheckpointWriter(out, shards, language, rewrite)
                    yield writer
                    for name, tensor in others.items():
                        writer.write(name, tensor)
            before_commit()
    except OSError as error:  # disk full, permission denied, read-only file system, ...
        raise write_failed(out, error) from None


def write_hf_checkpoint(
    out: str | os.PathLike,
    language_tensors: Mapping[str, torch.Tensor | LazyTensor],
    source: HFCheckpoint,
    **options: Any,
) -> Path:
    """:func:`writing_hf_checkpoint` of ``language_tensors`` (all of them at hand); the output's path."""
    with writing_hf_checkpoint(out, source, **options) as writer:
        for name, tensor in language_tensors.items():
            writer.put(name, tensor)
    return writer.path


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
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name != INDEX_NAME:
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
