"""Which Gemma 4 layers use sliding attention: the one place that decides it.

Hugging Face states it per layer (``config.layer_types``); the provider keeps that exact list
(``Gemma4TextModelProvider.layer_types``) and every module asks :func:`is_sliding_layer`. A
periodic "n sliding, then one full" rule would be wrong for any other pattern (``[s, s, f, f]``,
or anything irregular): wrong window, head dim, KV heads and torch_dist keys, silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"


def pattern_from_layer_types(layer_types: Sequence[str]) -> list[str]:
    """Validate HF ``layer_types`` and return them as the provider's per-layer pattern."""
    unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
    if unknown:
        raise ValueError(f"unsupported Gemma 4 layer types {unknown}; expected {SLIDING!r} or {FULL!r}")
    return list(layer_types)


def is_sliding_layer(config: Any, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-indexed, as in megatron-core) uses sliding attention."""
    return config.layer_types[layer_number - 1] == SLIDING


def layer_type_rank(config: Any, layer_number: int) -> tuple[int, int]:
    """``(index among layers of the same type, number of layers of that type)`` for ``layer_number``.

    Sliding and full layers have different attention shapes, so torch_dist stores each type as its
    own stack of layers; this is a layer's place in its stack.
    """
    own = config.layer_types[layer_number - 1]
    same = [i for i, layer_type in enumerate(config.layer_types) if layer_type == own]
    return same.index(layer_number - 1), len(same)
