"""Where the Gemma 4 language model lives in each HF class's checkpoint and config, its full layers' KV heads,
and the routed experts' two HF layouts (stacked, per expert).

No heavy imports: cheap (the command line's pre-flight and topology checks read it before torch loads).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: HF class → prefix of its language-model tensors (the VL checkpoint nests the text model).
LANGUAGE_MODEL_PREFIX = {
    "Gemma4ForCausalLM": "model.",
    "Gemma4ForConditionalGeneration": "model.language_model.",
    # The 12B "Unified": Gemma 4's dense text model (no PLE, no MoE) under classes of its own.
    "Gemma4UnifiedForCausalLM": "model.",
    "Gemma4UnifiedForConditionalGeneration": "model.language_model.",
}
#: ``model_type`` of the configs read as Gemma 4: text configs, then their VL wrappers.
MODEL_TYPES = ("gemma4_text", "gemma4_unified_text", "gemma4", "gemma4_unified")


def text_config_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text part of a HF ``config.json`` dict (VL checkpoints nest it under ``text_config``)."""
    return config.get("text_config") or config


#: Why an untied checkpoint is refused, the same words on every road (the pre-flight and the bridge).
UNTIED_REFUSAL = (
    "tie_word_embeddings is false (an lm_head of its own): untied Gemma 4 is not supported, the mappings carry "
    "one embedding for both ends (docs/UPSTREAM.md 49)"
)


def ties_embeddings(config: Mapping[str, Any] | Any) -> bool:
    """Whether ``lm_head`` is ``embed_tokens`` (every published Gemma 4): neither the config (dict or object)
    nor its text config says ``tie_word_embeddings: false``. A fine-tuned variant may untie them."""

    def field(part: Mapping[str, Any] | Any, name: str) -> Any:
        return part.get(name) if isinstance(part, Mapping) else getattr(part, name, None)

    text = field(config, "text_config")
    return all(field(part, "tie_word_embeddings") is not False for part in (config, text) if part is not None)


def declared_dtype(config: Mapping[str, Any] | Any) -> Any:
    """The ``torch.dtype`` a config (dict or object) declares: its text config's, else its own (VL configs
    declare it at the top level only), as ``dtype`` or the older ``torch_dtype``; ``None`` if neither.

    torch is imported only when asked, so this module stays cheap to import.
    """
    import torch

    def field(part: Mapping[str, Any] | Any, name: str) -> Any:
        return part.get(name) if isinstance(part, Mapping) else getattr(part, name, None)

    for holder in (field(config, "text_config"), config):
        if holder is None:
            continue
        dtype = field(holder, "dtype") or field(holder, "torch_dtype")
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def global_kv_heads(text: Mapping[str, Any] | Any) -> int:
    """KV heads of full-attention layers, as transformers builds them, from a text config (dict or object).

    ``num_global_key_value_heads`` applies only with ``attention_k_eq_v`` (transformers'
    ``use_alternative_attention``); otherwise full layers keep ``num_key_value_heads`` (docs/UPSTREAM.md 13).
    The one statement of the rule: the bridge's mappings and provider and the topology check read it.
    """

    def field(name: str) -> Any:
        return text.get(name) if isinstance(text, Mapping) else getattr(text, name, None)

    if field("attention_k_eq_v") and field("num_global_key_value_heads"):
        return int(field("num_global_key_value_heads"))
    return int(field("num_key_value_heads"))


# ---------------------------------------------------------------------------------------------
# The routed experts' two HF layouts. The checkpoint stacks them (``experts.gate_up_proj``
# [E, 2I, H], gate rows then up rows as transformers' ``Gemma4TextExperts`` chunks them, and
# ``experts.down_proj`` [E, H, I]); vLLM's Gemma 4 loader also takes one 2-D tensor per expert and
# projection (``experts.{e}.gate_proj.weight`` ...), which a live stream can yield as soon as each
# expert is gathered, without holding a layer's stack.
# ---------------------------------------------------------------------------------------------
STACKED = "stacked"
PER_EXPERT = "per-expert"
EXPERT_LAYOUTS = (STACKED, PER_EXPERT)
#: vime's zero-edit switch: set to ``per-expert`` in the actor's environment, the bridge's own
#: ``export_hf_weights`` yields each routed expert on its own (``core/expert_layout``).
EXPERT_LAYOUT_ENV = "VIME_GEMMA4_EXPERT_LAYOUT"


def check_expert_layout(layout: str, what: str = "expert layout") -> str:
    """``layout`` if it is one of :data:`EXPERT_LAYOUTS`; a one-line refusal naming ``what`` set it otherwise."""
    if layout not in EXPERT_LAYOUTS:
        raise ValueError(f"{what} {layout!r}: expected one of {', '.join(EXPERT_LAYOUTS)}")
    return layout


#: A stacked expert tensor's name: ``<layer>.experts.gate_up_proj`` or ``<layer>.experts.down_proj``.
STACK_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<stack>gate_up_proj|down_proj)$")
#: A per-expert tensor's name: ``<layer>.experts.<e>.<gate|up|down>_proj.weight``, or its FP8 scale
#: (``….weight_scale_inv``, convert/fp8.py), whose stack is named ``<layer>.experts.gate_up_proj_scale_inv``.
PER_EXPERT_NAME = re.compile(
    r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight(?P<suffix>_scale_inv)?$"
)
#: Stack → the per-expert projections it holds, in its row order.
STACK_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def per_expert_name(stack_name: str, expert: int, projection: str) -> str:
    """The per-expert name of ``projection`` of ``expert`` in the stack ``stack_name``."""
    match = STACK_NAME.match(stack_name)
    if match is None:
        raise ValueError(f"{stack_name!r} is not a stacked expert tensor")
    return f"{match['experts']}.{expert}.{projection}.weight"


def split_expert(stack_name: str, expert: int, weight: Any) -> list[tuple[str, Any]]:
    """One expert's slice of a stack as its per-expert tensors: views, no copy (gate rows, then up rows)."""
    projections = STACK_PROJECTIONS[STACK_NAME.match(stack_name)["stack"]]
    rows = weight.shape[0] // len(projections)
    return [
        (per_expert_name(stack_name, expert, projection), weight[index * rows : (index + 1) * rows])
        for index, projection in enumerate(projections)
    ]


def stack_of(per_expert: str) -> tuple[str, int, str] | None:
    """``(stack name, expert, projection)`` of a per-expert name (or scale); ``None`` for any other name."""
    match = PER_EXPERT_NAME.match(per_expert)
    if match is None:
        return None
    stack = next(stack for stack, projections in STACK_PROJECTIONS.items() if match["proj"] in projections)
    return f"{match['experts']}.{stack}{match['suffix'] or ''}", int(match["expert"]), match["proj"]
