"""An oracle of vLLM's Gemma 4 weight-name rules: which vLLM parameter (and shard, expert) each tensor loads into.

Written from vLLM's source, read at vllm-project/vllm 001cabc1be16a59a70d720ed61a13b678c060a18,
``vllm/model_executor/models/gemma4.py`` (line numbers of that file); the multimodal wrapper's
prefix mapping from ``gemma4_mm.py`` and the FP8 parameter names from
``layers/quantization/fp8.py`` at 45232a454e4c57191633fefda5baa9fa1f5dc8fd (001cabc1's upstream base):

* the VL wrapper maps ``model.language_model.`` to ``language_model.model.`` (gemma4_mm L900-910),
  ``Gemma4ForCausalLM._weight_iterator`` drops ``language_model.`` (L1651) and ``AutoWeightsLoader``
  hands ``model.*`` to ``Gemma4Model.load_weights`` without the ``model.`` prefix;
* renames (L1656-1674): ``.router.per_expert_scale`` -> ``.moe.per_expert_scale``,
  ``.experts.gate_up_proj`` / ``.experts.down_proj`` -> ``.moe.…``, ``.experts.<e>.`` -> ``.moe.experts.<e>.``;
* 3-D stacks are split per expert into bare names (L1691-1707): ``gate_proj = w[e, :I]``,
  ``up_proj = w[e, I:]``, ``down_proj = w[e]``;
* k_eq_v full layers: every ``self_attn.k_proj*`` tensor is yielded again as ``v_proj`` (L1714-1719);
* skipped (L1723-1735): towers, ``lm_head.`` when tied;
* ``Gemma4Model.load_weights`` (L1377-1515): the stacked mapping by substring, kept only when the
  stacked name is a parameter (``qkv_proj`` q/k/v, ``mlp.gate_up_proj`` 0/1); then the expert mapping
  (``experts.<e>.<proj>.`` -> ``experts.w13_`` / ``experts.w2_``, shard w1/w3/w2; a bare name ending
  ``experts.<e>.<proj>`` -> ``experts.w13_weight`` / ``w2_weight``); then the name itself (buffers such as
  ``layer_scalar`` included, L1418-1420). FP8 block parameters add ``weight_scale_inv`` beside each
  quantized ``weight`` (fp8.py L311-367, L606-744: ``w13_weight_scale_inv``, ``w2_weight_scale_inv``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

Target = tuple[str, str | None, int | None]

_STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
_STACKED += (("gate_up_proj", "gate_proj", "0"), ("gate_up_proj", "up_proj", "1"))
_STACKED_PARAM = re.compile(r"^layers\.\d+\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight(_scale_inv)?$")
_EXPERT_PARAM = re.compile(r"^layers\.\d+\.moe\.experts\.w(13|2)_weight(_scale_inv)?$")
_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)(\.|$)")
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
#: vLLM parameters that are FP8 GEMM weights under a block-FP8 config (each gets a ``weight_scale_inv``).
QUANTIZED_PARAM = re.compile(r"(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)\.weight$|experts\.w(13|2)_weight$")


def targets(name: str, shape: Sequence[int], text: Mapping) -> list[Target]:
    """The (vLLM parameter, shard, expert) entries ``name`` loads, in vLLM's order; ``[]`` if vLLM skips it."""
    if re.match(r"^(lm_head\.|model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.)", name):
        return []
    local = re.sub(r"^model\.(language_model\.)?", "", name)
    local = local.replace(".router.per_expert_scale", ".moe.per_expert_scale")
    local = local.replace(".experts.gate_up_proj", ".moe.gate_up_proj").replace(".experts.down_proj", ".moe.down_proj")
    local = re.sub(r"\.experts\.(\d+)\.", r".moe.experts.\1.", local)
    names = [local]
    if "moe.gate_up_proj" in local and len(shape) == 3:
        base = [local.replace("moe.", f"moe.experts.{e}.") for e in range(shape[0])]
        names = [n.replace("gate_up_proj", proj) for n in base for proj in ("gate_proj", "up_proj")]
    elif "moe.down_proj" in local and len(shape) == 3:
        names = [local.replace("moe.", f"moe.experts.{e}.") for e in range(shape[0])]
    out: list[Target] = []
    for each in names:
        out.append(_dispatch(each))
        layer = re.match(r"^layers\.(\d+)\.", each)
        full = layer and text["layer_types"][int(layer[1])] == "full_attention"
        if text.get("attention_k_eq_v") and full and "self_attn.k_proj" in each:
            out.append(_dispatch(each.replace("k_proj", "v_proj")))
    return out


def _dispatch(name: str) -> Target:
    for param, shard_name, shard in _STACKED:
        if shard_name in name and _STACKED_PARAM.match(name.replace(shard_name, param)):
            return name.replace(shard_name, param), shard, None
    match = _EXPERT.search(name)
    if match:
        kind = "experts.w13_" if match[2] in ("gate_proj", "up_proj") else "experts.w2_"
        weight_name = f"experts.{match[1]}.{match[2]}."
        if weight_name in name:
            moe = name.replace(weight_name, kind)
        else:
            moe = name.replace(weight_name.rstrip("."), kind.rstrip("_") + "_weight")
        if _EXPERT_PARAM.match(moe):
            return moe, _SHARD[match[2]], int(match[1])
    return name, None, None


def coverage(named_shapes: Iterable[tuple[str, Sequence[int]]], text: Mapping) -> dict[Target, list[str]]:
    """Every target loaded, with the names that load it (more than one name per target is a collision)."""
    loaded: dict[Target, list[str]] = {}
    for name, shape in named_shapes:
        for target in targets(name, shape, text):
            loaded.setdefault(target, []).append(name)
    return loaded


def with_scales(loaded: Iterable[Target]) -> set[Target]:
    """``loaded`` plus the ``weight_scale_inv`` entry of every quantized vLLM weight (block-FP8 config)."""
    out = set(loaded)
    for param, shard, expert in loaded:
        if QUANTIZED_PARAM.search(param):
            out.add((param + "_scale_inv", shard, expert))
    return out
