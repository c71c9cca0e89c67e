"""Running megatron-core code that assumes CUDA on a host without it (docs/UPSTREAM.md 11, 16, C1).

All three shims act only where the ranks compute on the host (:func:`on_host`: no CUDA, or a gloo
world on a machine with fewer GPUs than ranks, whose model is built on the CPU), and each only inside
a ``with`` block. Where the ranks own GPUs (nccl) they do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


def on_host() -> bool:
    """Whether this process computes on the CPU: no CUDA here, or it joined a non-nccl (gloo) world.

    CUDA alone does not decide it: ``--nproc 2`` on a one-GPU machine runs gloo ranks whose model is
    built on the CPU (:func:`vime_gemma4_bridge.convert.model.build_model`), and there megatron-core's
    ``torch.cuda.current_device()`` allocations would meet CPU weights ("found at least two devices,
    cuda:0 and cpu", scripts/gpu_check.sh's parity at EP2 on an H200, docs/GPU.md).
    """
    if not torch.cuda.is_available():
        return True
    return dist.is_initialized() and dist.get_backend() != "nccl"


@contextlib.contextmanager
def host_cuda_device() -> Iterator[None]:
    """While active on the host (:func:`on_host`), ``torch.cuda.current_device()`` answers the CPU.

    megatron-core's forward path allocates on ``torch.cuda.current_device()`` in many places that
    take no device argument: TP/EP gathers and reduce-scatters (``tensor_parallel.mappings``, used
    by the MoE token dispatcher), the global memory buffer, RoPE (``inv_freq`` moved on first use)
    and the MoE router (its weight moved on first use). Without a driver each of them raises;
    pointing them at the CPU makes the same computation run there, over gloo.

    Beside a GPU (gloo ranks on a machine with fewer GPUs than ranks) megatron-core's
    ``torch.compile``'d fusions also run eagerly here: dynamo, seeing CUDA, compiles them against it
    and failed on an H200 (docs/GPU.md); on a host without CUDA they compile for the CPU as before.
    """
    if not on_host():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        if torch.cuda.is_available():
            from torch._dynamo import config as dynamo_config

            with dynamo_config.patch(disable=True):
                yield
        else:
            yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


@contextlib.contextmanager
def tensors_stay_on_host() -> Iterator[None]:
    """While active on the host (:func:`on_host`), ``Tensor.cuda()`` returns the tensor unchanged.

    With PP > 1, ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied weight to
    CUDA (``weight.data.cuda()``) before all-reducing it between the first and last stage; without
    a GPU that call can only raise, so while the model is built CPU tensors stay where they are
    and the all-reduce runs over gloo.
    """
    if not on_host():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def cpu_checkpointing() -> Iterator[None]:
    """While active on the host (:func:`on_host`), megatron-core's torch_dist reader and writer run (UPSTREAM 16).

    ``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()`` after staging tensors to
    the CPU, and ``save_state_dict_async_finalize`` broadcasts its failure flag in a tensor on
    ``torch.cuda.current_device()``; without a driver both raise. Here there is nothing to synchronize
    and the flag lives on the CPU (gloo).
    """
    if not on_host():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with host_cuda_device():
            yield
    finally:
        torch.cuda.synchronize = original  # type: ignore[assignment]


class HostStream:
    """What ``torch.cuda.Stream()`` gives while a model is built on the host: a stream that is never used.

    megatron-core's alltoall token dispatcher creates its device-to-host copy stream when it is built
    (``token_dispatcher.py`` ``MoEAlltoAllTokenDispatcher.__init__``, megatron-core 0.19.2). A model
    built with that dispatcher on the host (miles asks for it: megatron-core refuses the allgather one
    with ``variable_seq_lengths``) is loaded and exported there, never run: its forward synchronises
    CUDA streams, which the host has none of.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass


@contextlib.contextmanager
def host_cuda_streams() -> Iterator[None]:
    """While active on the host (:func:`on_host`), ``torch.cuda.Stream()`` is a :class:`HostStream`."""
    if not on_host():
        yield
        return
    original = torch.cuda.Stream
    torch.cuda.Stream = HostStream  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.cuda.Stream = original  # type: ignore[misc]
