"""LoRA on Gemma 4's fused norms: the adapter enters where Hugging Face's PEFT and vLLM put it.

Gemma 4 keeps two RMSNorms inside its Megatron linears, as Transformer Engine fuses them: the
input norm in ``linear_qkv`` / a dense ``linear_fc1`` (``layer_norm_weight``) and the
post-attention norm in ``linear_proj`` (``post_layernorm``). Megatron-Bridge's ``LoRALinear``
adds the adapter to the wrapped module's *output* and feeds it the module's *input* unless the
module returns its norm's output (TE's ``return_layernorm_output``, which Megatron-Bridge sets on
``TELayerNormColumnParallelLinear`` only). So, unfixed, a LoRA on ``linear_proj`` trains
``post_norm(W x) + B A x`` while Hugging Face, vLLM and the merged export compute
``post_norm((W + B A) x)``; and on the CPU twins the ``linear_qkv`` adapter reads the un-normalised
input. :func:`with_gemma4_adapters` corrects both after any adapter transform: the provider runs it
as its last pre-wrap hook (``Gemma4TextModelProvider.pre_wrap_hook``), which is where vime applies
LoRA (``provider.register_pre_wrap_hook``). Parameter names and shapes do not change (UPSTREAM 53, 54, 55).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
from megatron.bridge.peft.lora_layers import LoRALinear

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core.hf_layout import STACK_NAME, STACK_PROJECTIONS, per_expert_name
from vime_gemma4_bridge.core.model import attention_config


class PostNormLoRALinear(LoRALinear):
    """``LoRALinear`` around a linear with a post-norm: ``post_layernorm(W x + B A x)``, as HF's ``o_proj`` LoRA."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = self.to_wrap.linear_forward(x)
        if seams.adapter_enabled(self):
            output = output + self.adapter_forward(self.adapter, x.contiguous(), *args, **kwargs).reshape(output.shape)
        return self.to_wrap.post_layernorm(output), bias


def _adapters(model: list[torch.nn.Module]) -> Iterator[tuple[str, AdapterWrapper]]:
    for chunk in model:
        for name, module in chunk.named_modules():
            if isinstance(module, AdapterWrapper):
                yield name, module


def _placed(adapter: AdapterWrapper) -> bool:
    """Whether ``adapter`` reads and adds where HF does: after an input norm, before a post-norm."""
    if hasattr(adapter.to_wrap, "post_layernorm"):
        return type(adapter) is PostNormLoRALinear
    return getattr(adapter.to_wrap, "return_layernorm_output", True)


def refuse_expert_adapters_split_over_etp(model: list[torch.nn.Module]) -> None:
    """Refuse routed-expert adapters when the experts are tensor-parallel (ETP > 1) (UPSTREAM 59).

    There Megatron-Bridge's expert adapter trains one function and exports another: ``linear_fc2``'s
    adapter (row-parallel ``linear_in`` left unreduced, as megatron-core does for expert linears, then a
    gathering ``linear_out``) concatenates the ranks' partial products instead of summing them, and the
    release exports ``linear_fc1``'s ``lora_B`` rows in the ranks' ``[gate; up]`` shard order as if unsharded.
    """
    from megatron.bridge.peft.utils import is_expert_linear
    from megatron.core import parallel_state

    etp = parallel_state.get_expert_tensor_parallel_world_size() or 1  # None: no model parallel state
    experts = [name for name, _ in _adapters(model) if is_expert_linear(name)] if etp > 1 else []
    if experts:
        raise ValueError(
            f"{experts[0]}: LoRA on routed experts at expert tensor parallel size {etp} trains and exports "
            "different functions in Megatron-Bridge; use --expert-tensor-parallel-size 1, or leave the experts "
            "out of the LoRA targets"
        )


