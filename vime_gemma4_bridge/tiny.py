"""Tiny, random, deterministic Gemma 4 checkpoints built with transformers' own classes.

Why this exists: conversion bugs (a transposed projection, two experts swapped, a norm taken
from the wrong layer, a dropped buffer) are invisible when tensors look alike. A real
checkpoint is too large for CI, and transformers' default init leaves norms at one, scales
at one and ``layer_scalar`` at one, so a wrong mapping between two of them still round-trips
bit-exactly. This module therefore re-draws *every* saved tensor from its own generator
(seeded from the spec seed and the tensor name) and refuses to write a checkpoint in which
any two tensors, two experts of one stacked tensor, or two leading-dimension slices are
equal, or in which a tensor is constant.

The model is built by ``Gemma4ForConditionalGeneration`` (text + minimal vision tower, no
audio) or ``Gemma4ForCausalLM`` and saved with ``save_pretrained``, so tensor names, shapes,
tied weights and config fields are exactly what transformers produces and reads back.

Defaults mirror the structure of gemma-4-26B-A4B (MoE next to a dense MLP, ``attention_k_eq_v``,
separate head dim / KV heads on global layers) at toy size, chosen so that TP up to 4,
PP2 x VPP2 and EP up to 8 all divide them. The vocabulary (300) is deliberately not a
multiple of 128 so that vocab padding in Megatron is exercised.

Tokenizer: a byte-level BPE built locally with ``tokenizers`` (nothing can be downloaded),
with Gemma 4's special-token strings at the front and ``<unusedN>`` fillers so that
``len(tokenizer) == vocab_size``. It is saved through ``PreTrainedTokenizerFast`` so
``AutoTokenizer.from_pretrained(out)`` works.

No processor / image-processor files are written: transformers' ``Gemma4Processor`` requires
the "vision" backend (Pillow) and ``Gemma4ImageProcessor`` / ``Gemma4VideoProcessor`` import
torchvision; neither is installed in the pinned environment, and a hand-written
``preprocessor_config.json`` that was never loaded by transformers would be untested.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vime_gemma4_bridge.digest import tensor_digest

if TYPE_CHECKING:
    from transformers import (
        Gemma4Config,
        Gemma4TextConfig,
        Gemma4VisionConfig,
        PreTrainedModel,
        PreTrainedTokenizerFast,
    )

__all__ = [
    "DTYPES",
    "TinySpec",
    "add_parser",
    "assert_all_distinct",
    "build_tokenizer",
    "build_tiny_model",
    "checkpoint_stats",
    "main",
    "randomize_",
    "spec_from_args",
    "write_tiny_checkpoint",
]

#: ``--dtype`` choices and their torch dtypes.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Short layer-type names accepted on the command line -> transformers' names.
_LAYER_TYPE_NAMES = {
    "sliding": "sliding_attention",
    "full": "full_attention",
    "sliding_attention": "sliding_attention",
    "full_attention": "full_attention",
}

#: Special tokens, in id order, with Gemma 4's strings and leading ids (pad 0, eos 1, bos 2,
#: unk 3, mask 4). Multimodal ids are remapped into the tiny vocab and written to config.json.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|image>",
    "<image|>",
    "<|image|>",
    "<|video|>",
    "<|audio>",
    "<audio|>",
    "<|audio|>",
    "<|turn>",
    "<turn|>",
)
_TOKEN_ID = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
PAD_ID, EOS_ID, BOS_ID = _TOKEN_ID["<pad>"], _TOKEN_ID["<eos>"], _TOKEN_ID["<bos>"]
#: Named special tokens exposed as tokenizer attributes (``tok.image_token_id`` ...), as in Gemma 4.
_NAMED_SPECIALS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "video_token": "<|video|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
}
#: Smallest vocab the byte-level tokenizer fits in: the specials plus all 256 bytes.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

#: Fixed corpus the tokenizer's BPE merges are learnt from: a fixed text gives fixed merges.
_MERGE_CORPUS = (
    "the quick brown fox jumps over the lazy dog. the model converts the weights of the experts "
    "and the layers into the other format and then back again, and the result is the same. "
    "in the beginning there is the tokenizer, then the embedding, then the attention, then the "
    "mixture of experts, and at the end there is the norm and the head that gives the logits."
)

# Value ranges of the random draw: small enough that a forward pass stays finite in float16,
# wide enough that every value is distinct at bfloat16 precision.
_SCALE_STD = 0.1  # 1-D multiplicative scales (norm weights, router scales): 1 + 0.1 * N(0, 1)
_LAYER_SCALAR_RANGE = (0.5, 1.5)  # layer_scalar: uniform, always positive
_MAX_REDRAWS = 64


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
            boi_token_id=_TOKEN_ID["<|image>"],
            eoi_token_id=_TOKEN_ID["<image|>"],
            image_token_id=_TOKEN_ID["<|image|>"],
            video_token_id=_TOKEN_ID["<|video|>"],
            boa_token_id=_TOKEN_ID["<|audio>"],
            eoa_token_index=_TOKEN_ID["<audio|>"],
            audio_token_id=_TOKEN_ID["<|audio|>"],
            tie_word_embeddings=True,
        )
        config.architectures = [self.architecture]
        return config

    def describe(self) -> str:
        """Short human description used in the summary line."""
        kind = f"MoE {self.experts}x top-{self.top_k}" if self.moe else "dense"
        return f"{self.architecture} ({kind}, {self.layers} layers, {self.dtype})"


# --------------------------------------------------------------------------------- tensors
def _tensor_seed(seed: int, name: str, salt: int) -> int:
    """Stable per-tensor seed (``hash()`` is salted per process, sha256 is not)."""
    digest = hashlib.sha256(f"vime-gemma4-tiny:{seed}:{name}:{salt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw(name: str, shape: torch.Size, seed: int, salt: int) -> torch.Tensor:
    """Draw one tensor in float32 from its own generator.

    1-D tensors are all multiplicative scales in Gemma 4 (RMSNorm weights are used as ``x * w``,
    not ``x * (1 + w)``; router ``scale`` / ``per_expert_scale``), so they are drawn near one;
    ``layer_scalar`` multiplies the whole residual stream and is kept positive. Everything else
    (projections, embeddings, stacked experts, the vision position table) is ``N(0, 1/fan_in)``
    with ``fan_in`` the last dimension, which keeps activations O(1) through the norms.
    """
    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name, salt))
    if name.endswith("layer_scalar"):
        lo, hi = _LAYER_SCALAR_RANGE
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float32)
    if len(shape) <= 1:
        return 1.0 + _SCALE_STD * torch.randn(shape, generator=gen, dtype=torch.float32)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen, dtype=torch.float32) / fan_in**0.5


def _own_problems(name: str, t: torch.Tensor) -> list[str]:
    """Problems of one tensor on its own: non-finite, constant, or repeated slices."""
    problems = []
    flat = t.detach().reshape(-1).float()
    if not torch.isfinite(flat).all():
        problems.append(f"{name}: non-finite values")
    if flat.numel() > 1 and bool((flat == flat[0]).all()):
        problems.append(f"{name}: constant tensor ({flat[0].item()})")
    if flat.numel() == 1 and flat.item() in (0.0, 1.0):
        problems.append(f"{name}: scalar left at init value {flat.item()}")
    if t.dim() >= 3:  # stacked experts [E, ...] and the vision position table [2, ...]
        seen: dict[str, int] = {}
        for i in range(t.shape[0]):
            fp = tensor_digest(t[i], with_shape=False)
            if fp in seen:
                problems.append(f"{name}: slices {seen[fp]} and {i} are equal")
            seen.setdefault(fp, i)
    return problems


def assert_all_distinct(state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise ``AssertionError`` unless every tensor is distinguishable from every other.

    Checks: no two tensors have equal flattened contents (any shape); within every tensor of
    rank >= 3 (stacked experts ``[E, ...]``) no two leading slices are equal; no tensor of more
    than one element is constant (catches norms/scales left at ones or zeros); no one-element
    tensor (``layer_scalar``) is 0 or 1; all values finite. Called before saving, after
    read-back, and by the tests: a checkpoint that fails is never published.
    """
    problems: list[str] = []
    owners: dict[str, str] = {}
    for name in sorted(state_dict):
        t = state_dict[name]
        problems += _own_problems(name, t)
        fp = tensor_digest(t, with_shape=False)
        if fp in owners:
            problems.append(f"{name} equals {owners[fp]}")
        owners.setdefault(fp, name)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise AssertionError(f"{len(problems)} indistinct tensor(s):\n  {shown}{more}")


