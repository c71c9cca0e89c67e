"""vime's bridge-mode weight sync, step by step, as a test double (behaviour from vime's sources; no vime code).

What vime does at every weight sync with ``--megatron-to-hf-mode bridge`` (vllm-project/vime,
``update_weight/hf_weight_iterator_bridge.py``, ``update_weight/common.py``, ``utils/misc.py``,
``update_weight/update_weight_from_disk.py``), reproduced so the plugin can be driven exactly that way:

1. ``AutoBridge.from_hf_pretrained(hf_checkpoint, trust_remote_code=True)``;
2. a weight dict of every named parameter and, of the buffers, only those whose name contains
   ``expert_bias``, keyed ``vp_stages.{vp}.{name}``;
3. ``bridge.get_conversion_tasks(model)``; every task with a ``param_weight`` replaced
   (``dataclasses.replace``) by the dict's tensor, which must be there (an ``assert``), lazily, behind
   a wrapper that has ``__len__`` and ``__iter__`` but is not a list;
4. ``for hf_name, weight, megatron_name in bridge.export_hf_weights(model, cpu=False, conversion_tasks=...)``,
   each through vime's ``postprocess_hf_param`` and ``quantize_params`` (its FP8 rollouts);
5. chunks: a bucket is closed when its size plus the next tensor's would reach the buffer size (``>=``);
6. disk transport on rank 0 (``update_weight_from_disk.py`` @03a8e1bf): the non-weight files copied
   into the version directory, each chunk one ``model-XXXXX.safetensors`` (a name seen twice is an
   error), renamed to the ``-of-`` form, an index written through tmp + fsync + replace; then the
   engines reload from that directory (tests/test_vllm.py drives vLLM's ``reload_weights`` with it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch


def weight_dict(model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """vime's ``named_params_and_buffers(..., convert_to_global_name=False)``: parameters + ``expert_bias`` buffers."""
    weights: dict[str, torch.Tensor] = {}
    for vp_stage, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            weights[f"vp_stages.{vp_stage}.{name.removeprefix('module.')}"] = param
        for name, buffer in chunk.named_buffers():
            if "expert_bias" in name:
                weights[f"vp_stages.{vp_stage}.{name.removeprefix('module.')}"] = buffer
    return weights


class LazyTasks:
    """vime's lazy task wrapper: ``__len__`` and ``__iter__``, each task mapped when iterated."""

    def __init__(self, fn: Callable[[Any], Any], tasks: list) -> None:
        self.fn = fn
        self.tasks = tasks

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Any]:
        for task in self.tasks:
            yield self.fn(task)


def replace_task_weights(tasks: list, weights: dict[str, torch.Tensor]) -> LazyTasks:
    def replace(task: Any) -> Any:
        if task is None or task.param_weight is None:
            return task
        key = f"vp_stages.{task.vp_stage}.{task.param_name}"
        assert key in weights, f"{key=} not in the weight dict (vp_stage={task.vp_stage}, {task.param_name=})"
        return dataclasses.replace(task, param_weight=weights[key].to(task.param_weight.device))

    return LazyTasks(replace, tasks)


