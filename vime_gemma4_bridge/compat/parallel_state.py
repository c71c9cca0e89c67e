"""megatron-core's parallel state, re-initialised for another topology in the same process (UPSTREAM 12).

A test suite or a sweep runs many topologies in one set of rank processes (importing Megatron-Bridge
costs ~10 s per rank), but megatron-core expects one ``initialize_model_parallel`` per process:
``destroy_model_parallel`` forgets some globals and none of the process groups, and the CUDA RNG
tracker of builds with ``force_reset_rng`` keeps its first kind and state unless told to reset. The
two functions here are the only code of the package that touches those globals.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

# Globals of megatron.core.parallel_state that destroy_model_parallel() (megatron-core 0.19)
# leaves set. Most are overwritten by the next initialize_model_parallel(), but not all: e.g.
# _EMBEDDING_GLOBAL_RANKS is only written on ranks inside the new embedding group, so a middle
# pipeline stage of a PP4 world would keep the ranks of an earlier PP1/PP2 topology and
# is_rank_in_embedding_group() would answer True. Value: what it is reset to.
_STALE_PARALLEL_STATE: dict[str, Any] = {
    "_EMBEDDING_GLOBAL_RANKS": None,
    "_PIPELINE_GLOBAL_RANKS": None,
    "_DATA_PARALLEL_GLOBAL_RANKS": None,
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": None,
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": None,
    "_MODEL_PARALLEL_GLOBAL_RANKS": None,
    "_EXPERT_MODEL_PARALLEL_RANKS": None,
    "_MPU_DATA_PARALLEL_RANK": None,
    "_MPU_DATA_PARALLEL_WORLD_SIZE": None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP": None,
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO": None,
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS": None,
}


def reset_model_parallel(*, destroy_groups: bool = True) -> None:
    """Forget megatron-core's parallel state so that another topology can be initialised.

    Beyond ``parallel_state.destroy_model_parallel()`` this clears the globals it forgets (see
    ``_STALE_PARALLEL_STATE``), the micro-batch calculator and, with ``destroy_groups``, shuts
    down the process groups megatron-core created: ``destroy_model_parallel`` only drops its
    references, so every re-initialisation would otherwise leak ~20 communicators (gloo: sockets
    and threads per group). Models built for the old topology must not be used afterwards.
    Must be called on all ranks (group shutdown order has to match for nccl).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    # Read before destroy_model_parallel() drops it. Also covers a half-initialised state left by
    # an initialize_model_parallel() that raised midway (destroy is safe to call in any state).
    groups = list(getattr(ps, "_global_process_group_list", None) or [])
    ps.destroy_model_parallel()
    for name, value in _STALE_PARALLEL_STATE.items():
        if hasattr(ps, name):
            setattr(ps, name, value)
    hybrid = getattr(ps, "_HYBRID_DP_CP_GROUPS", None)
    if isinstance(hybrid, dict):
        hybrid.clear()
    with contextlib.suppress(ImportError):
        from megatron.core import num_microbatches_calculator

        num_microbatches_calculator.destroy_num_microbatches_calculator()
    if destroy_groups and dist.is_initialized():
        pg_map = dist.distributed_c10d._world.pg_map
        world = dist.GroupMember.WORLD
        seen: set[int] = set()
        for group in groups:
            if group is None or group is world or id(group) in seen or pg_map.get(group) is None:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)


def seed_cuda_rng_tracker(seed: int) -> None:
    """Seed megatron-core's model-parallel CUDA RNG tracker afresh, also when it was seeded before.

    Builds whose ``model_parallel_cuda_manual_seed`` has ``force_reset_rng`` keep an initialised
    tracker unless it is set; older builds have no such argument and always rebuild it. Needs a
    CUDA driver (the caller checks).
    """
    from megatron.core.tensor_parallel import random as mrandom

    kwargs: dict[str, Any] = {}
    if "force_reset_rng" in inspect.signature(mrandom.model_parallel_cuda_manual_seed).parameters:
        kwargs["force_reset_rng"] = True
    mrandom.model_parallel_cuda_manual_seed(seed, **kwargs)
