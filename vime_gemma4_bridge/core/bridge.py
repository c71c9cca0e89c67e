"""The Gemma 4 language-model bridge: mapping tables, provider hook, registration.

A Megatron-Bridge per-model bridge: one ``MegatronModelBridge`` subclass, a provider hook and
declarative mapping tables; every TP/PP/EP/ETP gather and scatter is Megatron-Bridge's (its mapping
classes and conversion tasks). What is Gemma 4's own (each a gap listed in docs/UPSTREAM.md):

* one bridge for ``Gemma4ForCausalLM`` (HF names under ``model.``) and for the language model of
  ``Gemma4ForConditionalGeneration`` (under ``model.language_model.``), and for the 12B's
  ``Gemma4Unified*`` twins of both: the vision/audio towers (the 12B's embedders) never enter
  Megatron, and the export streams exactly the HF language-model tensors;
* both models are this plugin's (:mod:`~vime_gemma4_bridge.core.provider`), with or without TE: the MoE
  (26B-A4B), the dense members (E2B, E4B, 31B, 12B: :mod:`~vime_gemma4_bridge.core.dense`), LoRA (core/lora.py);
* attention_k_eq_v: full layers have no ``v_proj`` in HF (V = K on import, dropped on export, no LoRA);
* Megatron weights in the checkpoint's own dtype (a bf16 copy of an fp32 checkpoint is lossy);
* refusals instead of silent skips: a Megatron parameter without a mapping, a persistent buffer
  that is a conversion task (vime's weight sync reads parameters only), tied copies that diverged.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import transformers
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, register_bridge_implementation
from megatron.bridge.models.conversion.utils import persistent_buffers
from megatron.core.models.gpt.gpt_model import GPTModel

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.compat.bridge_hooks import ModelBridgeHooks
from vime_gemma4_bridge.compat.hf_save import complete_saves_from_source
from vime_gemma4_bridge.core import expert_layout, mapping_table
from vime_gemma4_bridge.core.block_fp8 import as_rollout_checkpoint_stores, rollout_block_fp8_weights
from vime_gemma4_bridge.core.expert_layout import in_expert_layout
from vime_gemma4_bridge.core.hf_layout import (
    LANGUAGE_MODEL_PREFIX,
    PER_EXPERT,
    STACKED,
    UNTIED_REFUSAL,
    declared_dtype,
    split_expert,
    stack_of,
    ties_embeddings,
)
from vime_gemma4_bridge.core.layer_pattern import FULL
from vime_gemma4_bridge.core.lora import Gemma4AdapterExport
from vime_gemma4_bridge.core.provider import Gemma4TextModelProvider
from vime_gemma4_bridge.core.provider_config import UnsupportedCheckpoint, dense_provider, moe_provider
from vime_gemma4_bridge.core.tied import broadcast_tied_embeddings, check_tied_embeddings


class Gemma4LanguageModelBridge(Gemma4AdapterExport, ModelBridgeHooks):
    """Gemma 4 language-model bridge (MoE and dense) for the CausalLM and the VL checkpoint."""

    def _architecture(self) -> str:
        architectures = getattr(self.hf_config, "architectures", None) or []
        for architecture in architectures:
            if architecture in LANGUAGE_MODEL_PREFIX:
                return architecture
        raise UnsupportedCheckpoint(f"not a Gemma 4 checkpoint: architectures={architectures}")

    def _text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    def _is_dense(self) -> bool:
        return not getattr(self._text_config(), "enable_moe_block", False)

    def provider_bridge(self, hf_pretrained: Any) -> Any:
        self.hf_config = hf_pretrained.config
        if not ties_embeddings(self.hf_config):  # every road builds its model here: vime's too
            raise UnsupportedCheckpoint(UNTIED_REFUSAL)
        text = self._text_config()
        provider = dense_provider(text) if self._is_dense() else moe_provider(text)
        # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP; the divisor is
        # Megatron-Bridge's rule (the largest power of 2 up to 128 dividing the vocabulary: no padding at
        # TP1, none for Gemma 4's 262,144); import pads zero rows (ColumnParallelMapping), export drops them.
        provider.make_vocab_size_divisible_by = self.make_vocab_size_divisible_by(text.vocab_size)
        provider.should_pad_vocab = True
        # Keep the checkpoint's dtype: a bf16 copy of an fp32 checkpoint cannot round-trip bitwise.
        dtype = declared_dtype(self.hf_config) or torch.float32
        provider.params_dtype = dtype
        provider.bf16 = dtype == torch.bfloat16
        provider.fp16 = dtype == torch.float16
        provider.autocast_dtype = dtype
        provider.pipeline_dtype = dtype
        return provider

    def mapping_registry(self) -> MegatronMappingRegistry:
        table = mapping_table.DENSE_MAPPING_TABLE if self._is_dense() else mapping_table.MOE_MAPPING_TABLE
        return mapping_table.build_registry(table, LANGUAGE_MODEL_PREFIX[self._architecture()])

    def build_conversion_tasks(self, hf_pretrained: Any, megatron_model: list, weight_dtype: Any = None) -> list:
        """Megatron-Bridge's tasks, refusing what upstream would skip with a warning or let through.

        Ordered one expert stack at a time (:func:`one_stack_at_a_time`).
        """
        tasks = super().build_conversion_tasks(
            hf_pretrained, megatron_model, **seams.conversion_task_kwargs(weight_dtype)
        )
        check_conversion_tasks(tasks, megatron_model, functools.partial(seams.unwrap_name, self))
        return one_stack_at_a_time(tasks)

    def maybe_modify_loaded_hf_weight(self, hf_param: str | dict[str, str], hf_state_dict: Any) -> Any:
        """Supply what HF leaves out: V = K on k_eq_v full layers, and the PLE table's padding rows
        (upstream's mapping pads only the embedding and output layer).
        """
        if isinstance(hf_param, str) and hf_param.endswith("embed_tokens_per_layer.weight"):
            return self._padded_per_layer_table(super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict))
        if not isinstance(hf_param, dict) or set(hf_param) != {"q", "k", "v"} or not self._absent_in_hf(hf_param["v"]):
            return super().maybe_modify_loaded_hf_weight(hf_param, hf_state_dict)
        weights = {role: hf_state_dict[hf_param[role]] for role in ("q", "k")}
        weights["v"] = weights["k"].clone()
        return weights

    def maybe_modify_converted_hf_weight(self, task: Any, converted_weights_dict: dict, hf_state_dict: Any) -> dict:
        """Drop what exists only on the Megatron side: the V projection HF leaves out
        (:meth:`maybe_modify_loaded_hf_weight`) and the vocabulary's padding rows (:meth:`provider_bridge`).
        """
        return {
            name: self._unpadded(name, tensor)
            for name, tensor in converted_weights_dict.items()
            if not self._absent_in_hf(name)
        }

    def _unpadded(self, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` without the vocabulary padding rows, if it is a vocabulary table."""
        field = next((f for suffix, f in mapping_table.VOCAB_TENSORS.items() if hf_name.endswith(suffix)), None)
        rows = getattr(self._text_config(), field, None) if field else None
        return tensor[:rows] if rows and tensor.shape[0] > rows else tensor

    def _padded_per_layer_table(self, table: torch.Tensor) -> torch.Tensor:
        """The HF PLE table with zero rows up to the Megatron table's size (``core/dense.per_layer_vocab_size``)."""
        from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
        from megatron.core import parallel_state

        divisor = self.make_vocab_size_divisible_by(self._text_config().vocab_size)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rows = calculate_padded_vocab_size(table.shape[0], divisor, tp, logging_enabled=False)
        return (
            table
            if rows == table.shape[0]
            else torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])
        )

    def _absent_in_hf(self, hf_name: str) -> bool:
        """Whether the HF checkpoint has no such projection: ``v_proj`` of a k_eq_v full layer (the config says so)."""
        match = re.search(r"layers\.(\d+)\.self_attn\.v_proj\.weight$", hf_name)
        text = self._text_config()
        return bool(
            match and getattr(text, "attention_k_eq_v", False) and text.layer_types[int(match.group(1))] == FULL
        )

    def accumulate_grouped_export(
        self,
        task: Any,
        converted_weights_dict: dict,
        model_config: Any,
        grouped_buffers: dict,
        hf_state_dict: Any,
        *args: Any,
        grouped_sources: dict[str, list[str]] | None = None,
        **kwargs: Any,
    ) -> dict | None:
        """Stack each expert into its layer's tensor as it arrives, or hand it on at once (per-expert layout).

        Megatron-Bridge keeps every converted expert of a layer until the last one arrives, then
        copies them into a stacked tensor: two copies of a layer's experts at the peak. Writing each
        expert into a preallocated ``[E, ...]`` tensor keeps one (plus the expert in flight), which
        is what bounds the live export's memory to a chunk plus one layer's stacked experts. In the
        per-expert layout (:func:`expert_layout`) nothing is kept: each expert gathered is returned
        at once as its per-expert tensors (views of the gathered value), so the export's memory no
        longer grows with the number of experts. Same placement rule as upstream (the expert's global
        number; under EP the gathered ``[EP, ...]`` value holds that local expert of every EP rank;
        UPSTREAM 44). ``grouped_sources`` (the fork from 04c0fd03 passes it) gets the Megatron name of
        every expert in each name returned, as upstream records it; the completing task's name is kept
        for builds that yield none (UPSTREAM 51). A build that
        calls this hook with other arguments, and mappings that transpose on export, keep upstream's path.
        """
        if args or kwargs or getattr(task.mapping, "transpose_on_export", False):
            sources = {} if grouped_sources is None else {"grouped_sources": grouped_sources}
            return super().accumulate_grouped_export(
                task, converted_weights_dict, model_config, grouped_buffers, hf_state_dict, *args, **sources, **kwargs
            )
        from megatron.bridge.utils.common_utils import extract_expert_number_from_param
        from megatron.core import parallel_state

        ep_size = parallel_state.get_expert_model_parallel_world_size()
        num_experts = model_config.num_moe_experts
        per_rank = num_experts // ep_size
        try:
            local = extract_expert_number_from_param(task.param_name) % per_rank
        except ValueError:
            return None
        per_expert = expert_layout.expert_layout() == PER_EXPERT
        complete = {}
        for key, value in converted_weights_dict.items():
            gathered = ep_size > 1 and value.ndim > 0 and value.shape[0] == ep_size
            slots = [local + rank * per_rank for rank in range(ep_size)] if gathered else [local]
            pieces = value if gathered else value.unsqueeze(0)
            if per_expert:
                for slot, piece in zip(slots, pieces, strict=True):
                    for name, part in split_expert(key, slot, piece):
                        complete[name] = part
                        if grouped_sources is not None:
                            grouped_sources.setdefault(name, []).append(task.param_name)
                continue
            if grouped_sources is not None:
                grouped_sources.setdefault(key, []).append(task.param_name)
            entry = grouped_buffers.get(key)
            if entry is None:
                stack = torch.empty((num_experts, *pieces.shape[1:]), dtype=pieces.dtype, device=pieces.device)
                entry = grouped_buffers[key] = {"stack": stack, "filled": set()}
            for slot, piece in zip(slots, pieces, strict=True):
                entry["stack"][slot].copy_(piece)
                entry["filled"].add(slot)
            if len(entry["filled"]) == num_experts:
                complete[key] = grouped_buffers.pop(key)["stack"]
        self._grouped_task_name = task.param_name if complete else None
        return complete or None

    def broadcast_shared_embeddings(self, megatron_model: Any) -> None:
        """Tie the last stage's output layer to the embedding after a load, at any VPP (core/tied.py)."""
        broadcast_tied_embeddings(megatron_model)

    def stream_weights_megatron_to_hf(self, megatron_model: Any, hf_pretrained: Any, *args: Any, **kwargs: Any):
        """Upstream export of the language model, after proving the tied output layer still equals the embedding.

        With the caller's own conversion tasks (vime's weight sync) the export reads only their
        weights, so the check, which reads the model's, is skipped (core/tied.py says why). The
        stream is the language model (:meth:`converts_hf_tensor`), in block FP8 where the checkpoint
        stores it so. A HF save of ``hf_pretrained``'s source that consumes it is completed from the
        source (the towers: :meth:`converts_hf_tensor`, ``compat/hf_save``; docs/UPSTREAM.md 30), set
        up here, before the caller hands the stream to that save.
        """
        complete_saves_from_source(hf_pretrained, self.converts_hf_tensor, self.in_checkpoint_layout)
        arguments = inspect.signature(super().stream_weights_megatron_to_hf).bind(
            megatron_model, hf_pretrained, *args, **kwargs
        )
        return self._checked_stream(arguments.arguments.get("conversion_tasks") is None, arguments)

    def _checked_stream(self, check: bool, arguments: inspect.BoundArguments):
        # vime's live sync only: a save, round trip or export sets the layout
        fp8 = frozenset() if expert_layout.set_by_the_caller() else rollout_block_fp8_weights(arguments.args[1])
        if check:
            check_tied_embeddings(arguments.args[0])
        items = super().stream_weights_megatron_to_hf(*arguments.args, **arguments.kwargs)
        stream = seams.with_grouped_names(items, self)
        if any(stack_of(name) for name in fp8):  # the experts as the rollout checkpoint stores them
            stream = in_expert_layout(PER_EXPERT, stream)
        yield from as_rollout_checkpoint_stores(fp8, stream) if fp8 else stream

    def in_checkpoint_layout(self, stream: Iterable[Any]) -> Iterator[Any]:
        """``stream`` with the experts stacked, as a checkpoint stores them, whatever ``VIME_GEMMA4_EXPERT_LAYOUT``
        (vime's live sync's switch) says: the hook every HF save of this bridge's export applies."""
        return in_expert_layout(STACKED, stream)

    def converts_hf_tensor(self, hf_name: str) -> bool:
        """Whether the export yields the source tensor ``hf_name``: the language model's, not a VL tower's.

        The hook a complete HF save needs (docs/UPSTREAM.md 30): the other source tensors are passed
        through from the source (:meth:`stream_weights_megatron_to_hf`).
        """
        return hf_name.startswith(LANGUAGE_MODEL_PREFIX[self._architecture()])


