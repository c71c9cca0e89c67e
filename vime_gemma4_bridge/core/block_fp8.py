"""Block FP8, the rollout engine's weight format: the DeepSeek-V3 / Qwen3-FP8 layout vLLM's FP8 method loads.

A weight ``NAME`` [rows, cols] becomes ``NAME`` in ``float8_e4m3fn`` plus ``NAME_scale_inv`` in float32 of
shape [ceil(rows/128), ceil(cols/128)]: each 128×128 block is divided by its scale, ``block amax / 448``
(448 is e4m3's largest finite value), so that ``q * scale_inv`` gives the weight back within e4m3
rounding. An all-zero block gets scale 1 (its values are exact either way, and no consumer divides by zero).

Here, below the conversions, because the bridge itself quantizes vime's live sync when the rollout
checkpoint is block FP8 (``Gemma4LanguageModelBridge.stream_weights_megatron_to_hf``, core/bridge.py);
``convert/fp8.py`` builds the FP8 exports and checkpoints on it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "as_rollout_checkpoint_stores",
    "quantize_block_fp8",
    "rollout_block_fp8_weights",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of a 2-D weight: 128×128 blocks, ``scale_inv = block amax / 448``, ``q`` e4m3."""
    if weight.ndim != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    col_blocks = math.ceil(cols / BLOCK)
    padded = col_blocks * BLOCK
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=weight.device)
    scale_inv = torch.empty((math.ceil(rows / BLOCK), col_blocks), dtype=torch.float32, device=weight.device)
    band = torch.zeros((BLOCK, padded), dtype=torch.float32, device=weight.device)
    for index, start in enumerate(range(0, rows, BLOCK)):
        height = min(BLOCK, rows - start)
        view = band[:height]
        view[:, :cols].copy_(weight[start : start + height])
        amax = view.view(height, col_blocks, BLOCK).abs().amax(dim=(0, 2))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        scale_inv[index] = scale
        view.view(height, col_blocks, BLOCK).div_(scale[None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        q[start : start + height] = view[:, :cols].to(FP8_DTYPE)
    return q, scale_inv


def rollout_block_fp8_weights(hf_pretrained: Any) -> frozenset[str]:
    """The weights the checkpoint stores in block FP8 (each with a ``NAME_scale_inv``), if its config says fp8.

    vime serves FP8 rollouts from an FP8 ``--hf-checkpoint``, the checkpoint its bridge is opened on, and
    its own quantizer (``quantize_params``, ``processors/quantizer_fp8.py`` @0696c9bd) acts only on
    names matching ``module.module.decoder.layers.N``, which no export's third field carries (the
    conversion tasks' names are unwrapped): without the bridge, vLLM's FP8 layers would receive bf16.
    Which weights are FP8 is read from the checkpoint itself (its ``_scale_inv`` tensors), not guessed.
    """
    config = getattr(hf_pretrained, "config", hf_pretrained)
    quantization = getattr(config, "quantization_config", None) or {}
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    if quantization.get("quant_method") != "fp8":
        return frozenset()
    if list(quantization.get("weight_block_size") or ()) != [BLOCK, BLOCK]:
        raise ValueError(
            f"the rollout checkpoint's FP8 weight_block_size is {quantization.get('weight_block_size')}: "
            f"the live sync quantizes in [{BLOCK}, {BLOCK}] blocks only (serve a block-FP8 or a bf16 checkpoint)"
        )
    source = getattr(getattr(hf_pretrained, "state", None), "source", None)
    keys = source.get_all_keys() if source is not None else ()
    return frozenset(key.removesuffix(SCALE_SUFFIX) for key in keys if key.endswith(".weight" + SCALE_SUFFIX))


def as_rollout_checkpoint_stores(fp8: frozenset[str], stream: Iterable[Any]) -> Iterator[Any]:
    """``stream`` as the rollout checkpoint stores it: each weight in ``fp8`` as ``NAME`` (e4m3) + ``NAME_scale_inv``.

    The items keep the build's tuple type and their other fields (the Megatron name), so vime's
    processors pass them through (``stream`` comes in the checkpoint's expert layout). Rank 0 says in
    one line what went out in FP8 and which 2-D weights stayed as trained.
    """
    quantized, kept = 0, set()
    for item in stream:
        name, weight = item[0], item[1]
        if name not in fp8:
            if weight.ndim == 2 and name.endswith(".weight"):
                kept.add(re.sub(r"(?<=\.)(layers|experts)\.\d+(?=\.)", r"\1.<n>", name))
            yield item
            continue
        q, scale_inv = quantize_block_fp8(weight)
        quantized += 1
        yield type(item)(name, q, *item[2:])
        yield type(item)(name + SCALE_SUFFIX, scale_inv, *item[2:])
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(
            f"Gemma 4 live sync in the rollout checkpoint's block FP8: {quantized} weight(s) in FP8; "
            f"2-D weights as trained, as it stores them: {', '.join(sorted(kept)) or 'none'}",
            file=sys.stderr,
        )
