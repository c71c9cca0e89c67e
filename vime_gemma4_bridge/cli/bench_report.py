"""The bench's figures and their report: every step's measurement, the ratios, the targets, the headline.

Why apart from the command (:mod:`vime_gemma4_bridge.cli.bench`): the report is the bench's contract —
the table, the phase lines, one ``target …: met|MISSED`` line per target of the performance issue
(reported, never asserted) and, last, the machine-readable headline line
``export_vs_reference=.. import_vs_reference=.. live_vs_copy=.. ...``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vime_gemma4_bridge.testing.spec import TinySpec

__all__ = ["BenchResult", "RealWidth", "Step", "format_report", "real_width_fields", "real_width_lines"]

#: Targets of the performance issue; reported, never asserted.
TARGET_CONVERSION_VS_REFERENCE = 1.5
TARGET_DOUBLING_RATIO = 2.2
TARGET_LIVE_VS_COPY = 3.0
#: Recording and checking the digests costs under this share of import + export wall time: integrity near free.
TARGET_CHECKSUM_OVERHEAD = 0.05
#: import / export peak extra RSS at ``--quick``: at most this plus one layer's stacked experts.
TARGET_PEAK_EXTRA_BASE = 1536 * 10**6
#: import / export peak extra RSS at twice the bytes (``--scaling``), over the first size's.
TARGET_PEAK_DOUBLING = 1.2
#: per-expert live export peak extra RSS: at most the chunk plus this (one expert, its EP gather, the allocator).
TARGET_PER_EXPERT_MARGIN = 64 * 10**6
STEPS = ("reference", "import", "export", "live", "copy")
#: Every rank's peak RSS over its shard bytes (build + load, 8 ranks at real widths): each rank holds its shard.
TARGET_RANK_PEAK_OVER_SHARD = 1.5
#: Rank 0's peak over its shard during a round trip, in largest tensors (no whole-model copies).
TARGET_ROUNDTRIP_RANK0_EXTRA_TENSORS = 2
#: rollout-check's scoring: peak RSS within the embedding + two decoder layers + this (a login node's memory).
TARGET_ROLLOUT_CHECK_SLACK = 1 << 30


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
    checksum_seconds: float = 0.0  # of ``seconds``: held up by digests, recording or checking (io/digests.py)

    @property
    def gb_per_s(self) -> float:
        """Checkpoint tensor bytes per wall second (decimal GB)."""
        return self.size_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class RealWidth:
    """``--real-width``: memory at the shard on published widths (``bench.measure_real_width``).

    ``ranks`` holds every rank's ``start_rss`` / ``load_peak`` / ``shard_bytes`` and ``roundtrip_peak``
    (the round trip's consumer, rank 0, is the first).
    """

    size_bytes: int
    largest_tensor: int
    topology: str
    ranks: list[dict]
    #: ``bench_jobs.rollout_scoring_job`` on the same checkpoint, in a process of its own.
    scoring: dict
    #: ``bench.measure_depth``: the same widths at 8 layers, round trip and live export (``None``: not run).
    depth: dict | None = None

    @property
    def rollout_check_peak(self) -> int:
        """rollout-check's scoring process: its peak RSS (bytes)."""
        return self.scoring["peak"]

    @property
    def rollout_check_bound(self) -> int:
        """The embedding + the two largest decoder layers + :data:`TARGET_ROLLOUT_CHECK_SLACK` (bytes)."""
        return self.scoring["embedding"] + self.scoring["two_layers"] + TARGET_ROLLOUT_CHECK_SLACK

    @property
    def rank_peak_over_shard(self) -> float:
        """The largest over the ranks of (peak RSS during build + load - RSS before) / the rank's shard bytes.

        Over the RSS before: the idle process (Python, torch, megatron-core: 0.6 GB) is no part of the
        load, and would make a small shard look worse than a large one.
        """
        return max((rank["load_peak"] - rank["start_rss"]) / rank["shard_bytes"] for rank in self.ranks)

    @property
    def live_vs_copy(self) -> float:
        """``export-live``'s stream on these ranks over rank 0 cloning the same bytes (its wall time, not CPU)."""
        rank0 = self.ranks[0]
        return rank0["live_seconds"] / rank0["copy_seconds"] if rank0["copy_seconds"] > 0 else math.nan

    @property
    def roundtrip_rank0_extra(self) -> int:
        """Rank 0's peak RSS during the round trip over its RSS before it and its shard bytes."""
        rank0 = self.ranks[0]
        return max(rank0["load_peak"], rank0["roundtrip_peak"]) - rank0["start_rss"] - rank0["shard_bytes"]


@dataclass
class BenchResult:
    """Everything one bench run measured, and the headline figures derived from it."""

    sizes: list[int]  # tensor bytes of each synthetic checkpoint
    specs: list[TinySpec]
    nprocs: list[int]
    buffer_size: int
    layer_experts: int  # the memory yardstick: one layer's stacked experts, or a dense model's largest tensor
    steps: list[Step]
    generate_seconds: list[float]
    dense_model: bool = False
    real_width: RealWidth | None = None

    @property
    def yardstick(self) -> str:
        """What :attr:`layer_experts` measures, as the targets name it."""
        return "the largest tensor (PLE table)" if self.dense_model else "one layer's experts"

    @property
    def yardstick_key(self) -> str:
        """The last line's key of the yardstick."""
        return "largest_tensor" if self.dense_model else "layer_experts"

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

    def checksum_overhead(self) -> float:
        """Seconds spent on digests over the conversion's wall time, import and export together (headline)."""
        found = [self.find(step, self.sizes[0], self.headline_nproc) for step in ("import", "export")]
        if not all(found):
            return math.nan
        return sum(s.checksum_seconds for s in found) / sum(s.seconds for s in found)

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
        elif step.step.startswith("live") or step.step == "copy":
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
    n = result.headline_nproc
    export, imp, live_vs_copy = result.ratio("export"), result.ratio("import"), result.live_vs_copy()
    live_extra, experts = result.peak_extra("live"), result.layer_experts
    live_limit = result.buffer_size + experts
    per_expert_extra, margin = result.peak_extra("live-per-expert"), TARGET_PER_EXPERT_MARGIN
    fp8 = result.find("live-fp8", result.sizes[0], n)
    lines += [
        "not counted: rank start-up and imports",
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
            f"live peak extra <= chunk + {result.yardstick}",
            live_extra <= live_limit,
            f"{live_extra / 1e6:.1f} MB vs {result.buffer_size / 1e6:.1f} + {experts / 1e6:.1f} MB",
        ),
        _target(
            f"live per-expert peak extra <= chunk + {margin / 1e6:.0f} MB",
            per_expert_extra <= result.buffer_size + margin,
            f"{per_expert_extra / 1e6:.1f} MB vs {result.buffer_size / 1e6:.1f} + {margin / 1e6:.0f} MB",
        ),
        _target(
            f"live <= {TARGET_LIVE_VS_COPY:g}x a plain copy",
            live_vs_copy <= TARGET_LIVE_VS_COPY,
            f"{_fmt(live_vs_copy)}x",
        ),
        _target(
            f"digests (recorded and checked) < {TARGET_CHECKSUM_OVERHEAD:g} of import + export time",
            result.checksum_overhead() < TARGET_CHECKSUM_OVERHEAD,
            _fmt(result.checksum_overhead(), 3),
        ),
    ]
    for step in ("import", "export"):
        extra = result.peak_extra(step)
        lines.append(
            _target(
                f"{step} peak extra <= {TARGET_PEAK_EXTRA_BASE / 1e6:.0f} MB + {result.yardstick}",
                extra <= TARGET_PEAK_EXTRA_BASE + experts,
                f"{extra / 1e6:.1f} MB vs {TARGET_PEAK_EXTRA_BASE / 1e6:.0f} + {experts / 1e6:.1f} MB",
            )
        )
    if len(result.sizes) > 1:
        doubled = {step: result.doubling(step) for step in STEPS}
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
        by_cpu = {step: result.doubling(step, cpu=True) for step in STEPS}
        lines.append(
            f"doubling_ratio={_fmt(worst, 3)} "
            + " ".join(f"doubling_ratio_{step}={_fmt(value, 3)}" for step, value in doubled.items())
            + f" doubling_ratio_cpu={_fmt(max(by_cpu['import'], by_cpu['export']), 3)} "
            + " ".join(f"doubling_ratio_cpu_{step}={_fmt(value, 3)}" for step, value in by_cpu.items())
            + " "
            + " ".join(f"peak_doubling_{step}={_fmt(value, 3)}" for step, value in peaks.items())
        )
    lines += real_width_lines(result.real_width) if result.real_width else []
    lines.append(
        f"export_vs_reference={_fmt(export, 3)} import_vs_reference={_fmt(imp, 3)} "
        f"live_vs_copy={_fmt(live_vs_copy, 3)} live_peak_extra_mb={live_extra / 1e6:.1f} "
        f"{result.yardstick_key}_mb={experts / 1e6:.1f} import_peak_extra_mb={result.peak_extra('import') / 1e6:.1f} "
        f"export_peak_extra_mb={result.peak_extra('export') / 1e6:.1f} "
        f"live_per_expert_peak_extra_mb={per_expert_extra / 1e6:.1f} "
        f"live_fp8_gb_per_s={_fmt(fp8.gb_per_s if fp8 else math.nan, 3)} "
        f"checksum_overhead={_fmt(result.checksum_overhead(), 3)} {real_width_fields(result.real_width)}"
    )
    return lines


