"""The CPU-host adapter: what a model built by the Gemma 4 providers needs on a host without CUDA.

megatron-core assumes CUDA in places that take no device argument (docs/UPSTREAM.md 11, C1, P3):
the tied-embedding all-reduce of a PP > 1 build moves the weight to CUDA, and the forward's
gathers, buffers, masks and router allocate on ``torch.cuda.current_device()``. The model code (core/) is what
an upstream pull request would contain, so it stays free of these run-time patches; this adapter
applies them where the model is built (:func:`vime_gemma4_bridge.convert.model.build_model`, and
any caller building a provider's model on a CPU host), and only where the ranks compute on the host
(:func:`~vime_gemma4_bridge.compat.cuda.on_host`: no CUDA, or gloo ranks beside a GPU they do not own). On a GPU
(vime's actors) it calls the provider and returns.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from vime_gemma4_bridge.compat.cuda import host_cuda_device, host_cuda_streams, on_host, tensors_stay_on_host


def provide_model(provider: Any, **kwargs: Any) -> list[nn.Module]:
    """``provider.provide_distributed_model(**kwargs)``, built and runnable on this host.

    On the host the build runs with CPU tensors staying put (``Tensor.cuda`` is the identity),
    ``current_device()`` answering the CPU and CUDA streams inert (an alltoall MoE dispatcher builds;
    its forward needs CUDA), and every chunk gets :func:`prepare_host_forward`.
    """
    if not on_host():
        return provider.provide_distributed_model(**kwargs)
    with tensors_stay_on_host(), host_cuda_device(), host_cuda_streams():
        chunks = provider.provide_distributed_model(**kwargs)
    return [prepare_host_forward(chunk) for chunk in chunks]


def prepare_host_forward(model: nn.Module) -> nn.Module:
    """Let a built Gemma 4 ``GPTModel`` run its forward pass on a host without CUDA. In place.

    The model's forward runs inside :func:`host_cuda_device` (its core attention is already the
    host twin, :class:`~vime_gemma4_bridge.core.cpu_modules.Gemma4DotProductAttention`, by the spec).
    Does nothing where the ranks own GPUs, or twice.
    """
    if not on_host() or getattr(model, "_vime_host_forward", False):
        return model
    forward = model.forward

    @functools.wraps(forward)
    def host_forward(*args: Any, **kwargs: Any) -> Any:
        with host_cuda_device():
            return forward(*args, **kwargs)

    model.forward = host_forward
    model._vime_host_forward = True
    return model
