"""A training checkpoint written by Megatron-LM itself: test-side rank code for tests/test_interchange.py.

:func:`train_and_save_job` builds this plugin's Gemma 4 model at a topology (DDP-wrapped, as
training wraps it), loads an HF checkpoint into it, runs **one real optimizer step** (a pipelined
forward and backward over token ids, megatron-core's ``finalize_model_grads``, Adam's
``optimizer.step()``) and saves a torch_dist checkpoint with **Megatron-LM's own**
``megatron.training.checkpointing.save_checkpoint``: model, optimizer state, optimizer-parameter
scheduler, RNG state and ``args`` (in the common state). Three optimizer forms (:data:`FORMS`):

* ``"no_dist_opt"``: megatron-core's ``get_megatron_optimizer`` with ``use_distributed_optimizer=False``;
* ``"dp_reshardable"``: the distributed optimizer, megatron-core's default dist-ckpt optimizer format;
* ``"fully_reshardable"``: the distributed optimizer with ``args.dist_ckpt_optim_fully_reshardable``.

It also exports the *trained* model through Megatron-Bridge (``export_hf_weights``, gathered to
rank 0) and writes those tensors with safetensors to a reference directory: ``export_job`` of the
saved checkpoint must give the same tensors, bitwise.

Megatron-LM and megatron-core assume CUDA in places that take no device argument; everything this
module needs on a CPU host with gloo ranks is a *scoped* stand-in, active only inside the rank job
(:func:`cpu_training`, :func:`cuda_rng_state_stand_in`, :func:`cuda_tensor_types`), each restored
when its block ends. Nothing under the virtual environment is edited.
"""

from __future__ import annotations

import contextlib
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

#: The optimizer forms, by name: (use_distributed_optimizer, dist_ckpt_optim_fully_reshardable).
FORMS: dict[str, tuple[bool, bool]] = {
    "no_dist_opt": (False, False),
    "dp_reshardable": (True, False),
    "fully_reshardable": (True, True),
}
#: The iteration the checkpoint is saved at.
ITERATION = 7
#: Learning rate of the one step: large enough that every bf16 weight with a gradient moves.
LR = 1e-2
#: Seed of the CPU RNG the checkpoint's stand-in CUDA RNG state is made from.
CUDA_RNG_SEED = 1234


# ------------------------------------------------------------------------------------------------
# Scoped stand-ins for CUDA on a CPU host
# ------------------------------------------------------------------------------------------------


class _HostStream:
    """``torch.cuda.current_stream()`` on the host: DDP's grad sync orders itself after the compute stream
    (``param_and_grad_buffer.py`` ``start_grad_sync``: ``current_stream.wait_event`` for CUDA-graph
    events); on the CPU every op is already done when the next one starts, so there is nothing to wait for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


class _CudaFactoriesOnHost(TorchFunctionMode):
    """Tensors megatron-core makes with an explicit ``device="cuda"`` are made on the CPU instead.

    E.g. the optimizers' ``found_inf`` / ``_scale`` / ``_dummy_overflow_buf`` (``optimizer.py``) and
    the tied-embedding grad all-reduce's buffers: without a driver those constructors raise.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_training() -> Iterator[None]:
    """While active (CPU host only), megatron-core's DDP, optimizer and Megatron-LM's save run on gloo ranks.

    Stacks the repository's own shims (``compat/cuda``: ``current_device()`` answers the CPU,
    ``Tensor.cuda()`` is the identity, ``torch.cuda.synchronize()`` a no-op) with two of this module:
    ``torch.cuda.current_stream()`` and ``torch.cuda.Stream()`` are inert :class:`_HostStream` s (DDP's
    grad sync asks for the current stream unconditionally; Megatron-LM's ``_ddp_wrap``, which
    Megatron-Bridge's ``provide_distributed_model`` calls, makes an initialisation stream, orders it after
    the current one with ``wait_stream`` and enters ``torch.cuda.stream(...)`` around the wrapping), the
    repository's own ``HostStream`` (which ``provide_model`` installs for the build) gets the same inert
    ``wait_stream``, ``torch.cuda.stream(...)`` is a no-op context, and factories given ``device="cuda"``
    make CPU tensors (:class:`_CudaFactoriesOnHost`). Where CUDA is present nothing is replaced.
    """
    from vime_gemma4_bridge.compat import cuda as cuda_compat
    from vime_gemma4_bridge.compat.cuda import cpu_checkpointing, on_host, tensors_stay_on_host

    if not on_host():
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_checkpointing())  # synchronize() no-op + host_cuda_device()
        stack.enter_context(tensors_stay_on_host())
        stack.enter_context(mock.patch.object(torch.cuda, "current_stream", lambda device=None: _HostStream()))
        stack.enter_context(mock.patch.object(torch.cuda, "Stream", _HostStream))
        stack.enter_context(mock.patch.object(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()))
        stack.enter_context(
            mock.patch.object(cuda_compat.HostStream, "wait_stream", lambda self, stream: None, create=True)
        )
        stack.enter_context(_CudaFactoriesOnHost())
        yield


