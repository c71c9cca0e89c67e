"""miles' bridge road, pinned as a test double (radixark/miles @31f1ca96; behaviour read from the files, no miles code).

Pinned, not faithful: each function below is our reading of the cited file and lines, and runs
here where miles cannot (it needs ray, SGLang and CUDA). What miles does with
``--megatron-to-hf-mode bridge --colocate`` at every weight sync:

1. ``actor.py`` L220-231: the weights getter is a ``TensorBackuper`` of
   ``named_params_and_buffers(args, model, convert_to_global_name=False)``: CPU copies
   (``tensor_backper.py`` L66-72) keyed ``vp_stages.{vp}.{name}``, every ``module.`` prefix stripped,
   parameters (not ``_is_witness_param``) and only the ``expert_bias`` buffers (``common.py`` L299-314);
2. ``hf_weight_iterator_bridge.py`` ``get_hf_weight_chunks`` (L38-70), inside
   ``megatron_bridge_utils.patch_megatron_model`` (``miles/utils/megatron_bridge_utils.py``):
   ``get_conversion_tasks`` → ``_process_conversion_tasks`` (L147-176: ``None`` tasks, tasks without a
   ``param_weight`` and keys missing from the dict kept as they are; the others given the dict's
   tensor moved ``.cuda()``; wrapped in ``_MapWithLen``: ``len`` and iteration, no indexing) →
   ``export_hf_weights(model, cpu=False, conversion_tasks=..., merge_adapter_weights=False)`` unpacked
   as three fields (L73) → ``postprocess_hf_param`` (``remove_padding``) → ``quantize_params`` with
   ``f"module.module.{megatron_name}"`` (L81-88) → the LoRA/base filter (L63-66) →
   ``_stream_atomic_units`` (L103-128; Gemma 4 has no atomic groups: ``common.py`` L28-47) →
   ``_chunk_atomic_units_by_size`` (L131-144: a chunk closes when it would reach the size, ``>=``);
3. ``update_weight_from_tensor.py`` ``_send_to_colocated_engine`` (L450-545): each chunk, per dtype,
   packed into SGLang's ``FlattenedTensorBucket`` (``{"flattened_tensor", "metadata"}``), serialized,
   ``gather_object``-ed to the first rank of the engine's group (``--rollout-num-gpus-per-engine``
   ranks, L119-125), which calls ``update_weights_from_tensor(serialized_named_tensors=[one per
   rank], load_format="flattened_bucket")``: engine rank r loads the payload of group rank r.

Not reproduced: ray, CUDA IPC (``MultiprocessingSerializer`` ships CUDA handles; here the payload is
pickled bytes), the engine's own ``load_weights`` (tests of SGLang itself are issue 47's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# ---------------------------------------------------------------------------------------------- step 1


def strip_param_name_prefix(name: str | None) -> str | None:
    """``misc_utils.py`` L1-7: every leading ``module.`` removed; ``None`` stays ``None``."""
    if name is None:
        return None
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def backed_up_weights(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The actor's weights as the bridge iterator receives them: ``common.py`` L299-314 names,
    ``tensor_backper.py`` L66-72 copies (new CPU tensors, never the parameters themselves)."""
    weights: dict[str, torch.Tensor] = {}
    for vp_stage, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            if not getattr(param, "_is_witness_param", False):
                weights[f"vp_stages.{vp_stage}.{strip_param_name_prefix(name)}"] = param.detach().clone().cpu()
        for name, buffer in chunk.named_buffers():
            if "expert_bias" in name:
                weights[f"vp_stages.{vp_stage}.{strip_param_name_prefix(name)}"] = buffer.detach().clone().cpu()
    return weights


# ---------------------------------------------------------------------------------------------- step 2


class MapWithLen:
    """``hf_weight_iterator_bridge.py`` L166-176: ``__len__`` and ``__iter__``, not a list."""

    def __init__(self, fn: Callable[[Any], Any], xs: Any) -> None:
        self.fn = fn
        self.xs = xs

    def __len__(self) -> int:
        return len(self.xs)

    def __iter__(self) -> Iterator[Any]:
        for x in self.xs:
            yield self.fn(x)


def to_device(tensor: torch.Tensor) -> torch.Tensor:
    """miles' ``.cuda()`` (L160): where there is no GPU, a copy, so the task still holds another tensor."""
    return tensor.cuda() if torch.cuda.is_available() and dist.get_backend() == "nccl" else tensor.clone()


