"""Running megatron-core code that assumes CUDA on a host without it (docs/UPSTREAM.md 11, 16, C1).

All three shims do nothing where CUDA is available, and each is active only inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def host_cuda_device() -> Iterator[None]:
    """While active on a host without CUDA, ``torch.cuda.current_device()`` answers the CPU.

    megatron-core's forward path allocates on ``torch.cuda.current_device()`` in many places that
    take no device argument: TP/EP gathers and reduce-scatters (``tensor_parallel.mappings``, used
    by the MoE token dispatcher), the global memory buffer, RoPE (``inv_freq`` moved on first use)
    and the MoE router (its weight moved on first use). Without a driver each of them raises;
    pointing them at the CPU makes the same computation run there, over gloo.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


@contextlib.contextmanager
def tensors_stay_on_host() -> Iterator[None]:
    """While active on a host without CUDA, ``Tensor.cuda()`` returns the tensor unchanged.

    With PP > 1, ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied weight to
    CUDA (``weight.data.cuda()``) before all-reducing it between the first and last stage; without
    a GPU that call can only raise, so while the model is built CPU tensors stay where they are
    and the all-reduce runs over gloo.
    """
    if torch.cuda.is_available():
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
    """While active on a host without CUDA, megatron-core's torch_dist reader and writer run (docs/UPSTREAM.md 16).

    ``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()`` after staging tensors to
    the CPU, and ``save_state_dict_async_finalize`` broadcasts its failure flag in a tensor on
    ``torch.cuda.current_device()``; without a driver both raise. Here there is nothing to synchronize
    and the flag lives on the CPU (gloo).
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with host_cuda_device():
            yield
    finally:
        torch.cuda.synchronize = original  # type: ignore[assignment]
