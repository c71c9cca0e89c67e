"""A HF checkpoint held against its own ``config.json``: the config field by field, then the tensors.

This is the model's validation, so it lives beside the checkpoint reader (:mod:`vime_gemma4_bridge.io.hf`)
rather than with any command: every reader of a checkpoint may ask it, and the commands' pre-flight
(:mod:`vime_gemma4_bridge.cli.preflight`) runs it before any rank starts.

:func:`check_config` reads the config as transformers does and refuses the first field no Gemma 4
model can have. :func:`check_language_model` compares the language-model tensors with what the
config implies, from the safetensors headers only (no tensor data: seconds for 26B-A4B). What the
config implies is transformers' own answer: the state dict of a meta-device model of that config (no
memory), language-model part, tied aliases dropped. A config that lies (``num_experts`` edited), a
missing or extra tensor, a wrong dtype or shape: each is one line, at most ten, then a count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core.hf_layout import (
    LANGUAGE_MODEL_PREFIX,
    MODEL_TYPES,
    UNTIED_REFUSAL,
    declared_dtype,
    text_config_dict,
    ties_embeddings,
)
from vime_gemma4_bridge.io.hf import SAFETENSORS_DTYPES, CheckpointError, HFCheckpoint

#: Problems listed one per line before the rest are counted.
MAX_LISTED = 10


class PreflightError(CheckpointError):
    """The checkpoint's tensors do not match its config.json; the message has one line per problem."""


class ConfigError(CheckpointError):
    """A config.json field has the wrong type, is missing, or has a value no Gemma 4 model can have."""


#: Text-config fields that size the model: integers ≥ 1 wherever they are set.
_SIZES = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "sliding_window",
    "global_head_dim",
    "num_global_key_value_heads",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
)
#: Integers ≥ 0 (0: the feature is off).
_COUNTS = ("num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input")
_LAYER_TYPES = ("sliding_attention", "full_attention")


def check_config(checkpoint: HFCheckpoint) -> dict[str, Any]:
    """The config as transformers reads it (defaults filled in), or :class:`ConfigError` naming the field.

    In this order: the raw ``config.json`` values of the size fields are integers; transformers'
    own (strict) config class accepts the file; the values can build a model (sizes ≥ 1, MoE
    fields present, ``top_k_experts`` ≤ ``num_experts``, one known ``layer_types`` entry per
    layer, KV-shared layers fewer than the layers, query heads a multiple of KV heads). A field
    missing from ``config.json`` is transformers' default, as it is for every reader of the file.
    """
    import transformers

    where = "text_config." if "text_config" in checkpoint.config else ""
    raw = text_config_dict(checkpoint.config)

    def refuse(field: str, problem: str) -> ConfigError:
        return ConfigError(f"{checkpoint.path / 'config.json'}: {where}{field} {problem}; fix config.json")

    if raw.get("model_type", "gemma4_text") not in MODEL_TYPES:  # transformers would read it as Gemma 4
        raise ConfigError(
            f"{checkpoint.path / 'config.json'}: {where}model_type {raw['model_type']!r} is not Gemma 4 "
            f"(one of {', '.join(MODEL_TYPES)})"
        )
    for field in (*_SIZES, *_COUNTS):
        value = raw.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise refuse(field, f"is {value!r}, not an integer")
    if "layer_types" in raw:  # before transformers, which rewrites the last entry
        _check_layer_types(raw["layer_types"], raw.get("num_hidden_layers"), refuse)
    try:
        config = transformers.AutoConfig.from_pretrained(checkpoint.path)
    except Exception as error:  # noqa: BLE001 (transformers' strict validation raises its own types)
        why = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__
        raise ConfigError(
            f"{checkpoint.path / 'config.json'} is refused by transformers ({why}); fix config.json"
        ) from None
    if not ties_embeddings(config):
        raise ConfigError(f"{checkpoint.path / 'config.json'}: {UNTIED_REFUSAL}")
    text = (config.text_config if hasattr(config, "text_config") else config).to_dict()
    moe = bool(text.get("enable_moe_block"))
    for field in _SIZES:
        value = text.get(field)
        required = field not in ("global_head_dim", "num_global_key_value_heads") and (
            moe or field not in ("num_experts", "top_k_experts", "moe_intermediate_size")
        )
        if value is None and required:
            raise refuse(field, "is missing" + (" (enable_moe_block is true)" if moe else ""))
        if value is not None and value < 1:
            raise refuse(field, f"is {value}; it must be at least 1")
    for field in _COUNTS:
        if (text.get(field) or 0) < 0:
            raise refuse(field, f"is {text[field]}; it must be 0 or more")
    layers = text["num_hidden_layers"]
    if moe and text["top_k_experts"] > text["num_experts"]:
        raise refuse("top_k_experts", f"is {text['top_k_experts']}, more than num_experts ({text['num_experts']})")
    if (text.get("num_kv_shared_layers") or 0) >= layers:
        raise refuse("num_kv_shared_layers", f"is {text['num_kv_shared_layers']}; it must be below {layers} layers")
    if text["num_attention_heads"] % text["num_key_value_heads"]:
        raise refuse(
            "num_key_value_heads",
            f"is {text['num_key_value_heads']}, which does not divide num_attention_heads "
            f"({text['num_attention_heads']})",
        )
    _check_layer_types(text.get("layer_types"), layers, refuse)
    return config.to_dict()


