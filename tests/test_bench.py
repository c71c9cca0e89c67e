"""``vime-gemma4 bench``: the machinery runs end to end on a tiny synthetic checkpoint (no timing assertions).

What is checked is what a reader of the bench relies on: the synthetic checkpoint is a real Gemma 4
checkpoint with 26B-A4B's proportions, every step is measured (positive wall time, CPU time and RSS),
and the last line has the exact machine-readable format. Speed targets are the bench's to report,
never the tests' to assert (figures on a shared 2-core runner say nothing).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from vime_gemma4_bridge.cli import bench, bench_report
from vime_gemma4_bridge.cli import main as cli
from vime_gemma4_bridge.io import hf as hf_io
from vime_gemma4_bridge.testing import synthetic

LAST_LINE = re.compile(
    r"^export_vs_reference=(?P<export>[0-9.]+) import_vs_reference=(?P<import>[0-9.]+) "
    r"live_vs_copy=(?P<live_vs_copy>[0-9.]+) live_peak_extra_mb=(?P<live>[0-9.]+) "
    r"layer_experts_mb=(?P<experts>[0-9.]+) import_peak_extra_mb=(?P<import_peak>[0-9.]+) "
    r"export_peak_extra_mb=(?P<export_peak>[0-9.]+) live_per_expert_peak_extra_mb=(?P<per_expert>[0-9.]+) "
    r"live_fp8_gb_per_s=(?P<fp8_gb_per_s>[0-9.]+) checksum_overhead=(?P<checksum_overhead>[0-9.]+) "
    r"rank_peak_over_shard=(?P<over_shard>nan|[0-9.]+) roundtrip_rank0_extra_mb=(?P<rank0_extra>nan|-?[0-9.]+) "
    r"rollout_check_peak_mb=(?P<rollout_check>nan|[0-9.]+) live_vs_copy_8r=(?P<live_vs_copy_8r>nan|[0-9.]+)$"
)

STEPS = ["reference", "live", "live-per-expert", "live-fp8", "copy", "import", "export"]


def test_spec_for_size_has_26b_proportions() -> None:
    spec = synthetic.spec_for_size(150_000_000)
    assert spec.moe and spec.experts == 128 and spec.top_k == 8 and not spec.causal_lm
    assert spec.moe_intermediate_size * 4 == spec.hidden_size
    total = synthetic.spec_bytes(spec)
    assert 0.8 < total / 150e6 < 1.2
    experts = spec.layers * spec.experts * 3 * spec.moe_intermediate_size * spec.hidden_size * 2
    assert experts / total > 0.85, "experts must dominate the bytes, as in 26B-A4B"
    doubled = synthetic.spec_for_size(300_000_000, layers=2 * spec.layers, hidden=spec.hidden_size)
    assert 1.95 < synthetic.spec_bytes(doubled) / total < 2.05


def test_synthetic_checkpoint_is_a_gemma4_checkpoint(tmp_path: Path) -> None:
    spec = synthetic.spec_for_size(3_000_000)
    path, nbytes = synthetic.write_synthetic_checkpoint(tmp_path / "hf", spec, shards=3)
    source = hf_io.HFCheckpoint(path)
    assert len(set(source.weight_map.values())) > 1, "sharded with an index, like a published checkpoint"
    tensors = source.load()
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == nbytes
    assert "lm_head.weight" not in tensors  # tied, as save_pretrained writes it
    gate_up = tensors["model.language_model.layers.0.experts.gate_up_proj"]
    assert tuple(gate_up.shape) == (128, 2 * spec.moe_intermediate_size, spec.hidden_size)
    assert synthetic.layer_experts_bytes(path) == 128 * 3 * spec.moe_intermediate_size * spec.hidden_size * 2


def test_bench_runs_and_prints_the_headline_last(local_world, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = bench.run_bench(
        [0.003], [1], buffer_size=1_000_000, workdir=tmp_path / "work", world_for=local_world, log=lambda _: None
    )
    assert [s.step for s in result.steps] == STEPS
    for step in result.steps:
        assert step.seconds > 0 and step.cpu > 0 and step.peak_rss > 0 and step.gb_per_s > 0, step
    lines = bench_report.format_report(result)
    match = LAST_LINE.match(lines[-1])
    assert match, lines[-1]
    figures = {name: float(value) for name, value in match.groupdict().items()}
    real_width = [figures.pop(name) for name in ("over_shard", "rank0_extra", "rollout_check", "live_vs_copy_8r")]
    assert all(math.isnan(value) for value in real_width), "not without --real-width"
    assert all(value > 0 and math.isfinite(value) for value in figures.values()), figures
    assert figures["experts"] == pytest.approx(result.layer_experts / 1e6, abs=0.05)
    for step in ("import", "export"):  # digests recorded (import) and checked, written with the shards (export)
        found = result.find(step, result.sizes[0], 1)
        assert 0 < found.checksum_seconds < found.seconds, found
    assert any(line.startswith("| 0.00") and "| export |" in line for line in lines)
    assert not list((tmp_path / "work").iterdir()), "checkpoints are removed unless --keep"


def test_real_width_measures_every_rank_against_its_shard(local_world, tmp_path: Path) -> None:
    """``--real-width``'s machinery on a small MoE: build + load, then a bitwise round trip, at TP2·EP2 on 2
    ranks; every rank reports its shard and peak; rollout-check's scoring then, in one process; the three
    figures reach the last line."""
    from vime_gemma4_bridge.convert.topology import Topology

    spec = synthetic.spec_for_size(3_000_000)
    wide = bench.measure_real_width(
        tmp_path / "work",
        spec,
        at=(2, Topology(tp=2, ep=2)),
        world_for=local_world,
        log=lambda _: None,
    )
    assert len(wide.ranks) == 2 and wide.topology == str(Topology(tp=2, ep=2))
    for rank in wide.ranks:
        assert 0 < rank["shard_bytes"] < wide.size_bytes and rank["load_peak"] >= rank["start_rss"] > 0, rank
    over_idle = [(r["load_peak"] - r["start_rss"]) / r["shard_bytes"] for r in wide.ranks]  # the idle RSS is no load's
    assert wide.rank_peak_over_shard == max(over_idle) > 0
    assert not (tmp_path / "work" / "hf-real-width-roundtrip").exists()  # roundtrip --output's, removed after
    lines = bench_report.real_width_lines(wide)
    assert lines[1].startswith("target every rank's peak RSS over its RSS before <= 1.5x its shard (build + load): ")
    # rollout-check's scoring, a layer at a time in a process of its own: its peak and the bound's parts
    assert wide.scoring["peak"] >= wide.scoring["start_rss"] > 0 and wide.scoring["embedding"] > 0
    assert 0 < wide.scoring["two_layers"] < wide.size_bytes and wide.rollout_check_bound > wide.scoring["embedding"]
    # export-live's stream there against rank 0 cloning the same bytes
    rank0 = wide.ranks[0]
    assert rank0["live_bytes"] > 0 and rank0["copy_seconds"] > 0 and rank0["live_seconds"] > 0
    assert wide.live_vs_copy == rank0["live_seconds"] / rank0["copy_seconds"]
    assert lines[3].startswith("target live export on 2 ranks <= 3x rank 0 cloning the same bytes: ")
    assert lines[4].startswith("target rollout-check's scoring peak RSS <= the embedding + two decoder layers + 1 GB")
    assert bench_report.real_width_fields(wide) == (
        f"rank_peak_over_shard={wide.rank_peak_over_shard:.3f} "
        f"roundtrip_rank0_extra_mb={wide.roundtrip_rank0_extra / 1e6:.1f} "
        f"rollout_check_peak_mb={wide.rollout_check_peak / 1e6:.1f} live_vs_copy_8r={wide.live_vs_copy:.3f}"
    )
    assert not list((tmp_path / "work").iterdir())


def test_dense_bench_measures_against_the_largest_tensor(local_world, tmp_path: Path) -> None:
    """``bench --dense e4b``: an E4B-shaped checkpoint whose PLE table is its largest tensor, and the yardstick."""
    spec = synthetic.dense_spec_for_size(3_000_000)
    assert not spec.moe and spec.per_layer_input_size and spec.kv_shared_layers
    result = bench.run_bench(
        [0.003],
        [1],
        buffer_size=1_000_000,
        workdir=tmp_path / "work",
        world_for=local_world,
        log=lambda _: None,
        dense=True,
    )
    assert [s.step for s in result.steps] == STEPS
    lines = bench_report.format_report(result)
    assert "largest_tensor_mb=" in lines[-1] and "layer_experts_mb" not in lines[-1]
    assert any(line.startswith("target live peak extra <= chunk + the largest tensor (PLE table)") for line in lines)
    table = 2 * spec.vocab_size * spec.layers * spec.per_layer_input_size
    assert result.layer_experts == table  # bf16 PLE table: the yardstick is that tensor


def test_command_line(capsys: pytest.CaptureFixture) -> None:
    args = cli.build_parser().parse_args(["bench", "--quick"])
    assert args.func is bench.main and args.quick and args.size_gb is None
    assert cli.main(["bench", "--nproc", "3"]) == 2  # EP = nproc must divide the 128 experts
    assert "must divide the 128 experts" in capsys.readouterr().err
