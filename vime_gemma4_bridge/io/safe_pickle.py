"""The pickles of a torch_dist checkpoint, read or checked without letting them run code.

A torch_dist checkpoint is mostly pickles, and the readers do not all restrict them (torch 2.14,
megatron-core 0.19.2):

* ``.metadata``: PyTorch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load``
  (``distributed/checkpoint/filesystem.py``); megatron-core calls it on every rank.
* byte items inside the ``.distcp`` files (megatron-core's ``ShardedObject``: the ``common_state``
  that every current checkpoint holds, the modules' ``_extra_state``): PyTorch's
  ``DefaultLoadPlanner.load_bytes`` unpickles them with ``torch.load(weights_only=False)``
  (``distributed/checkpoint/default_planner.py``), i.e. anything runs.
* a ``common.pt`` in the iteration directory (the legacy place of the common state, which
  megatron-core's ``load_common_state_dict`` prefers when present) and any other ``*.pt``
  (Megatron-Bridge's ``train_state.pt``): ``torch.load`` with PyTorch's weights-only default.
* tensor items: ``torch.load(weights_only=True)`` (PyTorch) or :mod:`.torch_dist_reader`'s own
  tensor-only unpickler.

:func:`read_checkpoint_metadata` reads ``.metadata`` through one allow-list; :func:`check_archive`
runs every ``torch.save`` archive (a ``.pt`` file, one item of a ``.distcp`` file) through the
same list without loading any data (tensor rebuilds and storages are stand-ins), recursing into
archives nested as bytes. Anything else is refused in one line naming the file and the class,
before any rank starts; the bytes megatron-core reads later are then known to construct only these.

The allow-list (:data:`_NAMED`, plus two rules in :func:`_allowed`) is what a torch_dist checkpoint
legitimately holds: PyTorch's checkpoint metadata classes (recorded from the checkpoints the test
suite writes at every topology it imports, as megatron-core 0.19.2 and the plugin write them);
``torch.save``'s tensor and storage primitives (what ``torch.load``'s weights-only unpickler
admits for a tensor); and megatron-core's own list of what its checkpoints hold
(``megatron/core/safe_globals.py``: ``SAFE_GLOBALS``, the training ``args`` namespace, numpy RNG
state, its enums and ``OptimizerConfig``; a test checks the table covers the installed list).
"""

from __future__ import annotations

import enum
import importlib
import io
import mmap
import pickle
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError

__all__ = ["UnsafeCheckpoint", "check_archive", "check_archives", "read_checkpoint_metadata"]

_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")

