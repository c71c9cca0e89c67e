"""Tiny, random, deterministic Gemma 4 checkpoints built with transformers' own classes (the test factory).

Why this exists: conversion bugs (a transposed projection, two experts swapped, a norm taken
from the wrong layer, a dropped buffer) are invisible when tensors look alike. A real
checkpoint is too large for CI, and transformers' default init leaves norms at one, scales
at one and ``layer_scalar`` at one, so a wrong mapping between two of them still round-trips
bit-exactly. The factory therefore re-draws *every* saved tensor from its own generator
(seeded from the spec seed and the tensor name) and refuses to write a checkpoint in which
any two tensors, two experts of one stacked tensor, or two leading-dimension slices are
equal, or in which a tensor is constant (:mod:`vime_gemma4_bridge.testing.weights`).

The model is built by ``Gemma4ForConditionalGeneration`` (text + minimal vision tower, no
audio) or ``Gemma4ForCausalLM`` and saved with ``save_pretrained``, so tensor names, shapes,
tied weights and config fields are exactly what transformers produces and reads back.

Defaults mirror the structure of gemma-4-26B-A4B (MoE next to a dense MLP, ``attention_k_eq_v``,
separate head dim / KV heads on global layers) at toy size, chosen so that TP up to 4,
PP2 x VPP2 and EP up to 8 all divide them. The vocabulary (300) is deliberately not a
multiple of 128 so that vocab padding in Megatron is exercised.

Tokenizer (:mod:`vime_gemma4_bridge.testing.tokenizer`): a byte-level BPE built locally with
``tokenizers`` (nothing can be downloaded), with Gemma 4's special-token strings at the front and
``<unusedN>`` fillers so that ``len(tokenizer) == vocab_size``. It is saved through
``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(out)`` works.

No processor / image-processor files are written: transformers' ``Gemma4Processor`` requires
the "vision" backend (Pillow) and ``Gemma4ImageProcessor`` / ``Gemma4VideoProcessor`` import
torchvision; neither is installed in the pinned environment, and a hand-written
``preprocessor_config.json`` that was never loaded by transformers would be untested.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vime_gemma4_bridge.io.commit import atomic_directory
from vime_gemma4_bridge.testing.tokenizer import BOS_ID, EOS_ID, MIN_VOCAB_SIZE, PAD_ID, TOKEN_ID, build_tokenizer
from vime_gemma4_bridge.testing.weights import assert_all_distinct, randomize_, saved_tensors

if TYPE_CHECKING:
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig, PreTrainedModel

#: ``--dtype`` choices and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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
    0 disables it) and ``kv_shared_layers`` like the small Gemma 4 models. ``layer_types``
    holds ``"sliding"`` / ``"full"`` per layer (``None``: alternate, ending with ``full``).
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
        return DTYPES[self.dtype]

    @property
    def architecture(self) -> str:
        """The transformers class written into ``config.architectures``."""
        return "Gemma4ForCausalLM" if self.causal_lm else "Gemma4ForConditionalGeneration"

    def text_config(self) -> Gemma4TextConfig:
        """The text-model config; all sizes come from the spec, nothing from transformers' defaults."""
        from transformers import Gemma4TextConfig

        ple = 0 if self.moe else self.per_layer_input_size
        moe_kwargs = (
            {
                "enable_moe_block": True,
                "num_experts": self.experts,
                "top_k_experts": self.top_k,
                "moe_intermediate_size": self.moe_intermediate_size,
            }
            if self.moe
            else {"enable_moe_block": False}
        )
        return Gemma4TextConfig(
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
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=self.vocab_size,
            num_kv_shared_layers=self.kv_shared_layers,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
            tie_word_embeddings=True,
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

    def hf_config(self) -> Gemma4Config | Gemma4TextConfig:
        """The config of the model class: ``Gemma4Config`` (text + vision, no audio) or the text config."""
        from transformers import Gemma4Config

        text = self.text_config()
        if self.causal_lm:
            text.architectures = [self.architecture]
            return text
        config = Gemma4Config(
            text_config=text,
            vision_config=self.vision_config(),
            audio_config=None,
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


def build_tiny_model(spec: TinySpec) -> PreTrainedModel:
    """Instantiate the transformers model for ``spec`` and randomise it (CPU, eval mode).

    The global torch RNG is forked so building a checkpoint never perturbs the caller's seeds
    (transformers' own init draws from it; its values are all overwritten anyway).
    """
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, GenerationConfig

    cls = Gemma4ForCausalLM if spec.causal_lm else Gemma4ForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        model = cls(spec.hf_config())
    model = model.to(spec.torch_dtype).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=[EOS_ID, TOKEN_ID["<turn|>"]],
        pad_token_id=PAD_ID,
    )
    randomize_(model, spec.seed)
    return model


def is_empty_dir(path: Path) -> bool:
    """A directory a checkpoint may be written into without ``force``."""
    return path.is_dir() and not any(path.iterdir())


def _read_back(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``directory``."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                if key in out:
                    raise AssertionError(f"tensor {key} appears in more than one shard")
                out[key] = handle.get_tensor(key)
    return out


def write_tiny_checkpoint(
    out_dir: str | os.PathLike[str], spec: TinySpec | None = None, *, force: bool = False
) -> Path:
    """Build ``spec`` and write a loadable HF checkpoint to ``out_dir``; return its path.

    ``out_dir`` must not exist or be an empty directory, unless ``force`` (then it is replaced).
    Everything is written into a hidden partial sibling, verified (the safetensors are read
    back, compared with the model bit for bit and checked with :func:`assert_all_distinct`)
    and only then committed (:func:`vime_gemma4_bridge.io.commit.atomic_directory`), so an
    interrupted or failed run never leaves a directory that looks like a complete checkpoint.
    Besides the HF files, ``tiny_spec.json`` records the spec so a checkpoint can be regenerated.
    """
    spec = spec or TinySpec()
    out = Path(out_dir).absolute()
    if out.exists() and not is_empty_dir(out) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)

    model = build_tiny_model(spec)
    expected = saved_tensors(model)
    assert_all_distinct(expected)  # never write a checkpoint that cannot catch a mix-up

    with atomic_directory(out, replace=force) as tmp:
        model.save_pretrained(tmp)
        build_tokenizer(spec.vocab_size).save_pretrained(tmp)
        (tmp / "tiny_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True) + "\n")
        _verify_written(tmp, expected)
    return out


def _verify_written(directory: Path, expected: Mapping[str, torch.Tensor]) -> None:
    """Check the files in ``directory`` hold exactly ``expected``, bit for bit, and are complete."""
    for required in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if not (directory / required).is_file():
            raise AssertionError(f"save_pretrained did not write {required}")
    saved = _read_back(directory)
    if set(saved) != set(expected):
        raise AssertionError(
            f"saved tensor names differ: missing {sorted(set(expected) - set(saved))}, "
            f"unexpected {sorted(set(saved) - set(expected))}"
        )
    for name, t in expected.items():
        if saved[name].dtype != t.dtype or not torch.equal(saved[name], t):
            raise AssertionError(f"{name} was not saved bit-exactly")
    assert_all_distinct(saved)


def checkpoint_stats(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(number of tensors, total bytes of the safetensors files) of a written checkpoint."""
    directory = Path(path)
    files = sorted(directory.glob("*.safetensors"))
    return len(_read_back(directory)), sum(f.stat().st_size for f in files)