def real_width_lines(wide: RealWidth) -> list[str]:
    """``--real-width``'s figures: every rank's peak and shard, rank 0's round trip, and the two targets."""
    return [
        f"real width: {wide.size_bytes / 1e9:.3f} GB, largest tensor {wide.largest_tensor / 1e6:.1f} MB; "
        f"build + load at {wide.topology}, per rank peak RSS / shard GB: "
        + ", ".join(f"{r['load_peak'] / 1e9:.2f}/{r['shard_bytes'] / 1e9:.2f}" for r in wide.ranks)
        + f" (RSS before: {min(r['start_rss'] for r in wide.ranks) / 1e9:.2f} GB); round trip there, per rank "
        "peak GB: " + ", ".join(f"{r['roundtrip_peak'] / 1e9:.2f}" for r in wide.ranks) + " (rank 0 compares), bitwise",
        _target(
            f"every rank's peak RSS over its RSS before <= {TARGET_RANK_PEAK_OVER_SHARD}x its shard (build + load)",
            wide.rank_peak_over_shard <= TARGET_RANK_PEAK_OVER_SHARD,
            f"{_fmt(wide.rank_peak_over_shard)}x",
        ),
        _target(
            f"round-trip rank 0 peak over its shard <= {TARGET_ROUNDTRIP_RANK0_EXTRA_TENSORS}x the largest tensor",
            wide.roundtrip_rank0_extra <= TARGET_ROUNDTRIP_RANK0_EXTRA_TENSORS * wide.largest_tensor,
            f"{wide.roundtrip_rank0_extra / 1e6:.1f} MB vs {wide.largest_tensor / 1e6:.1f} MB",
        ),
        _target(
            f"live export on {len(wide.ranks)} ranks <= {TARGET_LIVE_VS_COPY:g}x rank 0 cloning the same bytes",
            wide.live_vs_copy <= TARGET_LIVE_VS_COPY,
            f"{_fmt(wide.live_vs_copy)}x ({wide.ranks[0]['live_bytes'] / 1e9:.2f} GB in "
            f"{wide.ranks[0]['live_seconds']:.1f} s vs {wide.ranks[0]['copy_seconds']:.1f} s)",
        ),
        *([_depth_line(wide.depth, wide.topology)] if wide.depth else []),
        _target(
            "rollout-check's scoring peak RSS <= the embedding + two decoder layers + 1 GB",
            wide.rollout_check_peak <= wide.rollout_check_bound,
            f"{wide.rollout_check_peak / 1e6:.1f} MB vs {wide.rollout_check_bound / 1e6:.1f} MB "
            f"(RSS before: {wide.scoring['start_rss'] / 1e6:.1f} MB)",
        ),
    ]


