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
#: What Megatron-Bridge's ``Gemma4VLModel`` (upstream, and the fork's that miles' runs save from) puts before
#: every language-model key: it has no ``sharded_state_dict`` of its own, so megatron-core's default prefixes
#: each child's keys with the child's name (``megatron/bridge/models/gemma_vl/modeling_gemma4_vl.py`` L156-179).
LANGUAGE_MODEL_KEY_PREFIX = "language_model."
#: That model's HF towers and embedders: saved per parameter, replicated and whole, under the module's name
#: (megatron-core ``sharded_state_dict_default``); the HF checkpoint holds each under ``model.<key>``.
TOWER_KEY = re.compile(r"^(vision_tower|embed_vision|audio_tower|embed_audio)\.")
#: Keys the plugin itself once wrote -> the key the model asks for now. Before 2026-12 a CPU host stored the
#: routed experts' pre-norm under megatron-core's local-spec key (core/spec.py ``te_keys_map``); the TE
#: model, and upstream Megatron-Bridge's, always used ``pre_mlp_layernorm.weight``.
FORMER_KEYS = {"decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight"}


#: Layouts other Gemma 4 code writes that the plugin's model does not load: a test on a model key -> the layout's
#: name, what differs and what to do (docs/INTERCHANGE.md has the derivations). The first that matches names
#: the layout: upstream's dense norm names come first, because its E2B (``use_double_wide_mlp``) is keyed one
#: layer at a time too (``hetereogenous_dist_checkpoint``, gemma4_provider.py L183-186).
FOREIGN_LAYOUTS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"\.post_self_attn_layernorm\.|\.post_mlp_layernorm\."),
        "upstream Megatron-Bridge's dense Gemma 4 (its own norm names: post_self_attn_layernorm, post_mlp_layernorm, "
        "and attention stacks): rewrite it first with vime-gemma4 migrate --load DIR --to ours --save OUT "
        "--hf-checkpoint HF",
    ),
    (
        re.compile(r"^decoder\.layers\.\d+\."),
        "one key per layer (vime's or slime's native Gemma 4): "
        "decoder.layers.<i>.* with no layer axis, not the stacked decoder.layers.*: rewrite it first with "
        "vime-gemma4 migrate --load DIR --to ours --save OUT (a dense one also --hf-checkpoint HF)",
    ),
)


#: The norms upstream Megatron-Bridge's Gemma 4 MoE model builds as megatron-core's ``TENorm`` (q/k norms,
#: ``linear_proj.post_layernorm``, ``pre_mlp_layernorm``, the final norm; docs/INTERCHANGE.md): a TE
#: RMSNorm, whose state carries an ``_extra_state`` (empty without FP8) that its default-strict load asks for.
UPSTREAM_TE_NORM = (
    r"^(language_model\.)?decoder\.(final_layernorm|layers\.pre_mlp_layernorm"
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


def is_vision_language(keys: Iterable[str]) -> bool:
    """Whether these torch_dist keys are in the layout of Megatron-Bridge's ``Gemma4VLModel``."""
    return any(key.startswith(LANGUAGE_MODEL_KEY_PREFIX) for key in keys)


def layout_name(keys: Iterable[str]) -> str:
    """Which layout a readable checkpoint's keys are in, for the report."""
    keys = list(keys)
    if is_vision_language(keys):
        towers = sum(1 for key in keys if TOWER_KEY.match(key))
        return f"vision-language (Megatron-Bridge's Gemma4VLModel: language_model.*, {towers} tower tensors)"
    return "language model at the top level (the plugin's; upstream Megatron-Bridge's Gemma 4 MoE)"


class ConversionError(ValueError):
    """A conversion cannot proceed (one line: what is wrong and what to do)."""


def refuse_unused_keys(keys: Iterable[str]) -> None:
    """Raise :class:`ConversionError` if any of these torch_dist keys is a model weight nothing loaded.

    Optimizer, RNG and common state (training checkpoints) and TE's ``_extra_state`` are not weights; a
    vision-language checkpoint's towers are carried to the HF output beside the model (:data:`TOWER_KEY`).
    """
    not_weights = (NON_MODEL_KEY.search, EXTRA_STATE.search, TOWER_KEY.match)
    unused = sorted(key for key in keys if not any(test(key) for test in not_weights))
    if unused:
        raise ConversionError(
            f"torch_dist checkpoint holds {len(unused)} tensor(s) this model lacks (e.g. {unused[0]}): "
            "it holds a different model than --hf-checkpoint"
        )


def sharded_state_dict(model: list, stored: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``{"model": ...}`` (or ``model0``, ``model1``... with VPP) as Megatron saves it, and its metadata.

    ``stored``: the keys of a checkpoint to read; each item asks for its key as that checkpoint names it:
    under :data:`LANGUAGE_MODEL_KEY_PREFIX` in a vision-language checkpoint, and the former key
    (:data:`FORMER_KEYS`) where the checkpoint holds it in place of the current one.
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
    prefix = LANGUAGE_MODEL_KEY_PREFIX if any(key.startswith(LANGUAGE_MODEL_KEY_PREFIX) for key in stored) else ""
    former = {new: old for old, new in FORMER_KEYS.items() if prefix + old in stored and prefix + new not in stored}
    if former or prefix:
        for item in nested_values(state):
            if hasattr(item, "key"):
                item.key = prefix + former.get(item.key, item.key)
    return state, metadata