#: Names a checkpoint pickle may hold, besides dtypes and the metadata classes (see :func:`_allowed`).
_NAMED = {
    # plain containers and PyTorch's own small types (as torch.load's weights-only unpickler admits them)
    ("collections", "OrderedDict"),
    ("collections", "Counter"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("builtins", "complex"),
    ("_codecs", "encode"),  # how pickle protocol 2 (torch.save's) writes bytes
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    # where an item lies in its file (Metadata.storage_data's values), by the name the build gives it
    (seams.storage_info_class().__module__, seams.storage_info_class().__qualname__),
    # megatron-core 0.19.2's SAFE_GLOBALS (megatron/core/safe_globals.py), by the name pickle records
    ("types", "SimpleNamespace"),
    ("pathlib", "PosixPath"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.dtypes", "UInt32DType"),
    ("argparse", "Namespace"),
    ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "CudaGraphModule"),
    ("megatron.core.transformer.enums", "CudaGraphScope"),
    ("megatron.core.transformer.enums", "InferenceCudaGraphScope"),
    ("megatron.core.enums", "ModelType"),
    ("megatron.core.optimizer", "OptimizerConfig"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
    ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"),
    ("_io", "BytesIO"),
    ("signal", "Signals"),
    ("torch._C", "Generator"),
}

#: torch.save's tensor primitives besides ``torch._utils._rebuild_*`` and ``torch.*Storage``:
#: stand-ins when only checking (no storage is ever loaded).
_TENSOR_PRIMITIVES = {
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}

#: Functions that unpickle nested bytes (another torch.save archive): checked recursively.
_NESTED_LOADS = {("torch.storage", "_load_from_bytes"), ("megatron.core.safe_globals", "safe_load_from_bytes")}


class UnsafeCheckpoint(ConversionError):
    """A checkpoint file whose pickle names something a checkpoint never holds."""


def _allowed(module: str, name: str) -> Any:
    """The object a pickle may name as ``module.name``, or ``None``."""
    if (module, name) not in _NAMED and module != "torch" and module not in _CLASS_MODULES:
        return None  # checked before importing: a hostile pickle's module is never imported
    found = getattr(importlib.import_module(module), name, None)
    if (module, name) in _NAMED:
        return found
    if module == "torch":
        return found if isinstance(found, torch.dtype) else None
    metadata_class = isinstance(found, type) and (
        hasattr(found, "__dataclass_fields__") or issubclass(found, enum.Enum)
    )
    return found if metadata_class else None


def _stand_in(*args: Any, **kwargs: Any) -> None:
    """What a tensor rebuild or storage class is while checking: nothing is constructed."""


class _Unpickler(pickle.Unpickler):
    """The allow-list unpickler; ``checking``: an archive's ``data.pkl``, tensors as stand-ins."""

    def __init__(self, file: io.BytesIO, *, checking: bool) -> None:
        super().__init__(file)
        self.checking = checking

    def find_class(self, module: str, name: str) -> Any:
        if self.checking:
            if (
                (module, name) in _TENSOR_PRIMITIVES
                or (module == "torch._utils" and name.startswith("_rebuild_"))
                or (module == "torch" and name.endswith("Storage"))
            ):
                return _stand_in
            if (module, name) in _NESTED_LOADS:
                return _check_nested
        found = _allowed(module, name)
        if found is None:
            raise UnsafeCheckpoint(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> None:
        if not self.checking:
            raise pickle.UnpicklingError("a persistent id outside a torch.save archive")
        return None  # a storage reference: its bytes are never read


def _check_nested(data: Any) -> None:
    if isinstance(data, bytes | bytearray):
        _check_zip(io.BytesIO(data))


def read_checkpoint_metadata(iteration_dir: str | Path) -> Any:
    """PyTorch's ``Metadata`` of a torch_dist iteration directory, read through the allow-list.

    Raises :class:`UnsafeCheckpoint` (one line: the file, the class, what to do) for a class
    outside it, and :class:`ConversionError` for a file that is not a pickle at all.
    """
    path = Path(iteration_dir) / ".metadata"
    try:
        metadata = _Unpickler(io.BytesIO(path.read_bytes()), checking=False).load()
    except UnsafeCheckpoint as error:
        raise _refusal(path, "", error) from None
    except Exception as error:  # noqa: BLE001 (pickle, EOF or OS errors of a damaged .metadata)
        raise _damaged(path, "", error) from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise ConversionError(f"{path} holds a {type(metadata).__name__}, not PyTorch checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
        metadata.storage_meta = StorageMeta()
    return metadata


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of a mapped file (for ``zipfile``)."""

    def __init__(self, buffer: mmap.mmap, offset: int, length: int) -> None:
        super().__init__()
        self.buffer, self.start, self.length, self.position = buffer, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, min(self.length, base + position))
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, target: Any) -> int:
        count = max(0, min(len(target), self.length - self.position))
        begin = self.start + self.position
        target[:count] = self.buffer[begin : begin + count]
        self.position += count
        return count


def _check_zip(file: Any) -> None:
    """Run the ``data.pkl`` of one torch.save archive through the allow-list (raises on a refusal)."""
    with zipfile.ZipFile(file) as archive:
        pickles = [name for name in archive.namelist() if name.count("/") == 1 and name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ValueError("not a torch.save archive (no single data.pkl)")
        _Unpickler(io.BytesIO(archive.read(pickles[0])), checking=True).load()


def check_archive(path: str | Path) -> None:
    """Refuse a ``torch.save`` file (``common.pt``, ``train_state.pt``) that could run code when loaded."""
    check_archives(Path(path), [("", 0, Path(path).stat().st_size)])


def check_archives(path: Path, items: Iterable[tuple[str, int, int]]) -> None:
    """Refuse a file whose ``torch.save`` archives at ``(item name, offset, length)`` could run code.

    One line per refusal: :class:`UnsafeCheckpoint` names the file, the item and the class;
    :class:`ConversionError` a damaged archive. Only each archive's directory and pickle are read.
    """
    with open(path, "rb") as handle:
        size = path.stat().st_size
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    try:
        for item, offset, length in items:
            try:
                if buffer is None or offset + length > size:
                    raise ValueError("the archive is past the end of the file")
                _check_zip(_Window(buffer, offset, length))
            except UnsafeCheckpoint as error:
                raise _refusal(path, item, error) from None
            except Exception as error:  # noqa: BLE001 (zip, pickle or EOF errors of damaged bytes)
                raise _damaged(path, item, error) from None
    finally:
        if buffer is not None:
            buffer.close()


def _where(path: Path, item: str) -> str:
    return f"{path} (item {item})" if item else str(path)


def _refusal(path: Path, item: str, error: UnsafeCheckpoint) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"{_where(path, item)} refused: its pickle names {error}, which a torch_dist checkpoint never holds "
        "(loading it could run code); do not use this checkpoint, re-create it with vime-gemma4 import"
    )


def _damaged(path: Path, item: str, error: Exception) -> ConversionError:
    return ConversionError(
        f"{_where(path, item)} is unreadable ({type(error).__name__}: {error}); "
        "the checkpoint is damaged: re-create it with vime-gemma4 import"
    )
