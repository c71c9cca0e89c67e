"""A torch_dist checkpoint's ``.metadata`` read without letting it run code.

PyTorch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load`` (torch 2.14,
``distributed/checkpoint/filesystem.py``), and megatron-core's loader calls it on every rank: a
``.metadata`` whose pickle names ``os.system`` runs it. :func:`read_checkpoint_metadata` unpickles
the file with an allow-list and returns the result; anything else is refused in one line naming the
file and the class, before any rank starts. The bytes megatron-core reads later are then known to
construct only these classes.

The allow-list is what PyTorch's checkpoint metadata is made of, as megatron-core 0.19.2 and the
plugin write it (recorded from the 45 checkpoints the test suite writes, at every topology it
imports; every export's pre-flight reads through it, so the suite checks the list): the classes of
``torch.distributed.checkpoint.metadata`` and ``.planner`` (dataclasses and enums), the filesystem
writer's ``_StorageInfo``, ``torch.Size``, dtypes, the layout lookup ``torch.serialization._get_layout``
(a name -> ``torch.layout`` table) and plain containers.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.io.torch_dist_layout import ConversionError

_CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_NAMED = {
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


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


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise UnsafeCheckpoint(f"{module}.{name}")
        return found


def read_checkpoint_metadata(iteration_dir: str | Path) -> Any:
    """PyTorch's ``Metadata`` of a torch_dist iteration directory, read through the allow-list.

    Raises :class:`UnsafeCheckpoint` (one line: the file, the class, what to do) for a class
    outside it, and :class:`ConversionError` for a file that is not a pickle at all.
    """
    path = Path(iteration_dir) / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except UnsafeCheckpoint as error:
        raise UnsafeCheckpoint(
            f"{path} refused: its pickle names {error}, which a torch_dist checkpoint never holds (loading it "
            "could run code); do not use this checkpoint, re-create it with vime-gemma4 import"
        ) from None
    except Exception as error:  # noqa: BLE001 (pickle, EOF or OS errors of a damaged .metadata)
        raise ConversionError(
            f"{path} is unreadable ({type(error).__name__}: {error}); "
            "the checkpoint is damaged: re-create it with vime-gemma4 import"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise ConversionError(f"{path} holds a {type(metadata).__name__}, not PyTorch checkpoint metadata")
    if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
        metadata.storage_meta = StorageMeta()
    return metadata
