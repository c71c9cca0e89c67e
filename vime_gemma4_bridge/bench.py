"""``vime-gemma4 bench``: conversion speed and memory, measured against the physical limit.

Why this exists: a conversion that is bitwise right can still be too slow or too hungry for a 52 GB
checkpoint (gemma-4-26B-A4B). The honest yardstick is what the machine can do at all with the same
bytes: a plain safetensors read of every tensor plus a write of them to a new file set (the
*reference*). The bench measures, in one run and on one synthetic checkpoint:

(a) the reference, in one rank process: ``safetensors.safe_open`` / ``get_tensor`` for every tensor,
    then ``safetensors.torch.save_file`` into the same shard layout (best of 3 runs);
(b) ``import`` HF → torch_dist (:func:`vime_gemma4_bridge.torch_dist.import_job`, unchanged) at EP = nproc;
(c) ``export`` torch_dist → HF (:func:`vime_gemma4_bridge.torch_dist.export_job`, unchanged) at the default
    topology, as ``vime-gemma4 export`` runs without topology flags: the routed experts stream from the
    torch_dist files to the HF shards (:mod:`vime_gemma4_bridge.stream_export`), rank 0 writes;
(d) the live export of RL training (:func:`vime_gemma4_bridge.live.iter_hf_weights` grouped by
    :func:`vime_gemma4_bridge.live.chunk_by_bytes`, as ``export-live`` does but without writing the
    chunks: each chunk is dropped once complete, like a consumer that pushed it), on the loaded model;

each with wall time, CPU time (all ranks; wall time is noisy on shared cores), GB/s (tensor bytes of
the checkpoint / wall time) and peak RSS, for every ``--nproc``. One
:class:`~vime_gemma4_bridge.distributed.LocalWorld` per ``--nproc`` runs (a)-(d), so rank start-up and
the ~10 s import of Megatron-Bridge are *excluded*: every figure is timed inside the ranks, between
barriers, around the job function alone (megatron-core's torch_dist writer helper process, started once
per rank process, is started before any timing too: :func:`writer_startup_job`). The conversion
figures include everything the job does (parallel state, building the model, reading, resharding,
writing); the live figure excludes building and loading the model (that happens once per training
run, not once per weight update).

Peak RSS is exact: the ranks reset the kernel's high-water mark (``/proc/self/clear_refs``) before a
step and read ``VmHWM`` after it; where that is not allowed a 5 ms sampling thread stands in. "Extra"
is the peak over the RSS at the step's start. All files are in the page cache (the checkpoint has
just been written) and nothing is fsync'ed, for the reference as for the conversions, so the limit
measured is memory bandwidth and the safetensors/Python overheads, not the disk.

The synthetic checkpoint is a Gemma 4 VL MoE checkpoint with 26B-A4B's proportions (128 experts,
top-8, expert width hidden/4, dense MLP 3·hidden/4, one full-attention layer in six, experts ~90% of
the bytes, the embedding ~3%), written straight from a meta-device transformers model (exact names,
shapes and config; random values), because the tiny factory's distinctness checks would dominate at
hundreds of MB. It has no tokenizer: conversion never reads one. Doubling the size (``--scaling``)
doubles the layers and the vocabulary, keeping every tensor shape but the embedding's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import json
import logging
import math
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.world import LocalWorld
from vime_gemma4_bridge.testing.tiny import TinySpec
from vime_gemma4_bridge.testing.tokenizer import MIN_VOCAB_SIZE

__all__ = [
    "BenchResult",
    "Step",
    "add_parser",
    "format_report",
    "layer_experts_bytes",
    "live_job",
    "main",
    "measured_job",
    "reference_job",
    "run_bench",
    "spec_for_size",
    "write_synthetic_checkpoint",
    "writer_startup_job",
]

#: Targets of the performance issue; reported, never asserted.
TARGET_CONVERSION_VS_REFERENCE = 1.5
TARGET_DOUBLING_RATIO = 2.2
TARGET_LIVE_VS_COPY = 3.0
#: import / export peak extra RSS at ``--quick``: at most this plus one layer's stacked experts.
TARGET_PEAK_EXTRA_BASE = 1536 * 10**6
#: import / export peak extra RSS at twice the bytes (``--scaling``), over the first size's.
TARGET_PEAK_DOUBLING = 1.2
#: ``--quick``: one size at one rank, under two minutes on 2 cores. Big enough that the fixed costs
#: of a conversion (parallel state, building the model, planning: ~0.5 s) do not swamp a reference
#: that is one pass over page-cached bytes (0.4-1 s/GB here); 26B-A4B is 52 GB.
QUICK_SIZE_GB = 3.0
QUICK_NPROC = (1,)
DEFAULT_SIZE_GB = 3.0
DEFAULT_NPROC = (1, 2, 4)
#: 26B-A4B's hidden size: the synthetic model uses it when the size allows :data:`MIN_LAYERS` layers.
FULL_HIDDEN = 2816
MIN_LAYERS = 2
_STEPS = ("reference", "import", "export", "live", "copy")


# --------------------------------------------------------------------------------------------
# The synthetic checkpoint
# --------------------------------------------------------------------------------------------


def spec_for_size(size_bytes: int, *, layers: int | None = None, hidden: int | None = None) -> TinySpec:
    """A 26B-A4B-shaped MoE spec of about ``size_bytes`` (bf16).

    Per layer 26B-A4B holds ~94% of its bytes in the 128 stacked experts (width hidden/4), a dense
    MLP of width 3·hidden/4 and small attention; the embedding is ~3% of the model. With ``hidden``
    fixed, bytes grow linearly in the layer count (the vocabulary grows with it, keeping the
    embedding's share), so the layer count is solved for. ``hidden`` defaults to 26B-A4B's own
    (2816) or, for smaller sizes, the largest multiple of 64 that still gives :data:`MIN_LAYERS`
    layers: per-tensor sizes then stay realistic (a 26B expert weight is 4 MB; per-tensor costs of
    a converter would otherwise dominate a small benchmark and say nothing about the real model).
    ``layers`` overrides the solve (used to double a size).
    """
    if size_bytes <= 0:
        raise ValueError(f"size must be positive, got {size_bytes} bytes")
    if hidden is None:
        # ~200·hidden² bytes per layer (experts 192·h², dense MLP 4.5·h², attention the rest).
        fitting = 64 * math.floor(math.sqrt(size_bytes / (MIN_LAYERS * 200)) / 64)
        hidden = max(128, min(FULL_HIDDEN, fitting))
    if layers is None:
        # Six layers are one period of the sliding/full pattern, so bytes(6·k) is exactly linear in k.
        six, twelve = _spec_bytes(_shaped_spec(hidden, 6)), _spec_bytes(_shaped_spec(hidden, 12))
        per_layer = (twelve - six) / 6
        # At least 2 layers: a model without sliding layers makes transformers warn about unused RoPE keys.
        layers = max(2, round((size_bytes - (six - 6 * per_layer)) / per_layer))
    return _shaped_spec(hidden, layers)


def _shaped_spec(hidden: int, layers: int) -> TinySpec:
    """26B-A4B's proportions at ``hidden``: 16 heads of ~3·hidden/32, 8 KV heads, 2 global KV heads of twice the dim."""
    head_dim = max(8, 4 * round(3 * hidden / 32 / 4))
    # One full-attention layer in six, the last one full (transformers forces it), as in 26B-A4B.
    layer_types = tuple("full" if (layers - 1 - i) % 6 == 0 else "sliding" for i in range(layers))
    return TinySpec(
        layers=layers,
        layer_types=layer_types,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 4,
        moe_intermediate_size=hidden // 4,
        experts=128,
        top_k=8,
        heads=16,
        kv_heads=8,
        global_kv_heads=2,
        head_dim=head_dim,
        global_head_dim=2 * head_dim,
        attention_k_eq_v=True,
        sliding_window=128,
        # 3·layers·hidden rows keep the embedding at ~3% of the bytes; +5 keeps it off a multiple of 128.
        vocab_size=max(MIN_VOCAB_SIZE, 3 * layers * hidden + 5),
        dtype="bfloat16",
        moe=True,
        causal_lm=False,
    )


def _meta_tensors(spec: TinySpec) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(name, shape, dtype)`` of every tensor ``save_pretrained`` would write for ``spec`` (tied aliases dropped)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    cls = Gemma4ForCausalLM if spec.causal_lm else Gemma4ForConditionalGeneration
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = cls(spec.hf_config())
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    out = []
    for name, tensor in model.state_dict().items():
        if name in tied:
            continue
        dtype = spec.torch_dtype if tensor.is_floating_point() else tensor.dtype
        out.append((name, tuple(tensor.shape), dtype))
    return out


def _spec_bytes(spec: TinySpec) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in _meta_tensors(spec))