def one_stack_at_a_time(tasks: list) -> list:
    """The tasks with each run of grouped-export (expert) tasks ordered stack by stack, in first-seen order.

    Megatron-Bridge sorts tasks by the numbers in their names, which interleaves a layer's experts
    (``linear_fc1.weight0``, ``linear_fc2.weight0``, ``linear_fc1.weight1`` ...): both of the
    layer's stacks fill together and are complete only at its last expert, while the consumer
    still holds the chunk it was assembling. Stack after stack, ``gate_up_proj`` is handed on
    (flushing that chunk) before ``down_proj`` starts to fill, which lowers the export's peak by
    up to a chunk. Every rank gets the same permutation: it depends on the tasks' stacked HF names
    and positions only, which agree across pipeline and expert-parallel ranks (upstream's
    collectives pair tasks by position). Every task is kept; expert order within a stack is unchanged.
    """
    ordered: list = []
    stacks: dict[str, list] = {}  # the current run of expert tasks, by stacked HF tensor
    for task in tasks:
        if task is not None and getattr(task.mapping, "is_grouped_export", False):
            stacks.setdefault(str(task.mapping.hf_param), []).append(task)
            continue
        ordered.extend(grouped for stack in stacks.values() for grouped in stack)
        stacks.clear()
        ordered.append(task)
    ordered.extend(grouped for stack in stacks.values() for grouped in stack)
    return ordered


