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

import contextlib
import functools
import inspect
import os
import re
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import transformers
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, register_bridge_implementation
from megatron.bridge.models.conversion.utils import persistent_buffers
from megatron.core.models.gpt.gpt_model import GPTModel

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.compat.bridge_hooks import ModelBridgeHooks
from vime_gemma4_bridge.compat.mappings import (
    ColumnParallel,
    ColumnParallelQKVMapping,
    FusedGatedExpertMapping,
    GatedMLPMapping,
    Replicated,
    RowParallel,
    RowParallelFusedExpertMapping,
)
from vime_gemma4_bridge.core.block_fp8 import as_rollout_checkpoint_stores, rollout_block_fp8_weights
from vime_gemma4_bridge.core.hf_layout import (
    EXPERT_LAYOUT_ENV,
    LANGUAGE_MODEL_PREFIX,
    PER_EXPERT,
    STACKED,
    UNTIED_REFUSAL,
    check_expert_layout,
    declared_dtype,
    global_kv_heads,
    split_expert,
    stack_of,
    ties_embeddings,
)
from vime_gemma4_bridge.core.layer_pattern import FULL, SLIDING, pattern_from_layer_types
from vime_gemma4_bridge.core.lora import Gemma4AdapterExport
from vime_gemma4_bridge.core.provider import Gemma4DenseTextModelProvider, Gemma4TextModelProvider
from vime_gemma4_bridge.core.tied import broadcast_tied_embeddings, check_tied_embeddings

MappingTable = tuple[tuple[type, str, str | dict[str, str]], ...]

# ---------------------------------------------------------------------------------------------
# Both models. Megatron names are relative to the GPTModel, HF names to the language-model prefix; ``*``
# is the layer index; a dict HF side fuses HF tensors into one Megatron tensor. Tied embeddings: no
# ``lm_head`` / ``output_layer`` on purpose (core/tied.py). Each row states its parallelism (column / row /
# replicated): builds disagree on how ``AutoMapping`` guesses it from a class name (compat/mappings.py).
# ---------------------------------------------------------------------------------------------
SHARED_MAPPING_ROWS: MappingTable = (
    (ColumnParallel, "embedding.word_embeddings.weight", "embed_tokens.weight"),
    (Replicated, "decoder.final_layernorm.weight", "norm.weight"),
    # attention (sliding and full layers share names; shapes differ per layer type)
    (
        ColumnParallelQKVMapping,
        "decoder.layers.*.self_attention.linear_qkv.weight",
        {
            "q": "layers.*.self_attn.q_proj.weight",
            "k": "layers.*.self_attn.k_proj.weight",
            "v": "layers.*.self_attn.v_proj.weight",
        },
    ),
    (Replicated, "decoder.layers.*.self_attention.q_layernorm.weight", "layers.*.self_attn.q_norm.weight"),
    (Replicated, "decoder.layers.*.self_attention.k_layernorm.weight", "layers.*.self_attn.k_norm.weight"),
    (Replicated, "decoder.layers.*.self_attention.linear_qkv.layer_norm_weight", "layers.*.input_layernorm.weight"),
    (RowParallel, "decoder.layers.*.self_attention.linear_proj.weight", "layers.*.self_attn.o_proj.weight"),
    (
        Replicated,
        "decoder.layers.*.self_attention.linear_proj.post_layernorm.weight",
        "layers.*.post_attention_layernorm.weight",
    ),
    (Replicated, "decoder.layers.*.post_ffn_layernorm.weight", "layers.*.post_feedforward_layernorm.weight"),
    (Replicated, "decoder.layers.*.layer_scalar", "layers.*.layer_scalar"),
)

