"""Transformer Engine leaves of the Gemma 4 layer spec; imported only where TE imports.

Their CPU twins (same names, shapes and torch_dist keys) are in :mod:`vime_gemma4_bridge.core.cpu_modules`.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.extensions.transformer_engine import TEDotProductAttention, TERowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from vime_gemma4_bridge.core.layer_pattern import is_sliding_layer
from vime_gemma4_bridge.core.model import Gemma4RMSNorm


class TERowParallelLinearLayerNorm(TERowParallelLinear):
    """TE row-parallel linear followed by Gemma 4's post-attention RMSNorm (``post_layernorm``)."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = Gemma4RMSNorm(config, output_size)

    def linear_forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The linear alone, before the post-norm (where a LoRA adds its output: core/lora.py)."""
        output, bias = super().forward(x)
        if bias is not None:
            raise ValueError("TERowParallelLinearLayerNorm requires add_bias_linear=False (post-norm before bias)")
        return output, bias

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        output, bias = self.linear_forward(x)
        return self.post_layernorm(output), bias


class Gemma4TEDotProductAttention(TEDotProductAttention):
    """TE attention with the layer's own window: HF ``sliding_window`` W as ``(W - 1, 0)``, none on full layers."""

    def __init__(self, config: TransformerConfig, layer_number: int, *args: Any, **kwargs: Any) -> None:
        config = copy.copy(config)
        config.window_size = (config.window_size - 1, 0) if is_sliding_layer(config, layer_number) else None
        config.window_attn_skip_freq = None
        super().__init__(config, layer_number, *args, **kwargs)