class IncompleteMapping(ValueError):
    """A Megatron weight the export would drop, or one vime's weight sync could not find."""


def check_conversion_tasks(tasks: list, megatron_model: list, unwrap_name: Any) -> None:
    """Every parameter has a task (tied ``output_layer`` and PEFT adapters aside); no persistent buffer is one.

    Megatron-Bridge only logs a parameter it cannot map (0.6.2 then fails on the empty task slot,
    the fork skips it: the export silently lacks that weight). A persistent buffer that is a task
    breaks vime's weight sync, which looks every task's weight up among the model's parameters
    (and ``expert_bias`` buffers) and asserts it is there.
    """
    mapped = {task.param_name for task in tasks if task is not None and task.megatron_module is not None}
    for model in megatron_model:
        for raw_name, _ in model.named_parameters():
            name = unwrap_name(raw_name)
            if name not in mapped and "output_layer" not in name and ".adapter." not in name:  # tied; PEFT's own
                raise IncompleteMapping(f"Megatron parameter {name!r} has no Gemma 4 mapping; the export would drop it")
        for raw_name, _ in persistent_buffers(model):
            name = unwrap_name(raw_name)
            if name in mapped and "expert_bias" not in name:
                raise IncompleteMapping(
                    f"persistent buffer {name!r} is a conversion task; vime's weight sync reads parameters only "
                    "(make it a frozen parameter)"
                )


