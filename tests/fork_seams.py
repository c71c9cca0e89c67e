"""vime's Megatron-Bridge fork, reproduced on the installed release for tests: where it differs from the release.

The fork (``radixark/Megatron-Bridge@bridge``, read at 1187a604 / d063066b; docs/SEAMS.md) cannot be
installed here, so :func:`fork_seams` patches the installed 0.6.2 release, for the duration of a
``with`` block, into the fork's shape where the plugin touches it:

1. **export tuple** — ``HFWeightTuple`` gets the fork's third field ``megatron_param_name``, and
   ``stream_weights_megatron_to_hf`` yields ``(hf_name, tensor, task.param_name)``: the name of the
   task being exported when the tensor is yielded (for grouped experts, the expert task that
   completed the group), exactly where the fork fills it. ``AutoBridge.export_hf_weights`` and the
   stream take the fork's arguments (no ``weight_dtype``).
2. **build_conversion_tasks(hf_pretrained, megatron_model)** — without ``weight_dtype``.
3. **mappings without ``_pg_collection``** — mapping objects keep no process-group collection
   (``set_process_groups_from_pg_collection`` sets the groups only), and ``AutoMapping`` hands its
   delegate none, as the fork's ``_get_or_create_mapping`` does.
4. **parallelism detection by exact class name** — the fork's ``AutoMapping._detect_parallelism_type``
   (``param_mapping.py`` @d063066b) treats a module as a fused norm + column linear only when its
   class is exactly ``TELayerNormColumnParallelLinear`` or ``InferenceLayerNormColumnParallelLinear``
   (the release: any class name containing ``LayerNormColumnParallelLinear``); any other class then
   goes through the registry, the ``tensor_model_parallel`` / ``partition_dim`` attributes, the
   "Norm in the name -> replicated" rule and ``TELinear``, in the release's order.
5. **tied-embedding broadcast from chunk 0 on every stage** — the fork's
   ``MegatronModelBridge._broadcast_shared_embeddings`` (``model_bridge.py`` @1187a604, "TODO Fix for
   VPP") reads ``unwrap_model(model)[0]`` on the last stage as on the first, so at VPP > 1 the last
   stage's chunk has neither embedding nor output layer: ``AssertionError: Output layer not found``.
6. **the HF save** — the fork's ``AutoBridge.save_hf_weights`` (``auto_bridge.py`` @d063066b) streams
   without ``weight_dtype`` into ``SafeTensorsStateSource.save_generator``, whose loop reads each item
   by attribute (``item.param_name, item.weight``: a plain ``(name, tensor)`` pair fails) and which,
   strict or not, only *prints* "N tensors from the original checkpoint were not written" (the
   release raises): the shards it could not complete are silently missing, and the index it still
   writes lists the saved keys only. It saves tensors as they come (no ``.contiguous()``: safetensors
   refuses a view), and its distributed save without an index builds ``dict(generator)`` (two-field
   items only). :func:`fork_save_generator` is that file's code in our words; the release's is not used.
   A bridge without a safetensors source (config-only) takes ``save_hf_weights``' own path, which
   unpacks two fields (:func:`save_config_only_shards`); so does its ``_filter_quant``, run first when
   the model is modelopt-quantized (:func:`modelopt_is_quantized`), which re-yields plain pairs.
7. **expert gathering at EP1** — the fork's ``MegatronParamMapping.gather_from_ep_ranks``
   (``param_mapping.py`` @d063066b) lacks the release's ``if self.ep_size == 1`` return: it broadcasts
   the experts per rank over PP, all-gathers over the one-rank EP group, and ``.squeeze()``s every
   size-1 dimension of the weight.
8. **the tied alias by literal name** — the fork's export (``model_bridge.py`` @1187a604 and @d063066b,
   "TODO(yuya): fix this hard coded naming"), when the model's config says the embeddings are tied,
   yields ``lm_head.weight`` after exactly ``model.embed_tokens.weight`` if the source checkpoint holds
   an ``lm_head.weight``, and *always* for a config-only bridge (``hf_pretrained`` a ``PretrainedConfig``:
   "Always emit lm_head.weight for config-only"). Its ``ValueError`` on an ``lm_head.weight`` of the
   model's own while tied is not reproduced: no Gemma 4 mapping yields that name. (The release aliases
   by the bridge's ``output_layer`` mapping, which Gemma 4's tied bridge does not have: never.)

9. **the adapter export** — :func:`fork_adapter_stream`: ``peft_bridge.py``'s
   ``stream_adapter_weights_megatron_to_hf(megatron_model, cpu, show_progress)`` at @21018090 (with
   the 1187a604 double) or @d063066b, in our words: ``HFWeightTuple(hf_name, tensor, megatron_name)``,
   the third field the adapter's local ``linear_in`` name for ``lora_A`` and ``linear_out`` for
   ``lora_B``; grouped experts one expert at a time (@21018090: 2-D adapters only) or, for a checkpoint
   that stacks its experts, packed into stacks without the third field (@d063066b). ``AutoBridge.
   export_adapter_weights(model, cpu, show_progress)`` (``auto_bridge.py`` @d063066b, no
   ``exclude_adapter_base_prefixes``) calls it with those two keywords.

Everything is restored on exit, and the plugin's cached seam detection is cleared both ways, so a
shared rank process can run release and fork cases one after the other.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import transformers

#: The only fused norm + column linear classes the fork's parallelism detection recognises (exact names).
FORK_FUSED_NORM_LINEARS = ("TELayerNormColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")


def _clear_seam_cache() -> None:
    from vime_gemma4_bridge.compat import seams

    for detector in (
        seams.export_tuple,
        seams.conversion_tasks_take_weight_dtype,
        seams.mappings_keep_pg_collection,
    ):
        detector.cache_clear()


def fork_save_generator(source: Any, generator: Any, output_path: Any, strict: bool) -> None:
    """``SafeTensorsStateSource.save_generator`` as the fork's ``hf_pretrained/state.py`` @d063066b writes it.

    Read there (non-distributed path): only rank 0 writes, the others drain the stream; each item is read
    by attribute (``item.param_name, item.weight``); a shard is ``save_file``'d as soon as all its keys
    arrived, **without** ``.contiguous()`` (safetensors refuses a non-contiguous tensor); without an
    index in the source, everything goes to one ``model.safetensors``; a name the source lacks raises
    ``KeyError`` when strict (else is skipped); shards left incomplete are only **printed** ("could not
    be saved because the generator did not yield all of their tensors", then "Error: N tensors from the
    original checkpoint were not written"), and the index is still written, with **only the saved keys**
    (and the source index's metadata). The release makes tensors contiguous and raises instead.
    """
    from collections import defaultdict
    from pathlib import Path

    from safetensors.torch import save_file

    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        for _ in generator:
            pass
        return
    output_path = Path(output_path)
    output_path.mkdir(parents=True, exist_ok=True)
    key_to_file = source.key_to_filename_map
    buffered: dict[str, torch.Tensor] = {}
    if not key_to_file:
        for item in generator:
            buffered[item.param_name] = item.weight
        if buffered:
            save_file(buffered, output_path / "model.safetensors")
        return
    pending: dict[str, set[str]] = defaultdict(set)
    for key, file in key_to_file.items():
        pending[file].add(key)
    yielded: set[str] = set()
    saved: set[str] = set()
    for item in generator:
        name, tensor = item.param_name, item.weight
        yielded.add(name)
        if name not in key_to_file:
            if strict:
                raise KeyError(
                    f"Tensor '{name}' from generator not found in the original model structure. "
                    "To ignore, set strict=False."
                )
            print(f"Warning: tensor '{name}' from generator not found in original model structure. Skipping.")
            continue
        buffered[name] = tensor
        for file in [file for file, keys in pending.items() if keys <= buffered.keys()]:
            save_file({key: buffered.pop(key) for key in pending[file]}, output_path / file)
            saved |= pending.pop(file)
    if pending:
        print(
            "Warning: The following files could not be saved because the generator did not yield all of their tensors:"
        )
        if not strict:
            for file, keys in pending.items():
                save_file({key: buffered.pop(key) for key in keys if key in buffered}, output_path / file)
                saved |= keys
    unsaved = set(key_to_file) - saved
    if unsaved:
        print(
            f"\nError: {len(unsaved)} tensors from the original checkpoint were not written. "
            "See warnings above for details."
        )
    index = source.path / "model.safetensors.index.json"
    if index.exists():
        weight_map = {key: key_to_file[key] for key in saved}
        if weight_map:
            metadata = json.loads(index.read_text()).get("metadata", {})
            (output_path / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=4)
            )


def modelopt_is_quantized(module: torch.nn.Module) -> bool:
    """modelopt's ``is_quantized`` (``torch/quantization/utils/core_utils.py``, nvidia-modelopt 0.47.0): any
    ``TensorQuantizer`` among the modules; by class name here, modelopt not being installed."""
    return any(type(child).__name__ == "TensorQuantizer" for child in module.modules())


def _filter_quant(generator: Any, quantizers: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``save_hf_weights``' ``_filter_quant`` (``auto_bridge.py`` @d063066b), applied when the model is
    quantized: ``for name, tensor in gen`` (two fields), quantizer tensors (``"_quantizer."`` in the name) set
    aside for ``modelopt_weights.pt``, the rest re-yielded as plain ``(name, tensor)`` pairs."""
    for name, tensor in generator:
        if "_quantizer." in name:
            quantizers[name] = tensor
            continue
        yield name, tensor


def save_config_only_shards(state_dict: dict[str, torch.Tensor], path: Any) -> None:
    """The fork's config-only save (``auto_bridge.py`` @d063066b ``save_hf_weights``): huggingface_hub's shard
    plan, one ``save_file`` per shard, an index when sharded. Its state dict is built with ``for name, tensor in
    generator``, so a three-field ``HFWeightTuple`` stops it ("too many values to unpack")."""
    from pathlib import Path

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    plan = split_torch_state_dict_into_shards(state_dict)
    Path(path).mkdir(parents=True, exist_ok=True)
    for filename, names in plan.filename_to_tensors.items():
        save_file({name: state_dict[name] for name in names}, Path(path) / filename)
    if plan.is_sharded:
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        (Path(path) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_generator_distributed(source: Any, generator: Any, output_path: Any) -> None:
    """The fork's ``_save_generator_distributed`` (state.py @d063066b), its no-index fallback only: the
    saver of index 0 builds ``dict(generator)``, which takes two-field items alone (a three-field
    ``HFWeightTuple`` raises "dictionary update sequence element #0 has length 3; 2 is required")."""
    from pathlib import Path

    from safetensors.torch import save_file

    if source.key_to_filename_map:
        raise NotImplementedError("the double reproduces the fork's distributed save without an index only")
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:  # the saver of index 0
        Path(output_path).mkdir(parents=True, exist_ok=True)
        buffered = dict(generator)
        if buffered:
            save_file(buffered, Path(output_path) / "model.safetensors")
    else:
        for _ in generator:
            pass


#: The ``peft_bridge.py`` each double pairs with its ``model_bridge.py``: the one vime's three-field adapter
#: unpack was written against (@21018090, docs/VIME.md) with 1187a604, its own commit's with d063066b.
PEFT_BRIDGE_AT = {"1187a604": "21018090", "d063066b": "d063066b"}


def fork_adapter_stream(self: Any, megatron_model: Any, cpu: bool = True, show_progress: bool = True, *, revision: str):
    """``stream_adapter_weights_megatron_to_hf`` as the fork's ``peft_bridge.py`` writes it, at ``revision``.

    Read there: each adapter task is materialised, then yielded as ``HFWeightTuple(hf_name, tensor,
    megatron_name)``, the adapter's local ``linear_in`` name for ``lora_A`` and ``linear_out`` for ``lora_B``;
    a fused adapter's ``lora_B`` is split per HF base name (``_get_fused_adapter_linear_out_slices``). A
    grouped expert linear's adapter is gathered over EP and yielded once per expert, for the base names
    ``_get_base_hf_param_names_for_adapter`` gives ``.weight<e>``, the expert's slice chosen by
    ``_select_expert_adapter_weight``. The revisions differ there:

    * **@21018090** — every expert, whatever its names; ``_select_expert_adapter_weight`` and, at EP > 1,
      ``_gather_expert_adapter_weight`` ``assert weight.ndim < 3`` (its ``LoRA`` builds one 2-D adapter
      per grouped linear). A checkpoint naming its experts stacked gets the stack's name once per expert.
    * **@d063066b** — when the names for expert 0 carry no expert number (a stacked checkpoint), the
      "packed" road: each expert's adapter stacked ``[E, ...]`` under the stack's name, as
      ``HFWeightTuple(hf_name, tensor)``: the third field ``None``.

    The helpers it calls are the release's, which match the fork's for these adapters.
    """
    from megatron.bridge.peft.utils import is_expert_linear

    megatron_model = megatron_model if isinstance(megatron_model, list) else [megatron_model]
    num_experts = megatron_model[0].config.num_moe_experts
    tasks = [task for tasks in self.build_adapter_conversion_tasks(megatron_model).values() for task in tasks]
    registry = self.mapping_registry()
    for task in self._with_progress_tracking(tasks, "Streaming adapter weights", show_progress):
        adapter = self.materialize_adapter_weights([task])[0]
        (in_name, lora_a), (out_name, lora_b) = adapter.linear_in_weight[:2], adapter.linear_out_weight[:2]
        is_expert = is_expert_linear(task.global_base_prefix)
        grouped = is_expert and ".local_experts." not in task.global_base_prefix
        gathered_a = gathered_b = None
        if grouped:
            if revision == "21018090":
                assert lora_a.ndim < 3 and lora_b.ndim < 3
            gathered_a, gathered_b = (
                self._gather_expert_adapter_weight(lora_a),
                self._gather_expert_adapter_weight(lora_b),
            )
        suffixes = [f".weight{expert}" for expert in range(num_experts)] if grouped else [".weight"]
        if grouped and revision == "d063066b":
            names = self._get_base_hf_param_names_for_adapter(
                registry, task.global_base_prefix, task.adapter_key, ".weight0"
            )
            if names and all(self._infer_hf_expert_idx(name) is None for name in names):
                a_names, b_names = self._build_lora_hf_names(names)
                per_a, per_b = self._collect_packed_expert_adapter_tensors(
                    lora_a, lora_b, gathered_a, gathered_b, num_experts
                )
                stacked_a = torch.stack(per_a).cpu() if cpu else torch.stack(per_a)
                by_base = self._build_packed_expert_linear_out_by_base(
                    megatron_model, names, per_b, is_expert=is_expert
                )
                for index, name in enumerate(names):
                    yield model_bridge_tuple()(a_names[index], stacked_a)
                    yield model_bridge_tuple()(b_names[index], by_base[name].cpu() if cpu else by_base[name])
                continue
        for suffix in suffixes:
            a, b = lora_a, lora_b
            if grouped:
                expert = int(suffix.removeprefix(".weight"))
                a = self._select_expert_adapter_weight(lora_a, gathered_a, expert, num_experts)
                b = self._select_expert_adapter_weight(lora_b, gathered_b, expert, num_experts)
            a, b = (a.cpu(), b.cpu()) if cpu else (a, b)
            names = self._get_base_hf_param_names_for_adapter(
                registry, task.global_base_prefix, task.adapter_key, suffix
            )
            a_names, b_names = self._build_lora_hf_names(names)
            per_base = None
            if task.adapter_key is None:
                per_base = self._get_fused_adapter_linear_out_slices(megatron_model, names, b, is_expert=is_expert)
            if per_base is None:
                per_base = {names[0]: b}
                names = names[:1]
            for index, name in enumerate(names):
                yield model_bridge_tuple()(a_names[index], a, in_name)
                yield model_bridge_tuple()(b_names[index], per_base[name], out_name)


def model_bridge_tuple() -> Any:
    """``model_bridge.HFWeightTuple`` as the fork's ``peft_bridge.py`` imports it: the double's, in the block."""
    from megatron.bridge.models.conversion import model_bridge

    return model_bridge.HFWeightTuple


def _recording_current_task(release_tracking: Any) -> Any:
    """The release's task loop, recording on the bridge the task being exported (the fork names items after it)."""

    def tracking(self, tasks, description, show_progress=True):
        for task in release_tracking(self, tasks, description, show_progress):
            self._fork_current_task = task
            yield task

    return tracking


@contextlib.contextmanager
def fork_seams(revision: str = "1187a604") -> Iterator[None]:
    """The fork's shape; ``revision`` picks its ``model_bridge.py``: at 1187a604 a grouped-expert export's
    third field is the local name of the expert task that completed it, at d063066b ``None`` (its grouped
    branch builds ``HFWeightTuple(hf_name, tensor)`` with two arguments)."""
    if revision not in ("1187a604", "d063066b"):
        raise ValueError(f"no fork double for model_bridge.py @{revision}")
    from megatron.bridge.models.conversion import auto_bridge, model_bridge, param_mapping
    from megatron.bridge.models.hf_pretrained import state
    from megatron.core.utils import unwrap_model

    release_tuple = model_bridge.HFWeightTuple
    bridge_cls = model_bridge.MegatronModelBridge
    mapping_cls = param_mapping.MegatronParamMapping
    saved = [
        (model_bridge, "HFWeightTuple", release_tuple),
        (bridge_cls, "stream_weights_megatron_to_hf", bridge_cls.stream_weights_megatron_to_hf),
        (bridge_cls, "_with_progress_tracking", bridge_cls._with_progress_tracking),
        (bridge_cls, "build_conversion_tasks", bridge_cls.build_conversion_tasks),
        (auto_bridge.AutoBridge, "export_hf_weights", auto_bridge.AutoBridge.export_hf_weights),
        (auto_bridge.AutoBridge, "save_hf_weights", auto_bridge.AutoBridge.save_hf_weights),
        (auto_bridge.AutoBridge, "save_hf_pretrained", auto_bridge.AutoBridge.save_hf_pretrained),
        (state.SafeTensorsStateSource, "save_generator", state.SafeTensorsStateSource.save_generator),
        (mapping_cls, "__init__", mapping_cls.__init__),
        (mapping_cls, "set_process_groups_from_pg_collection", mapping_cls.set_process_groups_from_pg_collection),
        (param_mapping.AutoMapping, "_get_or_create_mapping", param_mapping.AutoMapping._get_or_create_mapping),
        (param_mapping.AutoMapping, "_detect_parallelism_type", param_mapping.AutoMapping._detect_parallelism_type),
        (mapping_cls, "gather_from_ep_ranks", mapping_cls.gather_from_ep_ranks),
        (bridge_cls, "_broadcast_shared_embeddings", bridge_cls._broadcast_shared_embeddings),
        (bridge_cls, "stream_adapter_weights_megatron_to_hf", bridge_cls.stream_adapter_weights_megatron_to_hf),
        (auto_bridge.AutoBridge, "export_adapter_weights", auto_bridge.AutoBridge.export_adapter_weights),
    ]

    class ForkHFWeightTuple(NamedTuple):
        param_name: str
        weight: torch.Tensor
        megatron_param_name: str | None = None

        def iter_finalized(self, **kwargs: Any):  # the release's stream finalises its tuples with this
            yield from release_tuple(self.param_name, self.weight).iter_finalized(**kwargs)

    release_stream = bridge_cls.stream_weights_megatron_to_hf
    release_tracking = bridge_cls._with_progress_tracking
    release_build = bridge_cls.build_conversion_tasks
    release_init = mapping_cls.__init__
    release_set_groups = mapping_cls.set_process_groups_from_pg_collection

    tracking = _recording_current_task(release_tracking)

    def stream(
        self, model, hf_pretrained, cpu=True, show_progress=True, conversion_tasks=None, merge_adapter_weights=True
    ):
        chunks = unwrap_model(model if isinstance(model, list) else [model])
        tied = self._share_embeddings_and_output_weights(chunks[0].config)
        for item in release_stream(
            self, model, hf_pretrained, cpu, show_progress, conversion_tasks, merge_adapter_weights
        ):
            # the release builds its tuples with the module's HFWeightTuple, patched here: take two fields
            task = self._fork_current_task
            grouped = getattr(task.mapping, "is_grouped_export", False)
            task_name = None if grouped and revision == "d063066b" else task.param_name
            yield ForkHFWeightTuple(item[0], item[1], task_name)
            if not (tied and item[0] == "model.embed_tokens.weight"):
                continue
            source = getattr(getattr(hf_pretrained, "state", None), "source", None)
            if source is not None:
                alias = "lm_head.weight" in source.get_all_keys()
            else:  # "Always emit lm_head.weight for config-only"
                alias = isinstance(hf_pretrained, transformers.PretrainedConfig)
            if alias:
                yield ForkHFWeightTuple("lm_head.weight", item[1].clone().detach(), task_name)

    def export_hf_weights(
        self, model, cpu=False, show_progress=True, conversion_tasks=None, merge_adapter_weights=True
    ):
        return self._model_bridge.stream_weights_megatron_to_hf(
            model,
            self.hf_pretrained,
            cpu=cpu,
            show_progress=show_progress,
            conversion_tasks=conversion_tasks,
            merge_adapter_weights=merge_adapter_weights,
        )

    def save_hf_weights(
        self,
        model,
        path,
        show_progress=True,
        strict=True,
        merge_adapter_weights=True,
        distributed_save=False,
        save_every_n_ranks=1,
    ):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        generator = self._model_bridge.stream_weights_megatron_to_hf(
            model,
            self.hf_pretrained,
            cpu=True,
            show_progress=show_progress,
            merge_adapter_weights=merge_adapter_weights,
        )
        instance = model[0]
        while hasattr(instance, "module"):
            instance = instance.module
        quantizers: dict[str, torch.Tensor] = {}
        if modelopt_is_quantized(instance):
            generator = _filter_quant(generator, quantizers)
        source = getattr(getattr(self.hf_pretrained, "state", None), "source", None)
        if isinstance(source, state.SafeTensorsStateSource):
            source.save_generator(
                generator, path, strict=strict, distributed_save=distributed_save, save_every_n_ranks=save_every_n_ranks
            )
        else:  # the config-only path (auto_bridge.py @d063066b, save_hf_weights): two-field unpack on rank 0
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                save_config_only_shards({name: tensor.contiguous().cpu() for name, tensor in generator}, path)
            else:
                for _ in generator:
                    pass
        if quantizers and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            torch.save(quantizers, Path(path) / "modelopt_weights.pt")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def save_hf_pretrained(
        self,
        model,
        path,
        show_progress=True,
        source_path=None,
        strict=True,
        merge_adapter_weights=True,
        distributed_save=False,
        save_every_n_ranks=1,
    ):
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            additional_files = getattr(self._model_bridge, "ADDITIONAL_FILE_PATTERNS", None) or None
            self.hf_pretrained.save_artifacts(path, original_source_path=source_path, additional_files=additional_files)
        self.save_hf_weights(
            model,
            path,
            show_progress,
            strict,
            merge_adapter_weights=merge_adapter_weights,
            distributed_save=distributed_save,
            save_every_n_ranks=save_every_n_ranks,
        )

    def save_generator(self, generator, output_path, strict=True, distributed_save=False, save_every_n_ranks=1):
        if distributed_save:
            return save_generator_distributed(self, generator, output_path)
        return fork_save_generator(self, generator, output_path, strict)

    def build_conversion_tasks(self, hf_pretrained, megatron_model):
        return release_build(self, hf_pretrained, megatron_model)

    def mapping_init(self, *args, **kwargs):
        release_init(self, *args, **kwargs)
        self.__dict__.pop("_pg_collection", None)

    def set_groups(self, pg_collection):
        release_set_groups(self, pg_collection)
        self.__dict__.pop("_pg_collection", None)

    def get_or_create_mapping(self, parallelism_type):
        delegate = {
            "column": param_mapping.ColumnParallelMapping,
            "row": param_mapping.RowParallelMapping,
            "replicated": param_mapping.ReplicatedMapping,
        }[parallelism_type]
        return delegate(self.megatron_param, self.hf_param)

    def detect_parallelism_type(self, module):
        module_type = type(module).__name__
        if module_type in FORK_FUSED_NORM_LINEARS:
            if self.megatron_param and self.megatron_param.endswith(("layer_norm_weight", "layer_norm_bias")):
                return "replicated"
            return "column"
        for parallelism, types in self._MODULE_TYPE_REGISTRY.items():
            if module_type in types:
                return parallelism
        if hasattr(module, "tensor_model_parallel"):
            if not module.tensor_model_parallel:
                return "replicated"
            partition_dim = getattr(module, "partition_dim", None)
            if partition_dim in (0, 1):
                return "column" if partition_dim == 0 else "row"
        if "Norm" in module_type or "Normalization" in module_type:
            return "replicated"
        if module_type == "TELinear":
            return module.parallel_mode if module.parallel_mode in ("column", "row") else "replicated"
        raise ValueError(f"Cannot determine parallelism type for module '{module_type}' at '{self.megatron_param}'")

    release_gather = mapping_cls.gather_from_ep_ranks

    def gather_from_ep_ranks(self, megatron_weights, megatron_module, hf_param_name):
        if self.ep_size != 1:  # the same code as the release's from here on
            return release_gather(self, megatron_weights, megatron_module, hf_param_name)
        # param_mapping.py @d063066b has no `if self.ep_size == 1: return` (the release's first statement):
        # the PP broadcast of experts-per-rank, a one-rank all_gather, unsqueeze(0) then .squeeze()
        if megatron_module is None:
            self.broadcast_obj_from_pp_rank(None, "num_experts_per_rank")
        else:
            num_experts = self._get_config(megatron_module).num_moe_experts
            self.broadcast_obj_from_pp_rank(num_experts // self.ep_size, "num_experts_per_rank")
        gathered = [torch.empty_like(megatron_weights)]
        torch.distributed.all_gather(gathered, megatron_weights, group=self.ep_group)
        return {str(hf_param_name): gathered[0].unsqueeze(0).squeeze()}

    def broadcast_shared_embeddings(self, megatron_model):
        from megatron.core import parallel_state
        from megatron.core.utils import unwrap_model

        chunk = unwrap_model(megatron_model)[0]
        config = chunk.config
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        if not (config.share_embeddings_and_output_weights and config.pipeline_model_parallel_size > 1):
            return
        if not (first or last):
            return
        group = parallel_state.get_embedding_group()
        ranks = torch.distributed.get_process_group_ranks(group)
        if torch.distributed.get_rank() in ranks:
            if hasattr(chunk, "embedding") and hasattr(chunk.embedding, "word_embeddings"):
                weights = chunk.embedding.word_embeddings.weight.data
            else:
                assert hasattr(chunk, "output_layer"), "Output layer not found"
                weights = torch.empty_like(chunk.output_layer.weight.data)
            torch.distributed.broadcast(weights, src=ranks[0], group=group)
            if hasattr(chunk, "output_layer"):
                chunk.output_layer.weight.data.copy_(weights)

    def export_adapter_weights(self, model, cpu=True, show_progress=True):
        return self._model_bridge.stream_adapter_weights_megatron_to_hf(model, cpu=cpu, show_progress=show_progress)

    model_bridge.HFWeightTuple = ForkHFWeightTuple
    bridge_cls.stream_adapter_weights_megatron_to_hf = functools.partialmethod(
        fork_adapter_stream, revision=PEFT_BRIDGE_AT[revision]
    )
    auto_bridge.AutoBridge.export_adapter_weights = export_adapter_weights
    bridge_cls.stream_weights_megatron_to_hf = stream
    bridge_cls._with_progress_tracking = tracking
    bridge_cls.build_conversion_tasks = build_conversion_tasks
    auto_bridge.AutoBridge.export_hf_weights = export_hf_weights
    auto_bridge.AutoBridge.save_hf_weights = save_hf_weights
    auto_bridge.AutoBridge.save_hf_pretrained = save_hf_pretrained
    state.SafeTensorsStateSource.save_generator = save_generator
    mapping_cls.__init__ = mapping_init
    mapping_cls.set_process_groups_from_pg_collection = set_groups
    param_mapping.AutoMapping._get_or_create_mapping = get_or_create_mapping
    param_mapping.AutoMapping._detect_parallelism_type = detect_parallelism_type
    mapping_cls.gather_from_ep_ranks = gather_from_ep_ranks
    bridge_cls._broadcast_shared_embeddings = broadcast_shared_embeddings
    _clear_seam_cache()
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _clear_seam_cache()


class HFSourcedWeightTuple(NamedTuple):
    """The fork's ``HFSourcedWeightTuple`` (``model_bridge.py`` @04c0fd03 L156-181): the third field is a tuple."""

    param_name: str
    weight: torch.Tensor
    megatron_param_names: tuple[str, ...]

    @property
    def megatron_param_name(self) -> str | None:
        return self.megatron_param_names[0] if len(self.megatron_param_names) == 1 else None


@contextlib.contextmanager
def sourced_export() -> Iterator[None]:
    """The installed release in the shape of upstream's #6074 as vime's fork holds it at 04c0fd03.

    Read in the fork's ``model_bridge.py`` @04c0fd03b44628fe9fcbe9f218f9a763ca36877a (upstream's
    ``auto_bridge.py`` at that revision is not stored; #6074 adds the same keyword to
    ``AutoBridge.export_hf_weights``, which forwards it):

    * ``HFSourcedWeightTuple`` next to a two-field ``HFWeightTuple`` (L108-112, L156-181);
    * ``stream_weights_megatron_to_hf(..., weight_dtype=None, with_megatron_names=False)`` (L1661-1671):
      off, the two-field tuples as before; on, every item is an ``HFSourcedWeightTuple`` whose names are
      ``(task.param_name,)`` for a converted weight (L1867-1897) and, for a grouped-expert export, every
      expert task the grouped-export hook recorded under that name, in accumulation order
      (``_grouped_sources``, L1766, L1802-1821: the hook is called with ``grouped_sources=``, a dict
      when names are asked for, else None).

    The release's stream is the same code without the names (model_bridge.py L1373-1444): the double
    records the task being exported and hands the hook the fork's keyword.
    """
    from megatron.bridge.models.conversion import auto_bridge, model_bridge

    bridge_cls = model_bridge.MegatronModelBridge
    release_stream = bridge_cls.stream_weights_megatron_to_hf
    release_tracking = bridge_cls._with_progress_tracking
    release_export = auto_bridge.AutoBridge.export_hf_weights

    tracking = _recording_current_task(release_tracking)

    def stream(
        self,
        megatron_model,
        hf_pretrained,
        cpu=True,
        show_progress=True,
        conversion_tasks=None,
        merge_adapter_weights=True,
        weight_dtype=None,
        with_megatron_names=False,
    ):
        sources: dict[str, list[str]] | None = {} if with_megatron_names else None
        hook = type(self)._accumulate_grouped_export
        self._accumulate_grouped_export = lambda *args: hook(self, *args, grouped_sources=sources)
        try:
            items = release_stream(
                self,
                megatron_model,
                hf_pretrained,
                cpu,
                show_progress,
                conversion_tasks,
                merge_adapter_weights,
                weight_dtype,
            )
            for name, weight in items:
                if sources is None:
                    yield model_bridge.HFWeightTuple(name, weight)
                elif name in sources:
                    yield HFSourcedWeightTuple(name, weight, tuple(sources.pop(name)))
                else:
                    yield HFSourcedWeightTuple(name, weight, (self._fork_current_task.param_name,))
        finally:
            del self._accumulate_grouped_export

    def export_hf_weights(
        self,
        model,
        cpu=False,
        show_progress=True,
        conversion_tasks=None,
        merge_adapter_weights=True,
        weight_dtype=None,
        with_megatron_names=False,
    ):
        stream = self._model_bridge.stream_weights_megatron_to_hf
        return stream(
            model,
            self.hf_pretrained,
            cpu,
            show_progress,
            conversion_tasks,
            merge_adapter_weights,
            weight_dtype,
            with_megatron_names,
        )

    model_bridge.HFSourcedWeightTuple = HFSourcedWeightTuple
    bridge_cls.stream_weights_megatron_to_hf = stream
    bridge_cls._with_progress_tracking = tracking
    auto_bridge.AutoBridge.export_hf_weights = export_hf_weights
    _clear_seam_cache()
    try:
        yield
    finally:
        del model_bridge.HFSourcedWeightTuple
        bridge_cls.stream_weights_megatron_to_hf = release_stream
        bridge_cls._with_progress_tracking = release_tracking
        auto_bridge.AutoBridge.export_hf_weights = release_export
        _clear_seam_cache()