def process_conversion_tasks(tasks: Any, weights: dict[str, torch.Tensor]) -> MapWithLen:
    """``_process_conversion_tasks`` (L147-163)."""

    def handle_one(task: Any) -> Any:
        if task is None or task.param_weight is None:
            return task
        key = f"vp_stages.{task.vp_stage}.{task.param_name}"
        if key not in weights:
            return task  # "buffer-like params (Gemma-4 layer_scalar/scale) ... keep as-is"
        return dataclasses.replace(task, param_weight=to_device(weights[key]))

    return MapWithLen(handle_one, tasks)


def remove_padding(name: str | None, param: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``processors/padding_remover.py`` L6-12 (``postprocess_hf_param``, ``megatron_to_hf/__init__.py`` L17-20)."""
    if strip_param_name_prefix(name) in {"embedding.word_embeddings.weight", "output_layer.weight"}:
        return param[:vocab_size]
    return param


FP8_LAYER = re.compile(r"module\.module\.decoder\.layers\.(\d+)\.(.+)")
FP8_EXPERT = re.compile(r"mlp.experts\.(.+)\.weight(\d+)")
FP8_SHARED = re.compile(r"mlp.shared_experts\.(.+)")
#: ``quantizer_fp8.py`` L71-101, the names a dense/attention weight is quantized under (those Gemma 4 has).
FP8_DENSE = ("self_attention.linear_proj.weight", "self_attention.linear_qkv.weight")


def quantize_param_fp8(name: str, weight: torch.Tensor, block: Any) -> list[tuple[str, torch.Tensor]]:
    """``_quantize_param`` (L114-138), its per-tensor branch; the block branch needs SGLang's or Triton's kernels."""
    assert name.endswith(".weight"), f"Expected weight parameter, got {name}"
    if block is not None:
        raise NotImplementedError("miles' block FP8 needs SGLang's per_block_cast_to_fp8 or its Triton kernel")
    fp8_min, fp8_max = torch.finfo(torch.float8_e4m3fn).min, torch.finfo(torch.float8_e4m3fn).max
    scale = weight.abs().max().clamp(min=1e-12).to(torch.float32) / fp8_max
    qweight = (weight / scale).clamp(min=fp8_min, max=fp8_max).to(torch.float8_e4m3fn)
    return [(name, qweight), (name.replace(".weight", ".weight_scale"), scale.view(1))]


def quantize_params(megatron_name: str, named: list, quantization_config: dict | None) -> list:
    """``processors/__init__.py`` L17-21 into ``quantize_params_fp8`` (``quantizer_fp8.py`` L16-111), fp8 only."""
    if quantization_config is None:
        return named
    assert quantization_config["quant_method"] == "fp8", "the double pins miles' fp8 quantizer only"
    assert quantization_config.get("fmt", "e4m3") == "e4m3" and quantization_config["activation_scheme"] == "dynamic"
    block = quantization_config.get("weight_block_size")
    match = FP8_LAYER.match(megatron_name)
    if not match:
        return named  # (MTP layers: Gemma 4 has none)
    rest = match.group(2)
    expert = FP8_EXPERT.match(rest)
    if expert and expert.group(1) in ("linear_fc1", "linear_fc2"):
        kept = [(n, p) for n, p in named if not n.endswith("_scale")]
        return [pair for n, p in kept for pair in quantize_param_fp8(n, p, block)]
    shared = FP8_SHARED.match(rest)
    if shared and shared.group(1) in ("linear_fc1.weight", "linear_fc2.weight"):
        return [pair for n, p in named for pair in quantize_param_fp8(n, p, block)]
    if rest in FP8_DENSE or rest in ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight"):
        return [pair for n, p in named for pair in quantize_param_fp8(n, p, block)]
    return named


def is_lora_weight_name(name: str) -> bool:
    """``lora_utils.py`` L183-185."""
    return ".lora_A." in name or ".lora_B." in name


@contextlib.contextmanager
def patch_megatron_model(model: list[torch.nn.Module]) -> Iterator[None]:
    """``miles/utils/megatron_bridge_utils.py`` L9-29: the first chunk's config given
    ``share_embeddings_and_output_weights`` while the bridge runs, and every module's
    ``_maintain_float32_expert_bias`` called first (Gemma 4's modules have none)."""
    from megatron.core.utils import unwrap_model

    chunk = unwrap_model(model)[0]
    added = not hasattr(chunk.config, "share_embeddings_and_output_weights")
    if added:
        chunk.config.share_embeddings_and_output_weights = chunk.share_embeddings_and_output_weights
    for m in model:
        for module in m.modules():
            if hasattr(module, "_maintain_float32_expert_bias"):
                module._maintain_float32_expert_bias()
    try:
        yield
    finally:
        if added:
            delattr(chunk.config, "share_embeddings_and_output_weights")


def stream_atomic_units(items: Iterable[tuple[str, torch.Tensor, str]], groups: list) -> Iterator[list]:
    """``_stream_atomic_units`` (L103-128) with Gemma 4's atomic groups, which are none (``common.py``
    L28-47: no ``q_lora_rank``, no model groups): every item is its own unit. (With groups, miles
    calls ``megatron_name.endswith`` on every item: the tests require a ``str`` third field anyway.)"""
    assert not groups, "Gemma 4 has no atomic update groups in miles @31f1ca96"
    for hf_name, weight, _megatron_name in items:
        yield [(hf_name, weight)]


def chunk_atomic_units_by_size(units: Iterable[list], chunk_size: int) -> Iterator[list]:
    """``_chunk_atomic_units_by_size`` (L131-144)."""
    bucket: list = []
    bucket_size = 0
    for unit in units:
        unit_size = sum(t.nbytes for _, t in unit)
        if bucket and bucket_size + unit_size >= chunk_size:
            yield bucket
            bucket, bucket_size = [], 0
        bucket.extend(unit)
        bucket_size += unit_size
    if bucket:
        yield bucket


@dataclasses.dataclass
class MilesArgs:
    """The fields of miles' ``args`` the bridge iterator reads (``vocab_size``: the actor sets the tokenizer's)."""

    hf_checkpoint: str
    vocab_size: int
    update_weight_buffer_size: int


def get_hf_weight_chunks(
    bridge: Any,
    model: list[torch.nn.Module],
    weights: dict[str, torch.Tensor],
    args: MilesArgs,
    quantization_config: dict | None,
    weight_type: str = "base",
    names: list | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``HfWeightIteratorBridge.get_hf_weight_chunks`` (L38-90), its bridge opened by the caller (L21).
    ``names`` (the double's only addition) collects every third field the export yields."""
    renamed = {strip_param_name_prefix(k): v for k, v in weights.items()}
    with patch_megatron_model(model):
        if weight_type == "lora":
            named = bridge.export_adapter_weights(model, cpu=False, show_progress=False)
        else:
            tasks = process_conversion_tasks(bridge.get_conversion_tasks(model), renamed)
            named = bridge.export_hf_weights(model, cpu=False, conversion_tasks=tasks, merge_adapter_weights=False)

        def postprocessed() -> Iterator[tuple[str, torch.Tensor, str]]:
            for hf_param_name, weight, megatron_param_name in named:
                if names is not None:
                    names.append(megatron_param_name)
                hf_name = hf_param_name.replace(".base_layer.", ".")
                weight = remove_padding(megatron_param_name, weight, args.vocab_size)
                if weight_type == "base" and quantization_config is not None:
                    quantized = quantize_params(
                        f"module.module.{megatron_param_name}", [(hf_name, weight)], quantization_config
                    )
                    for q_name, q_weight in quantized:
                        yield q_name, q_weight, megatron_param_name
                else:
                    yield hf_name, weight, megatron_param_name

        wanted = is_lora_weight_name if weight_type == "lora" else (lambda name: not is_lora_weight_name(name))
        items = ((h, w, m) for h, w, m in postprocessed() if wanted(h))
        yield from chunk_atomic_units_by_size(stream_atomic_units(items, []), args.update_weight_buffer_size)


# ---------------------------------------------------------------------------------------------- step 3


class FlattenedTensorBucket:
    """SGLang's ``srt/weight_sync/tensor_bucket.py`` (stored at 07e90009): one dtype per bucket,
    flattened by ``torch.cat``, rebuilt by slicing and ``reshape`` with the recorded metadata."""

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]] | None = None, flattened=None, metadata=None):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            self.metadata, flats, start = [], [], 0
            for name, tensor in named_tensors:
                flat = tensor.flatten()
                self.metadata.append((name, tensor.shape, tensor.dtype, start, start + flat.numel()))
                flats.append(flat)
                start += flat.numel()
            self.flattened = torch.cat(flats, dim=0)
        else:
            self.flattened, self.metadata = flattened, metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, shape, dtype, start, end in self.metadata:
            tensor = self.flattened[start:end].reshape(shape)
            out.append((name, tensor if tensor.dtype == dtype else tensor.to(dtype)))
        return out


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def send_to_colocated_engine(chunk: list[tuple[str, torch.Tensor]], group: Any, src: int) -> list[list[bytes]] | None:
    """``_send_to_colocated_engine`` (L450-545), base weights: per-dtype buckets (``supports_multi_dtypes``
    absent from that SGLang bucket), serialized, gathered to ``src``; there, one list per dtype of
    every group rank's payload, as ``update_weights_from_tensor`` receives them."""
    by_dtype: dict[torch.dtype, list] = {}
    for name, tensor in chunk:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    serialized = []
    for named in by_dtype.values():
        bucket = FlattenedTensorBucket(named_tensors=named)
        serialized.append(_serialize({"flattened_tensor": bucket.flattened, "metadata": bucket.metadata}))
    gathered = [None] * dist.get_world_size(group) if dist.get_rank() == src else None
    dist.gather_object(serialized, object_gather_list=gathered, dst=src, group=group)
    if dist.get_rank() != src:
        return None
    return [[per_rank[i] for per_rank in gathered] for i in range(len(gathered[0]))]


def engine_loads(per_dtype_payloads: list[list[bytes]]) -> list[list[tuple[str, torch.Tensor]]]:
    """The engine side of ``load_format="flattened_bucket"``: for each engine rank, every tensor it receives."""
    ranks: list[list[tuple[str, torch.Tensor]]] = []
    for payloads in per_dtype_payloads:
        for rank, payload in enumerate(payloads):
            data = torch.load(io.BytesIO(payload), weights_only=False)
            bucket = FlattenedTensorBucket(flattened=data["flattened_tensor"], metadata=data["metadata"])
            while len(ranks) <= rank:
                ranks.append([])
            ranks[rank].extend(bucket.reconstruct_tensors())
    return ranks


def gather_groups(engine_ranks: int) -> tuple[Any, int]:
    """``UpdateWeightFromTensor.__init__`` (L119-125): gloo groups of ``--rollout-num-gpus-per-engine`` ranks."""
    mine = None
    for start in range(0, dist.get_world_size(), engine_ranks):
        ranks = list(range(start, min(start + engine_ranks, dist.get_world_size())))
        group = dist.new_group(ranks=ranks, backend="gloo")
        if dist.get_rank() in ranks:
            mine = (group, start)
    assert mine is not None
    return mine


def save_hf_model(bridge: Any, model: list[torch.nn.Module], path: Path) -> None:
    """``hf_export.py`` ``save_hf_model`` (L149-193), bridge branch: ``save_hf_pretrained`` inside
    ``patch_megatron_model``, a barrier, rank 0 refuses a save without weight files, then ``.complete``."""
    path.mkdir(parents=True, exist_ok=True)
    if dist.get_rank() == 0:
        (path / ".complete").unlink(missing_ok=True)
    with patch_megatron_model(model):
        bridge.save_hf_pretrained(model, path=path)
    dist.barrier()
    if dist.get_rank() == 0:
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise RuntimeError(f"HF export to {path} produced no weight files")
        (path / ".complete").touch()


def pp_assemble_full_adapter(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """``update_weight_from_tensor.py`` ``_pp_assemble_full_adapter`` (L37-74): every PP rank's adapter
    tensors, described by ``all_gather_object`` and sent per dtype as one flat ``broadcast`` from each
    stage, so that every PP rank holds the whole adapter, sorted by name."""
    import math

    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = dist.get_world_size(group=pp_group)
    if pp_size == 1:
        return named
    pp_rank = dist.get_rank(group=pp_group)
    global_ranks = dist.get_process_group_ranks(pp_group)
    local_meta = [(n, tuple(t.shape), t.dtype) for n, t in named]
    all_meta: list = [None] * pp_size
    dist.all_gather_object(all_meta, local_meta, group=pp_group)
    local = dict(named)
    merged: dict[str, torch.Tensor] = {}
    for src_pp, meta in enumerate(all_meta):
        by_dtype: dict = {}
        for n, shape, dtype in meta:
            by_dtype.setdefault(dtype, []).append((n, shape))
        for dtype, entries in by_dtype.items():
            flat = torch.empty(sum(math.prod(shape) for _, shape in entries), dtype=dtype)
            offset = 0
            if src_pp == pp_rank:
                for n, shape in entries:
                    flat[offset : offset + math.prod(shape)].copy_(local[n].reshape(-1))
                    offset += math.prod(shape)
            dist.broadcast(flat, src=global_ranks[src_pp], group=pp_group)
            offset = 0
            for n, shape in entries:
                merged[n] = flat[offset : offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
    return sorted(merged.items())