@contextlib.contextmanager
def cuda_tensor_types() -> Iterator[None]:
    """While active (CPU host only), a CPU tensor's ``.type()`` names its CUDA twin ("torch.cuda.BFloat16Tensor").

    megatron-core's mixed-precision and distributed optimizers sort the model's parameters by
    ``param.type()`` against the CUDA type names only (``optimizer.py``
    ``Float16OptimizerWithFloat16Params.__init__``, ``distrib_optimizer.py`` ``_build_model_and_main_param_groups``)
    and raise ``TypeError`` for anything else, and gradient clipping asserts
    ``param.grad.type() == 'torch.cuda.FloatTensor'`` (``clip_grads.py`` ``clip_grad_by_total_norm_fp32``);
    the CPU tensors are of the same dtypes, so answering the CUDA name lets the same code run.
    Only ``.type()`` without arguments is changed; active around the optimizer's construction and its step.
    """
    from vime_gemma4_bridge.compat.cuda import on_host

    if not on_host():
        yield
        return
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name.removeprefix("torch.")
            return name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _host_cuda_rng_state() -> torch.Tensor:
    """A CUDA (Philox) generator state as ``torch.cuda.get_rng_state()`` returns it: 16 bytes, seed then offset."""
    return torch.tensor(list(struct.pack("<QQ", CUDA_RNG_SEED, 0)), dtype=torch.uint8)


@contextlib.contextmanager
def cuda_rng_state_stand_in() -> Iterator[None]:
    """While active (no CUDA), ``torch.cuda.get_rng_state()`` returns a well-formed 16-byte Philox state.

    Megatron-LM's ``checkpointing.get_rng_state`` calls ``torch.cuda.get_rng_state()`` unconditionally;
    without a driver it raises. The stand-in has the CUDA state's own layout (seed
    :data:`CUDA_RNG_SEED`, offset 0), so a GPU run that loads this checkpoint's RNG state can
    ``torch.cuda.set_rng_state`` it.
    """
    if torch.cuda.is_available():
        yield
        return
    with mock.patch.object(torch.cuda, "get_rng_state", lambda device="cuda": _host_cuda_rng_state()):
        yield


# ------------------------------------------------------------------------------------------------
# Megatron-LM's args
# ------------------------------------------------------------------------------------------------


def megatron_lm_args(
    save_dir: str, topology: Any, form: str, text_config: Any, world_size: int, padded_vocab_size: int
) -> Any:
    """Megatron-LM's full default namespace (``parse_args`` of a controlled ``sys.argv``) set for this run.

    ``parse_args`` without ``validate_args``: the namespace is what ``save_checkpoint`` reads (``save``,
    ``ckpt_format``, the optimizer form, ``no_save_*``) and what a later ``--load`` compares
    (the parallel sizes, the model's shape); the model itself is built by Megatron-Bridge, not from it.
    """
    from megatron.training import arguments

    distributed, fully_reshardable = FORMS[form]
    argv, sys.argv = sys.argv, ["megatron-lm", "--save", save_dir, "--ckpt-format", "torch_dist"]
    try:
        args = arguments.parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.save = save_dir
    args.ckpt_format = "torch_dist"
    args.use_dist_ckpt = True
    args.async_save = False
    args.use_distributed_optimizer = distributed
    args.dist_ckpt_optim_fully_reshardable = fully_reshardable
    args.no_save_optim = False
    args.no_save_rng = False
    args.bf16 = True
    args.params_dtype = torch.bfloat16
    args.accumulate_allreduce_grads_in_fp32 = True
    args.optimizer = "adam"
    args.lr = LR
    args.min_lr = 0.0
    args.clip_grad = 1.0
    args.weight_decay = 0.0
    args.world_size = world_size
    args.rank = dist.get_rank()
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = topology.tp, topology.pp
    args.virtual_pipeline_model_parallel_size = topology.vpp
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = topology.ep, topology.etp
    args.data_parallel_size = topology.data_parallel_size(world_size)
    args.num_layers = int(text_config.num_hidden_layers)
    args.hidden_size = int(text_config.hidden_size)
    args.ffn_hidden_size = int(text_config.intermediate_size)
    args.num_attention_heads = int(text_config.num_attention_heads)
    args.num_query_groups = int(text_config.num_key_value_heads)
    args.group_query_attention = args.num_query_groups != args.num_attention_heads
    args.kv_channels = int(text_config.head_dim)
    args.num_experts = int(text_config.num_experts) if getattr(text_config, "enable_moe_block", False) else None
    args.moe_ffn_hidden_size = int(text_config.moe_intermediate_size) if args.num_experts else None
    top_k = getattr(text_config, "top_k_experts", None) or getattr(text_config, "num_experts_per_tok", None)
    args.moe_router_topk = int(top_k) if top_k else args.moe_router_topk
    args.vocab_size = int(text_config.vocab_size)
    args.padded_vocab_size = padded_vocab_size
    args.iteration = ITERATION
    args.train_iters = ITERATION
    args.consumed_train_samples = 0
    return args