# The MoE model: its modules are the plugin's (core/model.py, core/spec.py).
MOE_MAPPING_TABLE: MappingTable = (
    *SHARED_MAPPING_ROWS,
    # feed-forward: dense MLP ("shared expert") beside the routed experts, each with its norms
    (Replicated, "decoder.layers.*.pre_shared_expert_layernorm.weight", "layers.*.pre_feedforward_layernorm.weight"),
    (
        GatedMLPMapping,
        "decoder.layers.*.mlp.shared_experts.linear_fc1.weight",
        {"gate": "layers.*.mlp.gate_proj.weight", "up": "layers.*.mlp.up_proj.weight"},
    ),
    (RowParallel, "decoder.layers.*.mlp.shared_experts.linear_fc2.weight", "layers.*.mlp.down_proj.weight"),
    (
        Replicated,
        "decoder.layers.*.mlp.post_shared_expert_layernorm.weight",
        "layers.*.post_feedforward_layernorm_1.weight",
    ),
    (Replicated, "decoder.layers.*.pre_mlp_layernorm.weight", "layers.*.pre_feedforward_layernorm_2.weight"),
    (Replicated, "decoder.layers.*.mlp.router.weight", "layers.*.router.proj.weight"),
    (Replicated, "decoder.layers.*.mlp.router.scale", "layers.*.router.scale"),
    (Replicated, "decoder.layers.*.mlp.router.per_expert_scale", "layers.*.router.per_expert_scale"),
    # routed experts: one Megatron tensor per expert <-> one stacked HF tensor [E, ...]
    (FusedGatedExpertMapping, "decoder.layers.*.mlp.experts.linear_fc1.weight*", "layers.*.experts.gate_up_proj"),
    (RowParallelFusedExpertMapping, "decoder.layers.*.mlp.experts.linear_fc2.weight*", "layers.*.experts.down_proj"),
    (Replicated, "decoder.layers.*.mlp.post_moe_layernorm.weight", "layers.*.post_feedforward_layernorm_2.weight"),
)


# The dense model (E2B / E4B / 31B): core/dense.py. KV-shared layers have a query projection
# only (``linear_q``); the per-layer embeddings (PLE) live in the embedding and in each layer.
DENSE_MAPPING_TABLE: MappingTable = (
    *SHARED_MAPPING_ROWS,
    (ColumnParallel, "decoder.layers.*.self_attention.linear_q.weight", "layers.*.self_attn.q_proj.weight"),
    (Replicated, "decoder.layers.*.self_attention.linear_q.layer_norm_weight", "layers.*.input_layernorm.weight"),
    (Replicated, "decoder.layers.*.mlp.linear_fc1.layer_norm_weight", "layers.*.pre_feedforward_layernorm.weight"),
    (
        GatedMLPMapping,
        "decoder.layers.*.mlp.linear_fc1.weight",
        {"gate": "layers.*.mlp.gate_proj.weight", "up": "layers.*.mlp.up_proj.weight"},
    ),
    (RowParallel, "decoder.layers.*.mlp.linear_fc2.weight", "layers.*.mlp.down_proj.weight"),
    # per-layer embeddings (PLE): the token table is vocabulary-parallel, the projections are replicated
    (ColumnParallel, "embedding.per_layer_embedding.weight", "embed_tokens_per_layer.weight"),
    (Replicated, "embedding.per_layer_model_projection.weight", "per_layer_model_projection.weight"),
    (Replicated, "embedding.per_layer_projection_norm.weight", "per_layer_projection_norm.weight"),
    (Replicated, "decoder.layers.*.per_layer_input_gate.weight", "layers.*.per_layer_input_gate.weight"),
    (Replicated, "decoder.layers.*.per_layer_projection.weight", "layers.*.per_layer_projection.weight"),
    (Replicated, "decoder.layers.*.post_per_layer_input_norm.weight", "layers.*.post_per_layer_input_norm.weight"),
)


#: HF tensors with one row per vocabulary entry (padded on the Megatron side) -> their text-config size.
VOCAB_TENSORS = {
    "embed_tokens.weight": "vocab_size",
    "lm_head.weight": "vocab_size",
    "embed_tokens_per_layer.weight": "vocab_size_per_layer_input",
}


