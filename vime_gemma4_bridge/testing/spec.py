"""What a tiny Gemma 4 checkpoint is made of (:class:`TinySpec`), without torch.

The spec is read by the command line (``vime-gemma4 tiny``'s defaults, ``bench``'s shapes) before
any conversion starts, so building a parser never imports torch; the factory that turns a spec
into a checkpoint is :mod:`vime_gemma4_bridge.testing.tiny`. The transformers configs are built
on demand (:meth:`TinySpec.hf_config`).

Defaults mirror the structure of gemma-4-26B-A4B (MoE next to a dense MLP, ``attention_k_eq_v``,
separate head dim / KV heads on global layers) at toy size, chosen so that TP up to 4,
PP2 x VPP2 and EP up to 8 all divide them. The vocabulary (300) is deliberately not a
multiple of 128 so that vocab padding in Megatron is exercised.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vime_gemma4_bridge.testing.tokenizer import BOS_ID, EOS_ID, MIN_VOCAB_SIZE, PAD_ID, TOKEN_ID

if TYPE_CHECKING:
    import torch
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

#: ``--dtype`` choices: names of torch dtypes.
DTYPES = ("bfloat16", "float16", "float32")

#: Short layer-type names accepted on the command line -> transformers' names.
_LAYER_TYPE_NAMES = {
    "sliding": "sliding_attention",
    "full": "full_attention",
    "sliding_attention": "sliding_attention",
    "full_attention": "full_attention",
}


@dataclass(frozen=True)
class TinySpec:
    """Every knob of a tiny Gemma 4 checkpoint; defaults divide TP<=4, PP2xVPP2 and EP<=8.

    ``moe=True`` builds 26B-A4B-style layers (dense MLP + router + stacked experts);
    ``moe=False`` builds a dense text model, which alone uses ``per_layer_input_size`` (PLE,
    0 disables it), ``kv_shared_layers`` and ``double_wide_mlp`` like the small Gemma 4 models. ``layer_types``
    holds ``"sliding"`` / ``"full"`` per layer (``None``: alternate, ending with ``full``).
    ``unified=True`` writes the 12B's classes (``Gemma4Unified*``: a dense text model without PLE or
    MoE, beside encoder-free vision and audio embedders instead of towers).
    """

    layers: int = 4
    layer_types: tuple[str, ...] | None = None
    hidden_size: int = 64
    intermediate_size: int = 32
    moe_intermediate_size: int = 16
    experts: int = 16
    top_k: int = 4
    heads: int = 16
    kv_heads: int = 8
    global_kv_heads: int = 4
    head_dim: int = 8
    global_head_dim: int = 16
    attention_k_eq_v: bool = True
    sliding_window: int = 8
    vocab_size: int = 300
    seed: int = 0
    dtype: str = "bfloat16"
    moe: bool = True
    causal_lm: bool = False
    per_layer_input_size: int = 8
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    unified: bool = False

    def __post_init__(self) -> None:
        if self.layer_types is not None and not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ----------------------------------------------------------------------------- checks
    def validate(self) -> None:
        """Raise ``ValueError`` for a spec transformers would reject or silently alter."""
        positive = (
            "layers hidden_size intermediate_size heads kv_heads global_kv_heads head_dim global_head_dim "
            "sliding_window vocab_size"
        ).split()
        if self.moe:
            positive += ["moe_intermediate_size", "experts", "top_k"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.moe and self.top_k > self.experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed experts ({self.experts})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.attention_k_eq_v and self.heads % self.global_kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of global_kv_heads ({self.global_kv_heads})")
        # RoPE rotates pairs; the proportional RoPE of global layers rotates a quarter of the head.
        if self.head_dim % 2 or self.global_head_dim % 8:
            raise ValueError("head_dim must be even and global_head_dim a multiple of 8 (RoPE)")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (byte-level tokenizer + specials)")
        if self.per_layer_input_size < 0 or self.kv_shared_layers < 0:
            raise ValueError("per_layer_input_size and kv_shared_layers must be >= 0")
        if self.moe and self.kv_shared_layers:
            raise ValueError("kv_shared_layers is only supported with dense models (moe=False)")
        if self.unified and (self.moe or self.per_layer_input_size):
            raise ValueError("the unified (12B) classes have no MoE and no PLE: use moe=False, per_layer_input_size=0")
        if self.double_wide_mlp and not self.kv_shared_layers:
            raise ValueError("double_wide_mlp widens the KV-shared layers' MLP: it needs kv_shared_layers")
        types = self.resolved_layer_types()
        if len(types) != self.layers:
            raise ValueError(f"layer_types has {len(types)} entries but layers is {self.layers}")
        if types[-1] != "full_attention":
            # transformers would silently rewrite it (with a warning); refuse instead.
            raise ValueError("the last layer must be 'full' (transformers forces it)")
        if self.kv_shared_layers:
            first_shared = self.layers - self.kv_shared_layers
            if first_shared < 1:
                raise ValueError("kv_shared_layers must leave at least one layer with its own K/V")
            missing = set(types[first_shared:]) - set(types[:first_shared])
            if missing:
                raise ValueError(f"kv-shared layers of type {sorted(missing)} have no earlier layer to share K/V with")

    def resolved_layer_types(self) -> list[str]:
        """Layer types in transformers' spelling (``sliding_attention`` / ``full_attention``)."""
        if self.layer_types is None:
            # Alternate so that both kinds land on every PP2 x VPP2 chunk, ending with full.
            return [
                "full_attention" if (self.layers - 1 - i) % 2 == 0 else "sliding_attention" for i in range(self.layers)
            ]
        out = []
        for t in self.layer_types:
            if t not in _LAYER_TYPE_NAMES:
                raise ValueError(f"unknown layer type {t!r}; use 'sliding' or 'full'")
            out.append(_LAYER_TYPE_NAMES[t])
        return out

    # ----------------------------------------------------------------------------- configs
    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype the tensors are stored in."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def architecture(self) -> str:
        """The transformers class written into ``config.architectures``."""
        family = "Gemma4Unified" if self.unified else "Gemma4"
        return f"{family}ForCausalLM" if self.causal_lm else f"{family}ForConditionalGeneration"

    def text_config(self) -> Gemma4TextConfig:
        """The text-model config; all sizes come from the spec, nothing from transformers' defaults."""
        import transformers

        ple = 0 if self.moe else self.per_layer_input_size
        # The unified text config has no PLE or MoE fields (transformers' modular file deletes them).
        ple_kwargs = (
            {} if self.unified else {"hidden_size_per_layer_input": ple, "vocab_size_per_layer_input": self.vocab_size}
        )
        moe_kwargs = (
            {}
            if self.unified
            else (
                {
                    "enable_moe_block": True,
                    "num_experts": self.experts,
                    "top_k_experts": self.top_k,
                    "moe_intermediate_size": self.moe_intermediate_size,
                }
                if self.moe
                else {"enable_moe_block": False}
            )
        )
        config_class = transformers.Gemma4UnifiedTextConfig if self.unified else transformers.Gemma4TextConfig
        return config_class(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            num_global_key_value_heads=self.global_kv_heads,
            head_dim=self.head_dim,
            global_head_dim=self.global_head_dim,
            attention_k_eq_v=self.attention_k_eq_v,
            sliding_window=self.sliding_window,
            layer_types=self.resolved_layer_types(),
            max_position_embeddings=4096,
            final_logit_softcapping=30.0,
            num_kv_shared_layers=self.kv_shared_layers,
            use_double_wide_mlp=self.double_wide_mlp,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
            tie_word_embeddings=True,
            **ple_kwargs,
            **moe_kwargs,
        )

    def vision_config(self) -> Gemma4VisionConfig:
        """A minimal but valid vision tower: 1 layer, hidden 16, 4x4 patches, 16 positions per axis."""
        from transformers import Gemma4VisionConfig

        return Gemma4VisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,  # 2-D RoPE splits the head in x/y halves: must be a multiple of 4
            patch_size=4,
            position_embedding_size=16,
            pooling_kernel_size=3,
        )

    def unified_embedder_configs(self) -> dict[str, Any]:
        """The 12B's encoder-free embedders at toy size: vision (2x2 patches merged 2x2) and audio."""
        from transformers import Gemma4UnifiedAudioConfig, Gemma4UnifiedVisionConfig

        vision = Gemma4UnifiedVisionConfig(
            patch_size=2, pooling_kernel_size=2, mm_embed_dim=24, mm_posemb_size=16, output_proj_dims=24
        )
        return {"vision_config": vision, "audio_config": Gemma4UnifiedAudioConfig(audio_embed_dim=20)}

    def hf_config(self) -> Gemma4Config | Gemma4TextConfig:
        """The config of the model class: ``Gemma4Config`` (text + vision, no audio), the unified config
        (text + vision and audio embedders) or the text config."""
        import transformers

        text = self.text_config()
        if self.causal_lm:
            text.architectures = [self.architecture]
            return text
        config_class = transformers.Gemma4UnifiedConfig if self.unified else transformers.Gemma4Config
        towers = (
            self.unified_embedder_configs()
            if self.unified
            else {"vision_config": self.vision_config(), "audio_config": None}
        )
        config = config_class(
            text_config=text,
            **towers,
            boi_token_id=TOKEN_ID["<|image>"],
            eoi_token_id=TOKEN_ID["<image|>"],
            image_token_id=TOKEN_ID["<|image|>"],
            video_token_id=TOKEN_ID["<|video|>"],
            boa_token_id=TOKEN_ID["<|audio>"],
            eoa_token_index=TOKEN_ID["<audio|>"],
            audio_token_id=TOKEN_ID["<|audio|>"],
            tie_word_embeddings=True,
        )
        config.architectures = [self.architecture]
        return config

    def describe(self) -> str:
        """Short human description used in the summary line."""
        kind = f"MoE {self.experts}x top-{self.top_k}" if self.moe else "dense"
        return f"{self.architecture} ({kind}, {self.layers} layers, {self.dtype})"