# ------------------------------------------------------------------------------------------------
# One training step
# ------------------------------------------------------------------------------------------------


def _pipelined_forward_backward(model: list[torch.nn.Module], input_ids: torch.Tensor, vocab: int) -> float | None:
    """Forward and backward of one micro-batch through this rank's pipeline stage (no VPP).

    The data flow of megatron-core's 1F1B schedule for one micro-batch: stage ``i`` receives the
    hidden states ``[seq, batch, hidden]`` from stage ``i-1``, runs, sends its output on; the last
    stage computes the next-token cross entropy over the real vocabulary ``vocab`` (the model's is padded)
    from the TP-gathered logits
    and runs backward; each stage sends the gradient of its input back. Point-to-point send/recv
    over gloo (megatron-core's p2p layer allocates on CUDA, cf. ``verify/parity.py``). Returns the
    loss on last-stage ranks.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_attr_wrapped_model, get_model_config

    assert len(model) == 1, "one chunk per rank (no VPP) in this prototype"
    chunk = model[0]
    config = get_model_config(chunk)
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    group = ps.get_pipeline_model_parallel_group() if pp_size > 1 else None
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    batch, seq_len = input_ids.shape
    position_ids = torch.arange(seq_len, dtype=torch.long).unsqueeze(0).expand(batch, seq_len)
    hidden_dtype = config.pipeline_dtype or config.params_dtype
    chunk.train()
    received = None
    if not first:
        shape = (seq_len, batch, config.hidden_size)
        prev = ps.get_pipeline_model_parallel_prev_rank()
        if config.variable_seq_lengths:
            sent = torch.empty(3, dtype=torch.int64)
            dist.recv(sent, src=prev, group=group)
            shape = tuple(sent.tolist())
        received = torch.empty(shape, dtype=hidden_dtype)
        dist.recv(received, src=prev, group=group)
        received.requires_grad_(True)
        get_attr_wrapped_model(chunk, "set_input_tensor")(received)
    output = chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None, runtime_gather_output=True)
    loss_value = None
    if last:
        logits = output[:, :-1, :vocab].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), input_ids[:, 1:].reshape(-1))
        loss.backward()
        loss_value = float(loss.detach())
    else:
        nxt = ps.get_pipeline_model_parallel_next_rank()
        if config.variable_seq_lengths:
            dist.send(torch.tensor(output.shape, dtype=torch.int64), dst=nxt, group=group)
        dist.send(output.detach().contiguous(), dst=nxt, group=group)
        grad = torch.empty(output.shape, dtype=output.dtype)
        dist.recv(grad, src=nxt, group=group)
        torch.autograd.backward(output, grad_tensors=grad)
    if received is not None:
        dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank(), group=group)
    return loss_value


def _optimizer(model: list[torch.nn.Module], distributed: bool) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        min_lr=0.0,
        weight_decay=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=1.0,
        use_distributed_optimizer=distributed,
    )
    with cpu_training(), cuda_tensor_types():
        return get_megatron_optimizer(config, model)


def _param_scheduler(optimizer: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=LR,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=100,
        wd_incr_style="constant",
    )


def _build_training_model(bridge: Any, topology: Any, distributed: bool) -> list[torch.nn.Module]:
    """``convert.build_model``'s provider set-up, but wrapped in megatron-core's DDP as training wraps it."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from vime_gemma4_bridge.convert.cpu_host import provide_model

    provider = bridge.to_megatron_provider(load_weights=False)
    provider.perform_initialization = False  # every weight is loaded next
    provider.tensor_model_parallel_size = topology.tp
    provider.pipeline_model_parallel_size = topology.pp
    provider.virtual_pipeline_model_parallel_size = topology.vpp
    provider.expert_model_parallel_size = topology.ep
    provider.expert_tensor_parallel_size = topology.etp
    provider.sequence_parallel = False
    provider.use_cpu_initialization = True
    provider.finalize()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=distributed,
        check_for_nan_in_grad=False,
    )
    with cpu_training():
        return provide_model(
            provider,
            ddp_config=ddp_config,
            wrap_with_ddp=True,
            use_cpu_initialization=True,
            init_model_with_meta_device=False,
            mixed_precision_wrapper=None,
        )


