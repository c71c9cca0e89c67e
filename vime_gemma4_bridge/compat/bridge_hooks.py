"""Megatron-Bridge's ``MegatronModelBridge`` with the private steps the Gemma 4 bridge changes under public names.

The steps a per-model bridge must change to convert Gemma 4 are private methods of
``MegatronModelBridge`` (``model_bridge.py``) and of its adapter half ``MegatronPeftBridge``
(``peft_bridge.py``), in the release and in vime's fork alike (docs/SEAMS.md): upstream's own
bridges override them, and it offers no public hook for any. :class:`ModelBridgeHooks` is the one
place that overrides them: each calls a public method, whose default is upstream's step, so core/
overrides public names only and a build that renames a step is followed here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

from vime_gemma4_bridge.compat import seams


class ModelBridgeHooks(MegatronModelBridge):
    """``MegatronModelBridge`` whose overridable private steps are public methods of the same name less ``_``
    (``_get_`` less ``get_``), each upstream's step until a subclass replaces it; and the helpers those
    steps use, public too."""

    _accumulate_grouped_export = seams.hands_to("accumulate_grouped_export")

    def accumulate_grouped_export(self, *args: Any, **kwargs: Any) -> Any:
        """Collect one grouped (expert) task's converted weights; the complete ones, or None (``model_bridge.py``).

        Arguments as the build passes them (five positional; the fork from 04c0fd03 adds ``grouped_sources=``).
        """
        return super()._accumulate_grouped_export(*args, **kwargs)

    _broadcast_shared_embeddings = seams.hands_to("broadcast_shared_embeddings")

    def broadcast_shared_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """Copy the embedding into the last stage's tied output layer after a load (``model_bridge.py``)."""
        return super()._broadcast_shared_embeddings(*args, **kwargs)

    _get_fused_adapter_linear_out_slices = seams.hands_to("fused_adapter_linear_out_slices")

    def fused_adapter_linear_out_slices(self, *args: Any, **kwargs: Any) -> Any:
        """A fused adapter's ``linear_out`` split per HF base name, or None (``peft_bridge.py``)."""
        return super()._get_fused_adapter_linear_out_slices(*args, **kwargs)

    _get_base_hf_param_names_for_adapter = seams.hands_to("base_hf_param_names_for_adapter")

    def base_hf_param_names_for_adapter(self, *args: Any, **kwargs: Any) -> Any:
        """The HF base names an adapter is exported under (``peft_bridge.py``)."""
        return super()._get_base_hf_param_names_for_adapter(*args, **kwargs)

    _merge_lora_adapter_weights = seams.hands_to("merge_lora_adapter_weights")

    def merge_lora_adapter_weights(self, *args: Any, **kwargs: Any) -> Any:
        """The converted base weights with their LoRA adapters merged in (``peft_bridge.py``)."""
        return super()._merge_lora_adapter_weights(*args, **kwargs)

    def is_fused_qkv(self, hf_weight_names: Iterable[str]) -> bool:
        """Whether the HF names are a fused QKV weight's q, k and v (``peft_bridge.py`` ``_is_fused_qkv``)."""
        return self._is_fused_qkv(hf_weight_names)

    def infer_qkv_projection_from_name(self, hf_name: str) -> str | None:
        """Which of ``q_proj`` / ``k_proj`` / ``v_proj`` an HF name is (``_infer_qkv_projection_from_name``)."""
        return self._infer_qkv_projection_from_name(hf_name)

    def merge_single_adapter_weight(
        self, base: torch.Tensor, alpha: int, dim: int, linear_in: torch.Tensor, linear_out: torch.Tensor
    ) -> torch.Tensor:
        """``base`` with one LoRA adapter merged in, as upstream merges it: in fp32, back in ``base``'s dtype
        (``peft_bridge.py`` ``_merge_single_adapter_weight``)."""
        return self._merge_single_adapter_weight(base, alpha, dim, linear_in, linear_out)