class Gemma4CausalLMBridge(Gemma4LanguageModelBridge):
    """Registered for ``Gemma4ForCausalLM``."""


class Gemma4ConditionalGenerationBridge(Gemma4LanguageModelBridge):
    """Registered for ``Gemma4ForConditionalGeneration``: its language model only."""


class Gemma4UnifiedCausalLMBridge(Gemma4LanguageModelBridge):
    """Registered for ``Gemma4UnifiedForCausalLM`` (the 12B: Gemma 4's dense text model, no PLE, no MoE)."""


class Gemma4UnifiedConditionalGenerationBridge(Gemma4LanguageModelBridge):
    """Registered for ``Gemma4UnifiedForConditionalGeneration``: its language model only (embedders copied)."""


#: HF class → (bridge, the ``model_type`` Megatron-Bridge writes into a config it builds for it); UPSTREAM 58.
BRIDGES = {
    "Gemma4ForCausalLM": (Gemma4CausalLMBridge, "gemma4"),
    "Gemma4ForConditionalGeneration": (Gemma4ConditionalGenerationBridge, "gemma4"),
    "Gemma4UnifiedForCausalLM": (Gemma4UnifiedCausalLMBridge, "gemma4_unified"),
    "Gemma4UnifiedForConditionalGeneration": (Gemma4UnifiedConditionalGenerationBridge, "gemma4_unified"),
}
_REGISTERED = False


def register() -> None:
    """Make ``AutoBridge`` dispatch the Gemma 4 classes to this plugin (those this transformers has). Idempotent.

    Registered under the class *name* (as Megatron-Bridge's own Gemma 4 bridges are) and under the
    transformers class itself, which wins over any name registration whenever that happens: the
    result does not depend on import order, and upstream's Gemma 4 modules are never imported.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    for name, (bridge_cls, model_type) in BRIDGES.items():
        hf_class = getattr(transformers, name, None)  # the 12B's classes came with transformers 5.12
        if hf_class is None:
            continue
        MegatronModelBridge.register_bridge(
            source=name, target=GPTModel, provider=Gemma4TextModelProvider, model_type=model_type
        )(bridge_cls)
        register_bridge_implementation(source=hf_class, target=GPTModel, bridge_class=bridge_cls)
    _REGISTERED = True
