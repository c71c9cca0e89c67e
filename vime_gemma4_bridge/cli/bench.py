"""``vime-gemma4 bench``: conversion speed and memory, measured against the physical limit.

Why this exists: a conversion that is bitwise right can still be too slow or too hungry for a 52 GB
checkpoint (gemma-4-26B-A4B). The honest yardstick is what the machine can do at all with the same
bytes: a plain safetensors read of every tensor plus a write of them to a new file set (the
*reference*). The bench measures, in one run and on one synthetic checkpoint:

(a) the reference, in one rank process: ``safetensors.safe_open`` / ``get_tensor`` for every tensor,
    then ``safetensors.torch.save_file`` into the same shard layout;
(b) ``import`` HF → torch_dist (:func:`vime_gemma4_bridge.convert.torch_dist_jobs.import_job`, unchanged)
    at EP = nproc;
(c) ``export`` torch_dist → HF (:func:`vime_gemma4_bridge.convert.torch_dist_jobs.export_job`, unchanged)
    at the default topology, as ``vime-gemma4 export`` runs without topology flags: the routed experts stream from the
    torch_dist files to the HF shards (:mod:`vime_gemma4_bridge.convert.stream_export`), rank 0 writes;
(d) the live export of RL training (:func:`vime_gemma4_bridge.convert.live.iter_hf_weights` grouped by
    :func:`vime_gemma4_bridge.convert.live.chunk_by_bytes`, as ``export-live`` does but without writing the
    chunks: each chunk is dropped once complete, like a consumer that pushed it), on the loaded model;

each with wall time, CPU time (all ranks; wall time is noisy on shared cores), GB/s (tensor bytes of
the checkpoint / wall time) and peak RSS, for every ``--nproc``. (a)-(c) run :data:`REPEATS` times
each, every run after removing what the run before wrote: the fastest run's times are kept, and the
largest peak memory of any run. One
:class:`~vime_gemma4_bridge.runtime.world.LocalWorld` per ``--nproc`` runs (a)-(d), so rank start-up and
the ~10 s import of Megatron-Bridge are *excluded*: every figure is timed inside the ranks, between
barriers, around the job function alone (:mod:`vime_gemma4_bridge.cli.bench_jobs`).
The conversion figures include everything the job does (parallel state, building the model, reading, resharding,
writing); the live figure excludes building and loading the model (that happens once per training
run, not once per weight update).

Peak RSS is exact: the ranks reset the kernel's high-water mark (``/proc/self/clear_refs``) before a
step and read ``VmHWM`` after it; where that is not allowed a 5 ms sampling thread stands in. "Extra"
is the peak over the RSS at the step's start. All files are in the page cache (the checkpoint has
just been written) and nothing is fsync'ed, for the reference as for the conversions, so the limit
measured is memory bandwidth and the safetensors/Python overheads, not the disk.

The synthetic checkpoint (:mod:`vime_gemma4_bridge.testing.synthetic`) is a Gemma 4 VL MoE checkpoint
with 26B-A4B's proportions, experts ~90% of the bytes; ``--scaling`` doubles its layers and vocabulary.
``--real-width`` adds memory at the shard on 26B-A4B's published widths (:func:`measure_real_width`):
every rank's peak RSS over its idle RSS and parameter bytes on 8 ranks, rank 0's during ``roundtrip
--output``, and ``export-live``'s stream there against rank 0 cloning the same bytes (``live_vs_copy_8r``);
then :func:`measure_depth`: the same widths at 8 layers, round trip and live export.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from vime_gemma4_bridge.cli.bench_jobs import (
    live_job,
    measured_job,
    reference_job,
    rollout_scoring_job,
    shard_memory_job,
)
from vime_gemma4_bridge.cli.bench_report import BenchResult, RealWidth, Step, format_report
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.world import LocalWorld
from vime_gemma4_bridge.testing.spec import TinySpec, preset
from vime_gemma4_bridge.testing.synthetic import (
    dense_spec_for_size,
    largest_tensor_bytes,
    layer_experts_bytes,
    spec_for_size,
    write_synthetic_checkpoint,
)

__all__ = ["add_parser", "main", "measure_real_width", "run_bench"]

#: ``--quick``: one size at one rank, under two minutes on 2 cores. Big enough that the fixed costs
#: of a conversion (parallel state, building the model, planning: ~0.5 s) do not swamp a reference
#: that is one pass over page-cached bytes (0.4-1 s/GB here); 26B-A4B is 52 GB.
QUICK_SIZE_GB = 3.0
QUICK_NPROC = (1,)
DEFAULT_SIZE_GB = 3.0
DEFAULT_NPROC = (1, 2, 4)
#: Runs of every timed step but the live ones (reference, import, export): the fastest is kept (wall times
#: on a shared 2-core VM swing by ±30%, and faster still when freshly freed memory is written again).
REPEATS = 3


# --------------------------------------------------------------------------------------------
# Orchestration
# --------------------------------------------------------------------------------------------


def _topology_for(nproc: int, dense: bool = False) -> Topology:
    """Pure expert parallelism over the world (EP = nproc, dense part replicated): how an MoE is spread first.

    A dense model has no experts: TP over up to 2 ranks (its 2 KV heads), data parallel beyond.
    """
    return Topology(tp=min(nproc, 2)) if dense else Topology(ep=nproc)


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
    dense: bool = False,
    real_width: bool = False,
) -> BenchResult:
    """Write the checkpoint(s), then for each world size run (a)-(d) on every size in one LocalWorld.

    Worlds run one after another (smallest first, ~1 GB RAM per rank), so at most ``max(nprocs)``
    ranks are alive. The reference is measured once per size, in rank 0 of the first world.
    ``world_for(n)`` supplies the worlds instead (e.g. a test session's shared one; not closed here).
    ``dense``: an E4B-shaped dense checkpoint instead, measured against its largest tensor (the PLE table).
    ``real_width``: then memory at the shard on 26B-A4B's published widths (:func:`measure_real_width`).
    """
    from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job

    shaped = dense_spec_for_size if dense else spec_for_size
    specs = [shaped(int(gb * 1e9)) for gb in sizes_gb]
    if scaling:
        base = specs[0]
        # Right after the first size: doubling_ratio compares these two.
        specs.insert(1, shaped(int(sizes_gb[0] * 2e9), layers=2 * base.layers, hidden=base.hidden_size))
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
        kind = (
            f"dense (PLE {spec.per_layer_input_size} per layer, {spec.kv_shared_layers} KV-shared layers)"
            if dense
            else f"{spec.experts} experts of width {spec.moe_intermediate_size}"
        )
        log(
            f"bench: checkpoint {i}: {nbytes / 1e9:.3f} GB, {spec.layers} layers, hidden {spec.hidden_size}, "
            f"{kind}, vocab {spec.vocab_size} (written in {generate_seconds[-1]:.1f} s)"
        )
    yardstick = largest_tensor_bytes(sources[0])[1] if dense else layer_experts_bytes(sources[0])
    result = BenchResult(
        sizes, specs, sorted(set(nprocs)), buffer_size, yardstick, [], generate_seconds, dense_model=dense
    )
    for nproc in result.nprocs:
        topology = _topology_for(nproc, dense)
        with contextlib.ExitStack() as stack:
            world = world_for(nproc) if world_for else stack.enter_context(LocalWorld(nproc))
            world.start()
            log(f"bench: {nproc} rank(s) ready at {topology}")
            for source, nbytes in zip(sources, sizes, strict=True):
                tag = f"{source.name}-n{nproc}"
                if nproc == result.nprocs[0]:
                    ref_dir = workdir / f"ref-{tag}"
                    measure = functools.partial(world.run, reference_job, str(source), str(ref_dir))
                    ref = _best_of(measure, outputs=(ref_dir,))[0]
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
                    _cleanup(ref_dir, keep)
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
                for name, key, what in (
                    ("live-per-expert", "per_expert", "experts one at a time"),
                    ("live-fp8", "fp8", "block FP8, per expert"),
                ):
                    runs = [r[key] for r in results]
                    note = f"{what}: {runs[0]['chunks']} chunks, {runs[0]['bytes'] / 1e6:.1f} MB yielded, not written"
                    result.steps.append(_step(name, nbytes, nproc, topology, runs, {}, note))
                    log(f"bench: {tag} {name} {result.steps[-1].seconds:.2f} s")
                copies = [r["copy"] for r in results]
                result.steps.append(
                    _step("copy", nbytes, nproc, topology, copies, {}, "torch.clone of each tensor live yields")
                )
                log(f"bench: {tag} copy {result.steps[-1].seconds:.2f} s")
                save, output = workdir / f"td-{tag}", workdir / f"out-{tag}"
                partial = workdir / f".td-{tag}.partial"
                job_args = (str(source), str(save), str(partial), topology)
                results = _best_of(
                    functools.partial(world.run, measured_job, import_job, job_args, quiet), outputs=(save, partial)
                )
                result.steps.append(_conversion_step("import", nbytes, nproc, topology, results))
                log(f"bench: {tag} import {result.steps[-1].seconds:.2f} s (best of {REPEATS})")
                # The export a user runs: default topology (experts streamed, see convert/stream_export.py).
                job_args = (str(save), str(source), str(output), Topology(), True, _max_shard_bytes(source))
                results = _best_of(
                    functools.partial(world.run, measured_job, export_job, job_args, quiet), outputs=(output,)
                )
                result.steps.append(_conversion_step("export", nbytes, nproc, Topology(), results))
                log(f"bench: {tag} export {result.steps[-1].seconds:.2f} s (best of {REPEATS})")
                _check_output(source, output)
                _cleanup(save, keep)
                _cleanup(output, keep)
    if not keep:
        for source in sources:
            shutil.rmtree(source, ignore_errors=True)
    if real_width:
        result.real_width = measure_real_width(workdir, buffer_size=buffer_size, keep=keep, quiet=quiet, log=log)
        result.real_width.depth = measure_depth(workdir, keep=keep, quiet=quiet, log=log)
    return result


#: ``--real-width``: the published 26B-A4B cut to two layers (one sliding, one full; 4.76 GB), loaded and
#: round-tripped at the seed's topology on 8 ranks (one run: the export gathers to rank 0, UPSTREAM 60).
REAL_WIDTH_PRESET, REAL_WIDTH_LAYERS = "26b-a4b", 2
REAL_WIDTH_AT = (8, Topology(tp=2, pp=2, ep=4))


def measure_real_width(
    workdir: Path,
    spec: TinySpec | None = None,
    *,
    at: tuple[int, Topology] = REAL_WIDTH_AT,
    buffer_size: int = 1 << 30,
    keep: bool = False,
    quiet: bool = True,
    world_for: Callable[[int], LocalWorld] | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> RealWidth:
    """Memory at the shard at published widths (``spec``, default :data:`REAL_WIDTH_PRESET` cut to
    :data:`REAL_WIDTH_LAYERS` layers), ``at`` (world size, topology): every rank's peak RSS over its shard
    bytes while the model is built and loaded, then rank 0's peak over its shard during ``roundtrip
    --output`` (compared and written as the export streams), which must be bitwise, and ``export-live``'s
    stream there in chunks of ``buffer_size`` against rank 0 cloning the same bytes (each the fastest of
    :data:`REPEATS`: on these 2 cores two single runs of 8 ranks gave 2.44x and 3.49x); then ``rollout-check``'s
    scoring there, in one process, layer by layer (``bench_jobs.rollout_scoring_job``).
    ``world_for(n)`` supplies the worlds (not closed here)."""
    spec = spec or preset(REAL_WIDTH_PRESET, REAL_WIDTH_LAYERS)
    path, nbytes = write_synthetic_checkpoint(workdir / "hf-real-width", spec)
    log(f"bench: real width: {nbytes / 1e9:.3f} GB, hidden {spec.hidden_size}, {spec.layers} layers")
    nproc, topology = at
    with contextlib.ExitStack() as stack:
        world = world_for(nproc) if world_for else stack.enter_context(LocalWorld(nproc))
        output = workdir / "hf-real-width-roundtrip"  # roundtrip --output's checkpoint
        ranks = world.run(shard_memory_job, str(path), topology, str(output), buffer_size, REPEATS, quiet)
    log(f"bench: real width: load and round trip at {topology} on {nproc} ranks done")
    if not ranks[0]["identical"]:
        raise RuntimeError(f"the round trip of {path} at {topology} was not bitwise identical")
    with contextlib.ExitStack() as stack:  # rollout-check's scoring, in a process of its own
        world = world_for(1) if world_for else stack.enter_context(LocalWorld(1))
        scoring = world.run(rollout_scoring_job, str(path), quiet)[0]
    log("bench: real width: rollout-check's scoring done")
    largest = largest_tensor_bytes(path)[1]
    _cleanup(output, keep)
    _cleanup(path, keep)
    return RealWidth(nbytes, largest, str(topology), ranks, scoring)


#: ``--real-width``'s deep check: the same widths at 8 layers (14.6 GB), at the seed's topology, on 8 ranks.
DEPTH_LAYERS, DEPTH_BUFFER = 8, 256 << 20


def measure_depth(
    workdir: Path,
    *,
    layers: int = DEPTH_LAYERS,
    buffer_size: int = DEPTH_BUFFER,
    keep: bool = False,
    quiet: bool = True,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict:
    """:data:`REAL_WIDTH_PRESET` at ``layers`` layers round-tripped at :data:`REAL_WIDTH_AT` (must be bitwise),
    then ``export-live --expert-layout per-expert`` there in chunks of ``buffer_size``, checked with
    ``verify-update``; in a world of its own, so no earlier job's leftovers share the memory.

    At 8 layers the 8 ranks hold 19.3 GB of parameters (the non-expert weights once per EP rank) of
    these 24 GB: the chunks are 256 MiB (1 GiB ones put rank 0 over). Too tight for ``make test``,
    whose own process holds ~1 GB more than this one: ``tests/test_memory.py -m limit`` runs it alone.
    """
    from vime_gemma4_bridge.convert.live import export_live_job
    from vime_gemma4_bridge.verify.roundtrip import roundtrip_job
    from vime_gemma4_bridge.verify.update import verify_update

    path, nbytes = write_synthetic_checkpoint(workdir / "hf-depth", preset(REAL_WIDTH_PRESET, layers))
    dump = workdir / "hf-depth-live"
    nproc, topology = REAL_WIDTH_AT
    log(f"bench: depth: {nbytes / 1e9:.3f} GB, {layers} layers, at {topology} on {nproc} ranks")
    with LocalWorld(nproc) as world:
        roundtrip = world.run(measured_job, roundtrip_job, (str(path), topology, None, False, 10**9), quiet)
        live_args = (str(path), topology, str(dump), buffer_size, False, "per-expert")
        live = world.run(measured_job, export_live_job, live_args, quiet)
    report = verify_update(path, dump)
    log("bench: depth: round trip, export-live and verify-update done")
    _cleanup(dump, keep)
    _cleanup(path, keep)
    result = roundtrip[0]["result"]
    return {
        "layers": layers,
        "bytes": nbytes,
        "tensors": result["total"]["count"],
        "equal": result["total"]["equal"],
        "identical": result["identical"],
        "verified": report["ok"],
        "buffer_size": buffer_size,
        "roundtrip_seconds": roundtrip[0]["seconds"],
        "live_seconds": live[0]["seconds"],
        "peak_rss": max(rank["peak_rss"] for run in (roundtrip, live) for rank in run),
    }


def _best_of(measure: Callable[[], list[dict]], *, outputs: Sequence[Path]) -> list[dict]:
    """``measure()`` (one measurement per rank; ``None`` where a rank measures nothing) run :data:`REPEATS`
    times: the fastest run's figures.

    Each run starts by removing what the one before wrote (``outputs``), so every run writes into
    the same kind of free memory. Wall and CPU time are the fastest run's; peak memory is the
    largest of any run (memory is not allowed a best case).
    """
    runs = []
    for _ in range(REPEATS):
        for path in outputs:
            shutil.rmtree(path, ignore_errors=True)
        runs.append([results for results in measure() if results is not None])
    best = min(runs, key=lambda results: max(r["seconds"] for r in results))
    for rank, results in enumerate(best):
        for key in ("peak_rss", "extra_rss"):
            results[key] = max(run[rank][key] for run in runs)
    return best


def _max_shard_bytes(source: Path) -> int:
    """The source's largest shard, so the export writes as many files as the reference does."""
    return max(f.stat().st_size for f in source.glob("*.safetensors"))


def _conversion_step(name: str, nbytes: int, nproc: int, topology: Topology, results: list[dict]) -> Step:
    report = results[0]["result"] or {}
    step = _step(name, nbytes, nproc, topology, results, dict(report.get("phases") or {}))
    step.checksum_seconds = float(report.get("checksum_seconds") or 0.0)
    return step


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
    from vime_gemma4_bridge.io import hf as hf_io

    if set(hf_io.HFCheckpoint(output).names()) != set(hf_io.HFCheckpoint(source).names()):
        raise RuntimeError(f"export wrote {output} with other tensors than {source}")


def _cleanup(path: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(path, ignore_errors=True)


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
(iter_hf_weights + chunk_by_bytes, chunks not written) on the loaded model, stacked, then per expert,
then in block FP8; (e) its yardstick, a plain torch.clone of the same weights. Each is timed inside
the ranks (start-up and imports excluded) with its peak RSS. Prints a table, the targets and, last
(nproc 1, the first size): export_vs_reference=.. import_vs_reference=.. live_vs_copy=..
live_peak_extra_mb=.. layer_experts_mb=.. import_peak_extra_mb=.. export_peak_extra_mb=..
live_per_expert_peak_extra_mb=.. live_fp8_gb_per_s=.. checksum_overhead=.. rank_peak_over_shard=..
roundtrip_rank0_extra_mb=.. rollout_check_peak_mb=.. live_vs_copy_8r=.. (the last four nan unless
--real-width).
With --scaling, also twice the first size: time and peak-memory doubling ratios. With --dense e4b,
an E4B-shaped dense checkpoint instead (PLE table the largest tensor; TP = min(nproc, 2)): the
memory yardstick is that tensor (largest_tensor_mb= in place of layer_experts_mb=). Targets are
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
        "--dense",
        choices=("e4b",),
        default=None,
        help="measure an E4B-shaped dense checkpoint instead (its PLE table, one tensor, is the yardstick; "
        "TP = min(nproc, 2))",
    )
    parser.add_argument(
        "--real-width",
        action="store_true",
        help="also measure memory at the shard on 26B-A4B's published widths cut to 2 layers (4.8 GB, as tiny "
        "--preset 26b-a4b --layers 2): every rank's peak RSS over its shard while building and loading at "
        "TP2·PP2·EP4 on 8 ranks, rank 0's during roundtrip --output there, the live export's time there against "
        "a plain copy of the same bytes (live_vs_copy_8r=), rollout-check's scoring, then the same widths at 8 "
        "layers there: round trip bitwise, export-live per expert verified (~23 GB of RAM, ~11 min)",
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
    from vime_gemma4_bridge.io import hf as hf_io

    sizes = args.size_gb or ([QUICK_SIZE_GB] if args.quick else [DEFAULT_SIZE_GB])
    nprocs = args.nproc or list(QUICK_NPROC if args.quick else DEFAULT_NPROC)
    try:
        buffer_size = hf_io.parse_size(args.buffer_size)
        if any(s <= 0 for s in sizes) or any(n < 1 for n in nprocs) or buffer_size < 1:
            raise ValueError("--size-gb, --nproc and --buffer-size must be positive")
        for n in nprocs:
            if 128 % n and not args.dense:
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
            dense=bool(args.dense),
            real_width=args.real_width,
        )
    lines = format_report(result)
    if args.json:
        data = {
            "sizes": result.sizes,
            "nprocs": result.nprocs,
            "buffer_size": result.buffer_size,
            result.yardstick_key + "_bytes": result.layer_experts,
            "steps": [vars(step) | {"gb_per_s": step.gb_per_s} for step in result.steps],
            "headline": lines[-1],
        }
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    print("\n".join(lines), flush=True)
    return 0
