"""Which Gemma 4 layers use sliding attention: the one place that decides it.

Hugging Face states it per layer (``config.layer_types``). Megatron-Bridge 0.6.2 squeezes that
into a periodic ``interleaved_attn_pattern = (sliding, full)`` tuple and asks
``_is_local_attn_layer(layer_number, pattern)``, which is only right for patterns of the form
"n sliding, then one full, repeated" (e.g. 26B-A4B's 5:1). A checkpoint with another pattern
(``[s, s, f, f]``, or anything irregular) would silently get the wrong window, head dim, KV heads
and torch_dist keys. We store the exact per-layer list in ``interleaved_attn_pattern`` and extend
upstream's predicate to accept it; two-int tuples keep upstream's behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron.bridge.models.gemma import gemma3_provider, modeling_gemma4

SLIDING = "sliding_attention"
FULL = "full_attention"

_upstream_is_local_attn_layer = gemma3_provider._is_local_attn_layer


def is_local_attn_layer(layer_number: int, layer_pattern: Any) -> bool:
    """Upstream's predicate, extended to an explicit per-layer list of HF layer types (1-indexed)."""
    if isinstance(layer_pattern, list):
        return layer_pattern[layer_number - 1] == SLIDING
    return _upstream_is_local_attn_layer(layer_number, layer_pattern)


def is_sliding_layer(config: Any, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (1-indexed, as in megatron-core) uses sliding attention."""
    return is_local_attn_layer(layer_number, config.interleaved_attn_pattern)


def pattern_from_layer_types(layer_types: Sequence[str]) -> list[str]:
    """Validate HF ``layer_types`` and return them as the provider's per-layer pattern."""
    unknown = sorted({t for t in layer_types if t not in (SLIDING, FULL)})
    if unknown:
        raise ValueError(f"unsupported Gemma 4 layer types {unknown}; expected {SLIDING!r} or {FULL!r}")
    return list(layer_types)


def install() -> None:
    """Make upstream's Gemma 4 modules consult the per-layer list (idempotent)."""
    modeling_gemma4._is_local_attn_layer = is_local_attn_layer
