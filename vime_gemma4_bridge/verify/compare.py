"""The one comparison engine: a reference and a candidate set of tensors, name by name, bitwise first.

Three reports stand on it: the round trip's per-family table (:func:`vime_gemma4_bridge.verify.report.compare`),
the checkpoint doctor (``vime-gemma4 compare``, :mod:`vime_gemma4_bridge.verify.doctor`) and the check of a
pushed weight update (``vime-gemma4 verify-update``). Each pairs the two sets with :func:`walk`, classifies
every pair with :func:`compare_tensors` and keeps what its own report needs. Checkpoints are read through
:class:`TensorFiles`, one tensor at a time, so two checkpoints are never in memory together.

"Equal" is bitwise: same dtype, same shape, same bytes (``core/bitwise.same_bytes``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.verify.fingerprint import CHUNK

#: What a pair can be: ``equal`` (bitwise), ``close`` (within ``atol``), ``different`` values, another
#: ``dtype`` or ``shape``; a name only the reference has is ``missing``, one only the candidate has ``extra``.
STATUSES = ("equal", "close", "different", "dtype", "shape", "missing", "extra")


def tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise identity: dtype, shape and every byte (NaN, Inf and ``-0.0`` included)."""
    return same_bytes(a, b)


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, cosine(a, b)) over all elements in float64, chunked; shapes must match.

    A NaN anywhere makes max |a - b| NaN (``torch.maximum`` propagates it), so a NaN can never pass
    for a small difference.
    """
    fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
    max_abs = torch.zeros((), dtype=torch.float64)
    dot = norm_a = norm_b = 0.0
    for start in range(0, fa.numel(), CHUNK):
        x, y = fa[start : start + CHUNK].double(), fb[start : start + CHUNK].double()
        max_abs = torch.maximum(max_abs, (x - y).abs().max())
        dot += (x * y).sum().item()
        norm_a += x.square().sum().item()
        norm_b += y.square().sum().item()
    if norm_a == 0.0 and norm_b == 0.0:
        cosine = 1.0
    elif norm_a == 0.0 or norm_b == 0.0:
        cosine = 0.0
    else:
        cosine = dot / math.sqrt(norm_a * norm_b)
    return max_abs.item(), cosine


@dataclass(frozen=True)
class Diff:
    """How a candidate tensor relates to its reference: a status of :data:`STATUSES` and, where measured,
    max |Δ| and cosine (``None`` for another shape, or when not measured)."""

    status: str
    max_abs: float | None = None
    cosine: float | None = None


def compare_tensors(
    reference: torch.Tensor, candidate: torch.Tensor, *, atol: float | None = None, measure: bool = True
) -> Diff:
    """Classify a pair: ``equal``; else ``shape``; else ``dtype``; else ``close`` (max |Δ| ≤ ``atol``) or ``different``.

    ``measure=False`` skips max |Δ| and cosine (a float64 pass over both tensors) for a caller that
    only needs the verdict, such as the round trip's table; ``close`` then never happens.
    """
    if tensors_identical(reference, candidate):
        return Diff("equal", 0.0, 1.0)
    if reference.shape != candidate.shape:
        return Diff("shape")
    max_abs, cosine = difference(reference, candidate) if measure else (None, None)
    if reference.dtype != candidate.dtype:
        return Diff("dtype", max_abs, cosine)
    if atol is not None and max_abs is not None and max_abs <= atol:
        return Diff("close", max_abs, cosine)
    return Diff("different", max_abs, cosine)


class TensorFiles:
    """Named tensors in safetensors files, read one at a time; each file is opened once (``with`` closes them).

    ``entries`` lists every (name, file) in order. A name may be in several files (a weight update
    pushed twice): it is then read from the first, and :func:`walk` reports the others.
    """

    def __init__(self, entries: Iterable[tuple[str, Path]] = ()) -> None:
        self.entries: list[tuple[str, Path]] = []
        self._first: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        for name, file in entries:
            self._add(name, file)

    @classmethod
    def of_checkpoint(cls, checkpoint: Any, names: Sequence[str] | None = None) -> TensorFiles:
        """A HF checkpoint's tensors (``HFCheckpoint``), all or ``names``, in its index order."""
        wanted = checkpoint.names() if names is None else names
        return cls((name, checkpoint.path / checkpoint.weight_map[name]) for name in wanted)

    @classmethod
    def of_files(cls, files: Iterable[Path]) -> TensorFiles:
        """Every tensor of these files, file by file in the order given, each file's in its own order."""
        tensors = cls()
        for file in files:
            for name in tensors._open(file).keys():
                tensors._add(name, file)
        return tensors

    def _add(self, name: str, file: Path) -> None:
        self.entries.append((name, file))
        self._first.setdefault(name, file)

    def _open(self, file: Path) -> Any:
        from safetensors import safe_open

        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        return handle

    def names(self) -> list[str]:
        """Each name once, in the order of first appearance."""
        return list(self._first)

    def file(self, name: str) -> Path:
        """The (first) file holding ``name``."""
        return self._first[name]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read now (from the first file holding it), through a handle of its own.

        safetensors maps the file; every page a handle has read stays in this process (its RSS) while
        the handle is open, so one handle per file would end a comparison holding the whole
        checkpoint. A tensor from a handle of its own takes its pages out when it is dropped.
        """
        from safetensors import safe_open

        with safe_open(self._first[name], framework="pt") as handle:
            return handle.get_tensor(name)

    def location(self, name: str) -> Any:
        """Where ``name``'s bytes are in the (first) file holding it (:class:`~vime_gemma4_bridge.io.hf.TensorLocation`,
        from the header): for a check that reads the tensor a block at a time instead of whole."""
        from vime_gemma4_bridge.io.hf import TensorLocation

        return TensorLocation.in_file(self._first[name], (name,))[name]

    def __contains__(self, name: object) -> bool:
        return name in self._first

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: A set of tensors by name: in memory, or read on demand.
Source = Mapping[str, torch.Tensor] | TensorFiles


@dataclass(frozen=True)
class Pair:
    """One name of the walk: its reference and candidate tensor (``None`` on the side that lacks it).

    ``again_in`` is set (and both tensors are ``None``) for a further appearance of a name the candidate
    already had, in that file.
    """

    name: str
    reference: torch.Tensor | None
    candidate: torch.Tensor | None
    again_in: Path | None = None


def walk(reference: Source, candidate: Source, *, order: str = "reference") -> Iterator[Pair]:
    """Pair the two sets name by name, reading each pair as it is yielded (``del`` it to keep one in memory).

    ``order="reference"``: the reference's names in order (``candidate`` ``None`` where missing), then
    the candidate's extras in its order. ``order="candidate"``: the candidate's entries in order
    (``reference`` ``None`` for an extra, ``again_in`` for a repeat), then the names it lacks in the
    reference's order.
    """
    ref_names, cand_names = names_of(reference), names_of(candidate)
    ref_set, cand_set = set(ref_names), set(cand_names)
    if order == "reference":
        for name in ref_names:
            yield Pair(name, tensor_of(reference, name), tensor_of(candidate, name) if name in cand_set else None)
        for name in cand_names:
            if name not in ref_set:
                yield Pair(name, None, tensor_of(candidate, name))
    elif order == "candidate":
        seen: set[str] = set()
        for name, file in _entries(candidate):
            if name in seen:
                yield Pair(name, None, None, again_in=file)
                continue
            seen.add(name)
            yield Pair(name, tensor_of(reference, name) if name in ref_set else None, tensor_of(candidate, name))
        for name in ref_names:
            if name not in cand_set:
                yield Pair(name, tensor_of(reference, name), None)
    else:
        raise ValueError(f"order must be 'reference' or 'candidate', got {order!r}")


def names_of(source: Source) -> list[str]:
    """Each name of ``source`` once, in its order."""
    return source.names() if isinstance(source, TensorFiles) else list(source)


def tensor_of(source: Source, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``source`` (read now from a :class:`TensorFiles`)."""
    return source.get(name) if isinstance(source, TensorFiles) else source[name]


def _entries(source: Source) -> list[tuple[str, Path | None]]:
    return list(source.entries) if isinstance(source, TensorFiles) else [(name, None) for name in source]
