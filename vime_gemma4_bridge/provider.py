"""Gemma 4 MoE text model provider that builds with Transformer Engine on GPU and without it on CPU.

It is Megatron-Bridge's ``Gemma4ModelProvider`` with one change of layer spec. With TE the
spec is upstream's, untouched. Without TE, upstream's spec is built with megatron-core's local
modules and the TE-only pieces are swapped for the twins in :mod:`vime_gemma4_bridge.modules`,
which keep the TE parameter names; the result has the same parameter names, shapes, TP/EP
partitioning and torch_dist keys on both hosts (table in docs/MODEL.md).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from megatron.bridge.models.gemma.gemma3_provider import Gemma3LanguageModelEmbedding
from megatron.bridge.models.gemma.gemma4_provider import Gemma4DenseProvider, Gemma4ModelProvider
from megatron.bridge.models.gemma.modeling_gemma4 import Gemma4RMSNorm, _gemma4_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

from vime_gemma4_bridge.modules import (
    ColumnParallelGroupedLinear,
    Gemma4DotProductAttention,
    Gemma4LanguageModelEmbedding,
    LayerNormColumnParallelLinear,
    RowParallelGroupedLinear,
    RowParallelLinearLayerNorm,
    host_cuda_device,
    prepare_host_forward,
    rounded_embedding_scale,
)
from vime_gemma4_bridge.te_guard import te_available


def gemma4_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Gemma 4 MoE decoder block spec: upstream's with TE, TE-named megatron-core twins without."""
    if te_available():
        return _gemma4_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
    block_spec = _gemma4_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    # Gemma 4's RMSNorm (params in params_dtype, HF's fp32 math) for the final norm too: megatron-core's
    # local WrappedTorchNorm keeps an fp32 weight, which breaks bitwise export of bf16 checkpoints.
    block_spec.layer_norm = Gemma4RMSNorm
    for layer_spec in block_spec.layer_specs:
        layer = layer_spec.submodules
        # TE fuses the input norm into linear_qkv (``layer_norm_weight``); so does the twin.
        layer.input_layernorm = IdentityOp
        layer.pre_mlp_layernorm = Gemma4RMSNorm
        attention = layer.self_attention.submodules
        attention.linear_qkv = LayerNormColumnParallelLinear
        attention.linear_proj = RowParallelLinearLayerNorm
        attention.core_attention = Gemma4DotProductAttention
        attention.q_layernorm = Gemma4RMSNorm
        attention.k_layernorm = Gemma4RMSNorm
        moe = layer.mlp.keywords["submodules"]  # partial(Gemma4MoELayer, submodules=MoESubmodules)
        moe.experts = partial(
            TEGroupedMLP,  # megatron-core's grouped experts; only its linears are TE in the TE spec
            submodules=GroupedMLPSubmodules(
                linear_fc1=ColumnParallelGroupedLinear, linear_fc2=RowParallelGroupedLinear
            ),
        )
    return block_spec


@dataclass
class Gemma4TextModelProvider(Gemma4ModelProvider):
    """Megatron-Bridge's Gemma 4 MoE provider with a layer spec that also builds (and runs) on CPU hosts.

    The built model embeds with transformers' dtype-rounded ``sqrt(hidden)`` scale
    (:class:`~vime_gemma4_bridge.modules.Gemma4LanguageModelEmbedding`) and, without CUDA, runs
    its forward through :func:`~vime_gemma4_bridge.modules.prepare_host_forward`.
    """

    transformer_layer_spec: Any = field(default_factory=lambda: gemma4_block_spec)

    def finalize(self) -> None:
        if not te_available():
            # Settings that need TE or CUDA kernels; the values chosen compute the same function.
            self.moe_permute_fusion = False
            self.moe_token_dispatcher_type = "allgather"
            self.moe_grouped_gemm = True  # grouped experts (``weight<K>``) are the TE layout we mirror
            self.gradient_accumulation_fusion = False
            self.bias_activation_fusion = False
            self.bias_dropout_fusion = False
            self.masked_softmax_fusion = False
            self.apply_rope_fusion = False
            self.persist_layer_norm = False
        super().finalize()

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        with _tied_embedding_sync_on_cpu():
            model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if isinstance(getattr(model, "embedding", None), Gemma3LanguageModelEmbedding):
            model.embedding.__class__ = Gemma4LanguageModelEmbedding  # HF's dtype-rounded sqrt(hidden) scale
        return prepare_host_forward(model)


@dataclass
class Gemma4DenseTextModelProvider(Gemma4DenseProvider):
    """Megatron-Bridge's dense Gemma 4 provider (local spec, PP=1) whose model matches transformers' forward.

    Changes to the built model, names and shapes untouched: every parameter and buffer in
    ``params_dtype``; the embedding scale ``sqrt(hidden)`` rounded to the embedding dtype as in
    transformers (upstream multiplies by the exact float, which differs in bf16 unless the root is
    exact); on hosts without CUDA the core attention swapped for a device-agnostic twin and the
    forward run with CPU allocations (:func:`vime_gemma4_bridge.modules.prepare_host_forward`);
    the vocab not padded (see ``provider_bridge``).
    """

    def provide(self, pre_process: bool | None = None, post_process: bool | None = None, vp_stage: int | None = None):
        model = super().provide(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        # Upstream creates the per-layer-input linears (``nn.Linear``) and ``layer_scalar`` in torch's
        # default float32 whatever ``params_dtype`` is; Megatron's Float16Module would cast them when
        # training, a bare model keeps them (bf16 activations then meet fp32 weights). Cast here.
        model.to(dtype=self.params_dtype)
        _install_rounded_embedding_scale(model)
        return prepare_host_forward(model)

    def build(self, pre_process: bool = True, post_process: bool = True) -> torch.nn.Module:
        """Upstream's build, which also runs on a host without CUDA.

        Upstream constructs ``Gemma4DenseRotaryEmbedding(config)`` without passing
        ``use_cpu_initialization``, so its frequencies are allocated on
        ``torch.cuda.current_device()``: on a CUDA-less host that device is the CPU while building.
        """
        with host_cuda_device():
            return super().build(pre_process=pre_process, post_process=post_process)


def _install_rounded_embedding_scale(model: torch.nn.Module) -> None:
    """Embed with transformers' dtype-rounded ``sqrt(hidden)`` before upstream's dense forward runs.

    Upstream's dense forward (``_install_ple_forward``) embeds and scales only when no
    ``decoder_input`` is given; handing it the embedding scaled the HF way keeps everything else
    (per-layer embeddings included, which read the scaled embedding) upstream's.
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


@contextlib.contextmanager
def _tied_embedding_sync_on_cpu() -> Iterator[None]:
    """Let megatron-core initialise tied embeddings across pipeline stages on a host without CUDA.

    With PP > 1, ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied weight to
    CUDA (``weight.data.cuda()``) before all-reducing it between the first and last stage. Without
    a GPU that call can only raise, so while the model is built ``Tensor.cuda`` leaves CPU tensors
    where they are and the all-reduce runs over gloo. Nothing changes where CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]
