"""Dense Gemma 4 (E2B / E4B / 31B): the installed Megatron-Bridge's own dense provider, adjusted.

The MoE model is this plugin's own (:mod:`vime_gemma4_bridge.core.provider`); the dense one is
Megatron-Bridge's ``Gemma4DenseProvider`` (local spec, PP = 1) where the installed build has it.
This module is imported only for dense checkpoints; on a build without that provider the bridge
refuses them with one line (:func:`vime_gemma4_bridge.core.bridge.dense_provider`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from megatron.bridge.models.gemma.gemma4_provider import Gemma4DenseProvider
from megatron.bridge.utils.vocab_utils import calculate_padded_vocab_size
from torch import nn

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core.model import rounded_embedding_scale


def build_dense_provider(text_config: Any) -> Gemma4DenseProvider:
    """Megatron-Bridge's dense provider for ``text_config`` (its own HF-config translation)."""
    return seams.dense_provider_from_hf(text_config)


@dataclass
class Gemma4DenseTextModelProvider(Gemma4DenseProvider):
    """Megatron-Bridge's dense Gemma 4 provider whose model matches transformers' forward.

    Changes to the built model, names and shapes untouched: every parameter in ``params_dtype``
    (upstream creates the per-layer-input linears and ``layer_scalar`` in float32); ``layer_scalar``
    a frozen parameter instead of a buffer (vime's weight sync reads parameters only); the
    embedding scale rounded to the embedding dtype as in transformers. A host without CUDA builds
    and runs it through the CPU-host adapter (:mod:`vime_gemma4_bridge.convert.cpu_host`: upstream's
    RoPE allocates on the current device).
    """

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        model.to(dtype=self.params_dtype)
        for module in model.modules():
            if "layer_scalar" in module._buffers:
                value = module._buffers.pop("layer_scalar")
                module.layer_scalar = nn.Parameter(value, requires_grad=False)
        _install_rounded_embedding_scale(model)
        return model

    def build(self, pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
        """Upstream's build, with the vocabularies padded as Megatron pads them.

        Upstream pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` alone, and
        the PLE table not at all; megatron-core splits both over TP, so both are padded as Megatron
        pads, to that times TP (the bridge pads the PLE rows on import, drops them on export).
        """
        divisor, per_layer_vocab = self.make_vocab_size_divisible_by, self.per_layer_embed_vocab_size
        multiple = divisor * self.tensor_model_parallel_size
        self.make_vocab_size_divisible_by = multiple
        self.per_layer_embed_vocab_size = calculate_padded_vocab_size(  # the PLE table alike
            per_layer_vocab, divisor, self.tensor_model_parallel_size, logging_enabled=False
        )
        try:
            return super().build(pre_process=pre_process, post_process=post_process)
        finally:
            self.make_vocab_size_divisible_by, self.per_layer_embed_vocab_size = divisor, per_layer_vocab


def _install_rounded_embedding_scale(model: torch.nn.Module) -> None:
    """Embed with transformers' dtype-rounded ``sqrt(hidden)`` before upstream's dense forward runs.

    Upstream's dense forward embeds and scales only when no ``decoder_input`` is given; handing it
    the embedding scaled the HF way keeps everything else (per-layer embeddings included) upstream's.
    """
    if not getattr(model, "pre_process", False) or not getattr(model.config, "scale_embeddings_by_hidden_size", False):
        return
    dense_forward = model.forward

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, **kwargs):
        if decoder_input is None:
            scale = rounded_embedding_scale(self.config.hidden_size, self.embedding.word_embeddings.weight.dtype)
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids) * scale
        return dense_forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

    model.forward = types.MethodType(forward, model)
