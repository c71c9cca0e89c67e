"""The pre-flight of the commands: everything that can be refused before any rank starts, in one place.

:func:`command_inputs` is the preamble every command that converts a HF checkpoint at a topology
runs (``roundtrip``, ``parity``, ``probe``, ``import``, ``export``, ``export-live``). A command names
its inputs (its output flag, its size flag, a torch_dist checkpoint it reads) instead of handing in
checks of its own, so the pre-flight keeps one order for all of them and each check is asked of the
layer that owns it from the top down: the topology (convert), the files on disk (io), then the
model's own rule of how it splits (core). Each refusal is a ``ValueError`` whose message is the
whole story; the command prints it with :func:`vime_gemma4_bridge.cli.errors.refuse` and exits 2.
The checks of the model itself live with the checkpoint, in :mod:`vime_gemma4_bridge.io.hf_model`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.model_split import validate_model_topology
from vime_gemma4_bridge.io.hf import HFCheckpoint, parse_size, prepare_output, refuse_overlap
from vime_gemma4_bridge.io.hf_model import check_config, check_language_model
from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint
from vime_gemma4_bridge.runtime.launch import requested_world_size


@dataclass(frozen=True)
class CommandInputs:
    """What the pre-flight accepted: everything a command launches its job with."""

    topology: Topology
    #: The world the job runs in: ``--nproc``, else torchrun's ``WORLD_SIZE``, else 1.
    world_size: int
    source: HFCheckpoint
    #: The output directory, checked writable (None: the command has none, or it was not asked for).
    output: Path | None
    #: The size flag's bytes (None: the command has no size flag).
    size: int | None
    #: The torch_dist checkpoint the command reads, checked against ``source`` (None: it reads none).
    torch_dist: TorchDistCheckpoint | None


def command_inputs(
    args: argparse.Namespace,
    *,
    output: str | None = None,
    size: str | None = None,
    torch_dist: str | None = None,
) -> CommandInputs:
    """A command's inputs, or the ``ValueError`` refusing them; ``output``, ``size``, ``torch_dist``: its flags.

    In this order (the first problem is the one reported): the topology of ``--tp --pp --vpp --ep
    --etp`` fits the world (``--nproc``, else torchrun's ``WORLD_SIZE``, else 1); ``--hf-checkpoint``
    opens (config, index, shards); its config names every field a model needs with a valid value
    (:func:`~vime_gemma4_bridge.io.hf_model.check_config`); the ``torch_dist`` checkpoint opens; the
    ``output`` (skipped when not given) overlaps no source and may be written (``--force`` replaces
    it); the ``size`` parses; the tensors against config.json
    (:func:`~vime_gemma4_bridge.io.hf_model.check_language_model`, the slowest file check); the
    ``torch_dist`` checkpoint's files, its layout and its model against the HF one; last the model
    splits over the topology (:func:`~vime_gemma4_bridge.core.model_split.validate_model_topology`,
    from the config alone). A command's own checks that need the model (ids, lengths) come after.
    """
    topology = Topology.from_args(args)
    world_size = requested_world_size(args.nproc)
    topology.validate(world_size)
    source = HFCheckpoint(args.hf_checkpoint)
    config = check_config(source)
    checkpoint = TorchDistCheckpoint(_value(args, torch_dist)) if torch_dist else None
    out = None
    if output and _value(args, output):
        sources = {"--hf-checkpoint": source.path} | ({torch_dist: checkpoint.path} if checkpoint else {})
        refuse_overlap(_value(args, output), output, sources)
        out = prepare_output(_value(args, output), force=args.force)
    size_bytes = parse_size(_value(args, size), size) if size else None
    check_language_model(source)
    if checkpoint:
        checkpoint.check_files()
        checkpoint.check_layout()
        checkpoint.check_matches(source)
    validate_model_topology(config, topology)
    return CommandInputs(topology, world_size, source, out, size_bytes, checkpoint)


def _value(args: argparse.Namespace, flag: str) -> str | None:
    """The value argparse parsed for ``flag`` (``--max-shard-size`` is ``args.max_shard_size``)."""
    return getattr(args, flag.lstrip("-").replace("-", "_"))
