"""What ``migrate`` moves: one stored piece of a checkpoint and where it goes, and how a stored key splits.

Shared by the MoE plan (:mod:`vime_gemma4_bridge.convert.migrate`) and the dense one
(:mod:`vime_gemma4_bridge.convert.migrate_dense`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vime_gemma4_bridge.io.torch_dist_layout import LANGUAGE_MODEL_KEY_PREFIX

#: A created TE norm's ``_extra_state``: an empty uint8 tensor, what a TE RMSNorm without FP8 holds.
EMPTY_STATE = "empty"
COMMON_STATE = "common_state"  # megatron-core dist_checkpointing/serialization.py L439: the common state as an object
#: Where the language model's key starts in a stored key (after an optimizer-state or ``language_model.`` prefix);
#: upstream's dense model keeps its per-layer embeddings at model level (``per_layer_*``).
MODEL_KEY = re.compile(r"(?:^|(?<=\.))(decoder|embedding|output_layer|per_layer_(?:embedding|model_proj|proj_norm))\.")
#: A megatron-core object's item as PyTorch's checkpoint metadata names it: its key, offsets and shape.
OBJECT_SHARD = re.compile(r"^(.*)/shard_([\d.]+)_([\d.]+)$")


@dataclass(frozen=True)
class Unit:
    """One stored piece of the source and where it goes: a tensor (``shape``, ``dtype``) or one object."""

    source: str
    target: str
    #: ``(index, size)`` on a leading stack axis, on each side; ``None``: no stack axis.
    source_stack: tuple[int, int] | None
    target_stack: tuple[int, int] | None
    shape: tuple[int, ...] = ()  # a tensor's shape without the stack axis
    dtype: Any = None
    #: an object's offset and shape without the stack axis (``None``: a tensor)
    object_at: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    layer: int = -1  # the HF layer, or -1 (moved by rank 0)
    #: ``(offset, length, total)`` on the first axis after the stack, on each side: a piece of the tensor
    source_rows: tuple[int, int, int] | None = None
    target_rows: tuple[int, int, int] | None = None
    #: what a created unit (``source`` ``""``) holds: a tensor's value, or an object's (:data:`EMPTY_STATE`)
    fill: Any = None
    #: the dtype the target's code holds the tensor in (``None``: the source's)
    target_dtype: Any = None


def split_key(key: str) -> tuple[str, str] | None:
    """``(prefix kept in the target, language-model key)`` of a stored key, or ``None`` when the key is not the
    language model's (RNG, a tower). An optimizer-state prefix is kept; ``language_model.`` (the
    vision-language model's) is dropped: every target is a text layout, the towers stay as they are."""
    match = MODEL_KEY.search(key)
    if match is None:
        return None
    prefix = key[: match.start()].replace(LANGUAGE_MODEL_KEY_PREFIX, "")
    if prefix and "optimizer.state." not in prefix:
        return None
    return prefix, key[match.start() :]
