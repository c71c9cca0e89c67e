"""The seams of the installed Megatron-Bridge build that this plugin depends on, found by feature.

Megatron-Bridge is installed in two shapes where Gemma 4 users train: the release (0.6.2) and
vime's fork (``radixark/Megatron-Bridge@bridge``, read at 1187a604; docs/SEAMS.md lists each seam
with where it was read). They differ in ways the plugin must follow, and the branch moves, so each
difference is detected from the code itself, never from a version string:

* **export tuple** — the release yields ``HFWeightTuple(param_name, weight)``; the fork adds a third
  field ``megatron_param_name`` (the task's local name), which vime's weight sync unpacks.
* **build_conversion_tasks** — the release takes ``weight_dtype``; the fork does not.
* **mapping process groups** — the release keeps the model's process-group collection on every
  mapping (``_pg_collection``); the fork keeps none (its mappings read megatron-core's state).
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Any


@cache
def export_yields_megatron_names() -> bool:
    """Whether ``export_hf_weights`` yields ``(hf_name, tensor, megatron_param_name)`` (vime's fork)."""
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple

    return "megatron_param_name" in HFWeightTuple._fields


@cache
def conversion_tasks_take_weight_dtype() -> bool:
    """Whether ``MegatronModelBridge.build_conversion_tasks`` accepts ``weight_dtype`` (the release)."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    return "weight_dtype" in inspect.signature(MegatronModelBridge.build_conversion_tasks).parameters


def conversion_task_kwargs(weight_dtype: Any) -> dict[str, Any]:
    """Keyword arguments for the build's ``build_conversion_tasks``; refuse what it cannot honour."""
    if conversion_tasks_take_weight_dtype():
        return {"weight_dtype": weight_dtype}
    if weight_dtype is not None:
        raise ValueError(
            f"this Megatron-Bridge build cannot export in another dtype (weight_dtype={weight_dtype}): "
            "its build_conversion_tasks takes no weight_dtype; export in the model's dtype"
        )
    return {}


@cache
def mappings_keep_pg_collection() -> bool:
    """Whether mapping objects keep the model's process-group collection (``_pg_collection``)."""
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    return hasattr(ReplicatedMapping("a.weight", "b.weight"), "_pg_collection")


def build_kind() -> str:
    """``"release"`` or ``"vime fork"``, as the export tuple tells (the seam vime's bridge mode needs)."""
    return "vime fork" if export_yields_megatron_names() else "release"


def describe() -> dict[str, Any]:
    """Every seam, for ``vime-gemma4 env`` and reports."""
    return {
        "build": build_kind(),
        "export tuple": (
            "(hf_name, tensor, megatron_param_name)" if export_yields_megatron_names() else "(hf_name, tensor)"
        ),
        "build_conversion_tasks weight_dtype": conversion_tasks_take_weight_dtype(),
        "mappings keep _pg_collection": mappings_keep_pg_collection(),
    }
