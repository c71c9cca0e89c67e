"""The pre-flight of the commands: everything that can be refused before any rank starts, in one place.

:func:`command_inputs` is the preamble every command that converts a HF checkpoint at a topology
runs (``roundtrip``, ``parity``, ``probe``; ``import``, ``export`` and ``export-live`` can call it
too): the topology against the world, the checkpoint opened, the model against the topology, the
command's own checks, then :func:`~vime_gemma4_bridge.io.hf_model.check_language_model`. Each
refusal is a ``ValueError`` whose message is the whole story; the command prints it with
:func:`vime_gemma4_bridge.cli.errors.refuse` and exits 2. The checks of the model itself live with
the checkpoint, in :mod:`vime_gemma4_bridge.io.hf_model`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.model_split import validate_model_topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.io.hf_model import check_config, check_language_model
from vime_gemma4_bridge.runtime.launch import requested_world_size


def command_inputs[T](
    args: argparse.Namespace,
    checks: Callable[[Topology, HFCheckpoint], T] | None = None,
    *,
    world_size: int | None = None,
) -> tuple[Topology, HFCheckpoint, T | None]:
    """``(topology, source, what checks returned)`` of a command, or the ``ValueError`` refusing its input.

    In this order (the first problem is the one reported): the topology of ``--tp --pp --vpp --ep
    --etp`` fits ``world_size`` (default: ``--nproc``, else torchrun's ``WORLD_SIZE``, else 1);
    ``--hf-checkpoint`` opens (config, index, shards); its config names every field a model needs
    with a valid value (:func:`check_config`); the model splits over the topology;
    ``checks(topology, source)``, the command's own (outputs, sizes, ids), whose result is returned;
    last the tensors against config.json (:func:`check_language_model`), the slowest check.
    """
    topology = Topology.from_args(args)
    topology.validate(requested_world_size(args.nproc) if world_size is None else world_size)
    source = HFCheckpoint(args.hf_checkpoint)
    validate_model_topology(check_config(source), topology)
    extra = checks(topology, source) if checks is not None else None
    check_language_model(source)
    return topology, source, extra
