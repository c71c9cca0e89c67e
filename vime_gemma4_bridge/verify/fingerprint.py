"""The one tensor fingerprint of the package: blake2b-64 of dtype, shape and raw bytes.

Bitwise-equal tensors, and (but for a 2⁻⁶⁴ chance) only they, share it. Reports (``compare``,
``probe``, ``verify-update``) print it to tell tensors apart; the tiny factory uses it without the
shape to prove that no two tensors hold the same values. :class:`Fingerprint` adds the few
statistics a person needs to see *how* two tensors differ.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

#: Hex characters of a digest shown to people; comparisons always use the full digest.
SHORT_HASH = 10
#: Elements per chunk when statistics are computed in float64 (bounds memory).
CHUNK = 1 << 22


def tensor_digest(tensor: torch.Tensor, *, with_shape: bool = True) -> str:
    """Hex digest of ``tensor``'s dtype, shape (unless ``with_shape=False``) and bytes."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{flat.dtype}|{tuple(tensor.shape) if with_shape else ''}|".encode())
    if flat.numel():
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def stacked_digest(tensor: torch.Tensor, parts: Iterable[str]) -> str:
    """Digest of a stacked tensor from the digests of its leading slices (already computed, not rehashed).

    Like :func:`tensor_digest`, equal exactly for bitwise-equal stacks; a different value, so it is
    only ever compared with other stacked digests.
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    for part in parts:
        digest.update(bytes.fromhex(part))
    return digest.hexdigest()


def short(digest: str | None) -> str | None:
    """The digest as shown to people."""
    return digest[:SHORT_HASH] if digest else None


@dataclass(frozen=True)
class Fingerprint:
    """A stable content hash (dtype, shape and bytes) plus a few statistics, for people and JSON."""

    digest: str
    mean: float
    std: float
    absmax: float

    @property
    def short(self) -> str:
        return self.digest[:SHORT_HASH]

    def as_dict(self) -> dict[str, Any]:
        return {"hash": self.short, "digest": self.digest, "mean": self.mean, "std": self.std, "absmax": self.absmax}

    def __str__(self) -> str:
        return f"{self.short} (mean={self.mean:+.3g} std={self.std:.3g} absmax={self.absmax:.3g})"


def _stats(tensor: torch.Tensor) -> tuple[float, float, float]:
    """(mean, std, absmax) in float64, chunk by chunk so a 262k x 2816 embedding stays cheap."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0, 0.0, 0.0
    total = squares = 0.0
    absmax = 0.0
    for start in range(0, n, CHUNK):
        chunk = flat[start : start + CHUNK].double()
        total += chunk.sum().item()
        squares += chunk.square().sum().item()
        absmax = max(absmax, chunk.abs().max().item())
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean * mean, 0.0)), absmax


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """The :class:`Fingerprint` of one tensor."""
    return Fingerprint(tensor_digest(tensor), *_stats(tensor))


def swap_halves(expert: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` → ``[up; gate]`` along dim 0: what a gate/up mix-up leaves, fingerprinted to recognise it."""
    gate, up = torch.chunk(expert, 2, dim=0)
    return torch.cat([up, gate], dim=0)
