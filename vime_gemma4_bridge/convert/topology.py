"""A run's parallel topology: its sizes, whether they fit a world, and megatron-core's state for it.

:class:`Topology` is pure (the launcher refuses a bad topology in milliseconds, the recipes check
theirs without torch); whether a model splits over it is the model's rule
(:func:`vime_gemma4_bridge.core.model_split.validate_model_topology`), read from a config below
every checkpoint and command. :func:`init_model_parallel` (re)initialises
megatron-core's parallel state on every rank of a running world, topology after topology in the same
processes (:mod:`vime_gemma4_bridge.compat.parallel_state` forgets the previous one).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from typing import Any

from vime_gemma4_bridge.compat.parallel_state import reset_model_parallel, seed_cuda_rng_tracker


@dataclass(frozen=True)
class Topology:
    """Megatron parallel sizes of one run: tensor, pipeline, virtual pipeline, expert, expert-tensor.

    ``etp`` defaults to 1, not to ``tp`` as in megatron-core: expert layers then fit worlds
    such as TP2·PP2·EP2 on 4 ranks (megatron-core needs ETP·EP·PP to divide the world size).
    Data parallelism is whatever the world size leaves over.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1

    def __str__(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp is not None:
            parts.append(f"VPP{self.vpp}")
        parts += [f"EP{self.ep}", f"ETP{self.etp}"]
        return "·".join(parts)

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one copy of the dense part of the model (TP·PP)."""
        return self.tp * self.pp

    @property
    def expert_parallel_size(self) -> int:
        """Ranks holding one copy of the expert layers (ETP·EP·PP)."""
        return self.etp * self.ep * self.pp

    @property
    def min_world_size(self) -> int:
        """Smallest world this topology fits: every valid world size is a multiple of it."""
        return math.lcm(self.model_parallel_size, self.expert_parallel_size)

    def validate(self, world_size: int) -> None:
        """Raise ``ValueError`` (one line: what is wrong, what to do) unless this fits ``world_size``."""
        for name in ("tp", "pp", "ep", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} must be a whole number >= 1, got {value!r}")
        if self.vpp is not None:
            if isinstance(self.vpp, bool) or not isinstance(self.vpp, int) or self.vpp < 1:
                raise ValueError(f"--vpp must be a whole number >= 1 or omitted, got {self.vpp!r}")
            if self.pp == 1:
                raise ValueError(f"--vpp {self.vpp} needs pipeline parallelism: set --pp to 2 or more, or omit --vpp")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"--nproc (the world size; under torchrun its WORLD_SIZE) must be a whole number >= 1, "
                f"got {world_size!r}"
            )
        hint = f"use a world size that is a multiple of {self.min_world_size} (e.g. --nproc {self.min_world_size})"
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"{self} does not fit {world_size} rank(s): TP·PP = {self.model_parallel_size} must divide "
                f"the world size; {hint} or lower --tp/--pp"
            )
        if world_size % self.expert_parallel_size:
            raise ValueError(
                f"{self} does not fit {world_size} rank(s): ETP·EP·PP = {self.expert_parallel_size} must divide "
                f"the world size; {hint} or lower --ep/--etp"
            )

    def data_parallel_size(self, world_size: int) -> int:
        """Copies of the dense model in a world of ``world_size`` ranks."""
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def megatron_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``parallel_state.initialize_model_parallel`` (and model providers)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        }

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add ``--tp --pp --vpp --ep --etp`` to ``parser`` (a group, so ``--help`` keeps them together)."""
        group = parser.add_argument_group("parallel topology")
        group.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default: 1)")
        group.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel size (default: 1)")
        group.add_argument(
            "--vpp",
            type=int,
            default=None,
            metavar="N",
            help="virtual pipeline stages per pipeline rank (interleaving; needs --pp >= 2; default: none)",
        )
        group.add_argument("--ep", type=int, default=1, metavar="N", help="expert-parallel size (default: 1)")
        group.add_argument(
            "--etp",
            type=int,
            default=1,
            metavar="N",
            help="expert tensor-parallel size (default: 1, not --tp, so that TP·PP·EP worlds stay small)",
        )
        return parser

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Topology:
        """Topology from the options of :meth:`add_arguments` (missing ones take the defaults)."""
        return cls(
            tp=getattr(args, "tp", 1),
            pp=getattr(args, "pp", 1),
            vpp=getattr(args, "vpp", None),
            ep=getattr(args, "ep", 1),
            etp=getattr(args, "etp", 1),
        )


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def init_model_parallel(
    topology: Topology, *, seed: int = 1234, destroy_groups: bool = True, keep_if_same: bool = False
) -> None:
    """(Re)initialise megatron-core's parallel state for ``topology`` in this rank.

    ``keep_if_same`` keeps the process groups when the parallel state already has exactly this
    topology (on every rank alike: the same sequence of calls runs everywhere); creating the groups
    again costs ~0.2 s, which a one-shot conversion that follows another one need not pay.

    ``torch.distributed`` must already be initialised (by a ``LocalWorld`` rank, ``init_from_env``
    or ``single_process_group`` of :mod:`vime_gemma4_bridge.runtime`), and every rank must call this
    with the same topology: it creates process groups collectively. Any earlier topology is torn
    down first (:func:`~vime_gemma4_bridge.compat.parallel_state.reset_model_parallel`). Torch's CPU
    RNG is seeded with ``seed`` on every rank so that CPU-initialised weights agree; with CUDA,
    megatron's model-parallel CUDA RNG tracker is seeded too (it raises without a driver, hence
    only then).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: run inside LocalWorld/launch(), under torchrun after "
            "init_from_env(), or within single_process_group()"
        )
    topology.validate(dist.get_world_size())
    if not (keep_if_same and ps.model_parallel_is_initialized() and _current_topology() == topology):
        reset_model_parallel(destroy_groups=destroy_groups)
        ps.initialize_model_parallel(**topology.megatron_kwargs())
    _seed_everything(seed)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        seed_cuda_rng_tracker(seed)


def _current_topology() -> Topology:
    layout = parallel_layout()
    return Topology(tp=layout["tp"], pp=layout["pp"], vpp=layout["vpp"], ep=layout["ep"], etp=layout["etp"])


def parallel_layout() -> dict[str, int | None]:
    """This rank's sizes and ranks as megatron-core's parallel_state reports them (for checks and logs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return {
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "dp": ps.get_data_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "edp": ps.get_expert_data_parallel_world_size(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
    }