#: Tiny dense family members, shaped like them in what is special and unlike the MoE tests' default
#: shape (every size differs); each splits over TP2 and PP2 x VPP2.
DENSE_SHAPES: dict[str, TinySpec] = {
    # 31B: no PLE, no KV sharing; k_eq_v full layers with fewer (global) KV heads than the sliding ones.
    "31b": TinySpec(
        moe=False,
        layers=8,
        layer_types=("sliding", "sliding", "sliding", "full") * 2,
        hidden_size=48,
        intermediate_size=40,
        heads=8,
        kv_heads=4,
        global_kv_heads=2,
        head_dim=8,
        global_head_dim=16,
        per_layer_input_size=0,
        vocab_size=310,
        seed=11,
    ),
    # 12B "Unified": no PLE, no KV sharing, 5 sliding : 1 full; k_eq_v full layers with ONE global KV head
    # (replicated over TP ranks); its own classes, with vision and audio embedders beside the text model.
    "12b": TinySpec(
        moe=False,
        unified=True,
        layers=12,
        layer_types=("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",),
        hidden_size=40,
        intermediate_size=56,
        heads=8,
        kv_heads=4,
        global_kv_heads=1,
        head_dim=8,
        global_head_dim=16,
        per_layer_input_size=0,
        vocab_size=340,
        seed=31,
    ),
    # E4B: PLE, the last half of the layers KV-shared, full layers keep the sliding layers' KV heads.
    "e4b": TinySpec(
        moe=False,
        layers=8,
        layer_types=("sliding", "sliding", "sliding", "full") * 2,
        hidden_size=32,
        intermediate_size=48,
        heads=4,
        kv_heads=2,
        global_kv_heads=2,
        head_dim=8,
        global_head_dim=16,
        attention_k_eq_v=False,
        per_layer_input_size=8,
        kv_shared_layers=4,
        vocab_size=320,
        seed=21,
    ),
    # E2B: PLE, 5 of 8 layers KV-shared (their sources on the first pipeline stage), double-wide MLP there.
    "e2b": TinySpec(
        moe=False,
        layers=8,
        layer_types=("sliding", "full", "sliding", "sliding", "full", "sliding", "sliding", "full"),
        hidden_size=24,
        intermediate_size=16,
        heads=4,
        kv_heads=2,
        global_kv_heads=2,
        head_dim=6,
        global_head_dim=16,
        attention_k_eq_v=False,
        per_layer_input_size=4,
        kv_shared_layers=5,
        double_wide_mlp=True,
        vocab_size=330,
        seed=21,
    ),
}