def build_registry(table: Iterable[tuple[type, str, str | dict[str, str]]], hf_prefix: str) -> MegatronMappingRegistry:
    """Instantiate a mapping table for one HF class (prefix)."""
    mappings = []
    for mapping_cls, megatron_name, hf in table:
        if isinstance(hf, dict):
            mappings.append(mapping_cls(megatron_name, **{role: hf_prefix + name for role, name in hf.items()}))
        else:
            mappings.append(mapping_cls(megatron_param=megatron_name, hf_param=hf_prefix + hf))
    return MegatronMappingRegistry(*mappings)


_EXPERT_LAYOUT: ContextVar[str | None] = ContextVar("vime_gemma4_expert_layout", default=None)


def expert_layout() -> str:
    """The expert layout now: :func:`exporting_experts`' inside one, else the environment's, else stacked."""
    return _EXPERT_LAYOUT.get() or check_expert_layout(os.environ.get(EXPERT_LAYOUT_ENV) or STACKED, EXPERT_LAYOUT_ENV)


@contextlib.contextmanager
def exporting_experts(layout: str) -> Iterator[None]:
    """Export experts in ``layout`` inside this block (it overrides the environment); wrap each step of an export."""
    token = _EXPERT_LAYOUT.set(check_expert_layout(layout))
    try:
        yield
    finally:
        _EXPERT_LAYOUT.reset(token)


def in_expert_layout(layout: str, stream: Iterable[Any]) -> Iterator[Any]:
    """``stream``'s items, each made inside :func:`exporting_experts` (``layout``); wrap an export with it.

    The layout is set around each step of ``stream`` and reset before the item is handed on: set
    inside a generator, a context variable would stay set in its consumer between items.
    """
    items = iter(stream)
    while True:
        with exporting_experts(layout):
            item = next(items, _END)
        if item is _END:
            return
        yield item


_END = object()


class UnsupportedCheckpoint(ValueError):
    """The checkpoint is Gemma 4, but not one this plugin (on this Megatron-Bridge build) can convert."""


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
        table = DENSE_MAPPING_TABLE if self._is_dense() else MOE_MAPPING_TABLE
        return build_registry(table, LANGUAGE_MODEL_PREFIX[self._architecture()])

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
        field = next((f for suffix, f in VOCAB_TENSORS.items() if hf_name.endswith(suffix)), None)
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
        per_expert = expert_layout() == PER_EXPERT
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
        stream is the language model (:meth:`converts_hf_tensor`), in block FP8 where the checkpoint stores it so.
        """
        arguments = inspect.signature(super().stream_weights_megatron_to_hf).bind(
            megatron_model, hf_pretrained, *args, **kwargs
        )
        return self._checked_stream(arguments.arguments.get("conversion_tasks") is None, arguments)

    def _checked_stream(self, check: bool, arguments: inspect.BoundArguments):
        # vime's live sync only: a save, round trip or export sets the layout (exporting_experts)
        fp8 = rollout_block_fp8_weights(arguments.args[1]) if _EXPERT_LAYOUT.get() is None else frozenset()
        if check:
            check_tied_embeddings(arguments.args[0])
        items = super().stream_weights_megatron_to_hf(*arguments.args, **arguments.kwargs)
        stream = seams.with_grouped_names(items, self)
        if any(stack_of(name) for name in fp8):  # the experts as the rollout checkpoint stores them
            stream = in_expert_layout(PER_EXPERT, stream)
        yield from as_rollout_checkpoint_stores(fp8, stream) if fp8 else stream

    def in_checkpoint_layout(self, stream: Iterable[Any]) -> Iterator[Any]:
        """``stream`` with the experts stacked, as a checkpoint stores them, whatever ``VIME_GEMMA4_EXPERT_LAYOUT``
        (vime's live sync's switch) says: the hook every HF save applies (``compat/hf_save.complete_saves_of``)."""
        return in_expert_layout(STACKED, stream)

    def converts_hf_tensor(self, hf_name: str) -> bool:
        """Whether the export yields the source tensor ``hf_name``: the language model's, not a VL tower's.

        The hook a complete HF save needs (docs/UPSTREAM.md 30): the other source tensors are passed
        through from the source (``compat/hf_save.complete_saves_of``, applied at registration).
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


