"""Pre-flight of a HF checkpoint: its language-model tensors against what its own ``config.json`` implies.

Run by every command that reads a HF checkpoint, before any rank starts, from the safetensors
headers only (no tensor data: seconds for 26B-A4B). What the config implies is transformers' own
answer: the state dict of a meta-device model of that config (no memory), language-model part,
tied aliases dropped. A config that lies (``num_experts`` edited), a missing or extra tensor, a
wrong dtype or shape: each is one line, at most ten, then a count.
"""

from __future__ import annotations

from typing import Any

from vime_gemma4_bridge.hf_io import SAFETENSORS_DTYPES, CheckpointError, HFCheckpoint

#: Problems listed one per line before the rest are counted.
MAX_LISTED = 10


class PreflightError(CheckpointError):
    """The checkpoint's tensors do not match its config.json; the message has one line per problem."""


def expected_language_model(checkpoint: HFCheckpoint) -> dict[str, tuple[list[int], str]]:
    """``{name: (shape, safetensors dtype)}`` of every language-model tensor the config implies."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(checkpoint.path)
    architecture = next(a for a in config.architectures if a in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"))
    dtype = _declared_dtype(config) or torch.float32
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = getattr(transformers, architecture)(config)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    expected = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(checkpoint.prefix) and name not in tied:
            tensor_dtype = dtype if tensor.is_floating_point() else tensor.dtype
            expected[name] = (list(tensor.shape), SAFETENSORS_DTYPES[tensor_dtype])
    return expected


def _declared_dtype(config: Any) -> Any:
    import torch

    for holder in (getattr(config, "text_config", None), config):
        dtype = getattr(holder, "dtype", None) or getattr(holder, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if isinstance(dtype, torch.dtype):
            return dtype
    return None


def check_language_model(checkpoint: HFCheckpoint) -> None:
    """Raise :class:`PreflightError` unless the language-model tensors are exactly what the config implies."""
    expected = expected_language_model(checkpoint)
    found = checkpoint.signatures(checkpoint.language_model_names())
    problems = []
    for name, (shape, dtype) in expected.items():
        if name not in found:
            problems.append(f"{name}: missing (config.json implies {dtype} {shape})")
        elif found[name] != (shape, dtype):
            problems.append(f"{name}: {found[name][1]} {found[name][0]} found, config.json implies {dtype} {shape}")
    problems += [
        f"{name}: unexpected language-model tensor (config.json implies no such tensor)"
        for name in found
        if name not in expected
    ]
    if problems:
        listed = problems[:MAX_LISTED]
        more = len(problems) - len(listed)
        raise PreflightError(
            f"HF checkpoint {checkpoint.path} does not match its config.json ({len(problems)} problem(s)); "
            "fix the checkpoint or its config:\n  " + "\n  ".join(listed) + (f"\n  ... and {more} more" if more else "")
        )
