"""How a torch_dist checkpoint is laid out: the model's sharded state dict as Megatron saves it, the keys that
are not weights, and the conversion error (shared by both directions).

Kept apart from :mod:`vime_gemma4_bridge.io.torch_dist` (the checkpoint on disk: its checks, save and load)
so that the streaming paths (convert/) use the same layout without the save and load.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Any

#: torch_dist keys that are not model weights (training checkpoints carry them; export ignores them).
NON_MODEL_KEY = re.compile(r"^(optimizer|rng_state|rerun_state_machine|common_state)|\.?optimizer\.")
#: TE's FP8 metadata objects (``_extra_state<k>``): never weights.
EXTRA_STATE = re.compile(r"_extra_state\d*$")
#: Keys the plugin itself once wrote -> the key the model asks for now. Before 2026-12 a CPU host stored the
#: routed experts' pre-norm under megatron-core's local-spec key (core/spec.py ``te_keys_map``); the TE
#: model, and upstream Megatron-Bridge's, always used ``pre_mlp_layernorm.weight``.
FORMER_KEYS = {"decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight"}


#: Layouts other Gemma 4 code writes that the plugin does not read (yet): a test on a model key -> the layout's
#: name and what it lacks (docs/INTERCHANGE.md has the derivations).
FOREIGN_LAYOUTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"^language_model\."),
        "Megatron-Bridge's Gemma4VLModel (upstream, or miles' runs on its fork): the text model is under "
        "language_model.*, not at the top level (decoder.*, embedding.*)",
    ),
    (
        re.compile(r"^decoder\.layers\.\d+\."),
        "one key per layer (vime's or slime's native Gemma 4, or upstream Megatron-Bridge's E2B): "
        "decoder.layers.<i>.* with no layer axis, not the stacked decoder.layers.*",
    ),
    (
        re.compile(r"\.post_self_attn_layernorm\.|\.post_mlp_layernorm\."),
        "upstream Megatron-Bridge's dense Gemma 4 (its own norm names: post_self_attn_layernorm, post_mlp_layernorm)",
    ),
)


#: The norms upstream Megatron-Bridge's Gemma 4 MoE model builds as megatron-core's ``TENorm`` (q/k norms,
#: ``linear_proj.post_layernorm``, ``pre_mlp_layernorm``, the final norm; docs/INTERCHANGE.md): a TE
#: RMSNorm, whose state carries an ``_extra_state`` (empty without FP8) that its default-strict load asks for.
UPSTREAM_TE_NORM = (
    r"^decoder\.(final_layernorm|layers\.pre_mlp_layernorm"
    r"|layers\.self_attention_\w+\.(q_layernorm|k_layernorm|linear_proj\.post_layernorm))\."
)
UPSTREAM_TE_NORM_WEIGHT = re.compile(UPSTREAM_TE_NORM + "weight$")
#: One of those objects as PyTorch's checkpoint metadata names it (megatron-core adds ``/shard_<offset>_<shape>``).
UPSTREAM_TE_NORM_STATE = re.compile(UPSTREAM_TE_NORM + r"_extra_state(/|$)")


def upstream_te_norm_states(model_state: dict[str, Any]) -> dict[str, Any]:
    """The ``_extra_state`` objects upstream's TE norms write, for a MoE model's sharded state dict.

    The plugin's norms hold no state besides the weight; its saves add these (an empty uint8 tensor,
    what a TE RMSNorm without FP8 holds) so that upstream Megatron-Bridge's Gemma 4 loads the checkpoint
    at its default strictness. Each is the object megatron-core would make for that module: the
    weight's key with ``_extra_state``, its layer axes as the object's offsets, its replica id. The
    plugin's own loads never ask for them (an ``_extra_state`` nothing asks for is ignored).
    """
    import torch
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    objects = {}
    for name, item in model_state.items():
        key = getattr(item, "key", "")
        if not UPSTREAM_TE_NORM_WEIGHT.match(key):
            continue
        axes = item.prepend_axis_num
        offsets = tuple((axis, item.global_offset[axis], item.global_shape[axis]) for axis in range(axes))
        object_key = key.removesuffix("weight") + "_extra_state"
        objects[name.removesuffix("weight") + "_extra_state"] = make_sharded_object_for_checkpoint(
            torch.empty(0, dtype=torch.uint8), object_key, offsets, item.replica_id
        )
    return objects


def foreign_layout(keys: Iterable[str]) -> str | None:
    """The layout another Gemma 4 implementation wrote these torch_dist keys in, if the plugin cannot read it."""
    model_keys = [key for key in keys if not NON_MODEL_KEY.search(key)]
    for pattern, layout in FOREIGN_LAYOUTS:
        if any(pattern.search(key) for key in model_keys):
            return layout
    return None


class ConversionError(ValueError):
    """A conversion cannot proceed (one line: what is wrong and what to do)."""


def refuse_unused_keys(keys: Iterable[str]) -> None:
    """Raise :class:`ConversionError` if any of these torch_dist keys is a model weight nothing loaded.

    Optimizer, RNG and common state (training checkpoints) and TE's ``_extra_state`` are not weights.
    """
    unused = sorted(key for key in keys if not NON_MODEL_KEY.search(key) and not EXTRA_STATE.search(key))
    if unused:
        raise ConversionError(
            f"torch_dist checkpoint holds {len(unused)} tensor(s) this model lacks (e.g. {unused[0]}): "
            "it holds a different model than --hf-checkpoint"
        )


def sharded_state_dict(model: list, stored: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``{"model": ...}`` (or ``model0``, ``model1``... with VPP) as Megatron saves it, and its metadata.

    ``stored``: the keys of a checkpoint to read; where it holds a former key (:data:`FORMER_KEYS`) in
    place of the current one, the item asks for the former key.
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    # The content metadata of Megatron-Bridge's / Megatron-LM's ``_build_sharded_state_dict_metadata``
    # (no distributed optimizer): the keys a training run's load expects.
    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True),
    }
    if len(model) == 1:
        state = {"model": model[0].sharded_state_dict(metadata=metadata)}
    else:
        state = {f"model{i}": chunk.sharded_state_dict(metadata=metadata) for i, chunk in enumerate(model)}
    former = {new: old for old, new in FORMER_KEYS.items() if old in stored and new not in stored}
    if former:
        for item in nested_values(state):
            if getattr(item, "key", None) in former:
                item.key = former[item.key]
    return state, metadata