def _depth_line(depth: dict, topology: str) -> str:
    return _target(
        f"{depth['layers']} layers ({depth['bytes'] / 1e9:.1f} GB) at {topology} round-trip bitwise and "
        "export-live per expert verifies",
        depth["identical"] and depth["equal"] == depth["tensors"] and depth["verified"],
        f"{depth['equal']}/{depth['tensors']} bitwise in {depth['roundtrip_seconds']:.0f} s, "
        f"{'verified' if depth['verified'] else 'NOT verified'} ({depth['buffer_size'] >> 20} MiB chunks, "
        f"{depth['live_seconds']:.0f} s); largest rank peak RSS {depth['peak_rss'] / 1e9:.2f} GB",
    )


def real_width_fields(wide: RealWidth | None) -> str:
    """The last line's ``--real-width`` fields (``nan`` without it)."""
    over_shard = wide.rank_peak_over_shard if wide else math.nan
    rank0_extra = wide.roundtrip_rank0_extra / 1e6 if wide else math.nan
    scoring = wide.rollout_check_peak / 1e6 if wide else math.nan
    live = wide.live_vs_copy if wide else math.nan
    return (
        f"rank_peak_over_shard={_fmt(over_shard, 3)} roundtrip_rank0_extra_mb={_fmt(rank0_extra, 1)} "
        f"rollout_check_peak_mb={_fmt(scoring, 1)} live_vs_copy_8r={_fmt(live, 3)}"
    )


def _target(what: str, met: bool, figure: str) -> str:
    return f"target {what}: {figure} {'met' if met else 'MISSED'}"
