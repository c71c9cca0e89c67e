"""Building the sharded Megatron Gemma 4 model for a topology, and moving weights in and out of it.

These are the steps every job shares (roundtrip, import, export, parity, probe, export-live), run on
every rank after :func:`vime_gemma4_bridge.convert.topology.init_model_parallel`. All resharding is
Megatron-Bridge's: ``AutoBridge.load_hf_weights`` / ``export_hf_weights`` with this plugin's
bridge registered.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from vime_gemma4_bridge.compat.cuda import on_host
from vime_gemma4_bridge.compat.gather_to_one import gathered_to
from vime_gemma4_bridge.convert.cpu_host import provide_model
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.hf_layout import STACKED


def open_bridge(hf_checkpoint: str | os.PathLike) -> Any:
    """``AutoBridge`` for a local Gemma 4 checkpoint (this plugin's bridge is registered before dispatch).

    Imported here, not at module level: validation in the launcher must refuse bad input in
    seconds, without paying for a Megatron-Bridge import.
    """
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(str(hf_checkpoint))


def build_model(bridge: Any, topology: Topology, *, initialize: bool = True) -> list[torch.nn.Module]:
    """The Megatron model chunks of this rank for ``topology`` (parallel state already initialised).

    ``initialize=False`` leaves the weights as allocated (megatron-core's ``perform_initialization``):
    for a caller that overwrites every weight next, random initialisation is pure cost (~3 s/GB on
    one core) and touches memory that streamed weights never need. On the CPU it is also
    megatron-core's ``_initialize_affine_weight_cpu``: a full, unsharded fp32 master weight per
    parallel linear on every rank (2.95 GB for 26B-A4B's embedding at any TP).
    """
    on_gpu = not on_host()
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.perform_initialization = initialize
    provider.tensor_model_parallel_size = topology.tp
    provider.pipeline_model_parallel_size = topology.pp
    provider.virtual_pipeline_model_parallel_size = topology.vpp
    provider.expert_model_parallel_size = topology.ep
    provider.expert_tensor_parallel_size = topology.etp
    provider.sequence_parallel = False
    provider.use_cpu_initialization = not on_gpu
    provider.finalize()
    return provide_model(
        provider,
        wrap_with_ddp=False,
        use_cpu_initialization=not on_gpu,
        init_model_with_meta_device=False,
        mixed_precision_wrapper=None,
    )


def loaded_model(bridge: Any, topology: Topology) -> list[torch.nn.Module]:
    """This rank's model chunks for ``topology`` with the bridge's checkpoint loaded into every weight:
    built without random initialisation, which the load would overwrite (:func:`build_model`)."""
    model = build_model(bridge, topology, initialize=False)
    bridge.load_hf_weights(model)
    return model


def is_rank0() -> bool:
    """Whether this is global rank 0, the rank that compares, writes and reports."""
    return dist.get_rank() == 0


def export_language_model(
    bridge: Any, model: list[torch.nn.Module], conversion_tasks: list | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge's export (all ranks take part) delivered to rank 0, as ``(hf_name, tensor)`` on CPU there;
    no name twice.

    Rank 0 is the one consumer (it compares or writes): the export gathers to it alone, and the
    other ranks get the same names with shape-only tensors (``compat/gather_to_one``, UPSTREAM 60).
    ``conversion_tasks`` restricts it to those of Megatron-Bridge's tasks (default: all of them). The
    experts come stacked, as the checkpoint stores them, whatever the live sync's switch says.
    """
    from vime_gemma4_bridge.core.bridge import in_expert_layout

    seen: set[str] = set()
    with gathered_to(0) as receives:
        exported = bridge.export_hf_weights(
            model, cpu=receives, show_progress=is_rank0(), conversion_tasks=conversion_tasks
        )
        for item in in_expert_layout(STACKED, exported):
            name, tensor = item[0], item[1]
            if name in seen:
                raise ValueError(f"export produced {name!r} twice; a mapping is duplicated")
            seen.add(name)
            yield name, tensor


def collect_on_rank0(
    bridge: Any, model: list[torch.nn.Module], conversion_tasks: list | None = None
) -> dict[str, torch.Tensor]:
    """Run the export on every rank and keep the tensors on rank 0 only (others get ``{}``)."""
    keep = is_rank0()
    exported = export_language_model(bridge, model, conversion_tasks)
    return {name: tensor.clone() for name, tensor in exported if keep}


def broadcast_from_rank0(obj: Any) -> Any:
    """Give every rank rank 0's value of ``obj`` (so all ranks agree on the exit status)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
