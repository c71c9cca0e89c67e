"""Building the sharded Megatron Gemma 4 model for a topology, and moving weights in and out of it.

These are the steps every job shares (roundtrip, import, export, parity, probe, export-live), run on
every rank after :func:`vime_gemma4_bridge.convert.topology.init_model_parallel`. The conversion is
Megatron-Bridge's: ``AutoBridge.load_hf_weights`` / ``export_hf_weights`` with this plugin's bridge
registered; a job with one consumer has the plugin's mapping classes deliver the export to it
(:func:`to_rank0`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from vime_gemma4_bridge.compat.cuda import on_host
from vime_gemma4_bridge.compat.gather_to_one import gathered_to, receives_export
from vime_gemma4_bridge.convert.cpu_host import provide_model
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.hf_layout import STACKED
from vime_gemma4_bridge.runtime.memory import release_freed_memory


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


@contextlib.contextmanager
def to_rank0(bridge: Any, model: list[torch.nn.Module], conversion_tasks: list | None = None) -> Iterator[list]:
    """The job's one-consumer export: within the block the export gathers to rank 0 alone (collective).

    Yields the conversion tasks to export with (``conversion_tasks``, default: all of the bridge's):
    their mappings are the ones taken over (``compat/gather_to_one``, UPSTREAM 60), so a mapping
    that is not the plugin's is refused before any tensor moves. The other ranks get the same names
    with shape-only tensors. Outside the block the export is upstream's again (vime's and miles' sync).
    """
    tasks = conversion_tasks if conversion_tasks is not None else bridge.get_conversion_tasks(model)
    with gathered_to(0, (task.mapping for task in tasks if task is not None)):
        yield tasks


def export_language_model(bridge: Any, model: list[torch.nn.Module], tasks: list) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge's export of ``tasks`` (all ranks take part), as ``(hf_name, tensor)``; no name twice.

    Run inside :func:`to_rank0` (which gives ``tasks``): rank 0 then gets CPU tensors and the other
    ranks shape-only ones. The experts come stacked, as the checkpoint stores them, whatever the
    live sync's switch says.
    """
    from vime_gemma4_bridge.core.expert_layout import in_expert_layout

    seen: set[str] = set()
    exported = bridge.export_hf_weights(model, cpu=receives_export(), show_progress=is_rank0(), conversion_tasks=tasks)
    for item in in_expert_layout(STACKED, exported):
        name, tensor = item[0], item[1]
        if name in seen:
            raise ValueError(f"export produced {name!r} twice; a mapping is duplicated")
        seen.add(name)
        yield name, tensor
        del item, tensor  # not held while the next one is made


#: A tensor of at least this size delivered to rank 0 is followed by :func:`release_freed_memory`.
RELEASE_AFTER = 64 << 20


def export_to_rank0(
    bridge: Any, model: list[torch.nn.Module], conversion_tasks: list | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Run the export to rank 0 on every rank: rank 0 gets ``(hf_name, tensor)`` as each arrives (use it
    before taking the next), the other ranks nothing (iterating drives their part of the collectives).

    Nothing is kept: a consumer that writes or compares each tensor as it comes holds one at a time,
    not the language model (48 GB at 26B-A4B).
    """
    keep = is_rank0()
    with to_rank0(bridge, model, conversion_tasks) as tasks:
        for name, tensor in export_language_model(bridge, model, tasks):
            large = tensor.numel() * tensor.element_size() >= RELEASE_AFTER
            if keep:
                yield name, tensor
            del tensor  # not held while the next one is made
            if keep and large:
                release_freed_memory()  # what making it left in glibc's heaps (runtime/memory.py)


def broadcast_from_rank0(obj: Any) -> Any:
    """Give every rank rank 0's value of ``obj`` (so all ranks agree on the exit status)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