def _saved_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as ``save_pretrained`` writes it: tied aliases (``lm_head``) dropped.

    Parameters and persistent buffers both appear; the first name of each storage wins, which
    for Gemma 4 is the embedding (``lm_head.weight`` comes last and is the tied alias).
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def randomize_(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Overwrite every saved parameter and persistent buffer in place, deterministically.

    Each tensor comes from a generator seeded with (seed, name, salt). If the draw, cast to the
    model dtype, collides with an earlier tensor, is constant, or repeats a slice, the salt is
    bumped and the tensor redrawn, so the result is deterministic and always distinct.
    Returns the saved tensors (tied aliases dropped) by name.
    """
    tensors = _saved_tensors(model)
    owners: set[str] = set()
    with torch.no_grad():
        for name in sorted(tensors):
            target = tensors[name]
            for salt in range(_MAX_REDRAWS):
                value = _draw(name, target.shape, seed, salt).to(target.dtype)
                fp = tensor_digest(value, with_shape=False)
                if fp not in owners and not _own_problems(name, value):
                    break
            else:  # pragma: no cover - needs a pathological spec (e.g. a 1-element tensor per layer in int8)
                raise RuntimeError(f"could not draw a distinct value for {name} in {_MAX_REDRAWS} tries")
            target.copy_(value)
            owners.add(fp)
    return tensors


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
        eos_token_id=[EOS_ID, _TOKEN_ID["<turn|>"]],
        pad_token_id=PAD_ID,
    )
    randomize_(model, spec.seed)
    return model


# ------------------------------------------------------------------------------- tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (the alphabet of byte-level BPE), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _learn_merges(words: Iterable[str], budget: int) -> list[tuple[str, str]]:
    """Plain BPE on a fixed word list; ties break lexicographically so the result is fixed."""
    corpus: dict[tuple[str, ...], int] = {}
    for w in words:
        corpus[tuple(w)] = corpus.get(tuple(w), 0) + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < budget:
        counts: dict[tuple[str, str], int] = {}
        for symbols, freq in corpus.items():
            for pair in zip(symbols, symbols[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + freq
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < 2:
            break
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, freq in corpus.items():
            out: list[str] = []
            i = 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + freq
        corpus = merged
    return merges


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` ids, built offline.

    Saved through ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5), which
    writes ``tokenizer.json`` + ``tokenizer_config.json`` that ``AutoTokenizer`` loads.

    Ids: Gemma 4's special tokens first (pad 0, eos 1, bos 2, ...), then the 256 byte symbols,
    then merges learnt from a fixed sentence, then ``<unusedN>`` fillers (Gemma has those too).
    BOS is prepended like Gemma's tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}")
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = [w for w, _ in pre.pre_tokenize_str(_MERGE_CORPUS)]
    merges = _learn_merges(words, vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    fillers = [f"<unused{i}>" for i in range(vocab_size - len(vocab))]
    for tok in fillers:
        vocab[tok] = len(vocab)
    assert len(vocab) == vocab_size

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=False))
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *fillers)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        extra_special_tokens=dict(_NAMED_SPECIALS),
        padding_side="left",
        model_max_length=4096,
    )


# ---------------------------------------------------------------------------------- writing
def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _new_sibling_dir(out: Path, tag: str) -> Path:
    """A fresh hidden directory next to ``out`` (same filesystem, so the final rename is atomic).

    ``os.mkdir`` rather than ``tempfile.mkdtemp`` so the checkpoint gets the caller's umask
    instead of mode 0700, which would hide it from other users and containers.
    """
    for _ in range(100):
        candidate = out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise FileExistsError(f"could not create a temporary directory next to {out}")


def _apply_umask(directory: Path) -> None:
    """Give written files the usual ``0666 & ~umask`` mode (some writers create them 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~mask)


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
    Everything is written into a hidden temporary sibling, verified (the safetensors are read
    back, compared with the model bit for bit and checked with :func:`assert_all_distinct`)
    and only then renamed into place, so an interrupted or failed run never leaves a
    directory that looks like a complete checkpoint. Besides the HF files, ``tiny_spec.json``
    records the spec so a checkpoint can be regenerated.
    """
    spec = spec or TinySpec()
    out = Path(out_dir).absolute()
    if out.exists() and not _is_empty_dir(out) and not force:
        raise FileExistsError(f"{out} exists and is not empty (use --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)

    model = build_tiny_model(spec)
    expected = _saved_tensors(model)
    assert_all_distinct(expected)  # never write a checkpoint that cannot catch a mix-up

    tmp = _new_sibling_dir(out, "partial")
    try:
        model.save_pretrained(tmp)
        build_tokenizer(spec.vocab_size).save_pretrained(tmp)
        (tmp / "tiny_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=2, sort_keys=True) + "\n")
        _verify_written(tmp, expected)
        _apply_umask(tmp)
        if out.exists() or out.is_symlink():
            trash = _new_sibling_dir(out, "old")
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
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


# -------------------------------------------------------------------------------------- CLI
def _layer_types_arg(value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(",") if v.strip())
    bad = [v for v in items if v not in ("sliding", "full")]
    if bad:
        raise argparse.ArgumentTypeError(f"layer types must be 'sliding' or 'full', got {bad}")
    return items


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``vime-gemma4 tiny OUT [options]``."""
    d = TinySpec()
    p = sub.add_parser(
        "tiny",
        help="write a tiny random Gemma 4 checkpoint (every tensor distinct) for conversion tests",
        description=(
            "Write a tiny, random, deterministic Gemma 4 checkpoint with transformers' own classes. Every saved "
            "tensor (norms, scales and layer_scalar included) is redrawn from a per-tensor generator so that no two "
            "tensors, experts or layers are equal: a conversion that mixes any of them up cannot round-trip. "
            "Defaults divide TP<=4, PP2xVPP2 and EP<=8."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("out", metavar="OUT", type=Path, help="output directory (must not exist or be empty)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    kind = p.add_argument_group("model kind")
    kind.add_argument(
        "--causal-lm",
        action="store_true",
        help="write Gemma4ForCausalLM (text only) instead of Gemma4ForConditionalGeneration (text + tiny vision)",
    )
    kind.add_argument(
        "--dense", action="store_true", help="dense text model (no router/experts); enables PLE and KV sharing knobs"
    )
    size = p.add_argument_group("sizes")
    size.add_argument("--layers", type=int, default=d.layers, help="decoder layers (PP x VPP must divide it)")
    size.add_argument(
        "--layer-types",
        type=_layer_types_arg,
        default=None,
        help="comma list of sliding/full, one per layer, the last one full; None: alternate, ending with full",
    )
    size.add_argument("--hidden-size", type=int, default=d.hidden_size, help="text hidden size")
    size.add_argument("--intermediate-size", type=int, default=d.intermediate_size, help="dense MLP width")
    size.add_argument("--moe-intermediate-size", type=int, default=d.moe_intermediate_size, help="per-expert width")
    size.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer (EP must divide it)")
    size.add_argument("--top-k", type=int, default=d.top_k, help="experts routed per token")
    size.add_argument("--heads", type=int, default=d.heads, help="attention (query) heads")
    size.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads of sliding layers")
    size.add_argument(
        "--global-kv-heads",
        type=int,
        default=d.global_kv_heads,
        help="KV heads of full-attention layers (only used with --attention-k-eq-v, as in transformers)",
    )
    size.add_argument("--head-dim", type=int, default=d.head_dim, help="head dim of sliding layers")
    size.add_argument("--global-head-dim", type=int, default=d.global_head_dim, help="head dim of full layers")
    size.add_argument(
        "--attention-k-eq-v",
        action=argparse.BooleanOptionalAction,
        default=d.attention_k_eq_v,
        help="full layers reuse K as V (no v_proj, global KV heads), like 26B-A4B",
    )
    size.add_argument("--sliding-window", type=int, default=d.sliding_window, help="sliding attention window")
    size.add_argument(
        "--vocab-size",
        type=int,
        default=d.vocab_size,
        help=f"vocabulary size (>= {MIN_VOCAB_SIZE}; default deliberately not a multiple of 128)",
    )
    dense = p.add_argument_group("dense-only")
    dense.add_argument(
        "--per-layer-input-size",
        type=int,
        default=d.per_layer_input_size,
        help="per-layer-embedding width (hidden_size_per_layer_input); 0 disables PLE",
    )
    dense.add_argument(
        "--kv-shared-layers", type=int, default=d.kv_shared_layers, help="last N layers reuse earlier K/V"
    )
    out = p.add_argument_group("output")
    out.add_argument("--seed", type=int, default=d.seed, help="seed of every tensor draw")
    out.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="stored dtype")
    p.set_defaults(func=main)
    return p


def spec_from_args(args: argparse.Namespace) -> TinySpec:
    """Turn parsed ``tiny`` arguments into a :class:`TinySpec` (raises ``ValueError`` if invalid)."""
    return TinySpec(
        layers=args.layers,
        layer_types=args.layer_types,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        experts=args.experts,
        top_k=args.top_k,
        heads=args.heads,
        kv_heads=args.kv_heads,
        global_kv_heads=args.global_kv_heads,
        head_dim=args.head_dim,
        global_head_dim=args.global_head_dim,
        attention_k_eq_v=args.attention_k_eq_v,
        sliding_window=args.sliding_window,
        vocab_size=args.vocab_size,
        seed=args.seed,
        dtype=args.dtype,
        moe=not args.dense,
        causal_lm=args.causal_lm,
        per_layer_input_size=args.per_layer_input_size,
        kv_shared_layers=args.kv_shared_layers,
    )


def main(args: argparse.Namespace) -> int:
    """``tiny`` sub-command: 2 on a bad spec or a non-empty OUT, else write and print one summary line."""
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"vime-gemma4 tiny: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not _is_empty_dir(out) and not args.force:
        print(f"vime-gemma4 tiny: error: {out} exists and is not empty (use --force to replace it)", file=sys.stderr)
        return 2
    path = write_tiny_checkpoint(out, spec, force=args.force)
    n_tensors, n_bytes = checkpoint_stats(path)
    print(f"tiny: {spec.describe()}: {n_tensors} tensors, {n_bytes} bytes -> {path}")
    return 0
