"""The seams of the installed Megatron-Bridge build that this plugin depends on, found by feature.

Megatron-Bridge is installed in two shapes where Gemma 4 users train: the release (0.6.2) and
vime's fork (``radixark/Megatron-Bridge@bridge``, read at 1187a604; docs/SEAMS.md lists each seam
with where it was read). They differ in ways the plugin must follow, and the branch moves, so each
difference is detected from the code itself, never from a version string:

* **export tuple** — three shapes: the release yields ``HFWeightTuple(param_name, weight)``; the fork
  (1187a604 / d063066b) adds a third field ``megatron_param_name`` (the task's local name), which vime's
  weight sync unpacks; upstream's #6074, in the fork from 04c0fd03, keeps two fields unless the export
  is asked ``with_megatron_names=True``, then yields ``HFSourcedWeightTuple(param_name, weight,
  megatron_param_names)`` (a tuple of local names; its ``megatron_param_name`` property is the one
  name, or None for zero or several).
* **build_conversion_tasks** — the release takes ``weight_dtype``; the fork does not.
* **mapping process groups** — the release keeps the model's process-group collection on every
  mapping (``_pg_collection``); the fork keeps none (its mappings read megatron-core's state).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from typing import Any

#: The export tuple shapes :func:`export_tuple` tells apart (``vime-gemma4 env`` prints the build's).
TWO_FIELDS = "(hf_name, tensor)"
THIRD_FIELD = "(hf_name, tensor, megatron_param_name)"
SOURCED = "(hf_name, tensor); with_megatron_names=True: HFSourcedWeightTuple(hf_name, tensor, megatron_param_names)"


@cache
def export_tuple() -> str:
    """What ``stream_weights_megatron_to_hf`` yields: :data:`TWO_FIELDS`, :data:`THIRD_FIELD` or :data:`SOURCED`.

    :data:`SOURCED` where the module has ``HFSourcedWeightTuple`` and the stream takes ``with_megatron_names``
    (the fork's ``model_bridge.py`` @04c0fd03 L156-181, L1661-1671), else by ``HFWeightTuple``'s fields.
    """
    from megatron.bridge.models.conversion import model_bridge

    stream = model_bridge.MegatronModelBridge.stream_weights_megatron_to_hf
    if hasattr(model_bridge, "HFSourcedWeightTuple") and "with_megatron_names" in inspect.signature(stream).parameters:
        return SOURCED
    return THIRD_FIELD if "megatron_param_name" in model_bridge.HFWeightTuple._fields else TWO_FIELDS


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


def with_grouped_names(stream: Iterable[Any], bridge: Any) -> Iterator[Any]:
    """``stream`` with a grouped expert's ``megatron_param_name`` of ``None`` filled in: the fork's
    ``model_bridge.py`` @d063066b builds those items with two arguments (1187a604: the completing expert
    task's local name), and vime's FP8 quantizer ``re.match``es every name (UPSTREAM 51). The name is the
    one the bridge's grouped-export hook last completed a group with (``_grouped_task_name``)."""
    for item in stream:
        if "megatron_param_name" in getattr(item, "_fields", ()) and item.megatron_param_name is None:
            item = item._replace(megatron_param_name=getattr(bridge, "_grouped_task_name", None))
        yield item


@contextlib.contextmanager
def peft_reads_module_attributes() -> Iterator[None]:
    """Within this block, Megatron-Bridge's LoRA transform takes a linear that states its own adapter attributes.

    ``peft/lora.py`` (0.6.2; the fork alike) asks ``get_adapter_attributes_from_linear``, which knows
    megatron-core's and TE's linears only and raises for any other (the CPU twins of TE's grouped
    expert linears, ``core/cpu_modules``). A module with an ``adapter_attributes()`` method is described
    by it; every other module goes to upstream's function unchanged (UPSTREAM 56). The transform reads
    that name from its module's globals at each call, so no subclass or argument reaches it: the name
    is rebound for the block only (the provider's pre-wrap hooks, where a LoRA transform runs) and
    upstream's function is back on exit, whatever happened.
    """
    from megatron.bridge.peft import lora
    from megatron.bridge.peft.utils import AdapterAttributes

    upstream = lora.get_adapter_attributes_from_linear

    def described(module: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(module, "adapter_attributes"):
            return AdapterAttributes(**module.adapter_attributes())
        return upstream(module, *args, **kwargs)

    lora.get_adapter_attributes_from_linear = described
    try:
        yield
    finally:
        lora.get_adapter_attributes_from_linear = upstream


def build_kind() -> str:
    """``"release"``, ``"vime fork"`` or ``"sourced export"``, as its export tuple tells."""
    return {TWO_FIELDS: "release", THIRD_FIELD: "vime fork", SOURCED: "sourced export"}[export_tuple()]


def describe() -> dict[str, Any]:
    """Every seam, for ``vime-gemma4 env`` and reports."""
    return {
        "build": build_kind(),
        "export tuple": export_tuple(),
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


def adapter_enabled(wrapper: Any) -> bool:
    """Whether a Megatron-Bridge ``AdapterWrapper`` adds its adapter (``adapter_wrapper.py``: ``_adapter_enabled``).

    ``enable_adapter_layers`` / ``disable_adapter_layers`` set it, and no public attribute reads it back; a
    wrapper with its own forward (``core/lora.PostNormLoRALinear``) must honour it as ``LoRALinear.forward`` does.
    """
    return wrapper._adapter_enabled


def tied_weights_keys(model: Any) -> set[str]:
    """The parameter names a transformers model declares tied to another (its ``_tied_weights_keys``).

    ``save_pretrained`` leaves these out of a checkpoint, so a checkpoint's expected tensors are the
    state dict less these. transformers' ``get_expanded_tied_weights_keys`` (5.12) answers a different
    question: it is empty when the config does not tie the word embeddings; nothing public reads the
    declaration itself.
    """
    return set(getattr(model, "_tied_weights_keys", None) or ())


def become(obj: Any, cls: type) -> None:
    """Make ``obj``, built by upstream, an instance of ``cls`` in place (``obj.__class__ = cls``).

    A swap, not a construction: upstream builds the object inside a constructor it gives no class
    hook for (megatron-core's ``GPTModel`` its embedding and output layer; Megatron-Bridge's LoRA
    transform its ``LoRALinear``), and others already hold it (the parent module, the parameters'
    owners, hooks). Keeping the object keeps every parameter, name, tie and reference; ``cls`` only
    changes methods (Megatron-Bridge's own Gemma providers do the same with ``extend_instance``).
    """
    obj.__class__ = cls


def hands_to(public: str) -> Callable[..., Any]:
    """An override of an upstream private step that calls the public method ``public`` with its arguments.

    The compat hook classes (``layer_hooks``, ``bridge_hooks``) override each private step core/ changes
    this way, so the upstream call lands on a public name that core/ overrides.
    """

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, public)(*args, **kwargs)

    step.__name__ = step.__qualname__ = f"hands_to_{public}"
    return step