#: Provider settings Megatron-Bridge's own ``MegatronModelBridge.CONFIG_MAPPING`` translates from a
#: Gemma 4 text config (read in 0.6.2 and the fork at 1187a604 / d063066b: the same table).
UPSTREAM_MAPPED_SETTINGS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "layernorm_epsilon",
        "vocab_size",
        "seq_length",
        "init_method_std",
        "share_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_ffn_hidden_size",
    }
)


def upstream_config_kwargs(text: Any) -> dict[str, Any]:
    """:data:`UPSTREAM_MAPPED_SETTINGS` from ``text`` through Megatron-Bridge's ``CONFIG_MAPPING`` (first HF name wins).

    The table, not ``hf_config_to_provider_kwargs``: that method also maps fields Gemma 4 sets
    otherwise (dtype, activation, RoPE) and, on the fork, asserts a ``torch_dtype`` that a VL
    checkpoint's text config may not declare.
    """
    kwargs: dict[str, Any] = {}
    for hf_name, megatron_name in MegatronModelBridge.CONFIG_MAPPING:
        if megatron_name in UPSTREAM_MAPPED_SETTINGS and megatron_name not in kwargs and hasattr(text, hf_name):
            kwargs[megatron_name] = getattr(text, hf_name)
    return kwargs  # Gemma4TextConfig defines every one of them (transformers' defaults where config.json is silent)


def _common_settings(text: Any) -> dict[str, Any]:
    """The provider settings of every Gemma 4 member (HF names on the right)."""
    rope = getattr(text, "rope_parameters", None) or {}
    full, sliding = rope.get(FULL) or {}, rope.get(SLIDING) or {}
    for layer_type, params, expected in ((FULL, full, "proportional"), (SLIDING, sliding, "default")):
        if params.get("rope_type", expected) != expected or params.get("factor", 1.0) != 1.0:
            raise UnsupportedCheckpoint(
                f"Gemma 4 {layer_type} RoPE {params} is not supported (expected rope_type={expected!r}, no factor)"
            )
    return {
        **upstream_config_kwargs(text),
        "layer_types": pattern_from_layer_types(text.layer_types),
        "window_size": text.sliding_window,
        "global_head_dim": text.global_head_dim or text.head_dim,
        "num_global_key_value_heads": global_kv_heads(text),
        "attention_k_eq_v": bool(getattr(text, "attention_k_eq_v", False)),
        "global_rotary_percent": float(full.get("partial_rotary_factor", 1.0)),
        "rotary_base": float(full.get("rope_theta", 1_000_000.0)),
        "local_rotary_base": float(sliding.get("rope_theta", 10_000.0)),
        "final_logit_softcapping": getattr(text, "final_logit_softcapping", None),
    }


def moe_provider(text: Any) -> Gemma4TextModelProvider:
    """The MoE provider for a Gemma 4 text config."""
    return Gemma4TextModelProvider(
        **_common_settings(text),
        moe_router_topk=text.top_k_experts,
        moe_shared_expert_intermediate_size=text.intermediate_size,
    )


def dense_provider(text: Any) -> Gemma4DenseTextModelProvider:
    """The dense provider (E2B / E4B / 31B) for a Gemma 4 text config."""
    settings = _common_settings(text)
    settings.pop("num_moe_experts", None)  # Gemma4TextConfig defines it for every member; dense has none
    settings.pop("moe_ffn_hidden_size", None)
    per_layer = int(getattr(text, "hidden_size_per_layer_input", 0) or 0)
    return Gemma4DenseTextModelProvider(
        **settings,
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=int(getattr(text, "vocab_size_per_layer_input", 0) or 0) if per_layer else 0,
        num_kv_shared_layers=int(getattr(text, "num_kv_shared_layers", 0) or 0),
        use_double_wide_mlp=bool(getattr(text, "use_double_wide_mlp", False)),
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
