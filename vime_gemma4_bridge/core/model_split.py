"""Whether a Gemma 4 model splits over Megatron's parallel sizes: a rule of the model, read from its config.

It lives with the model, below the checkpoints on disk and the commands, so that a command's
pre-flight can ask it last, after every file check, and the recipes without torch (this module
imports no torch). The topology is anything with the five sizes:
:class:`vime_gemma4_bridge.convert.topology.Topology` is one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from vime_gemma4_bridge.core.hf_layout import MODEL_TYPES, global_kv_heads, text_config_dict


class ParallelSizes(Protocol):
    """The sizes :func:`validate_model_topology` reads: tensor, pipeline, virtual pipeline, expert, expert-tensor."""

    @property
    def tp(self) -> int: ...

    @property
    def pp(self) -> int: ...

    @property
    def vpp(self) -> int | None: ...

    @property
    def ep(self) -> int: ...

    @property
    def etp(self) -> int: ...


class TopologyError(ValueError):
    """The model's shape does not split over the requested topology."""


def validate_model_topology(config: Mapping[str, Any], topology: ParallelSizes) -> None:
    """Raise :class:`TopologyError` (one line: what and what to do) if the model cannot be split so."""
    text = text_config_dict(config)
    if text.get("model_type") not in MODEL_TYPES:
        raise TopologyError(f"config model_type {text.get('model_type')!r} is not Gemma 4 ({', '.join(MODEL_TYPES)})")
    moe = bool(text.get("enable_moe_block"))
    layers = int(text["num_hidden_layers"])
    checks: list[tuple[str, int, int, str]] = [
        ("attention heads", int(text["num_attention_heads"]), topology.tp, "--tp"),
        ("KV heads", int(text["num_key_value_heads"]), topology.tp, "--tp"),
        ("FFN size (intermediate_size)", int(text["intermediate_size"]), topology.tp, "--tp"),
    ]
    global_kv = global_kv_heads(text)
    # Fewer than TP: each rank keeps a whole copy of its head (megatron-core's attention gathers the
    # QKV projection and picks its group; core/model.Gemma4SelfAttention its query heads): the 12B's one.
    if global_kv != int(text["num_key_value_heads"]) and not (global_kv < topology.tp and topology.tp % global_kv == 0):
        checks.append(("global KV heads", global_kv, topology.tp, "--tp"))
    if moe:
        checks += [
            ("experts", int(text["num_experts"]), topology.ep, "--ep"),
            ("expert FFN size (moe_intermediate_size)", int(text["moe_intermediate_size"]), topology.etp, "--etp"),
        ]
    stages = topology.pp * (topology.vpp or 1)
    checks.append(("layers", layers, stages, "--pp/--vpp (PP×VPP)"))
    for what, count, parts, flag in checks:
        if count % parts:
            raise TopologyError(f"{count} {what} do not divide by {flag} {parts}; choose a divisor of {count}")
    if not moe and topology.ep > 1:
        raise TopologyError("dense Gemma 4 has no experts to split: use --ep 1 (and --tp / --pp to split it)")
