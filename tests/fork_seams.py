"""vime's Megatron-Bridge fork, reproduced on the installed release for tests: its three seams.

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

Everything is restored on exit, and the plugin's cached seam detection is cleared both ways, so a
shared rank process can run release and fork cases one after the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch


def _clear_seam_cache() -> None:
    from vime_gemma4_bridge.compat import seams

    for detector in (
        seams.export_yields_megatron_names,
        seams.conversion_tasks_take_weight_dtype,
        seams.mappings_keep_pg_collection,
    ):
        detector.cache_clear()


@contextlib.contextmanager
def fork_seams() -> Iterator[None]:
    from megatron.bridge.models.conversion import auto_bridge, model_bridge, param_mapping

    release_tuple = model_bridge.HFWeightTuple
    bridge_cls = model_bridge.MegatronModelBridge
    mapping_cls = param_mapping.MegatronParamMapping
    saved = [
        (model_bridge, "HFWeightTuple", release_tuple),
        (bridge_cls, "stream_weights_megatron_to_hf", bridge_cls.stream_weights_megatron_to_hf),
        (bridge_cls, "_with_progress_tracking", bridge_cls._with_progress_tracking),
        (bridge_cls, "build_conversion_tasks", bridge_cls.build_conversion_tasks),
        (auto_bridge.AutoBridge, "export_hf_weights", auto_bridge.AutoBridge.export_hf_weights),
        (mapping_cls, "__init__", mapping_cls.__init__),
        (mapping_cls, "set_process_groups_from_pg_collection", mapping_cls.set_process_groups_from_pg_collection),
        (param_mapping.AutoMapping, "_get_or_create_mapping", param_mapping.AutoMapping._get_or_create_mapping),
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

    def tracking(self, tasks, description, show_progress=True):
        for task in release_tracking(self, tasks, description, show_progress):
            self._fork_current_task = task
            yield task

    def stream(
        self, model, hf_pretrained, cpu=True, show_progress=True, conversion_tasks=None, merge_adapter_weights=True
    ):
        for item in release_stream(
            self, model, hf_pretrained, cpu, show_progress, conversion_tasks, merge_adapter_weights
        ):
            # the release builds its tuples with the module's HFWeightTuple, patched here: take two fields
            yield ForkHFWeightTuple(item[0], item[1], self._fork_current_task.param_name)

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

    model_bridge.HFWeightTuple = ForkHFWeightTuple
    bridge_cls.stream_weights_megatron_to_hf = stream
    bridge_cls._with_progress_tracking = tracking
    bridge_cls.build_conversion_tasks = build_conversion_tasks
    auto_bridge.AutoBridge.export_hf_weights = export_hf_weights
    mapping_cls.__init__ = mapping_init
    mapping_cls.set_process_groups_from_pg_collection = set_groups
    param_mapping.AutoMapping._get_or_create_mapping = get_or_create_mapping
    _clear_seam_cache()
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        _clear_seam_cache()
