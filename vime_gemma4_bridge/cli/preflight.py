"""The pre-flight of the commands: everything that can be refused before any rank starts, in one place.

:func:`command_inputs` is the preamble every command that converts a HF checkpoint at a topology
runs (``roundtrip``, ``parity``, ``probe``; ``import``, ``export`` and ``export-live`` can call it
too): the topology against the world, the checkpoint opened, the model against the topology, the
command's own checks, then :func:`check_language_model`. Each refusal is a ``ValueError`` whose
message is the whole story; the command prints it with :func:`vime_gemma4_bridge.cli.errors.refuse`
and exits 2.

:func:`check_language_model` compares a checkpoint's language-model tensors with what its own
``config.json`` implies, from the safetensors headers only (no tensor data: seconds for 26B-A4B).
What the config implies is transformers' own answer: the state dict of a meta-device model of that
config (no memory), language-model part, tied aliases dropped. A config that lies (``num_experts``
edited), a missing or extra tensor, a wrong dtype or shape: each is one line, at most ten, then a
count.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from vime_gemma4_bridge.convert.topology import Topology, validate_model_topology
from vime_gemma4_bridge.io.hf import SAFETENSORS_DTYPES, CheckpointError, HFCheckpoint
from vime_gemma4_bridge.runtime.launch import requested_world_size

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


def command_inputs[T](
    args: argparse.Namespace,
    checks: Callable[[Topology, HFCheckpoint], T] | None = None,
    *,
    world_size: int | None = None,
) -> tuple[Topology, HFCheckpoint, T | None]:
    """``(topology, source, what checks returned)`` of a command, or the ``ValueError`` refusing its input.

    In this order (the first problem is the one reported): the topology of ``--tp --pp --vpp --ep
    --etp`` fits ``world_size`` (default: ``--nproc``, else torchrun's ``WORLD_SIZE``, else 1);
    ``--hf-checkpoint`` opens (config, index, shards); the model splits over the topology;
    ``checks(topology, source)``, the command's own (outputs, sizes, ids), whose result is returned;
    last the tensors against config.json (:func:`check_language_model`), the slowest check.
    """
    topology = Topology.from_args(args)
    topology.validate(requested_world_size(args.nproc) if world_size is None else world_size)
    source = HFCheckpoint(args.hf_checkpoint)
    validate_model_topology(source.config, topology)
    extra = checks(topology, source) if checks is not None else None
    check_language_model(source)
    return topology, source, extra
