"""The ``import`` / ``export`` jobs: one-shot HF ↔ Megatron torch_dist conversion, run on every rank, at any topology.

``import_job`` loads a Gemma 4 HF checkpoint into the Megatron model at a TP/PP/VPP/EP/ETP topology
(Megatron-Bridge's ``load_hf_weights``) and saves it as a torch_dist checkpoint
(:mod:`vime_gemma4_bridge.io.torch_dist`). ``export_job`` builds the model at any valid topology — not
necessarily the one it was saved at — loads the torch_dist checkpoint into it and writes a complete HF
checkpoint through Megatron-Bridge's ``export_hf_weights`` (config, tokenizer and non-language tensors
copied from ``--hf-checkpoint``). Both run the steps of a conversion path
(:mod:`~vime_gemma4_bridge.convert.paths`): at the default topology the routed experts bypass the
model in both directions (:mod:`~vime_gemma4_bridge.convert.stream_import`,
:mod:`~vime_gemma4_bridge.convert.stream_export`).

Both write into a hidden partial sibling committed only when complete
(:mod:`vime_gemma4_bridge.io.commit`), so an interrupted run never leaves anything at ``DIR`` / ``OUT``;
sources are only read. The commands around them (:mod:`vime_gemma4_bridge.cli.import_export`) refuse
every bad input before ranks start; the bench runs these same functions.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert import integrity
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io import torch_dist
from vime_gemma4_bridge.io.commit import commit_directory
from vime_gemma4_bridge.io.digests import hashing_seconds
from vime_gemma4_bridge.io.torch_dist import (
    ITERATION,
    ITERATION_DIR,
    RUN_CONFIG_NAME,
    SIDECAR_FORMAT,
    SIDECAR_NAME,
    SIDECAR_VERSION,
    TRACKER_NAME,
    ConversionError,
    TorchDistCheckpoint,
)
from vime_gemma4_bridge.io.torch_dist_layout import layout_name
from vime_gemma4_bridge.io.torch_dist_reader import TorchDistReader

__all__ = ["export_job", "import_job"]


class _Phases:
    """Wall time per phase; rank 0 says on stderr what runs (stdout carries only the final report)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, what: str) -> Iterator[None]:
        from vime_gemma4_bridge.convert.model import is_rank0

        if is_rank0():
            print(f"{self.command}: {what} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
        if is_rank0():
            print(f"{self.command}: {what}: done in {self.seconds[name]:.1f} s", file=sys.stderr, flush=True)


def _directory_stats(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def import_job(
    hf_checkpoint: str, save: str, partial: str, topology: Topology, *, replace: bool = True
) -> dict[str, Any]:
    """HF → Megatron at ``topology`` → torch_dist at ``save``. Runs on every rank; returns rank 0's report.

    The checkpoint is written into ``partial`` (rank 0's name wins under torchrun) and committed to
    ``save`` only when complete (:func:`~vime_gemma4_bridge.io.commit.commit_directory`; without
    ``replace`` a ``save`` another run wrote meanwhile is kept); on failure rank 0 removes ``partial``.
    """
    import torch.distributed as dist
    from megatron.core.utils import get_model_config

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert import paths
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io import hf as hf_io

    start = time.perf_counter()
    phases = _Phases("import")
    init_model_parallel(topology)
    work = Path(convert.broadcast_from_rank0(partial))
    out = Path(save)
    rank0 = convert.is_rank0()
    try:
        if rank0:
            work.mkdir(parents=True)  # from the start: a killed run leaves this hidden directory, never DIR
        with contextlib.redirect_stdout(sys.stderr):
            hashed_before = hashing_seconds()
            with phases("verify", f"checking the digests {hf_checkpoint} records, beside the load"):
                checking = integrity.check_beside(hf_checkpoint)
            with phases("build", f"building the Megatron model at {topology}"):
                bridge = convert.open_bridge(hf_checkpoint)
                # Every weight is loaded next, so random init (~3 s/GB) would be wasted; the saved run
                # config still says to initialise, as a model built from it for training must.
                model = convert.build_model(bridge, topology, initialize=False)
                get_model_config(model[0]).perform_initialization = True
                source = hf_io.HFCheckpoint(hf_checkpoint)
                path = paths.import_path(bridge, model, source, topology)
            if rank0:
                (work / ITERATION_DIR).mkdir()
            with path.writing(work / ITERATION_DIR):
                with phases("load_hf", f"loading {hf_checkpoint}{path.how}"):
                    path.load()
                dist.barrier()
                with phases("save", f"saving torch_dist to {out}"):
                    torch_dist.save_torch_dist(model, work / ITERATION_DIR, leave_out=path.leave_out())
            result: dict[str, Any] | None = None
            if rank0:
                signature = source.signatures(source.language_model_names())
                torch_dist.write_run_config(get_model_config(model[0]), work / ITERATION_DIR / RUN_CONFIG_NAME)
                sidecar = {
                    "format": SIDECAR_FORMAT,
                    "version": SIDECAR_VERSION,
                    "iteration": ITERATION,
                    "source": str(Path(hf_checkpoint).resolve()),
                    "saved_at": {"topology": str(topology), **vars(topology), "world_size": dist.get_world_size()},
                    "hf_config": source.config,
                    "language_model": signature,
                }
                (work / ITERATION_DIR / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=1) + "\n")
            dist.barrier()
            with phases("digests", "recording the digest of every stored item"):
                integrity.record_torch_dist_digests(work / ITERATION_DIR, writer=rank0, known=path.digests())
            checking.settle()  # the source's digests, checked while it converted: damaged, nothing is committed
            if rank0:
                (work / TRACKER_NAME).write_text(f"{ITERATION}\n")  # last: marks the checkpoint complete
                files, nbytes = _directory_stats(work)
                commit_directory(work, out, replace=replace)
                tensor_bytes = sum(_nbytes(shape, dtype) for shape, dtype in signature.values())
                moved = phases.seconds["load_hf"] + phases.seconds["save"]
                result = {
                    "command": "import",
                    "ok": True,
                    "hf_checkpoint": hf_checkpoint,
                    "save": str(out),
                    "topology": str(topology),
                    "parallel": vars(topology),
                    "world_size": dist.get_world_size(),
                    "experts_streamed": path.streamed,
                    "tensors": len(signature),
                    "bytes": tensor_bytes,
                    "seconds": round(time.perf_counter() - start, 3),
                    "gb_per_s": _rate(tensor_bytes, moved),
                    "phases": phases.seconds,
                    "checksum_seconds": round(phases.seconds["verify"] + hashing_seconds() - hashed_before, 3),
                    "checkpoint": {"iteration_dir": str(out / ITERATION_DIR), "files": files, "bytes": nbytes},
                }
            result = convert.broadcast_from_rank0(result)
    except BaseException:
        if rank0:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return result


def _quantized_layout(source: Any, quantize: str | None) -> dict[str, Any]:
    """``writing_hf_checkpoint``'s arguments for ``quantize`` (none for a plain export)."""
    from vime_gemma4_bridge.convert import fp8

    if fp8.check_quantize(quantize) is None:
        return {}
    return {"rewrite": fp8.quantized_checkpoint, "config_fields": fp8.config_fields(source)}


def export_job(
    load: str,
    hf_checkpoint: str,
    output: str,
    topology: Topology,
    force: bool,
    max_shard_size: int,
    quantize: str | None = None,
) -> dict[str, Any]:
    """torch_dist at ``load`` → Megatron at ``topology`` → complete HF checkpoint at ``output``. Every rank.

    At the default topology (TP1·PP1·EP1·ETP1) the routed experts stream from the torch_dist files
    to the HF shards when the checkpoint stores them whole (:mod:`vime_gemma4_bridge.convert.stream_export`);
    everything else, and every other topology, goes through the Megatron model. ``quantize="fp8"``
    writes the block-FP8 checkpoint vLLM serves (:func:`vime_gemma4_bridge.convert.fp8.quantized_checkpoint`,
    experts per expert, ``quantization_config`` in ``config.json``), quantizing each weight as it is written.
    """
    import torch.distributed as dist

    from vime_gemma4_bridge.convert import fp8, paths
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io import hf as hf_io
    from vime_gemma4_bridge.io import hf_write

    start = time.perf_counter()
    phases = _Phases("export")
    init_model_parallel(topology, keep_if_same=True)
    iteration_dir = TorchDistCheckpoint(load).iteration_dir
    rank0 = convert.is_rank0()
    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as stack:
        hashed_before = hashing_seconds()
        with phases("verify", "checking the recorded digests of the checkpoints read, beside the export"):
            checking = integrity.check_beside(hf_checkpoint, iteration_dir, language_model=False)
        with phases("build", f"building the Megatron model at {topology}"):
            bridge = convert.open_bridge(hf_checkpoint)
            # Every weight is read next (or streamed past the model): random init would be wasted.
            model = convert.build_model(bridge, topology, initialize=False)
            # open until the HF checkpoint is written: lazy tensors read from the checkpoint's files
            path = stack.enter_context(paths.export_path(bridge, model, topology, iteration_dir))
        with phases("load", f"loading torch_dist {iteration_dir}{path.how}"):
            path.load(iteration_dir)
        source = hf_io.HFCheckpoint(hf_checkpoint)
        signature = source.signatures(source.language_model_names()) if rank0 else {}
        exported = path.export(signature)
        result: dict[str, Any] | None = None
        if rank0:
            towers = _carried_towers(load, iteration_dir, source)
            what = f"exporting to HF names and writing {output}{' in block FP8' if quantize else ''}"
            with phases("write", what):
                # Each tensor written as it arrives, at its place in the source's layout: rank 0 holds
                # one at a time, whatever the topology; another name, shape or dtype is refused.
                with hf_write.writing_hf_checkpoint(
                    output,
                    source,
                    max_shard_size=max_shard_size,
                    force=force,
                    show_progress=True,
                    carried=towers,
                    before_commit=checking.settle,  # its sources' digests, checked while it wrote
                    **_quantized_layout(source, quantize),
                ) as writer:
                    for name, tensor in exported:
                        writer.put(name, tensor)
            moved = phases.seconds["load"] + phases.seconds["write"]
            files, nbytes = _directory_stats(writer.path)
            result = {
                "command": "export",
                "ok": True,
                "load": str(iteration_dir),
                "hf_checkpoint": hf_checkpoint,
                "output": str(writer.path),
                "topology": str(topology),
                "parallel": vars(topology),
                "world_size": dist.get_world_size(),
                "experts_streamed": path.streamed,
                "loader": path.loader,
                "layout": layout_name(TorchDistReader(iteration_dir).tensor_keys()),
                "towers_carried": len(towers),
                "tensors": writer.tensors,
                "bytes": writer.nbytes,
                "seconds": round(time.perf_counter() - start, 3),
                "gb_per_s": _rate(writer.nbytes, moved),
                "phases": phases.seconds,
                "checksum_seconds": round(phases.seconds["verify"] + hashing_seconds() - hashed_before, 3),
                "quantize": quantize,
                "vllm_block_misfits": fp8.vllm_block_misfits(source.shapes()) if quantize else [],
                "hf_output": {
                    "files": files,
                    "bytes": nbytes,
                    "shards": len(list(writer.path.glob("*.safetensors"))),
                    "tensors": len(hf_io.HFCheckpoint(writer.path).names()),
                },
            }
        else:
            for _ in exported:  # this rank's part of the export's collectives
                pass
            checking.settle()  # at the same point as rank 0's, before its commit
        return convert.broadcast_from_rank0(result)


def _carried_towers(load: str, iteration_dir: Path, source: Any) -> dict[str, Any]:
    """The tower tensors of a vision-language checkpoint, by HF name, read whole from its files (rank 0)."""
    reader = TorchDistReader(iteration_dir)
    carried = TorchDistCheckpoint(load).carried_towers(source)
    locations = source.locations(carried.values())
    towers = {}
    for key, name in carried.items():
        shape = locations[name].shape
        zeros = (0,) * len(shape)
        if not reader.has(key, shape, zeros, shape):
            raise ConversionError(f"torch_dist checkpoint {load} stores the tower tensor {key} in pieces, not whole")
        towers[name] = reader.read(key, zeros, shape)
    return towers


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    from vime_gemma4_bridge.io.hf import DTYPE_BYTES

    return math.prod(shape) * DTYPE_BYTES.get(dtype, 1)
