"""Which Gemma 4 layers use sliding attention: the one place that decides it.

Hugging Face states it per layer (``config.layer_types``); the provider keeps that exact list
(``Gemma4TextModelProvider.layer_types``) and every module asks :func:`is_sliding_layer`. A
periodic "n sliding, then one full" rule would be wrong for any other pattern (``[s, s, f, f]``,
or anything irregular): wrong window, head dim, KV heads and torch_dist keys, silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def layer_group_rank(config: Any, layer_number: int, group_of: Callable[[int], Any]) -> tuple[int, int]:
    """``(index among the layers of its group, size of the group)``; ``group_of`` maps a layer number to its group.

    Layers of different shapes cannot share one torch_dist stack (sliding vs full attention,
    KV-shared attention, the double-wide MLP): this is a layer's place in its group's stack.
    """
    own = group_of(layer_number)
    same = [number for number in range(1, config.num_layers + 1) if group_of(number) == own]
    return same.index(layer_number), len(same)


def is_kv_shared_layer(config: Any, layer_number: int) -> bool:
    """Whether the layer reads an earlier layer's K/V: one of the last ``num_kv_shared_layers`` (HF's flag)."""
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    return shared > 0 and layer_number > config.num_layers - shared


def kv_shared_types(config: Any) -> list[str]:
    """The layer types that KV-shared layers have, in first-seen order (each has one K/V source layer)."""
    types = [config.layer_types[n - 1] for n in range(1, config.num_layers + 1) if is_kv_shared_layer(config, n)]
    return list(dict.fromkeys(types))


def is_kv_source_layer(config: Any, layer_number: int) -> bool:
    """Whether the layer's K/V are read by later layers: the last non-shared layer of a shared type.

    transformers' ``store_full_length_kv`` (it also marks a type no shared layer has; nothing reads that one).
    """
    own = config.layer_types[layer_number - 1]
    if is_kv_shared_layer(config, layer_number) or own not in kv_shared_types(config):
        return False
    later = range(layer_number + 1, config.num_layers + 1)
    return not any(config.layer_types[n - 1] == own and not is_kv_shared_layer(config, n) for n in later)


def has_double_wide_mlp(config: Any, layer_number: int) -> bool:
    """Whether the layer's MLP is twice ``ffn_hidden_size`` wide (``use_double_wide_mlp`` on KV-shared layers)."""
    return bool(getattr(config, "use_double_wide_mlp", False)) and is_kv_shared_layer(config, layer_number)
