"""The rollout layouts as views for the comparison engine: per-expert tensors restacked, a checkpoint quantized.

A live stream or an export can hold the routed experts per expert (``experts.<e>.gate_proj.weight``
...) and in block FP8 (:mod:`vime_gemma4_bridge.convert.fp8`). The checks compare them with the HF
checkpoint through the one engine (:mod:`vime_gemma4_bridge.verify.compare`) by two views:

* :class:`Restacked` shows every complete set of per-expert tensors as the HF stack it came from —
  bitwise the stack when every expert is right — so ``verify-update`` and ``compare`` (the doctor,
  with its per-expert diagnoses) read both layouts; an incomplete set stays per expert, so the
  stack is reported missing and the stray experts by name;
* :class:`Quantized` shows a bf16 checkpoint as FP8 export writes it (each stack quantized expert by
  expert and projection by projection, then stacked, as :class:`Restacked` stacks the FP8 parts):
  quantization is deterministic, so an FP8 update is checked bitwise too.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from vime_gemma4_bridge.convert.fp8 import SCALE_SUFFIX, is_quantized, quantize_block_fp8
from vime_gemma4_bridge.core.hf_layout import STACK_NAME, STACK_PROJECTIONS, split_expert, stack_of
from vime_gemma4_bridge.verify.compare import TensorFiles

__all__ = ["Quantized", "Restacked"]


class Restacked(TensorFiles):
    """``files`` with each complete set of per-expert tensors (or FP8 scales) shown as its stack, at its first part.

    Complete: experts ``0 .. E-1`` each with every projection of the stack. A part pushed twice
    shows the stack twice (the engine reports it pushed twice).
    """

    def __init__(self, files: TensorFiles) -> None:
        super().__init__()
        self._inner = files
        groups: dict[str, dict[tuple[int, str], str]] = defaultdict(dict)
        for name in files.names():
            if (found := stack_of(name)) is not None:
                stack, expert, projection = found
                groups[stack][(expert, projection)] = name
        self._parts = {stack: parts for stack, parts in groups.items() if _complete(stack, parts)}
        stack_by_part = {part: stack for stack, parts in self._parts.items() for part in parts.values()}
        self.restacked = bool(self._parts)
        seen: set[str] = set()
        for name, file in files.entries:
            stack = stack_by_part.get(name)
            if stack is None:
                self._add(name, file)
            elif stack not in self._first or name in seen:
                self._add(stack, file)
            seen.add(name)

    def get(self, name: str) -> torch.Tensor:
        parts = self._parts.get(name)
        if parts is None:
            return self._inner.get(name)
        projections = STACK_PROJECTIONS[_stack_kind(name)]
        experts = 1 + max(expert for expert, _ in parts)
        pieces = [[self._inner.get(parts[(e, p)]) for p in projections] for e in range(experts)]
        if len({(piece.dtype, piece.shape) for row in pieces for piece in row}) != 1:
            return torch.cat([piece.reshape(-1) for row in pieces for piece in row])  # reported as a shape change
        return torch.stack([torch.cat(row) for row in pieces])

    def close(self) -> None:
        self._inner.close()
        super().close()


def _stack_kind(stack: str) -> str:
    return STACK_NAME.match(stack.removesuffix(SCALE_SUFFIX))["stack"]


def _complete(stack: str, parts: dict[tuple[int, str], str]) -> bool:
    projections = STACK_PROJECTIONS[_stack_kind(stack)]
    experts = 1 + max(expert for expert, _ in parts)
    return len(parts) == experts * len(projections) and all(
        (e, p) in parts for e in range(experts) for p in projections
    )


class Quantized(TensorFiles):
    """A checkpoint's tensors as FP8 export writes them: each quantized weight ``NAME`` (e4m3) then ``NAME_scale_inv``.

    Stacks are quantized per expert and projection (what FP8 export yields), then stacked like
    :class:`Restacked` stacks them; every other tensor is the checkpoint's, bitwise.
    """

    def __init__(self, files: TensorFiles) -> None:
        super().__init__()
        self._inner = files
        self._cached: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        for name, file in files.entries:
            self._add(name, file)
            if _quantized(name):
                self._add(name + SCALE_SUFFIX, file)

    def get(self, name: str) -> torch.Tensor:
        base = name.removesuffix(SCALE_SUFFIX)
        if not _quantized(base):
            return self._inner.get(name)
        if self._cached is None or self._cached[0] != base:
            self._cached = base, self._quantize(base)
        return self._cached[1][1 if name != base else 0]

    def _quantize(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        tensor = self._inner.get(name)
        if not STACK_NAME.match(name):
            return quantize_block_fp8(tensor)
        experts = [
            [quantize_block_fp8(part) for _, part in split_expert(name, e, tensor[e])] for e in range(len(tensor))
        ]
        return (
            torch.stack([torch.cat([q for q, _ in row]) for row in experts]),
            torch.stack([torch.cat([s for _, s in row]) for row in experts]),
        )

    def close(self) -> None:
        self._inner.close()
        super().close()


def _quantized(name: str) -> bool:
    return STACK_NAME.match(name) is not None or is_quantized(name)
