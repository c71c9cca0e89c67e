"""Bitwise identity of tensors, by their bytes: the one comparison every "bitwise" check makes.

``torch.equal`` compares values: a NaN is never equal to itself (a diverged run's checkpoint could
not round-trip) and ``-0.0`` equals ``0.0`` (a sign flip would pass). Comparing the bytes, each
element read as the integer of its width, keeps NaN payloads, infinities and signed zeros exact.
"""

from __future__ import annotations

import torch

#: Element size in bytes -> the integer dtype of that width (a free reinterpretation, no copy).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted as integers of its element width (a view of the same storage)."""
    return tensor.view(_BITS[tensor.element_size()]) if tensor.dtype.is_floating_point else tensor


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bytes (NaN, Inf and ``-0.0`` included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