def _pattern(layers: int, period: int) -> tuple[str, ...]:
    """``period - 1`` sliding layers then a full one, repeated over ``layers``."""
    return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(layers))


#: The published members' text models at their real widths and layer counts (the vision tower stays
#: tiny: conversion copies it). 26B-A4B: google/gemma-4-26B-A4B-it (tests/test_recipes.py holds its
#: text config); 12B: google/gemma-4-12B @56820d7d's config.json; 31B, E4B, E2B: their
#: ``config.json`` as public code quotes it (the Hub is not reachable here). RoPE, softcapping and
#: the per-layer vocabulary are transformers' defaults, which are the published values.
PUBLISHED: dict[str, TinySpec] = {
    "26b-a4b": TinySpec(
        layers=30, layer_types=_pattern(30, 6), hidden_size=2816, intermediate_size=2112,
        moe_intermediate_size=704, experts=128, top_k=8, heads=16, kv_heads=8, global_kv_heads=2,
        head_dim=256, global_head_dim=512, sliding_window=1024, vocab_size=262144, per_layer_input_size=0,
    ),
    "31b": TinySpec(
        moe=False, layers=60, layer_types=_pattern(60, 6), hidden_size=5376, intermediate_size=21504,
        heads=32, kv_heads=16, global_kv_heads=4, head_dim=256, global_head_dim=512, sliding_window=1024,
        vocab_size=262144, per_layer_input_size=0,
    ),
    "12b": TinySpec(
        moe=False, unified=True, layers=48, layer_types=_pattern(48, 6), hidden_size=3840,
        intermediate_size=15360, heads=16, kv_heads=8, global_kv_heads=1, head_dim=256, global_head_dim=512,
        sliding_window=1024, vocab_size=262144, per_layer_input_size=0,
    ),
    "e4b": TinySpec(
        moe=False, layers=42, layer_types=_pattern(42, 6), hidden_size=2560, intermediate_size=10240,
        heads=8, kv_heads=2, global_kv_heads=2, head_dim=256, global_head_dim=512, attention_k_eq_v=False,
        sliding_window=512, vocab_size=262144, per_layer_input_size=256, kv_shared_layers=18,
    ),
    "e2b": TinySpec(
        moe=False, layers=35, layer_types=_pattern(35, 5), hidden_size=1536, intermediate_size=6144,
        heads=8, kv_heads=1, global_kv_heads=1, head_dim=256, global_head_dim=512, attention_k_eq_v=False,
        sliding_window=512, vocab_size=262144, per_layer_input_size=256, kv_shared_layers=20,
        double_wide_mlp=True,
    ),
}  # fmt: skip


def preset(name: str, layers: int | None = None) -> TinySpec:
    """A published member (:data:`PUBLISHED`) cut to its first ``layers`` layers: the last one made full, as
    transformers makes it, and those among them that share K/V in the published model still sharing."""
    full = PUBLISHED[name]
    if layers is None or layers == full.layers:
        return full
    if not 1 <= layers <= full.layers:
        raise ValueError(f"--layers {layers}: {name} has {full.layers} layers; choose 1 to {full.layers}")
    shared = max(0, layers - (full.layers - full.kv_shared_layers))
    return dataclasses.replace(
        full,
        layers=layers,
        layer_types=full.layer_types[: layers - 1] + ("full",),
        kv_shared_layers=shared,
        double_wide_mlp=full.double_wide_mlp and shared > 0,
    )
