"""The live weight-export path of RL training (vime ``--megatron-to-hf-mode bridge``), and its check.

During training the Megatron actor pushes its weights to vLLM after every step, streaming
HF-named tensors out of Megatron-Bridge's export. This module is that stream for Gemma 4:

* :func:`iter_hf_weights` yields ``(hf_name, tensor, megatron_name)`` for the language model only
  — the tuple vime's bridge weight iterator unpacks — whichever tuple shape the installed
  Megatron-Bridge build yields (0.6.2 yields ``(hf_name, tensor)``; vime's build adds the Megatron
  name). Names, shapes and dtypes are those of the HF checkpoint: stacked experts, no ``v_proj`` on
  k_eq_v layers, no ``lm_head`` (tied), no vision/audio tensors — the layout vLLM's Gemma 4 loader
  takes.
  ``expert_layout="per-expert"`` yields each routed expert on its own as it is gathered (vLLM's
  per-expert names), ``quantize="fp8"`` the block-FP8 layout (:mod:`vime_gemma4_bridge.convert.fp8`).
* :func:`chunk_by_bytes` groups the stream into chunks below N bytes (a tensor of N or more stands
  alone), like vime's ``chunk_named_params_by_size``. Peak extra memory is one chunk plus what
  Megatron-Bridge holds to stack one layer's experts (per expert: one expert).
* :func:`export_live_job` (``vime-gemma4 export-live``, :mod:`vime_gemma4_bridge.cli.live`) drives it
  at a topology and writes each chunk as one safetensors file, the way vime's disk transport does;
  :func:`vime_gemma4_bridge.verify.update.verify_update` checks such a directory against the HF
  checkpoint, bitwise and by fingerprint, naming every mismatch.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.compat.gather_to_one import receives_export
from vime_gemma4_bridge.convert.fp8 import check_quantize, config_fields, quantize_stream, vllm_block_misfits
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.hf_layout import PER_EXPERT, STACKED, check_expert_layout, stack_of
from vime_gemma4_bridge.io import hf as hf_io
from vime_gemma4_bridge.io import hf_write
from vime_gemma4_bridge.io.commit import atomic_directory
from vime_gemma4_bridge.runtime.memory import release_freed_memory

__all__ = ["NamedWeight", "chunk_by_bytes", "export_live_job", "iter_hf_weights", "megatron_names_by_hf_name"]

NamedWeight = tuple[str, torch.Tensor, str]


def megatron_names_by_hf_name(conversion_tasks: Iterable[Any]) -> dict[str, str]:
    """HF tensor name → the Megatron parameter it comes from (per-expert suffix dropped for stacks)."""
    names: dict[str, str] = {}
    for task in conversion_tasks:
        if task is None:
            continue
        hf = task.mapping.hf_param
        megatron = task.global_param_name
        if getattr(task.mapping, "is_grouped_export", False):
            megatron = re.sub(r"(weight|bias)\d+$", r"\1", megatron)
        for hf_name in hf.values() if isinstance(hf, dict) else (hf,):
            names.setdefault(hf_name, megatron)
    return names


def megatron_name_of(names: dict[str, str], hf_name: str) -> str:
    """The Megatron parameter of ``hf_name``; a per-expert name's is its expert's (``linear_fc1.weight<e>``)."""
    if hf_name in names:
        return names[hf_name]
    stack, expert, _ = stack_of(hf_name) or (hf_name, None, None)
    if expert is None or stack not in names:
        raise KeyError(f"{hf_name}: no conversion task exports it")
    return f"{names[stack]}{expert}"


def iter_hf_weights(
    bridge: Any,
    model: list[torch.nn.Module],
    *,
    cpu: bool = False,
    conversion_tasks: list | None = None,
    expert_layout: str = STACKED,
    quantize: str | None = None,
) -> Iterator[NamedWeight]:
    """Stream ``(hf_name, tensor, megatron_name)`` of the language model; collective over all ranks.

    With ``conversion_tasks`` the caller's weights are the only ones read (vime's sleeping actor,
    core/tied.py); without, the tasks are the bridge's and the tied copies are checked first.
    ``expert_layout="per-expert"`` yields each routed expert's gate/up/down on its own, as soon as
    it is gathered (the bridge's hook, :func:`~vime_gemma4_bridge.core.expert_layout.in_expert_layout`, set
    around each step of the bridge's export and nowhere else). ``quantize="fp8"`` yields the
    block-FP8 layout (:mod:`vime_gemma4_bridge.convert.fp8`) and implies the per-expert layout.
    """
    if check_quantize(quantize) == "fp8":
        expert_layout = PER_EXPERT
    check_expert_layout(expert_layout)  # before any collective
    if conversion_tasks is None:
        from vime_gemma4_bridge.core.tied import check_tied_embeddings

        check_tied_embeddings(model)
    tasks = conversion_tasks if conversion_tasks is not None else bridge.get_conversion_tasks(model)
    stream = _exported(bridge, model, cpu, tasks, expert_layout)
    yield from quantize_stream(stream) if quantize == "fp8" else stream


def _exported(bridge: Any, model: list, cpu: bool, tasks: list, expert_layout: str) -> Iterator[NamedWeight]:
    """The bridge's export, in ``expert_layout``, each name once, with its Megatron name."""
    from vime_gemma4_bridge.core.expert_layout import in_expert_layout

    megatron_names = megatron_names_by_hf_name(tasks)
    exported = bridge.export_hf_weights(model, cpu=cpu, conversion_tasks=tasks, show_progress=False)
    seen: set[str] = set()
    for item in in_expert_layout(expert_layout, exported):
        hf_name, tensor = item[0], item[1]
        megatron_name = item[2] if len(item) > 2 else megatron_name_of(megatron_names, hf_name)
        if hf_name in seen:
            raise ValueError(f"live export produced {hf_name!r} twice")
        seen.add(hf_name)
        yield hf_name, tensor, megatron_name
        del item, tensor  # not held while the next one is made


def chunk_by_bytes(weights: Iterable[NamedWeight], max_bytes: int) -> Iterator[list[NamedWeight]]:
    """Group a stream into chunks below ``max_bytes``; a tensor that reaches it alone is a chunk alone.

    vime's rule (``chunk_named_params_by_size``): a chunk is closed when adding the next tensor would
    bring it to ``max_bytes`` or more.
    """
    if max_bytes < 1:
        raise ValueError(f"--buffer-size must be at least 1 byte, got {max_bytes}")
    chunk: list[NamedWeight] = []
    size = 0
    for item in weights:
        nbytes = item[1].numel() * item[1].element_size()
        if chunk and size + nbytes >= max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += nbytes
    if chunk:
        yield chunk


def export_live_job(
    hf_checkpoint: str,
    topology: Topology,
    dump: str,
    buffer_size: int,
    force: bool,
    expert_layout: str = STACKED,
    quantize: str | None = None,
) -> dict:
    """Runs on every rank: load HF at ``topology``, stream the live export, rank 0 writes the chunks.

    ``expert_layout`` and ``quantize`` are :func:`iter_hf_weights`'.

    Each chunk is one safetensors file (the one shard writer, :func:`~vime_gemma4_bridge.io.hf_write.save_safetensors`),
    named ``model-0000i-of-0000N`` once N is known, with an index and the checkpoint's side files; the
    directory is committed atomically (``force`` was checked by the command: an existing ``dump`` is replaced).
    """
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.integrity import verify_sources
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.core.tied import check_tied_embeddings

    init_model_parallel(topology)
    verify_sources(hf_checkpoint)  # the digests it records, before its bytes are used
    with contextlib.redirect_stdout(sys.stderr):  # megatron-core's and the bridge's chatter: stdout is the report's
        bridge = convert.open_bridge(hf_checkpoint)
        model = convert.loaded_model(bridge, topology)
    writer = convert.is_rank0()
    out = Path(dump)
    result: dict[str, Any] | None = None
    try:
        with atomic_directory(out, replace=force) if writer else contextlib.nullcontext() as tmp:
            files: list[tuple[str, list[str], int]] = []
            start = time.perf_counter()
            check_tied_embeddings(model)  # what iter_hf_weights checks when it builds the tasks itself
            with convert.to_rank0(bridge, model) as tasks:  # rank 0 writes: the export gathers to it alone
                stream = iter_hf_weights(
                    bridge,
                    model,
                    cpu=receives_export(),
                    conversion_tasks=tasks,
                    expert_layout=expert_layout,
                    quantize=quantize,
                )
                for index, chunk in enumerate(chunk_by_bytes(stream, buffer_size), start=1):
                    if tmp is None:
                        continue
                    name = f"model-{index:05d}.safetensors"
                    state = [(hf_name, tensor) for hf_name, tensor, _ in chunk]
                    hf_write.save_safetensors(tmp / name, state, metadata={"format": "pt"})
                    files.append((name, [n for n, _ in state], sum(hf_io.tensor_nbytes(t) for _, t in state)))
                    del chunk, state  # written: not held while the next chunk is assembled
                    if files[-1][2] >= convert.RELEASE_AFTER:
                        release_freed_memory()  # what assembling it left in glibc's heaps (runtime/memory.py)
            seconds = time.perf_counter() - start
            if tmp is not None:
                total = len(files)
                weight_map: dict[str, str] = {}
                for index, (name, names, _) in enumerate(files, start=1):
                    final = f"model-{index:05d}-of-{total:05d}.safetensors"
                    (tmp / name).rename(tmp / final)
                    weight_map.update({n: final for n in names})
                source = hf_io.HFCheckpoint(hf_checkpoint)
                for item in source.path.iterdir():  # side files, as vime's disk transport copies them
                    if item.is_file() and not item.name.endswith(".safetensors") and item.name != hf_io.INDEX_NAME:
                        shutil.copy2(item, tmp / item.name)
                if quantize == "fp8":  # the dump is a checkpoint vLLM's FP8 method reads
                    hf_write.update_config(tmp, config_fields(source))
                total_bytes = sum(size for *_, size in files)
                index_data = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
                (tmp / hf_io.INDEX_NAME).write_text(json.dumps(index_data, indent=2) + "\n")
                result = {
                    "dump": str(out),
                    "chunks": total,
                    "tensors": len(weight_map),
                    "bytes": total_bytes,
                    "largest_chunk_bytes": max(size for *_, size in files),
                    "chunk_tensor_counts": [len(names) for _, names, _ in files],
                    "seconds": seconds,
                    "vllm_block_misfits": vllm_block_misfits(source.shapes()) if quantize == "fp8" else [],
                }
    except OSError as error:  # the writer's disk full, read-only file system, ...
        if not writer:
            raise
        raise hf_write.write_failed(out, error) from None
    return convert.broadcast_from_rank0(result)
