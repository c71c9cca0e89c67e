"""Where the Gemma 4 language model lives in each HF class's checkpoint and config, and its full layers' KV heads.

No imports: cheap (the command line's pre-flight and topology checks read it before torch loads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: HF class → prefix of its language-model tensors (the VL checkpoint nests the text model).
LANGUAGE_MODEL_PREFIX = {
    "Gemma4ForCausalLM": "model.",
    "Gemma4ForConditionalGeneration": "model.language_model.",
}


def text_config_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text part of a HF ``config.json`` dict (VL checkpoints nest it under ``text_config``)."""
    return config.get("text_config") or config


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