def chunks(named: Iterable[tuple[str, torch.Tensor]], size: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """vime's ``chunk_named_params_by_size`` (vllm-project/vime@397a8429 ``vime/utils/misc.py``, its
    ``_chunk_by_size``): a bucket is yielded when it is not empty and its bytes plus the next tensor's
    ``nbytes`` reach ``size`` (``>=``); the last bucket is yielded if not empty. The one statement of
    the rule on the test side: tests/test_live.py checks the plugin's ``chunk_by_bytes`` against it."""
    bucket: list[tuple[str, torch.Tensor]] = []
    total = 0
    for item in named:
        nbytes = item[1].nbytes
        if bucket and total + nbytes >= size:
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += nbytes
    if bucket:
        yield bucket


def strip_module_prefixes(name: str | None) -> str | None:
    """vime's ``misc_utils.strip_param_name_prefix`` (its newest stored form): every leading ``module.``
    removed; ``None`` stays ``None``."""
    if name is None:
        return None
    while name.startswith("module."):
        name = name.removeprefix("module.")
    return name


def postprocess_hf_param(megatron_name: str, weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """vime's ``postprocess_hf_param`` (``megatron_to_hf/__init__.py`` @33679863) = ``remove_padding``
    (``processors/padding_remover.py`` @40ec17a0): ``[:vocab_size]`` for exactly two stripped names."""
    if strip_module_prefixes(megatron_name) in {"embedding.word_embeddings.weight", "output_layer.weight"}:
        return weight[:vocab_size]
    return weight


#: ``quantizer_fp8.py`` @0696c9bd: the Megatron names its FP8 quantizer acts on (decoder layers, then MTP).
VIME_FP8_LAYER_NAMES = (r"module\.module\.decoder\.layers\.(\d+)\.(.+)", r"module\.module\.mtp\.layers\.(\d+)\.(.+)")


def quantize_params(megatron_name: str | None, named: list, quantization_config: dict | None) -> list:
    """vime's ``quantize_params`` (``processors/__init__.py`` @5d429bd) into ``quantize_params_fp8`` (@0696c9bd).

    Without a config, or for a name neither pattern matches, the pairs pass through unchanged (its
    L16-27); a matching name would be quantized with vime's Triton kernel, which cannot run here: the
    double raises, so a test shows which names vime itself would touch. A ``None`` name meets vime's
    ``re.match`` as it would there (``TypeError``).
    """
    if quantization_config is None or quantization_config["quant_method"] != "fp8":
        return named
    assert quantization_config.get("fmt", "e4m3") == "e4m3" and quantization_config["activation_scheme"] == "dynamic"
    if any(re.match(pattern, megatron_name) for pattern in VIME_FP8_LAYER_NAMES):
        raise AssertionError(f"vime's own FP8 quantizer would act on {megatron_name} (its Triton kernel)")
    return named


def sync_weights(
    bridge: Any, model: list[torch.nn.Module], buffer_size: int, unnamed: list[str] | None = None
) -> Iterator[list]:
    """One weight sync, steps 2-5: the chunks every rank produces, through vime's processors
    (``hf_weight_iterator_bridge.py`` @40ec17a0: ``postprocess_hf_param``, then ``quantize_params`` with
    the quantization config of ``--hf-checkpoint``, the checkpoint the bridge was opened on). The HF
    names whose Megatron name came as ``None`` go to ``unnamed``; vime itself does not look."""
    unnamed = [] if unnamed is None else unnamed
    tasks = replace_task_weights(bridge.get_conversion_tasks(model), weight_dict(model))
    config = bridge.hf_pretrained.config
    vocab_size = getattr(config, "text_config", config).vocab_size
    quantization_config = getattr(config, "quantization_config", None)

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, weight, megatron_name in bridge.export_hf_weights(model, cpu=False, conversion_tasks=tasks):
            if not megatron_name:
                unnamed.append(hf_name)
            weight = postprocess_hf_param(megatron_name, weight, vocab_size)
            yield from quantize_params(megatron_name, [(hf_name, weight)], quantization_config)

    yield from chunks(named(), buffer_size)


#: What vime's disk sync does not copy from ``--hf-checkpoint`` (update_weight_from_disk.py @03a8e1bf L23-29, L175-176).
HF_WEIGHT_FILE_NAMES = {
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
}
HF_WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack")


def write_disk_update(chunk_stream: Iterable[list[tuple[str, torch.Tensor]]], hf_checkpoint: str, out: Path) -> int:
    """Step 6 on rank 0, as ``update_weight_from_disk.py`` @03a8e1bf does it; returns the tensors written.

    ``_prepare_version_dir`` (L107-115): the version directory anew, every top-level regular file of
    ``--hf-checkpoint`` that is not a weight file copied (``shutil.copy2``). ``_write_full_checkpoint``
    (L117-172): a name seen twice raises ``ValueError``; each non-empty chunk is saved as
    ``model-{chunk:05d}.safetensors`` with ``{"format": "pt"}`` (the chunk counter also counts empty
    chunks), then renamed in write order to ``model-{i:05d}-of-{n:05d}.safetensors``; the index
    ``{"metadata": {"total_size": ...}, "weight_map": ...}`` goes through a ``.tmp`` file, flush, fsync
    and ``os.replace``.
    """
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for source in Path(hf_checkpoint).iterdir():
        weights = source.name in HF_WEIGHT_FILE_NAMES or source.name.endswith(HF_WEIGHT_FILE_SUFFIXES)
        if source.is_file() and not weights:
            shutil.copy2(source, out / source.name)
    seen: set[str] = set()
    files: list[tuple[str, list[str]]] = []
    total_size = 0
    for index, chunk in enumerate(chunk_stream, start=1):
        state = {}
        for name, tensor in chunk:
            if name in seen:
                raise ValueError(f"Duplicate HF tensor while saving full disk checkpoint: {name}")
            seen.add(name)
            state[name] = tensor.detach().contiguous().cpu()
            total_size += state[name].numel() * state[name].element_size()
        if not state:
            continue
        name = f"model-{index:05d}.safetensors"
        save_file(state, out / name, metadata={"format": "pt"})
        files.append((name, list(state)))
    if not files:
        raise ValueError("No HF tensors were produced for full disk checkpoint")
    weight_map = {}
    for index, (name, names) in enumerate(files, start=1):
        final = f"model-{index:05d}-of-{len(files):05d}.safetensors"
        os.replace(out / name, out / final)
        weight_map.update(dict.fromkeys(names, final))
    tmp = out / "model.safetensors.index.json.tmp"
    with tmp.open("w") as handle:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, out / "model.safetensors.index.json")
    return len(seen)


def patch_auto_bridge_hf_config(bridge: Any) -> Any:
    """vime's ``utils/megatron_bridge_utils.py::patch_auto_bridge_hf_config`` (as stored in the public index):
    on the bridge's HF config, its ``config`` and ``text_config``, copy ``rope_parameters["rope_theta"]``
    to ``rope_theta`` where that attribute is missing. (Gemma 4's ``rope_parameters`` are per layer type,
    with no top-level ``rope_theta``: nothing is copied.)"""
    hf_pretrained = getattr(bridge, "hf_pretrained", None)
    configs: list[Any] = []
    for config in (hf_pretrained, getattr(hf_pretrained, "config", None)):
        for candidate in (config, getattr(config, "text_config", None)):
            if candidate is not None and all(candidate is not seen for seen in configs):
                configs.append(candidate)
    for config in configs:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        if isinstance(rope, dict) and "rope_theta" in rope and not hasattr(config, "rope_theta"):
            config.rope_theta = rope["rope_theta"]
    return bridge


@contextlib.contextmanager
def patch_megatron_model(model: list[torch.nn.Module]) -> Iterator[None]:
    """vime's ``patch_megatron_model``: give the first chunk's config ``share_embeddings_and_output_weights``
    (from the model) while Megatron-Bridge runs, if it lacks it; removed afterwards."""
    from megatron.core.utils import unwrap_model

    chunk = unwrap_model(model)[0]
    added = not hasattr(chunk.config, "share_embeddings_and_output_weights")
    if added:
        chunk.config.share_embeddings_and_output_weights = chunk.share_embeddings_and_output_weights
    try:
        yield
    finally:
        if added:
            delattr(chunk.config, "share_embeddings_and_output_weights")


#: vime's LoRA target translation (``lora_utils.py`` @00ca8b39 ``_MEGATRON_TO_HF_MODULES``).
MEGATRON_TO_HF_MODULES = {
    "linear_qkv": ["q_proj", "k_proj", "v_proj"],
    "linear_proj": ["o_proj"],
    "linear_fc1": ["gate_proj", "up_proj"],
    "linear_fc2": ["down_proj"],
}


def save_lora_adapter_for_vllm(bridge: Any, model: list, targets: list[str], rank: int, alpha: int, out: Path) -> None:
    """vime's ``save_lora_adapter_for_vllm`` (``lora_utils.py`` @00ca8b39): every rank unpacks three fields
    from ``bridge.export_adapter_weights(model, cpu=False, show_progress=False)``; rank 0 writes
    ``adapter_model.bin`` (``torch.save``), ``adapter_config.json`` (``build_peft_lora_config``: the Megatron
    targets turned into HF module names) and a ``STABLE`` marker."""
    import torch.distributed as dist

    state: dict[str, torch.Tensor] = {}
    with patch_megatron_model(model):
        for hf_name, weight, _megatron_name in bridge.export_adapter_weights(model, cpu=False, show_progress=False):
            state[hf_name] = weight.detach().clone().contiguous().cpu()
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "adapter_model.bin")
        modules = [hf for target in targets for hf in MEGATRON_TO_HF_MODULES.get(target, [target])]
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha}
        config |= {"lora_dropout": 0.0, "bias": "none", "target_modules": list(dict.fromkeys(modules))}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        (out / "STABLE").touch()
    dist.barrier()
