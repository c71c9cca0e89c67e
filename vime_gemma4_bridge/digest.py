"""The one tensor fingerprint of the package: blake2b-64 of dtype, shape and raw bytes.

Bitwise-equal tensors, and (but for a 2⁻⁶⁴ chance) only they, share it. Reports (``compare``,
``probe``, ``verify-update``) print it to tell tensors apart; the tiny factory uses it without the
shape to prove that no two tensors hold the same values.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_digest(tensor: torch.Tensor, *, with_shape: bool = True) -> str:
    """Hex digest of ``tensor``'s dtype, shape (unless ``with_shape=False``) and bytes."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{flat.dtype}|{tuple(tensor.shape) if with_shape else ''}|".encode())
    if flat.numel():
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()