def layer_experts_bytes(hf_checkpoint: str | os.PathLike) -> int:
    """Bytes of one layer's stacked experts (``gate_up_proj`` + ``down_proj`` of layer 0), from the file headers."""
    from safetensors import safe_open

    from vime_gemma4_bridge import hf_io

    source = hf_io.HFCheckpoint(hf_checkpoint)
    total = 0
    for suffix in ("gate_up_proj", "down_proj"):
        name = f"{source.prefix}layers.0.experts.{suffix}"
        with safe_open(source.path / source.weight_map[name], framework="pt") as handle:
            piece = handle.get_slice(name)
            total += math.prod(piece.get_shape()) * hf_io.DTYPE_BYTES[piece.get_dtype()]
    return total


def write_synthetic_checkpoint(
    out: str | os.PathLike, spec: TinySpec, *, shards: int = 4, seed: int = 0
) -> tuple[Path, int]:
    """Write a loadable Gemma 4 HF checkpoint for ``spec`` with random values; return (path, tensor bytes).

    Names, shapes and ``config.json`` are transformers' own (a meta-device model of ``spec``, tied
    ``lm_head`` dropped as ``save_pretrained`` does). Tensors are drawn one at a time and written in
    about ``shards`` safetensors files with an index, like a published checkpoint, so memory stays at
    one shard. Norm weights are drawn near one and ``layer_scalar`` positive, so the model is sane.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from vime_gemma4_bridge import hf_io

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tensors = _meta_tensors(spec)
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in tensors)
    shard_limit = max(1, math.ceil(total / max(1, shards)))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    files: list[list[str]] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if pending:
            save_file(pending, out / f".shard-{len(files)}", metadata={"format": "pt"})
            files.append(list(pending))
            pending, pending_bytes = {}, 0

    for name, shape, dtype in tensors:
        if name.endswith("layer_scalar"):
            value = 0.5 + torch.rand(shape, generator=gen)
        elif len(shape) <= 1:
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            value = torch.randn(shape, generator=gen, dtype=dtype) * (shape[-1] ** -0.5)
        nbytes = value.numel() * dtype.itemsize
        if pending and pending_bytes + nbytes > shard_limit:
            flush()
        pending[name] = value.to(dtype)
        pending_bytes += nbytes
    flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (out / f".shard-{i - 1}").rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / hf_io.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    config = spec.hf_config()
    config.dtype = spec.torch_dtype
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(out)
    return out, total


# --------------------------------------------------------------------------------------------
# Memory: exact peak RSS per step, inside the ranks
# --------------------------------------------------------------------------------------------


def _status_kb(field_name: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")


def _rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def _cpu_seconds() -> float:
    """User + system CPU time of this process, all threads: robust to other jobs sharing the cores, unlike wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _release_memory() -> None:
    """Free what the previous step left (garbage, glibc's cached arenas) so each step starts from its own baseline.

    And write the page cache's dirty pages to disk: a step that follows gigabytes of writes (the
    reference's repeats, an import before the export) would otherwise be throttled by the kernel
    to the disk's speed while it flushes the previous step's bytes (dirty_ratio), and measure that.
    """
    os.sync()
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _PeakRSS:
    """Peak resident memory of this process over a ``with`` block, and the RSS at its start.

    Exact where the kernel lets a process reset its high-water mark (writing ``5`` to
    ``/proc/self/clear_refs``, Linux ≥ 4.0): ``VmHWM`` after the block is then the block's peak.
    Otherwise a thread samples ``VmRSS`` every 5 ms (short spikes may be missed; ``exact`` says which).
    """

    def __init__(self) -> None:
        self.baseline = 0
        self.peak = 0
        self.exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _PeakRSS:
        self.baseline = _rss_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
            self.exact = True
        except OSError:
            self.peak = self.baseline
            self._thread = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: object) -> None:
        if self.exact:
            self.peak = _status_kb("VmHWM") * 1024
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak = max(self.peak, _rss_bytes())

    @property
    def extra(self) -> int:
        """Peak over the RSS at the start of the block."""
        return max(0, self.peak - self.baseline)


@contextlib.contextmanager
def _silenced(quiet: bool) -> Iterator[None]:
    """Drop the jobs' progress lines (torch_dist's phases, Megatron-Bridge's progress bar) unless verbose."""
    if not quiet:
        yield
        return
    sink = io.StringIO()
    logging.disable(logging.WARNING)  # Megatron's deprecation warnings, once per model build
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logging.disable(logging.NOTSET)


# --------------------------------------------------------------------------------------------
# Rank-side jobs
# --------------------------------------------------------------------------------------------


def reference_job(hf_checkpoint: str, out_dir: str, repeats: int = 3) -> dict[str, Any] | None:
    """The physical limit, on rank 0 only: read every tensor with safetensors, write them to a new file set.

    Same shard files as the source, with ``safe_open(...).get_tensor`` and ``save_file`` (the library's
    plain API, one shard in memory at a time). It takes a fraction of a second, so one hiccup of a
    shared host would swing every ratio: the best of ``repeats`` runs is kept (the limit is what the
    machine *can* do; keeping the best only makes the conversions' ratios larger). Other ranks return
    ``None`` at once.
    """
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    runs = [_reference_once(hf_checkpoint, out_dir) for _ in range(max(1, repeats))]
    return min(runs, key=lambda run: run["seconds"])


def _reference_once(hf_checkpoint: str, out_dir: str) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vime_gemma4_bridge import hf_io

    source = hf_io.HFCheckpoint(hf_checkpoint)
    by_file: dict[str, list[str]] = {}
    for name, file in source.weight_map.items():
        by_file.setdefault(file, []).append(name)
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    _release_memory()
    with _PeakRSS() as memory:
        start, cpu = time.perf_counter(), _cpu_seconds()
        out.mkdir(parents=True)
        nbytes = 0
        for file, names in by_file.items():
            with safe_open(source.path / file, framework="pt") as handle:
                tensors = {name: handle.get_tensor(name) for name in names}
            save_file(tensors, out / file, metadata={"format": "pt"})
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        shutil.copy2(source.path / hf_io.INDEX_NAME, out / hf_io.INDEX_NAME)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return {"seconds": seconds, "cpu": cpu, "bytes": nbytes, "peak_rss": memory.peak, "extra_rss": memory.extra}


def measured_job(fn: Callable[..., Any], args: Sequence[Any], quiet: bool = True) -> dict[str, Any]:
    """Run a conversion job function (every rank) between barriers; its wall time, peak RSS, and result.

    Wall time runs from the first barrier to the barrier after the job on the slowest rank, so it is
    the conversion's, with rank start-up and imports excluded.
    """
    import torch.distributed as dist

    _release_memory()
    dist.barrier()
    with _PeakRSS() as memory:
        start, cpu = time.perf_counter(), _cpu_seconds()
        with _silenced(quiet):
            result = fn(*args)
        dist.barrier()
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return {
        "seconds": seconds,
        "cpu": cpu,
        "peak_rss": memory.peak,
        "extra_rss": memory.extra,
        "exact_rss": memory.exact,
        "result": result if dist.get_rank() == 0 else None,
    }


def live_job(hf_checkpoint: str, topology: Topology, buffer_size: int, quiet: bool = True) -> dict[str, Any]:
    """The live export on a loaded model (every rank): stream time, and peak RSS over the loaded model.

    Build and load are done first and not timed; then memory is released, the baseline taken, and
    ``chunk_by_bytes(iter_hf_weights(...))`` consumed: each chunk is dropped once complete (a consumer
    that pushed it), so what remains above the baseline is the export's own working memory.
    """
    import torch.distributed as dist

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.live import chunk_by_bytes, iter_hf_weights

    with _silenced(quiet):
        init_model_parallel(topology)
        load_start = time.perf_counter()
        bridge = convert.open_bridge(hf_checkpoint)
        model = convert.build_model(bridge, topology)
        bridge.load_hf_weights(model)
        load_seconds = time.perf_counter() - load_start
        _release_memory()
        dist.barrier()
        chunks = tensors = nbytes = largest = 0
        with _PeakRSS() as memory:
            start, cpu = time.perf_counter(), _cpu_seconds()
            for chunk in chunk_by_bytes(iter_hf_weights(bridge, model, cpu=True), buffer_size):
                size = sum(t.numel() * t.element_size() for _, t, _ in chunk)
                chunks, tensors, nbytes, largest = chunks + 1, tensors + len(chunk), nbytes + size, max(largest, size)
                del chunk  # pushed: the consumer lets it go before the next one is assembled
            dist.barrier()
            seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        copy = _copy_reference(bridge, model, buffer_size)
    return {
        "seconds": seconds,
        "cpu": cpu,
        "copy": copy,
        "load_seconds": load_seconds,
        "peak_rss": memory.peak,
        "extra_rss": memory.extra,
        "exact_rss": memory.exact,
        "chunks": chunks,
        "tensors": tensors,
        "bytes": nbytes,
        "largest_chunk": largest,
    }


def _copy_reference(bridge: Any, model: Sequence[Any], buffer_size: int) -> dict[str, Any]:
    """The live export's memory-speed yardstick: ``torch.clone`` of each tensor it yields, timed alone.

    A second pass of the same stream; only the clones are timed (wall and this thread's CPU), each
    dropped at once. Its peak extra memory is, by construction, the largest clone.
    """
    from vime_gemma4_bridge.live import chunk_by_bytes, iter_hf_weights

    _release_memory()
    seconds = cpu = 0.0
    largest = 0
    for chunk in chunk_by_bytes(iter_hf_weights(bridge, model, cpu=True), buffer_size):
        for _, tensor, _ in chunk:
            start, thread_cpu = time.perf_counter(), time.thread_time()
            copied = tensor.clone()
            seconds, cpu = seconds + time.perf_counter() - start, cpu + time.thread_time() - thread_cpu
            largest = max(largest, copied.numel() * copied.element_size())
            del copied
        del chunk
    return {"seconds": seconds, "cpu": cpu, "peak_rss": _rss_bytes(), "extra_rss": largest}


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def writer_startup_job() -> float:
    """Start megatron-core's torch_dist writer helper process now; return the seconds it took.

    megatron-core's ``FileSystemWriterAsync`` (behind every torch_dist save, synchronous ones too)
    collects write results through a ``multiprocessing.Manager`` queue that it creates, with the
    *spawn* context, the first time a process saves. That is process start-up, paid once per rank
    process by every ``vime-gemma4 import`` run; like rank start-up it is kept out of the conversion
    figures (otherwise only the first size measured in a world would be charged for it) and reported
    on a line of its own.
    """
    start = time.perf_counter()
    try:
        from megatron.core.dist_checkpointing.strategies.filesystem_async import get_write_results_queue
    except ImportError:  # another megatron-core layout: the import step pays it, as the command does
        return 0.0
    with _silenced(True):
        get_write_results_queue()
    return time.perf_counter() - start


@dataclass
class Step:
    """One measured step at one size and world size."""

    step: str
    size_bytes: int
    nproc: int
    topology: str
    seconds: float  # wall time, slowest rank
    cpu: float  # CPU seconds, all ranks together
    peak_rss: int  # max over ranks
    extra_rss: int  # max over ranks of (peak - RSS at the step's start)
    phases: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def gb_per_s(self) -> float:
        """Checkpoint tensor bytes per wall second (decimal GB)."""
        return self.size_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class BenchResult:
    """Everything one bench run measured, and the headline figures derived from it."""

    sizes: list[int]  # tensor bytes of each synthetic checkpoint
    specs: list[TinySpec]
    nprocs: list[int]
    buffer_size: int
    layer_experts: int
    steps: list[Step]
    generate_seconds: list[float]
    writer_startup: dict[int, float] = field(default_factory=dict)  # nproc -> seconds (slowest rank)

    def find(self, step: str, size: int, nproc: int) -> Step | None:
        """The measurement of ``step`` at ``size`` bytes and ``nproc`` ranks (the reference: any nproc)."""
        for s in self.steps:
            if s.step == step and s.size_bytes == size and (s.nproc == nproc or step == "reference"):
                return s
        return None

    @property
    def headline_nproc(self) -> int:
        """The world size of the last line's figures: 1 if it was measured, else the smallest."""
        return 1 if 1 in self.nprocs else min(self.nprocs)

    def ratio(self, step: str, size: int | None = None, nproc: int | None = None, *, cpu: bool = False) -> float:
        """``step`` time / reference time at ``size`` (default: the first) and ``nproc`` (default: headline)."""
        size = self.sizes[0] if size is None else size
        nproc = self.headline_nproc if nproc is None else nproc
        measured, reference = self.find(step, size, nproc), self.find("reference", size, nproc)
        if measured is None or reference is None:
            return math.nan
        num, den = (measured.cpu, reference.cpu) if cpu else (measured.seconds, reference.seconds)
        return num / den if den > 0 else math.nan

    def peak_extra(self, step: str, size: int | None = None) -> int:
        """Peak extra RSS of ``step`` at ``size`` (default: the first) and :attr:`headline_nproc`."""
        found = self.find(step, self.sizes[0] if size is None else size, self.headline_nproc)
        return found.extra_rss if found else 0

    def live_vs_copy(self) -> float:
        """Live export wall time over the plain copy of the same weights, at the first size (headline nproc)."""
        live = self.find("live", self.sizes[0], self.headline_nproc)
        copy = self.find("copy", self.sizes[0], self.headline_nproc)
        return live.seconds / copy.seconds if live and copy and copy.seconds > 0 else math.nan

    def peak_doubling(self, step: str) -> float:
        """Peak extra RSS of ``step`` at the second size over the first's (``--scaling``: twice the bytes)."""
        if len(self.sizes) < 2 or not self.peak_extra(step):
            return math.nan
        return self.peak_extra(step, self.sizes[1]) / self.peak_extra(step)

    def doubling(self, step: str, *, cpu: bool = False) -> float:
        """Time at the second size / at the first, at :attr:`headline_nproc` (wall, or CPU with ``cpu``).

        With ``--scaling`` the second size is the first doubled (twice the layers and vocabulary);
        with two ``--size-gb`` values it is the second value, and the report states the byte ratio.
        CPU time is given too because one stall of a shared host can swing a wall-time ratio.
        """
        if len(self.sizes) < 2:
            return math.nan
        a = self.find(step, self.sizes[0], self.headline_nproc)
        b = self.find(step, self.sizes[1], self.headline_nproc)
        if not a or not b:
            return math.nan
        num, den = (b.cpu, a.cpu) if cpu else (b.seconds, a.seconds)
        return num / den if den > 0 else math.nan


def _topology_for(nproc: int) -> Topology:
    """Pure expert parallelism over the world (EP = nproc, dense part replicated): how an MoE is spread first."""
    return Topology(ep=nproc)


def run_bench(
    sizes_gb: Sequence[float],
    nprocs: Sequence[int],
    *,
    buffer_size: int,
    workdir: Path,
    scaling: bool = False,
    quiet: bool = True,
    keep: bool = False,
    world_for: Callable[[int], LocalWorld] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> BenchResult:
    """Write the checkpoint(s), then for each world size run (a)-(d) on every size in one LocalWorld.

    Worlds run one after another (smallest first, ~1 GB RAM per rank), so at most ``max(nprocs)``
    ranks are alive. The reference is measured once per size, in rank 0 of the first world.
    ``world_for(n)`` supplies the worlds instead (e.g. a test session's shared one; not closed here).
    """
    from vime_gemma4_bridge.torch_dist import export_job, import_job

    specs = [spec_for_size(int(gb * 1e9)) for gb in sizes_gb]
    if scaling:
        base = specs[0]
        # Right after the first size: doubling_ratio compares these two.
        specs.insert(1, spec_for_size(int(sizes_gb[0] * 2e9), layers=2 * base.layers, hidden=base.hidden_size))
    workdir.mkdir(parents=True, exist_ok=True)
    sources: list[Path] = []
    sizes: list[int] = []
    generate_seconds: list[float] = []
    for i, spec in enumerate(specs):
        start = time.perf_counter()
        path, nbytes = write_synthetic_checkpoint(workdir / f"hf-{i}", spec, seed=i)
        generate_seconds.append(time.perf_counter() - start)
        sources.append(path)
        sizes.append(nbytes)
        log(
            f"bench: checkpoint {i}: {nbytes / 1e9:.3f} GB, {spec.layers} layers, hidden {spec.hidden_size}, "
            f"{spec.experts} experts of width {spec.moe_intermediate_size}, vocab {spec.vocab_size} "
            f"(written in {generate_seconds[-1]:.1f} s)"
        )
    result = BenchResult(
        sizes, specs, sorted(set(nprocs)), buffer_size, layer_experts_bytes(sources[0]), [], generate_seconds
    )
    for nproc in result.nprocs:
        topology = _topology_for(nproc)
        with contextlib.ExitStack() as stack:
            world = world_for(nproc) if world_for else stack.enter_context(LocalWorld(nproc))
            result.writer_startup[nproc] = max(world.run(writer_startup_job))
            log(
                f"bench: {nproc} rank(s) ready at {topology}; torch_dist writer started in "
                f"{result.writer_startup[nproc]:.1f} s (not counted)"
            )
            for source, nbytes in zip(sources, sizes, strict=True):
                tag = f"{source.name}-n{nproc}"
                if nproc == result.nprocs[0]:
                    ref = world.run(reference_job, str(source), str(workdir / f"ref-{tag}"))[0]
                    result.steps.append(
                        Step(
                            "reference",
                            nbytes,
                            nproc,
                            "1 process",
                            ref["seconds"],
                            ref["cpu"],
                            ref["peak_rss"],
                            ref["extra_rss"],
                        )
                    )
                    _cleanup(workdir / f"ref-{tag}", keep)
                    log(f"bench: {tag} reference {ref['seconds']:.2f} s")
                # First: the conversions after it leave the ranks' heaps fragmented, which would be
                # counted as the live export's memory (vime's actor runs it on a settled process).
                results = world.run(live_job, str(source), topology, buffer_size, quiet)
                live = results[0]
                result.steps.append(
                    _step(
                        "live",
                        nbytes,
                        nproc,
                        topology,
                        results,
                        {"build+load, untimed": round(live["load_seconds"], 3)},
                        f"{live['chunks']} chunks, largest {live['largest_chunk'] / 1e6:.1f} MB, not written",
                    )
                )
                log(f"bench: {tag} live {result.steps[-1].seconds:.2f} s")
                copies = [r["copy"] for r in results]
                result.steps.append(
                    _step("copy", nbytes, nproc, topology, copies, {}, "torch.clone of each tensor live yields")
                )
                log(f"bench: {tag} copy {result.steps[-1].seconds:.2f} s")
                save, output = workdir / f"td-{tag}", workdir / f"out-{tag}"
                partial = workdir / f".td-{tag}.partial"
                for path in (save, output, partial):
                    shutil.rmtree(path, ignore_errors=True)
                results = world.run(measured_job, import_job, (str(source), str(save), str(partial), topology), quiet)
                result.steps.append(_conversion_step("import", nbytes, nproc, topology, results))
                log(f"bench: {tag} import {result.steps[-1].seconds:.2f} s")
                # The export a user runs: default topology (experts streamed, see stream_export.py).
                job_args = (str(save), str(source), str(output), Topology(), True, _max_shard_bytes(source))
                results = world.run(measured_job, export_job, job_args, quiet)
                result.steps.append(_conversion_step("export", nbytes, nproc, Topology(), results))
                log(f"bench: {tag} export {result.steps[-1].seconds:.2f} s")
                _check_output(source, output)
                _cleanup(save, keep)
                _cleanup(output, keep)
    if not keep:
        for source in sources:
            shutil.rmtree(source, ignore_errors=True)
    return result


def _max_shard_bytes(source: Path) -> int:
    """The source's largest shard, so the export writes as many files as the reference does."""
    return max(f.stat().st_size for f in source.glob("*.safetensors"))


def _conversion_step(name: str, nbytes: int, nproc: int, topology: Topology, results: list[dict]) -> Step:
    report = results[0]["result"] or {}
    return _step(name, nbytes, nproc, topology, results, dict(report.get("phases") or {}))


def _step(
    name: str,
    nbytes: int,
    nproc: int,
    topology: Topology,
    results: list[dict],
    phases: dict[str, float],
    note: str = "",
) -> Step:
    """One step from every rank's measurement: slowest wall time, total CPU, largest RSS figures."""
    return Step(
        name,
        nbytes,
        nproc,
        str(topology),
        max(r["seconds"] for r in results),
        sum(r["cpu"] for r in results),
        max(r["peak_rss"] for r in results),
        max(r["extra_rss"] for r in results),
        phases,
        note,
    )


def _check_output(source: Path, output: Path) -> None:
    """The export wrote the source's tensors (names, from the headers); bitwise equality is the tests' job."""
    from vime_gemma4_bridge import hf_io

    if set(hf_io.HFCheckpoint(output).names()) != set(hf_io.HFCheckpoint(source).names()):
        raise RuntimeError(f"export wrote {output} with other tensors than {source}")


def _cleanup(path: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _fmt(value: float, digits: int = 2) -> str:
    return "nan" if math.isnan(value) else f"{value:.{digits}f}"


def format_report(result: BenchResult) -> list[str]:
    """The table, the phase breakdown, the targets, and the machine-readable lines (the headline one last)."""
    lines = [
        "| size GB | nproc | topology | step | wall s | CPU s (all ranks) | GB/s | wall vs reference "
        "| peak RSS GB (max rank) | peak extra MB (max rank) |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for step in result.steps:
        if step.step == "reference":
            ratio = "1.00"
        elif step.step in ("live", "copy"):
            ratio = "—"  # in memory, no files: their yardstick is the copy (live_vs_copy)
        else:
            ratio = _fmt(result.ratio(step.step, step.size_bytes, step.nproc))
        lines.append(
            f"| {step.size_bytes / 1e9:.3f} | {step.nproc} | {step.topology} | {step.step} | {step.seconds:.2f} "
            f"| {step.cpu:.2f} | {step.gb_per_s:.3f} | {ratio} | {step.peak_rss / 1e9:.2f} "
            f"| {step.extra_rss / 1e6:.0f} |"
        )
    lines.append("")
    for step in result.steps:
        if step.phases or step.note:
            phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in step.phases.items())
            note = f"; {step.note}" if step.note else ""
            lines.append(f"phases {step.step} {step.size_bytes / 1e9:.3f} GB nproc {step.nproc}: {phases}{note}")
    startup = ", ".join(f"nproc {n}: {s:.1f} s" for n, s in result.writer_startup.items())
    n = result.headline_nproc
    export, imp, live_vs_copy = result.ratio("export"), result.ratio("import"), result.live_vs_copy()
    live_extra, experts = result.peak_extra("live"), result.layer_experts
    live_limit = result.buffer_size + experts
    lines += [
        f"not counted: rank start-up and imports; torch_dist writer helper start-up ({startup})",
        "",
        f"headline: size {result.sizes[0] / 1e9:.3f} GB, nproc {n}; ratios = conversion wall time / reference wall "
        f"time (CPU-time ratios: export {_fmt(result.ratio('export', cpu=True))}, "
        f"import {_fmt(result.ratio('import', cpu=True))})",
        _target(
            f"export <= {TARGET_CONVERSION_VS_REFERENCE}x reference",
            export <= TARGET_CONVERSION_VS_REFERENCE,
            f"{_fmt(export)}x",
        ),
        _target(
            f"import <= {TARGET_CONVERSION_VS_REFERENCE}x reference",
            imp <= TARGET_CONVERSION_VS_REFERENCE,
            f"{_fmt(imp)}x",
        ),
        _target(
            "live peak extra <= chunk + one layer's experts",
            live_extra <= live_limit,
            f"{live_extra / 1e6:.1f} MB vs {result.buffer_size / 1e6:.1f} + {experts / 1e6:.1f} MB",
        ),
        _target(
            f"live <= {TARGET_LIVE_VS_COPY:g}x a plain copy",
            live_vs_copy <= TARGET_LIVE_VS_COPY,
            f"{_fmt(live_vs_copy)}x",
        ),
    ]
    for step in ("import", "export"):
        extra = result.peak_extra(step)
        lines.append(
            _target(
                f"{step} peak extra <= {TARGET_PEAK_EXTRA_BASE / 1e6:.0f} MB + one layer's experts",
                extra <= TARGET_PEAK_EXTRA_BASE + experts,
                f"{extra / 1e6:.1f} MB vs {TARGET_PEAK_EXTRA_BASE / 1e6:.0f} + {experts / 1e6:.1f} MB",
            )
        )
    if len(result.sizes) > 1:
        doubled = {step: result.doubling(step) for step in _STEPS}
        worst = max(doubled["import"], doubled["export"])
        lines.append(
            _target(
                f"doubling model bytes <= {TARGET_DOUBLING_RATIO}x the time (import, export)",
                worst <= TARGET_DOUBLING_RATIO,
                f"{_fmt(worst)}x at {result.sizes[1] / result.sizes[0]:.3f}x the bytes, nproc {n}",
            )
        )
        peaks = {step: result.peak_doubling(step) for step in ("import", "export")}
        lines.append(
            _target(
                f"peak extra at {result.sizes[1] / result.sizes[0]:.3f}x the bytes <= {TARGET_PEAK_DOUBLING}x "
                "(import, export)",
                max(peaks.values()) <= TARGET_PEAK_DOUBLING,
                ", ".join(f"{step} {_fmt(value)}x" for step, value in peaks.items()),
            )
        )
        by_cpu = {step: result.doubling(step, cpu=True) for step in _STEPS}
        lines.append(
            f"doubling_ratio={_fmt(worst, 3)} "
            + " ".join(f"doubling_ratio_{step}={_fmt(value, 3)}" for step, value in doubled.items())
            + f" doubling_ratio_cpu={_fmt(max(by_cpu['import'], by_cpu['export']), 3)} "
            + " ".join(f"doubling_ratio_cpu_{step}={_fmt(value, 3)}" for step, value in by_cpu.items())
            + " "
            + " ".join(f"peak_doubling_{step}={_fmt(value, 3)}" for step, value in peaks.items())
        )
    lines.append(
        f"export_vs_reference={_fmt(export, 3)} import_vs_reference={_fmt(imp, 3)} "
        f"live_vs_copy={_fmt(live_vs_copy, 3)} live_peak_extra_mb={live_extra / 1e6:.1f} "
        f"layer_experts_mb={experts / 1e6:.1f} import_peak_extra_mb={result.peak_extra('import') / 1e6:.1f} "
        f"export_peak_extra_mb={result.peak_extra('export') / 1e6:.1f}"
    )
    return lines


def _target(what: str, met: bool, figure: str) -> str:
    return f"target {what}: {figure} {'met' if met else 'MISSED'}"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

DESCRIPTION = """\
Measure conversion speed and memory against the physical limit on a synthetic Gemma 4 MoE
checkpoint with 26B-A4B's proportions (experts ~90% of the bytes). For every --nproc, one set of
local ranks runs: (a) the reference, a plain safetensors read of every tensor and a write of them to
new files, in one process; (b) import HF -> torch_dist at EP = nproc (at one rank, the default
topology: routed experts streamed from the HF shards to torch_dist); (c) export torch_dist -> HF at
the default topology (routed experts streamed from torch_dist to the HF shards); (d) the live export
(iter_hf_weights + chunk_by_bytes, chunks not written) on the loaded model; (e) its yardstick, a
plain torch.clone of the same weights. Each is timed inside the ranks (start-up and imports
excluded) with its peak RSS. Prints a table, the targets and, last (nproc 1, the first size):
export_vs_reference=.. import_vs_reference=.. live_vs_copy=.. live_peak_extra_mb=..
layer_experts_mb=.. import_peak_extra_mb=.. export_peak_extra_mb=..
With --scaling, also twice the first size: time and peak-memory doubling ratios. Targets are
reported, not asserted: exit 0 whenever the run completes."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``vime-gemma4 bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="conversion speed and memory vs a plain safetensors read+write, on a synthetic 26B-A4B-shaped MoE",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a small run (~2 min on 2 cores): --size-gb {QUICK_SIZE_GB} --nproc {' '.join(map(str, QUICK_NPROC))} "
        "unless given",
    )
    parser.add_argument(
        "--size-gb",
        type=float,
        nargs="+",
        default=None,
        metavar="S",
        help=f"synthetic checkpoint size(s) in GB (default {DEFAULT_SIZE_GB}); the last line uses the first",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="also run twice the first size (twice the layers and vocabulary) and print doubling_ratio=",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="world sizes to measure, import at EP = N (default 1 2 4; ~1 GB RAM per rank plus the model)",
    )
    parser.add_argument(
        "--buffer-size",
        default="64MB",
        metavar="SIZE",
        help="live export chunk size (vime's --update-weight-buffer-size; default 64MB)",
    )
    parser.add_argument("--workdir", metavar="DIR", help="where checkpoints are written (default: a temporary dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints written under --workdir")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement as JSON to FILE")
    parser.add_argument("--verbose", action="store_true", help="show the jobs' own progress output")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    """``bench``: 2 on bad arguments, else 0 once every step has run (targets are reported, not asserted)."""
    from vime_gemma4_bridge import hf_io

    sizes = args.size_gb or ([QUICK_SIZE_GB] if args.quick else [DEFAULT_SIZE_GB])
    nprocs = args.nproc or list(QUICK_NPROC if args.quick else DEFAULT_NPROC)
    try:
        buffer_size = hf_io.parse_size(args.buffer_size)
        if any(s <= 0 for s in sizes) or any(n < 1 for n in nprocs) or buffer_size < 1:
            raise ValueError("--size-gb, --nproc and --buffer-size must be positive")
        for n in nprocs:
            if 128 % n:
                raise ValueError(f"--nproc {n} must divide the 128 experts (EP = nproc)")
    except ValueError as error:
        print(f"vime-gemma4 bench: error: {error}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vime-gemma4-bench-")))
        result = run_bench(
            sizes,
            nprocs,
            buffer_size=buffer_size,
            workdir=workdir,
            scaling=args.scaling,
            quiet=not args.verbose,
            keep=args.keep and bool(args.workdir),
        )
    lines = format_report(result)
    if args.json:
        data = {
            "sizes": result.sizes,
            "nprocs": result.nprocs,
            "buffer_size": result.buffer_size,
            "layer_experts_bytes": result.layer_experts,
            "steps": [vars(step) | {"gb_per_s": step.gb_per_s} for step in result.steps],
            "headline": lines[-1],
        }
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    print("\n".join(lines), flush=True)
    return 0
