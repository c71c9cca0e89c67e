"""Where the Gemma 4 language model lives in each Hugging Face class's checkpoint and config (no imports: cheap)."""

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
