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

The spec (:class:`~vime_gemma4_bridge.testing.spec.TinySpec`) lives in its own torch-free module.

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
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.io.commit import atomic_directory
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKEN_ID, build_tokenizer
from vime_gemma4_bridge.testing.weights import assert_all_distinct, on_disk, randomize_, saved_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def build_tiny_model(spec: TinySpec) -> PreTrainedModel:
    """Instantiate the transformers model for ``spec`` and randomise it (CPU, eval mode).

    The global torch RNG is forked so building a checkpoint never perturbs the caller's seeds
    (transformers' own init draws from it; its values are all overwritten anyway).
    """
    import transformers
    from transformers import GenerationConfig

    cls = getattr(transformers, spec.architecture)
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
    expected = on_disk(model, saved_tensors(model))
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
        if not same_bytes(saved[name], t):
            raise AssertionError(f"{name} was not saved bit-exactly")
    assert_all_distinct(saved)


def checkpoint_stats(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(number of tensors, total bytes of the safetensors files) of a written checkpoint."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    names = set()
    for file in files:  # the headers: a real-width checkpoint is not read
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return len(names), sum(f.stat().st_size for f in files)