def with_gemma4_adapters(model: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``model`` with every adapter placed as Hugging Face places it (in place; idempotent).

    A plain ``LoRALinear`` around a post-norm linear becomes :class:`PostNormLoRALinear`; an input-norm
    linear under any adapter returns its norm's output, so the adapter reads what the linear reads.
    Any other adapter type around a post-norm linear is refused: its merge would not be what it trained;
    so are routed-expert adapters at ETP > 1 (:func:`refuse_expert_adapters_split_over_etp`).
    """
    refuse_expert_adapters_split_over_etp(model)
    for name, adapter in _adapters(model):
        if _placed(adapter):
            continue
        if not hasattr(adapter.to_wrap, "post_layernorm"):
            adapter.to_wrap.return_layernorm_output = True
        elif type(adapter) is LoRALinear:
            seams.become(adapter, PostNormLoRALinear)
        else:
            raise ValueError(
                f"{name}: Gemma 4 normalises this linear's output (post_layernorm), so a "
                f"{type(adapter).__name__} there cannot compute what its merge exports; use LoRA or exclude it"
            )
    return model


class Gemma4AdapterExport:
    """Bridge mixin: Gemma 4's adapter export and merge, over Megatron-Bridge's (both builds share these hooks).

    It comes before ``compat.bridge_hooks.ModelBridgeHooks`` among the bridge's bases: that class names
    upstream's private steps publicly, and these methods replace those public names.

    * both exports refuse adapters that were not placed as HF places them (:func:`with_gemma4_adapters`);
    * the routed experts' adapters stream per expert, as vLLM's Gemma 4 loader names them
      (:meth:`base_hf_param_names_for_adapter`);
    * a fused QKV adapter's ``lora_B`` is split by its layer's own attention shape.

    Megatron-Bridge splits it with the model-wide config, in the adapter export and in the merged
    export (upstream's own Gemma 4 bridge guesses global layers from the tensor's size), and merges
    unsplit when a layer has no ``v_proj``. Full layers have their own head dim and KV heads
    (:func:`~vime_gemma4_bridge.core.model.attention_config`). A k_eq_v full layer's V is its adapted K
    (the model reads no V rows there: ``Gemma4SelfAttention.value_is_key``), so its ``v_proj`` adapter is
    exported as the ``k_proj`` one: vLLM loads K into a V slot of its own and adapts that slot by the
    ``v_proj`` adapter only (0.32.0 ``models/gemma4.py`` ``_gemma4_layer_weights_mapper``), while HF PEFT,
    which has no ``v_proj`` module there, computes V from the adapted K and ignores it.
    """

    def build_adapter_conversion_tasks(self, megatron_model: list, *args: Any, **kwargs: Any) -> Any:
        """Upstream's adapter tasks (both exports build them), once every adapter is known to be placed
        (and no routed expert's adapter is split over ETP ranks: :func:`refuse_expert_adapters_split_over_etp`).

        An adapter applied to the built model rather than as a provider pre-wrap hook trained with
        Megatron-Bridge's placement (``post_norm(W x) + B A x``), which no export can represent.
        """
        refuse_expert_adapters_split_over_etp(megatron_model)
        misplaced = [name for name, adapter in _adapters(megatron_model) if not _placed(adapter)]
        if misplaced:
            raise ValueError(
                f"{misplaced[0]}: this adapter was applied after the Gemma 4 provider built the model, so it did not "
                "train what HF and vLLM compute; apply LoRA as a provider pre-wrap hook "
                "(provider.register_pre_wrap_hook), or call core.lora.with_gemma4_adapters(model) right after it"
            )
        return super().build_adapter_conversion_tasks(megatron_model, *args, **kwargs)

    def _qkv_slices(self, megatron_model: list, layer: int, linear_out: torch.Tensor) -> dict[str, torch.Tensor]:
        """``linear_out``'s rows for ``q_proj`` / ``k_proj`` / ``v_proj`` of HF layer ``layer`` (0-based)."""
        from megatron.bridge.models.conversion.param_mapping import split_qkv_weights

        model = megatron_model[0] if isinstance(megatron_model, list) else megatron_model
        config = attention_config(model.config, layer + 1)
        q, k, v = split_qkv_weights(config, linear_out, feature_dim=linear_out.shape[-1])
        return {"q_proj": q, "k_proj": k, "v_proj": v}

    def fused_adapter_linear_out_slices(
        self, megatron_model: list, base_hf_weight_names: list[str], linear_out_tensor: torch.Tensor, **kwargs: Any
    ) -> dict[str, Any] | None:
        if not self.is_fused_qkv(base_hf_weight_names):
            return super().fused_adapter_linear_out_slices(
                megatron_model, base_hf_weight_names, linear_out_tensor, **kwargs
            )
        layer = int(re.search(r"layers\.(\d+)\.", base_hf_weight_names[0]).group(1))
        by_role = self._qkv_slices(megatron_model, layer, linear_out_tensor)
        return {name: by_role[self.infer_qkv_projection_from_name(name)] for name in base_hf_weight_names}

    def base_hf_param_names_for_adapter(
        self, mapping_registry: Any, global_base_prefix: str, adapter_key: str | None, base_suffix: str
    ) -> list[str]:
        """Upstream's HF base names of an adapter; a routed expert's (``.weight<e>``) per expert, not its stack.

        Every build asks this per expert (``.weight<e>``) on its grouped-expert road. Given the stack's
        name, the fork @21018090 yields each expert's adapter under the stack's name (nothing tells the
        experts apart), and the release and the fork @d063066b take a "packed" road of ``[E, ...]`` stacks
        (no Megatron name on the fork's third field). Given ``<layer>.experts.<e>.<gate|up|down>_proj.weight``,
        all three take their per-expert road: the expert's slice of the adapter (shared per EP rank or one
        per expert), a ``gate_up`` ``lora_B`` split by upstream's expert-TP-aware rule, the build's own
        tuple, named ``<layer>.experts.<e>.<gate|up|down>_proj.lora_A/B.weight`` as vLLM's Gemma 4 loader
        takes them (0.32.0 ``models/gemma4.py``; UPSTREAM 56). CanonicalLoRA's keyed adapters keep
        upstream's names.
        """
        names = super().base_hf_param_names_for_adapter(mapping_registry, global_base_prefix, adapter_key, base_suffix)
        expert = re.fullmatch(r"\.weight(\d+)", base_suffix)
        if expert is None or adapter_key is not None:
            return names
        return [
            per_expert_name(name, int(expert[1]), projection)
            for name in names
            for projection in STACK_PROJECTIONS[STACK_NAME.match(name)["stack"]]
        ]

    def stream_adapter_weights_megatron_to_hf(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """The adapter export, with a k_eq_v full layer's ``v_proj`` adapter replaced by its ``k_proj`` one.

        Fused (``LoRA``) or split (``CanonicalLoRA``): the ``k_proj`` item of a layer comes before its
        ``v_proj`` item in both builds' streams (the QKV mapping's and the split adapter's q, k, v order).
        """
        adapted_k: dict[str, torch.Tensor] = {}
        for item in super().stream_adapter_weights_megatron_to_hf(*args, **kwargs):
            adapter = re.fullmatch(r"(.*)(\.lora_[AB]\.weight)", item[0])
            if adapter is None:  # not a LoRA matrix of a projection: nothing to replace
                yield item
                continue
            base, side = adapter.groups()
            if base.endswith(".k_proj"):
                v_proj = base[: -len("k_proj")] + "v_proj"
                if self._absent_in_hf(v_proj + ".weight"):  # held until that layer's v_proj item, no longer
                    adapted_k[v_proj + side] = item[1]
            elif self._absent_in_hf(base + ".weight"):
                if item[0] not in adapted_k:
                    raise ValueError(
                        f"{item[0]}: a v_proj adapter of a k_eq_v layer without a k_proj one; V is K there, "
                        "so it trained nothing the rollout engines could serve: target k_proj (linear_k) too"
                    )
                item = item._replace(weight=adapted_k.pop(item[0]))
            yield item

    def merge_lora_adapter_weights(
        self, megatron_model: list, converted_weights_dict: dict[str, torch.Tensor], adapter_weights: list
    ) -> dict[str, torch.Tensor]:
        qkv = re.fullmatch(r"(?:.*\.)?layers\.(\d+)\.self_attention\.linear_qkv", adapter_weights[0].global_base_prefix)
        if not converted_weights_dict or len(adapter_weights) != 1 or qkv is None:
            return super().merge_lora_adapter_weights(megatron_model, converted_weights_dict, adapter_weights)
        adapter = adapter_weights[0]
        linear_in = adapter.linear_in_weight.weight
        by_role = self._qkv_slices(megatron_model, int(qkv.group(1)), adapter.linear_out_weight.weight)
        return {
            name: self.merge_single_adapter_weight(
                base, adapter.alpha, adapter.dim, linear_in, by_role[self.infer_qkv_projection_from_name(name)]
            )
            for name, base in converted_weights_dict.items()
        }