def _check_layer_types(types: Any, layers: Any, refuse: Callable[[str, str], ConfigError]) -> None:
    """One known attention type per layer (``layers``: the layer count, when known)."""
    if not isinstance(types, list):
        raise refuse("layer_types", f"is {types!r}, not a list of {list(_LAYER_TYPES)}")
    if layers is not None and len(types) != layers:
        raise refuse("layer_types", f"has {len(types)} entries for {layers} layers (num_hidden_layers)")
    unknown = [t for t in types if t not in _LAYER_TYPES]
    if unknown:
        raise refuse("layer_types", f"holds {unknown[0]!r}; each entry is one of {list(_LAYER_TYPES)}")


def expected_language_model(checkpoint: HFCheckpoint) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, safetensors dtype)}`` of every language-model tensor the config implies."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint.path)
    architecture = next(a for a in config.architectures if a in LANGUAGE_MODEL_PREFIX)
    dtype = declared_dtype(config) or torch.float32
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = getattr(transformers, architecture)(config)
    tied = seams.tied_weights_keys(model)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(checkpoint.prefix) and name not in tied:
            tensor_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            expected[name] = (list(tensor.shape), SAFETENSORS_DTYPES[tensor_dtype])
    return expected


def check_language_model(checkpoint: HFCheckpoint) -> None:
    """Raise :class:`PreflightError` unless the language-model tensors are exactly what the config implies."""
    expected = expected_language_model(checkpoint)
    found = checkpoint.signatures(checkpoint.language_model_names())
    problems = []
    for name, (shape, dtype) in expected.items():
        if name not in found:
            problems.append(f"{name}: missing (config.json implies {dtype} {shape})")
        elif found[name] != (shape, dtype):
            problems.append(f"{name}: {found[name][1]} {found[name][0]} found, config.json implies {dtype} {shape}")
    problems += [
        f"{name}: unexpected language-model tensor (config.json implies no such tensor)"
        for name in found
        if name not in expected
    ]
    if problems:
        listed = problems[:MAX_LISTED]
        more = len(problems) - len(listed)
        raise PreflightError(
            f"HF checkpoint {checkpoint.path} does not match its config.json ({len(problems)} problem(s)); "
            "fix the checkpoint or its config:\n  " + "\n  ".join(listed) + (f"\n  ... and {more} more" if more else "")
        )
