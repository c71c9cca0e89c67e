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


def te_available() -> bool:
    """Whether Transformer Engine imports here: TE modules and fusions, or the CPU twins (core/spec.py).

    te_guard answers it: that module must import nothing of the package, since it also runs standalone.
    """
    from vime_gemma4_bridge.compat import te_guard

    return te_guard.te_available()


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


# Upstream private names the plugin needs, each reached here and nowhere else (docs/SEAMS.md): when a
# build moves one, this is the one place to follow it.


def model_bridge_of(auto_bridge: Any) -> Any:
    """The per-model bridge an ``AutoBridge`` dispatches to (its private ``_model_bridge``; no public getter)."""
    return auto_bridge._model_bridge


def unwrap_name(model_bridge: Any, name: str) -> str:
    """A Megatron parameter name without wrapper prefixes (``module.``), as the bridge's conversion tasks name it.

    ``MegatronModelBridge._unwrap_name``: the tasks' names come from it, so checking them must use it too.
    """
    return model_bridge._unwrap_name(name)


def run_config_dict(provider: Any) -> Any:
    """``provider`` as Megatron-Bridge's ``ConfigContainer.to_yaml`` serialises a config (``_target_`` keys).

    ``_ConfigContainerBase._convert_value_to_dict``: the serializer of the run config a Megatron-Bridge
    training checkpoint carries, so the checkpoints the plugin writes read back with its loader.
    """
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase

    return _ConfigContainerBase._convert_value_to_dict(provider)


def serializable_content_metadata(metadata: dict) -> dict:
    """megatron-core's content metadata as its own checkpoint save stores it (``_clean_metadata_for_serialization``)."""
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    return _clean_metadata_for_serialization(metadata)


def storage_info_class() -> type:
    """PyTorch's record of where a torch_dist item lies in its file (``filesystem._StorageInfo``).

    The values of a checkpoint's ``Metadata.storage_data``: the streamed import writes them, the
    allow-list admits them.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo
