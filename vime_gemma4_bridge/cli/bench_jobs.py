"""The bench's rank-side jobs: each step timed inside the ranks, with its exact peak RSS.

Why inside the ranks: rank start-up and the ~10 s import of Megatron-Bridge are not the conversion's
cost, so every figure is taken between barriers around the job function alone (:func:`measured_job`
runs the commands' own job functions, unchanged). Peak RSS is exact: the ranks reset the kernel's
high-water mark (``/proc/self/clear_refs``) before a step and read ``VmHWM`` after it; where that is
not allowed a 5 ms sampling thread stands in (:class:`PeakRSS`). :func:`reference_job` is the physical
limit (a plain safetensors read and write of the same bytes) and :func:`live_job` the live export with
its yardstick, a plain copy. The command and its report are :mod:`vime_gemma4_bridge.cli.bench`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import resource
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.memory import release_garbage

__all__ = ["PeakRSS", "live_job", "measured_job", "reference_job", "silenced"]


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
    release_garbage()


class PeakRSS:
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

    def __enter__(self) -> PeakRSS:
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
def silenced(quiet: bool) -> Iterator[None]:
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


def reference_job(hf_checkpoint: str, out_dir: str) -> dict[str, Any] | None:
    """The physical limit, on rank 0 only: read every tensor with safetensors, write them to a new file set.

    Same shard files as the source, with ``safe_open(...).get_tensor`` and ``save_file`` (the library's
    plain API, one shard in memory at a time). Other ranks return ``None`` at once. It takes a
    fraction of a second, so the bench keeps the best of several runs, as for the conversions.
    """
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vime_gemma4_bridge.io import hf as hf_io

    source = hf_io.HFCheckpoint(hf_checkpoint)
    by_file = source.by_shard(source.names())
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    _release_memory()
    with PeakRSS() as memory:
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
    with PeakRSS() as memory:
        start, cpu = time.perf_counter(), _cpu_seconds()
        with silenced(quiet):
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
    that pushed it), so what remains above the baseline is the export's own working memory. The
    stacked stream (vime's default) is measured first, then the per-expert one and the block-FP8 one
    (``per_expert``, ``fp8``) on the same model.
    """
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.core.hf_layout import PER_EXPERT

    with silenced(quiet):
        init_model_parallel(topology)
        load_start = time.perf_counter()
        bridge = convert.open_bridge(hf_checkpoint)
        model = convert.build_model(bridge, topology)
        bridge.load_hf_weights(model)
        load_seconds = time.perf_counter() - load_start
        stacked = _measured_stream(bridge, model, buffer_size)
        per_expert = _measured_stream(bridge, model, buffer_size, expert_layout=PER_EXPERT)
        fp8 = _measured_stream(bridge, model, buffer_size, quantize="fp8")
        copy = _copy_reference(bridge, model, buffer_size)
    return {**stacked, "copy": copy, "load_seconds": load_seconds, "per_expert": per_expert, "fp8": fp8}


def _measured_stream(bridge: Any, model: Sequence[Any], buffer_size: int, **stream: Any) -> dict[str, Any]:
    """One pass of ``iter_hf_weights(**stream)`` in chunks, each dropped once complete: time and peak extra RSS."""
    import torch.distributed as dist

    from vime_gemma4_bridge.convert.live import chunk_by_bytes, iter_hf_weights

    _release_memory()
    dist.barrier()
    chunks = tensors = nbytes = largest = 0
    with PeakRSS() as memory:
        start, cpu = time.perf_counter(), _cpu_seconds()
        for chunk in chunk_by_bytes(iter_hf_weights(bridge, model, **{"cpu": True, **stream}), buffer_size):
            size = sum(t.numel() * t.element_size() for _, t, _ in chunk)
            chunks, tensors, nbytes, largest = chunks + 1, tensors + len(chunk), nbytes + size, max(largest, size)
            del chunk  # pushed: the consumer lets it go before the next one is assembled
        dist.barrier()
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return {
        "seconds": seconds,
        "cpu": cpu,
        "peak_rss": memory.peak,
        "extra_rss": memory.extra,
        "exact_rss": memory.exact,
        "chunks": chunks,
        "tensors": tensors,
        "bytes": nbytes,
        "largest_chunk": largest,
    }


def _copy_reference(bridge: Any, model: Sequence[Any], buffer_size: int, **stream: Any) -> dict[str, Any]:
    """The live export's memory-speed yardstick: ``torch.clone`` of each tensor it yields, timed alone.

    A second pass of the same stream (``stream``: :func:`iter_hf_weights`' options); only the clones
    are timed (wall and this thread's CPU), each dropped at once. Its peak extra memory is, by
    construction, the largest clone.
    """
    from vime_gemma4_bridge.convert.live import chunk_by_bytes, iter_hf_weights

    _release_memory()
    seconds = cpu = 0.0
    largest = 0
    for chunk in chunk_by_bytes(iter_hf_weights(bridge, model, **{"cpu": True, **stream}), buffer_size):
        for _, tensor, _ in chunk:
            start, thread_cpu = time.perf_counter(), time.thread_time()
            copied = tensor.clone()
            seconds, cpu = seconds + time.perf_counter() - start, cpu + time.thread_time() - thread_cpu
            largest = max(largest, copied.numel() * copied.element_size())
            del copied
        del chunk
    return {"seconds": seconds, "cpu": cpu, "peak_rss": _rss_bytes(), "extra_rss": largest}


def shard_memory_job(
    hf_checkpoint: str,
    topology: Topology,
    output: str | None,
    buffer_size: int | None = None,
    repeats: int = 1,
    quiet: bool = True,
) -> dict[str, Any]:
    """Memory at the shard (every rank): peak RSS while the model is built and loaded at ``topology`` (as
    ``roundtrip``, ``export-live`` and vime's HF ``--load`` road do), this rank's shard bytes (its
    parameters) and its RSS before; with ``output``, then the peak during ``roundtrip --output`` there
    (the export compared on rank 0 as it streams, and written to ``output``) and whether it was bitwise
    identical; with ``buffer_size``, then ``export-live``'s stream there (:func:`_one_consumer_live`, the
    fastest of ``repeats``).
    """
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io import hf as hf_io
    from vime_gemma4_bridge.verify.roundtrip import roundtrip_on_rank0

    with silenced(quiet):
        init_model_parallel(topology)
        _release_memory()
        with PeakRSS() as load:
            bridge = convert.open_bridge(hf_checkpoint)
            model = convert.loaded_model(bridge, topology)
        shard = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
        result: dict[str, Any] = {"start_rss": load.baseline, "load_peak": load.peak, "shard_bytes": shard}
        if output is not None:
            with PeakRSS() as check:
                source = hf_io.HFCheckpoint(hf_checkpoint)
                comparison, written = roundtrip_on_rank0(bridge, model, source, topology, output, force=True)
            identical = comparison is None or (comparison.identical and written is not None)
            result |= {"roundtrip_peak": check.peak, "identical": identical}
        if buffer_size is not None:
            runs = [_one_consumer_live(bridge, model, buffer_size) for _ in range(repeats)]
            result |= {key: min(run[key] for run in runs) for key in runs[0]}
    return result


def _one_consumer_live(bridge: Any, model: Sequence[Any], buffer_size: int) -> dict[str, Any]:
    """``export-live``'s stream on these ranks (the tied check, then the export delivered to rank 0 in
    chunks of ``buffer_size``, not written): its wall time, and rank 0's time to clone the same bytes
    (:func:`_copy_reference`, a second pass), as ``live_seconds`` / ``copy_seconds``."""
    from vime_gemma4_bridge.compat.gather_to_one import receives_export
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.core.tied import check_tied_embeddings

    with convert.to_rank0(bridge, model) as tasks:
        start = time.perf_counter()
        check_tied_embeddings(model)  # what export-live runs before its stream
        tied = time.perf_counter() - start
        live = _measured_stream(bridge, model, buffer_size, conversion_tasks=tasks, cpu=receives_export())
    with convert.to_rank0(bridge, model) as tasks:
        copy = _copy_reference(bridge, model, buffer_size, conversion_tasks=tasks, cpu=receives_export())
    return {"live_seconds": tied + live["seconds"], "live_bytes": live["bytes"], "copy_seconds": copy["seconds"]}


#: rollout-check's default prompts: 4 of 8 tokens, 12 tokens served each (``verify/rollout.rollout_check``).
ROLLOUT_CHECK_SHAPE = (4, 8 + 12)


def rollout_scoring_job(hf_checkpoint: str, quiet: bool = True) -> dict[str, Any]:
    """``rollout-check``'s transformers side (one forward over its default prompts plus served tokens, a
    decoder layer in memory at a time) on ``hf_checkpoint``, in bf16: this process's peak RSS over it, and
    the parts of the bound (the embedding, the two largest decoder layers, in checkpoint bytes)."""
    import math
    import re

    import torch

    from vime_gemma4_bridge.io.hf import TORCH_DTYPES, HFCheckpoint
    from vime_gemma4_bridge.verify.parity import excluded_token_ids, fixed_token_ids, hf_logits

    source = HFCheckpoint(hf_checkpoint)
    sizes = {
        name: math.prod(shape) * TORCH_DTYPES[dtype].itemsize
        for name, (shape, dtype) in source.signatures(source.language_model_names()).items()
    }
    layers: dict[int, int] = {}
    for name, nbytes in sizes.items():
        if match := re.search(r"\.layers\.(\d+)\.", name):
            layers[int(match[1])] = layers.get(int(match[1]), 0) + nbytes
    embedding = sum(nbytes for name, nbytes in sizes.items() if name.endswith("embed_tokens.weight"))
    text = source.config.get("text_config", source.config)
    ids = fixed_token_ids(text["vocab_size"], *ROLLOUT_CHECK_SHAPE, excluded_token_ids(source.config))
    with silenced(quiet):
        _release_memory()
        with PeakRSS() as scoring:
            hf_logits(hf_checkpoint, ids, torch.bfloat16, layer_by_layer=True)
    return {
        "start_rss": scoring.baseline,
        "peak": scoring.peak,
        "embedding": embedding,
        "two_layers": sum(sorted(layers.values())[-2:]),
    }