def _adam_moment_norms(optimizer: Any) -> dict[str, float]:
    """Sum of |exp_avg| and |exp_avg_sq| over this rank's optimizer state (chained optimizers included)."""
    totals = {"exp_avg": 0.0, "exp_avg_sq": 0.0, "tensors": 0}
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        for state in inner.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    totals[key] += float(state[key].abs().sum())
            totals["tensors"] += 1
    return totals


def train_and_save_job(
    hf_checkpoint: str, save_dir: str, reference_dir: str, topology: Any, form: str, iteration: int = ITERATION
) -> dict[str, Any] | None:
    """One optimizer step on the HF checkpoint's weights, saved by Megatron-LM's ``save_checkpoint``. Every rank.

    Returns rank 0's report (``None`` elsewhere): the iteration directory, the loss, the seconds per
    phase, this rank's Adam moment sums, and the number of language-model tensors the step changed;
    the trained weights, exported through Megatron-Bridge, are written to ``reference_dir``
    (``model.safetensors``) by rank 0.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import checkpointing, global_vars

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.verify.parity import excluded_token_ids, fixed_token_ids

    distributed, _ = FORMS[form]
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    text_config = getattr(bridge.hf_pretrained.config, "text_config", None) or bridge.hf_pretrained.config
    model = _build_training_model(bridge, topology, distributed)
    bridge.load_hf_weights(model)
    optimizer = _optimizer(model, distributed)
    scheduler = _param_scheduler(optimizer)
    seconds["build"] = round(time.perf_counter() - start, 3)

    tick = time.perf_counter()
    config = bridge.hf_pretrained.config.to_dict()
    input_ids = fixed_token_ids(
        int(text_config.vocab_size), 2, 16, excluded_token_ids(config), seed=100 + ps.get_data_parallel_rank()
    )
    with cpu_training(), cuda_tensor_types():
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _pipelined_forward_backward(model, input_ids, int(text_config.vocab_size))
        finalize_model_grads(model)
        update_successful, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
    seconds["step"] = round(time.perf_counter() - tick, 3)
    if not update_successful:
        raise RuntimeError("optimizer.step() reported an unsuccessful update")

    tick = time.perf_counter()
    padded_vocab = int(get_attr_wrapped_model(model[0], "vocab_size"))
    args = megatron_lm_args(save_dir, topology, form, text_config, dist.get_world_size(), padded_vocab)
    global_vars.set_args(args)
    with cpu_training(), cuda_rng_state_stand_in():
        checkpointing.save_checkpoint(iteration, model, optimizer, scheduler, 0)
    dist.barrier()
    seconds["save"] = round(time.perf_counter() - tick, 3)

    tick = time.perf_counter()
    with cpu_training():
        trained = {name: tensor.clone() for name, tensor in convert.export_to_rank0(bridge, model)}
    seconds["export_reference"] = round(time.perf_counter() - tick, 3)
    moments = {**_adam_moment_norms(optimizer), "loss": loss}
    all_moments = [None] * dist.get_world_size()
    dist.all_gather_object(all_moments, moments)
    if not convert.is_rank0():
        return None
    from safetensors.torch import save_file

    Path(reference_dir).mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in trained.items()}, str(Path(reference_dir) / "model.safetensors"))
    source = HFCheckpoint(hf_checkpoint)
    original = source.load(source.language_model_names())
    changed = sorted(name for name in original if name in trained and not torch.equal(original[name], trained[name]))
    return {
        "form": form,
        "topology": str(topology),
        "iteration_dir": str(Path(save_dir) / f"iter_{iteration:07d}"),
        "loss": next(m["loss"] for m in all_moments if m["loss"] is not None),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tensors": len(trained),
        "changed": len(changed),
        "unchanged": sorted(set(original) - set(changed)),
        "moments": all_moments,
        "seconds": seconds,
    }
