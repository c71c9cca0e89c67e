"""``vime-gemma4 import`` / ``export``: HF ↔ torch_dist, across topologies, safe outputs, clear refusals.

Conversions run as job functions in the shared worlds (8 ranks, then 4, then 2: each world is started
once) and every result is compared bitwise with its source over *all* tensors (vision tower included)
with ``report.compare``. Refusals go through the real command line in this process: they must come
before any rank is started, so each returns in well under a second and leaves nothing on disk. The
scripts are run once as programs (under torchrun and plain python).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job
from vime_gemma4_bridge.io.digests import DIGESTS_NAME
from vime_gemma4_bridge.io.torch_dist import (
    ITERATION_DIR,
    RUN_CONFIG_NAME,
    SIDECAR_NAME,
    TRACKER_NAME,
    TorchDistCheckpoint,
)
from vime_gemma4_bridge.runtime.world import RankError
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

CHECKPOINTS = {
    # 16 experts, 4 layers, VL: the default tiny model.
    "moe-vl": TinySpec(),
    # An irregular layer pattern (per-type torch_dist keys split unevenly over PP stages), 32 experts.
    "causal-irregular-32E": TinySpec(
        causal_lm=True,
        layers=6,
        layer_types=("sliding", "full", "full", "sliding", "sliding", "full"),
        experts=32,
        top_k=8,
        heads=8,
        kv_heads=4,
        global_kv_heads=2,
        head_dim=16,
        global_head_dim=32,
        hidden_size=96,
        seed=7,
    ),
    # fp32, no k_eq_v, 8 layers, 8 experts.
    "causal-fp32-8E": TinySpec(
        causal_lm=True,
        layers=8,
        layer_types=("sliding", "sliding", "sliding", "full") * 2,
        experts=8,
        top_k=2,
        attention_k_eq_v=False,
        head_dim=12,
        global_head_dim=24,
        moe_intermediate_size=24,
        dtype="float32",
        seed=11,
    ),
    "dense-vl": TinySpec(moe=False),
    # Added tokens: a vocabulary TP2 does not divide (padded to 1002 rows at TP2, 1001 at TP1).
    "moe-vocab-1001": TinySpec(vocab_size=1001, seed=5),
    "dense-vocab-1001": TinySpec(moe=False, vocab_size=1001, seed=6),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in CHECKPOINTS.items()}


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def assert_same_checkpoint(source: Path, output: Path, *, ep: int = 2) -> None:
    """Every tensor of ``output`` bitwise equal to ``source`` (language model and vision tower), same side files."""
    from vime_gemma4_bridge.io import hf as hf_io
    from vime_gemma4_bridge.verify import report

    reference, candidate = hf_io.HFCheckpoint(source), hf_io.HFCheckpoint(output)
    result = report.compare(reference.load(), candidate.load(), ep=ep)
    assert result.identical, report.format_report(result, f"{output} vs {source}")
    assert not result.ep_boundaries, result.ep_boundaries
    side = {p.name for p in source.iterdir() if not p.name.endswith(".safetensors") and p.name != hf_io.INDEX_NAME}
    written = {p.name for p in output.iterdir() if not p.name.endswith(".safetensors") and p.name != hf_io.INDEX_NAME}
    assert side == written
    for name in side:
        assert (source / name).read_bytes() == (output / name).read_bytes(), name


def digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (to prove a source was not modified)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def leftovers(out: Path) -> list[str]:
    """Temporary siblings of ``out`` that a finished run should not leave."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*"))


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str, float]:
    from vime_gemma4_bridge.cli import main as cli

    capsys.readouterr()
    start = time.monotonic()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err, time.monotonic() - start


def assert_refused(capsys: pytest.CaptureFixture, argv: list, needles: tuple[str, ...], untouched: Path) -> str:
    """Non-zero exit within seconds, one ``vime-gemma4 CMD: error:`` line naming ``needles``, nothing written."""
    existed = untouched.exists()
    before = digest(untouched) if untouched.is_dir() else None
    code, out, err, seconds = run_cli(capsys, *argv)
    assert code != 0
    assert out == ""
    errors = [line for line in err.splitlines() if line.startswith("vime-gemma4 ")]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.startswith(f"vime-gemma4 {argv[0]}: error: "), line
    for needle in needles:
        assert needle in line, line
    assert seconds < 5, f"refusal took {seconds:.1f} s: it must come before any rank starts"
    assert untouched.exists() == existed, "a refusal must not create its output"
    if before is not None:
        assert digest(untouched) == before
    assert not leftovers(untouched)
    return line


def variant(source: Path, out: Path, *, text: dict | None = None, top: dict | None = None) -> Path:
    """A copy of ``source`` with config.json fields replaced (``text`` in text_config when there is one)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(top or {})
    (config.get("text_config") or config).update(text or {})
    (out / "config.json").write_text(json.dumps(config))
    return out


# --------------------------------------------------------------------------------------------
# One rank in this process: the command line end to end (no --nproc), and the refusals
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_rank(checkpoints, tmp_path_factory) -> dict:
    """``vime-gemma4 import`` then ``export`` with one rank in this process (no --nproc, no torchrun)."""
    from vime_gemma4_bridge.cli import main as cli

    root = tmp_path_factory.mktemp("single")
    hf = checkpoints["moe-vl"]
    save, out = root / "torch_dist", root / "hf"
    times = {}
    start = time.monotonic()
    assert cli.main(["import", "--hf-checkpoint", str(hf), "--save", str(save), "--json"]) == 0
    times["import"] = time.monotonic() - start
    start = time.monotonic()
    assert cli.main(["export", "--load", str(save), "--hf-checkpoint", str(hf), "--output", str(out), "--json"]) == 0
    times["export"] = time.monotonic() - start
    return {"hf": hf, "save": save, "out": out, "times": times}


def test_cli_import_then_export_in_process_is_bitwise(single_rank, capsys) -> None:
    assert_same_checkpoint(single_rank["hf"], single_rank["out"])
    save = single_rank["save"]
    assert (save / TRACKER_NAME).read_text().strip() == "0"
    assert {p.name for p in (save / ITERATION_DIR).iterdir()} >= {
        "metadata.json",
        ".metadata",
        "__0_0.distcp",
        RUN_CONFIG_NAME,
        SIDECAR_NAME,
    }
    assert not leftovers(save) and not leftovers(single_rank["out"])


def test_json_report_is_the_only_stdout(single_rank, capsys, tmp_path: Path) -> None:
    """stdout carries exactly one JSON report (progress bars and logs go to stderr)."""
    out = tmp_path / "again"
    argv = ["export", "--load", single_rank["save"], "--hf-checkpoint", single_rank["hf"], "--output", out, "--json"]
    code, stdout, stderr, _ = run_cli(capsys, *argv)
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["command"] == "export" and report["ok"]
    assert report["topology"] == "TP1·PP1·EP1·ETP1" and report["world_size"] == 1
    assert report["tensors"] == 88 and report["bytes"] > 0 and report["seconds"] > 0 and report["gb_per_s"] >= 0
    assert set(report["phases"]) == {"verify", "build", "load", "write"}  # the export arrives into the write
    assert "Writing again" in stderr  # the write's progress bar (the export streams into it), on stderr


def test_text_report_and_force_replaces_only_when_complete(single_rank, capsys, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "old-file").write_text("old")
    argv = ["import", "--hf-checkpoint", single_rank["hf"], "--save", save]
    assert_refused(capsys, argv, ("already exists", "--force"), save)
    code, stdout, stderr, _ = run_cli(capsys, *argv, "--force")
    assert code == 0, stderr
    assert stdout.startswith("import OK: 88 language-model tensors, 739,272 bytes, at TP1·PP1·EP1·ETP1 on 1 rank(s)")
    assert "GB/s" in stdout and f"wrote torch_dist {save / ITERATION_DIR}" in stdout
    assert not (save / "old-file").exists() and (save / TRACKER_NAME).is_file()
    assert not leftovers(save)


def test_run_config_instantiates_the_provider(single_rank) -> None:
    """Megatron-Bridge's loader can rebuild the model from run_config.yaml (allow-listed targets)."""
    from vime_gemma4_bridge.core.provider import Gemma4TextModelProvider
    from vime_gemma4_bridge.core.spec import gemma4_block_spec
    from vime_gemma4_bridge.io.torch_dist import provider_from_run_config

    provider = provider_from_run_config(single_rank["save"] / ITERATION_DIR)
    assert type(provider) is Gemma4TextModelProvider
    assert provider.transformer_layer_spec is gemma4_block_spec
    assert (provider.num_layers, provider.hidden_size, provider.num_moe_experts) == (4, 64, 16)
    assert provider.layer_types == ["sliding_attention", "full_attention"] * 2
    sidecar = json.loads((single_rank["save"] / ITERATION_DIR / SIDECAR_NAME).read_text())
    assert sidecar["hf_config"] == json.loads((single_rank["hf"] / "config.json").read_text())
    assert len(sidecar["language_model"]) == 88


def test_import_refusals(checkpoints, capsys, tmp_path: Path) -> None:
    hf = checkpoints["moe-vl"]
    save = tmp_path / "out"
    base = ["import", "--hf-checkpoint", hf, "--save", save]
    refusals = [
        (["--ep", "3", "--nproc", "3"], ("16 experts", "--ep 3")),
        (["--tp", "3", "--nproc", "3"], ("16 attention heads", "--tp 3")),
        (["--tp", "16", "--nproc", "16"], ("8 KV heads", "--tp 16")),
        (["--etp", "3", "--nproc", "3"], ("16 expert FFN size (moe_intermediate_size)", "--etp 3")),
        (["--pp", "3", "--nproc", "3"], ("4 layers", "PP×VPP", "3")),
        (["--pp", "2", "--vpp", "4", "--nproc", "2"], ("4 layers", "PP×VPP", "8")),
        (["--tp", "2", "--pp", "2", "--nproc", "2"], ("does not fit 2 rank(s)", "--nproc 4")),
        (["--ep", "4", "--nproc", "6"], ("does not fit 6 rank(s)", "ETP·EP·PP")),
        (["--nproc", "0"], ("--nproc (the world size; under torchrun its WORLD_SIZE) must be a whole number",)),
        (["--vpp", "2", "--nproc", "2"], ("--vpp 2 needs pipeline parallelism",)),
    ]
    for extra, needles in refusals:
        assert_refused(capsys, base + extra, needles, save)

    # A whole checkpoint of that shape: the split is checked after the tensors agree with the config.
    ffn36 = dataclasses.replace(CHECKPOINTS["moe-vl"], intermediate_size=36, attention_k_eq_v=False)
    ffn = write_tiny_checkpoint(tmp_path / "ffn36", ffn36)
    argv = ["import", "--hf-checkpoint", ffn, "--save", save, "--tp", "8", "--nproc", "8"]
    assert_refused(capsys, argv, ("36 FFN size (intermediate_size)", "--tp 8"), save)

    llama = variant(hf, tmp_path / "llama", top={"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert_refused(capsys, ["import", "--hf-checkpoint", llama, "--save", save], ("not a Gemma 4 checkpoint",), save)
    gemma3 = variant(hf, tmp_path / "gemma3", text={"model_type": "gemma3_text"})
    assert_refused(capsys, ["import", "--hf-checkpoint", gemma3, "--save", save], ("is not Gemma 4",), save)

    file_out = tmp_path / "a-file"
    file_out.write_text("x")
    assert_refused(capsys, ["import", "--hf-checkpoint", hf, "--save", file_out], ("is a file",), file_out)
    inside = hf / "megatron"
    assert_refused(capsys, ["import", "--hf-checkpoint", hf, "--save", inside, "--force"], ("overlaps",), inside)
    assert_refused(capsys, ["import", "--hf-checkpoint", hf, "--save", hf, "--force"], ("overlaps",), hf)
    missing = tmp_path / "nowhere"
    assert_refused(capsys, ["import", "--hf-checkpoint", missing, "--save", save], ("is not a directory",), save)


@pytest.fixture(scope="module")
def sharded(checkpoints, tmp_path_factory) -> Path:
    """moe-vl re-written in 200 kB shards with an index."""
    from vime_gemma4_bridge.io import hf as hf_io
    from vime_gemma4_bridge.io import hf_write

    source = hf_io.HFCheckpoint(checkpoints["moe-vl"])
    out = tmp_path_factory.mktemp("sharded") / "moe-vl-sharded"
    hf_write.write_hf_checkpoint(out, source.load(source.language_model_names()), source, max_shard_size=200_000)
    assert len(list(out.glob("*.safetensors"))) > 2
    return out


def test_damaged_hf_checkpoint_refusals(sharded, capsys, tmp_path: Path) -> None:
    from vime_gemma4_bridge.io.hf import INDEX_NAME

    save = tmp_path / "out"
    shards = sorted(sharded.glob("*.safetensors"))

    no_shard = tmp_path / "no-shard"
    shutil.copytree(sharded, no_shard)
    (no_shard / shards[1].name).unlink()
    argv = ["import", "--hf-checkpoint", no_shard, "--save", save]
    assert_refused(capsys, argv, ("safetensors shard", shards[1].name, "is missing"), save)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(sharded, corrupt)
    data = bytearray((corrupt / shards[0].name).read_bytes())
    data[:16] = b"\xff" * 16  # the header length and the start of the JSON header
    (corrupt / shards[0].name).write_bytes(bytes(data))
    argv = ["import", "--hf-checkpoint", corrupt, "--save", save]
    assert_refused(capsys, argv, ("safetensors shard", shards[0].name, "unreadable or corrupt"), save)

    ghost = tmp_path / "ghost"
    shutil.copytree(sharded, ghost)
    index = json.loads((ghost / INDEX_NAME).read_text())
    index["weight_map"]["model.language_model.layers.0.ghost.weight"] = shards[0].name
    (ghost / INDEX_NAME).write_text(json.dumps(index))
    argv = ["import", "--hf-checkpoint", ghost, "--save", save]
    assert_refused(capsys, argv, ("model.language_model.layers.0.ghost.weight", "does not hold it"), save)


def test_export_refusals(single_rank, checkpoints, capsys, tmp_path: Path) -> None:
    hf, ckpt = single_rank["hf"], single_rank["save"]
    out = tmp_path / "hf-out"
    base = ["export", "--load", ckpt, "--hf-checkpoint", hf, "--output", out]

    other = checkpoints["causal-irregular-32E"]
    argv = ["export", "--load", ckpt, "--hf-checkpoint", other, "--output", out]
    assert_refused(capsys, argv, ("holds a different model", "num_hidden_layers is 4 there and 6 here"), out)
    fp32 = write_tiny_checkpoint(tmp_path / "fp32", dataclasses.replace(CHECKPOINTS["moe-vl"], dtype="float32"))
    argv = ["export", "--load", ckpt, "--hf-checkpoint", fp32, "--output", out]
    needles = ("holds a different model", "model.language_model.", "BF16[", "there and F32[", "trained from")
    assert_refused(capsys, argv, needles, out)

    wider = write_tiny_checkpoint(tmp_path / "wider", dataclasses.replace(CHECKPOINTS["moe-vl"], vocab_size=512))
    argv = ["export", "--load", ckpt, "--hf-checkpoint", wider, "--output", out]
    assert_refused(capsys, argv, ("holds a different model", "vocab_size is 300 there and 512 here"), out)

    assert_refused(capsys, base + ["--ep", "3", "--nproc", "3"], ("16 experts", "--ep 3"), out)
    assert_refused(capsys, base + ["--tp", "2", "--pp", "2", "--nproc", "2"], ("does not fit 2 rank(s)",), out)
    assert_refused(capsys, base + ["--max-shard-size", "lots"], ("--max-shard-size 'lots' is not a size",), out)

    not_ckpt = tmp_path / "not-a-checkpoint"
    not_ckpt.mkdir()
    argv = ["export", "--load", not_ckpt, "--hf-checkpoint", hf, "--output", out]
    assert_refused(capsys, argv, ("is not a torch_dist checkpoint", TRACKER_NAME, "vime-gemma4 import"), out)
    argv = ["export", "--load", tmp_path / "missing", "--hf-checkpoint", hf, "--output", out]
    assert_refused(capsys, argv, ("is not a directory",), out)

    half = tmp_path / "half"
    shutil.copytree(ckpt, half)
    (half / ITERATION_DIR / "metadata.json").unlink()
    argv = ["export", "--load", half, "--hf-checkpoint", hf, "--output", out]
    assert_refused(capsys, argv, ("no metadata.json", "incomplete or damaged"), out)

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep").write_text("keep")
    argv = ["export", "--load", ckpt, "--hf-checkpoint", hf, "--output", existing]
    assert_refused(capsys, argv, ("already exists", "--force"), existing)
    file_out = tmp_path / "a-file"
    file_out.write_text("x")
    argv = ["export", "--load", ckpt, "--hf-checkpoint", hf, "--output", file_out]
    assert_refused(capsys, argv, ("is a file",), file_out)
    for target, flag in ((hf, "--hf-checkpoint"), (ckpt, "--load"), (ckpt / ITERATION_DIR / "hf", "--load")):
        argv = ["export", "--load", ckpt, "--hf-checkpoint", hf, "--output", target, "--force"]
        assert_refused(capsys, argv, ("overlaps", flag), target)


def test_torch_dist_without_sidecar_is_checked_by_run_config(single_rank, checkpoints, capsys, tmp_path) -> None:
    """A checkpoint without vime_gemma4.json (e.g. from training) is checked through run_config.yaml."""
    bare = tmp_path / "bare"
    shutil.copytree(single_rank["save"], bare)
    (bare / ITERATION_DIR / SIDECAR_NAME).unlink()
    (bare / ITERATION_DIR / DIGESTS_NAME).unlink()  # a training run's save records no digests either
    out = tmp_path / "out"
    argv = ["export", "--load", bare, "--hf-checkpoint", checkpoints["causal-irregular-32E"], "--output", out]
    assert_refused(capsys, argv, ("holds a different model", "num_layers is 4 there", "num_hidden_layers is 6"), out)

    # Nothing left to check before ranks start: the rank refuses, in one line, and writes nothing.
    (bare / ITERATION_DIR / RUN_CONFIG_NAME).unlink()
    fp32 = write_tiny_checkpoint(tmp_path / "fp32", dataclasses.replace(CHECKPOINTS["moe-vl"], dtype="float32"))
    code, stdout, stderr, _ = run_cli(capsys, "export", "--load", bare, "--hf-checkpoint", fp32, "--output", out)
    assert code == 1 and stdout == ""
    errors = [line for line in stderr.splitlines() if line.startswith("vime-gemma4 ")]
    assert len(errors) == 1 and errors[0].startswith("vime-gemma4 export: error: torch_dist tensor "), stderr
    assert "is torch.bfloat16 but this model is torch.float32" in errors[0]
    assert not out.exists() and not leftovers(out)


def test_refusal_through_the_installed_program(checkpoints, tmp_path: Path) -> None:
    """The acceptance refusal, as a user runs it: non-zero within seconds, names experts and EP, no directory."""
    save = tmp_path / "never"
    argv = [VENV_BIN / "vime-gemma4", "import", "--hf-checkpoint", checkpoints["moe-vl"], "--save", save]
    start = time.monotonic()
    proc = subprocess.run([str(a) for a in argv] + ["--ep", "3", "--nproc", "3"], capture_output=True, text=True)
    seconds = time.monotonic() - start
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "vime-gemma4 import: error: 16 experts do not divide by --ep 3; choose a divisor of 16" in proc.stderr
    assert not save.exists() and not leftovers(save)
    assert seconds < 90, f"{seconds:.0f} s: the program imports megatron once and starts no rank"


# --------------------------------------------------------------------------------------------
# Cross-topology on real ranks: 8, then 4, then 2 (one world each)
# --------------------------------------------------------------------------------------------

#: name: (checkpoint, topology saved at). All imported in the 8-rank world.
IMPORTS_8 = {
    "A": ("moe-vl", Topology(tp=2, pp=2, ep=4, etp=1)),
    "B": ("causal-irregular-32E", Topology(ep=8)),
    "C": ("causal-fp32-8E", Topology(tp=2, pp=2)),
}


@pytest.fixture(scope="module")
def imported_8(local_world, checkpoints, tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("torch_dist_8")
    world = local_world(8)
    results = {}
    for name, (checkpoint, topology) in IMPORTS_8.items():
        save = root / name
        start = time.monotonic()
        reports = world.run(
            import_job, str(checkpoints[checkpoint]), str(save), str(root / f".{name}.partial"), topology
        )
        results[name] = {"save": save, "hf": checkpoints[checkpoint], "report": reports[0], "reports": reports}
        results[name]["seconds"] = time.monotonic() - start
    return results


def test_imports_on_8_ranks_have_megatron_layout(imported_8) -> None:
    for name, result in imported_8.items():
        save, report = result["save"], result["report"]
        assert report["topology"] == str(IMPORTS_8[name][1]) and report["world_size"] == 8
        assert (save / TRACKER_NAME).read_text() == "0\n"
        files = {p.name for p in (save / ITERATION_DIR).iterdir()}
        assert {"metadata.json", ".metadata", "__0_0.distcp", RUN_CONFIG_NAME, SIDECAR_NAME} <= files
        # Only main replicas write: at TP2·PP2·EP4 every rank holds its own experts, so all 8 ranks write.
        writers = {f for f in files if f.endswith(".distcp")}
        assert writers == ({f"__{rank}_0.distcp" for rank in range(8)} if name == "A" else writers) != set()
        meta = json.loads((save / ITERATION_DIR / "metadata.json").read_text())
        assert meta["sharded_backend"] == "torch_dist"
        sidecar = json.loads((save / ITERATION_DIR / SIDECAR_NAME).read_text())
        assert (
            sidecar["saved_at"]["topology"] == report["topology"]
            and len(sidecar["language_model"]) == report["tensors"]
        )
        assert not leftovers(save)


def _writer_spawned_a_manager() -> bool:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async._results_queue is not None


def test_saves_spawn_no_results_manager(local_world, imported_8) -> None:
    """The synchronous saves pass their write results in-process: no ~2 s helper process per run (UPSTREAM 27)."""
    assert not any(local_world(8).run(_writer_spawned_a_manager))


def test_torch_dist_common_state_is_what_megatron_load_reads(imported_8) -> None:
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(imported_8["A"]["save"] / ITERATION_DIR))
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    assert metadata == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    tensors = dist_checkpointing.load_tensors_metadata(str(imported_8["A"]["save"] / ITERATION_DIR))
    # One global tensor per expert axis (TE's layout), attention keyed per layer type (upstream's).
    assert tuple(tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].global_shape)[:2] == (4, 16)
    assert "decoder.layers.self_attention_global.linear_qkv.weight" in tensors
    assert "decoder.layers.self_attention_sliding.linear_qkv.weight" in tensors


def test_pickle_allow_list_admits_checkpoints_of_every_topology(imported_8) -> None:
    """What megatron-core writes at TP2·PP2·EP4, EP8 and TP2·PP2 (fp32) passes the pre-flight's allow-list.

    The list is also checked by every export in the suite (the pre-flight of ``export`` runs it);
    these three are the topologies and dtypes whose byte items and metadata differ most.
    """
    for result in imported_8.values():
        TorchDistCheckpoint(result["save"]).check_files()


def test_back_tp2pp2_import_exports_at_ep8(local_world, imported_8, tmp_path: Path) -> None:
    c = imported_8["C"]
    out = tmp_path / "C-ep8"
    report = local_world(8).run(export_job, str(c["save"]), str(c["hf"]), str(out), Topology(ep=8), False, 10**9)[0]
    assert report["topology"] == "TP1·PP1·EP8·ETP1" and report["world_size"] == 8
    assert_same_checkpoint(c["hf"], out, ep=8)


def test_ep8_import_exports_at_tp2pp2_on_4_ranks(local_world, imported_8, tmp_path: Path) -> None:
    b = imported_8["B"]
    out = tmp_path / "B-tp2pp2"
    report = local_world(4).run(export_job, str(b["save"]), str(b["hf"]), str(out), Topology(tp=2, pp=2), False, 10**9)
    assert report[0]["topology"] == "TP2·PP2·EP1·ETP1" and report[0]["world_size"] == 4
    assert_same_checkpoint(b["hf"], out, ep=8)


def _export_watching_rank0(load: str, hf_checkpoint: str, output: str, topology: Topology) -> dict:
    """``export_job`` with every tensor rank 0's writer takes watched: at each ``put``, how many of the
    tensors put before are still alive (a rank 0 that collected the language model holds them all)."""
    import weakref
    from unittest import mock

    from vime_gemma4_bridge.io import hf_write

    taken: list[weakref.ref] = []
    alive: list[int] = []
    put = hf_write.CheckpointWriter.put

    def watched(self, name: str, tensor) -> None:
        alive.append(sum(ref() is not None for ref in taken))
        put(self, name, tensor)
        taken.append(weakref.ref(tensor))

    with mock.patch.object(hf_write.CheckpointWriter, "put", watched):
        export_job(load, hf_checkpoint, output, topology, False, 10**9)
    return {"puts": len(taken), "most_alive": max(alive, default=0)}


def test_export_at_a_topology_writes_each_tensor_as_it_arrives(local_world, imported_8, tmp_path: Path) -> None:
    """TP2·PP2·EP2 on 8 ranks: rank 0 writes each exported tensor and drops it before the next arrives
    (issue 50, item 3); it used to collect all 88 before writing the first."""
    a = imported_8["A"]
    out = tmp_path / "A-tp2pp2ep2"
    watched = local_world(8).run(
        _export_watching_rank0, str(a["save"]), str(a["hf"]), str(out), Topology(tp=2, pp=2, ep=2)
    )
    assert watched[0]["puts"] == 88 and watched[0]["most_alive"] == 0, watched[0]
    assert_same_checkpoint(a["hf"], out, ep=2)


def _export_beside_a_gpu(load: str, hf_checkpoint: str, output: str, topology: Topology) -> dict:
    """``export_job`` on gloo ranks of a machine with a GPU: ``torch.cuda.is_available()`` answers True (stood
    in: this machine has none), and the ranks compute on the CPU (``compat.cuda.on_host``)."""
    from unittest import mock

    import torch

    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        return export_job(load, hf_checkpoint, output, topology, False, 10**9)


def test_one_consumer_export_on_gloo_ranks_beside_a_gpu(local_world, imported_8, tmp_path: Path) -> None:
    """At PP2 the one-consumer export receives the other stage's weights into CPU tensors on gloo ranks even
    where CUDA is available (scripts/gpu_check.sh's export at PP2 with --nproc on a GPU host): it allocated
    the receive buffer on CUDA whenever CUDA was available, which gloo's ``recv`` refuses."""
    b = imported_8["B"]
    out = tmp_path / "B-pp2"
    local_world(2).run(_export_beside_a_gpu, str(b["save"]), str(b["hf"]), str(out), Topology(pp=2))
    assert_same_checkpoint(b["hf"], out, ep=8)


def test_tp2pp2ep4_import_exports_at_tp1pp1ep2_on_2_ranks(local_world, imported_8, tmp_path: Path) -> None:
    """The acceptance path: sharded output with an index, sources untouched, every tensor bitwise."""
    from vime_gemma4_bridge.io import hf as hf_io

    a = imported_8["A"]
    out = tmp_path / "A-ep2"
    sources = {p: digest(p) for p in (a["hf"], a["save"])}
    report = local_world(2).run(export_job, str(a["save"]), str(a["hf"]), str(out), Topology(ep=2), False, 200_000)[0]
    assert report["topology"] == "TP1·PP1·EP2·ETP1" and report["world_size"] == 2
    assert report["tensors"] == 88 and report["hf_output"]["shards"] > 2
    assert_same_checkpoint(a["hf"], out, ep=4)
    index = json.loads((out / hf_io.INDEX_NAME).read_text())
    shards = {p.name for p in out.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == shards
    assert len(index["weight_map"]) == len(hf_io.HFCheckpoint(a["hf"]).names())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in hf_io.HFCheckpoint(out).load().values()
    )
    assert all(digest(p) == before for p, before in sources.items()), "a source was modified"
    assert not leftovers(out)


def _provider_rebuild_job(save: str, hf_checkpoint: str, topology: Topology) -> dict | None:
    """Build the model from run_config.yaml alone (as Megatron-Bridge's loader does), load, export, compare."""
    import torch.distributed as dist

    from vime_gemma4_bridge.convert import cpu_host
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io import hf as hf_io
    from vime_gemma4_bridge.io import torch_dist
    from vime_gemma4_bridge.verify import report

    init_model_parallel(topology)
    iteration_dir = Path(save) / ITERATION_DIR
    provider = torch_dist.provider_from_run_config(iteration_dir)
    for field, value in topology.megatron_kwargs().items():
        setattr(provider, field, value)
    provider.use_cpu_initialization = True
    provider.finalize()
    # provider.provide_distributed_model, as a trainer calls it; on this CPU host through the adapter.
    model = cpu_host.provide_model(
        provider,
        wrap_with_ddp=False,
        use_cpu_initialization=True,
        init_model_with_meta_device=False,
        mixed_precision_wrapper=None,
    )
    torch_dist.load_torch_dist(model, iteration_dir)
    bridge = convert.open_bridge(hf_checkpoint)  # names only: the HF side of the mapping
    exported = {name: tensor.clone() for name, tensor in convert.export_to_rank0(bridge, model)}
    result = None
    if dist.get_rank() == 0:
        source = hf_io.HFCheckpoint(hf_checkpoint)
        result = report.compare(source.load(source.language_model_names()), exported).as_dict()
    return convert.broadcast_from_rank0(result)


def test_model_rebuilt_from_run_config_loads_bitwise(local_world, imported_8) -> None:
    a = imported_8["A"]
    result = local_world(2).run(_provider_rebuild_job, str(a["save"]), str(a["hf"]), Topology(tp=2))[0]
    assert result["identical"], result


@pytest.mark.parametrize(
    ("checkpoint", "saved_at", "loaded_at"),
    [
        ("moe-vl", Topology(pp=2, vpp=2), Topology(tp=2)),
        ("causal-fp32-8E", Topology(ep=2), Topology(pp=2, vpp=2)),
        ("dense-vl", Topology(tp=2), Topology()),
        ("moe-vocab-1001", Topology(tp=2), Topology()),
        ("moe-vocab-1001", Topology(), Topology(tp=2)),
        ("dense-vocab-1001", Topology(tp=2), Topology()),
    ],
    ids=str,
)
def test_more_pairs_on_2_ranks(local_world, checkpoints, tmp_path, checkpoint, saved_at, loaded_at) -> None:
    """VPP (model0/model1 chunks) both ways, fp32, the dense model, a padded vocabulary both ways."""
    world = local_world(2)
    hf, save, out = checkpoints[checkpoint], tmp_path / "torch_dist", tmp_path / "hf"
    world.run(import_job, str(hf), str(save), str(tmp_path / ".partial"), saved_at)
    world.run(export_job, str(save), str(hf), str(out), loaded_at, False, 10**9)
    assert_same_checkpoint(hf, out)


@pytest.mark.parametrize(
    ("checkpoint", "saved_at", "streamed", "loader"),
    [
        ("causal-irregular-32E", Topology(ep=2), True, "direct"),  # whole chunks everywhere: no load plan
        ("causal-fp32-8E", Topology(pp=2), True, "direct"),
        ("moe-vl", Topology(tp=2), True, "dist_checkpointing"),  # experts whole, attention split over TP
        ("moe-vl", Topology(tp=2, etp=2), False, "dist_checkpointing"),  # experts split: the general path
    ],
    ids=str,
)
def test_default_topology_export_streams_experts_when_stored_whole(
    local_world, checkpoints, tmp_path, checkpoint, saved_at, streamed, loader
) -> None:
    """``export`` without topology flags on 2 ranks: experts streamed iff the checkpoint stores them whole."""
    world = local_world(2)
    hf, save, out = checkpoints[checkpoint], tmp_path / "torch_dist", tmp_path / "hf"
    world.run(import_job, str(hf), str(save), str(tmp_path / ".partial"), saved_at)
    report = world.run(export_job, str(save), str(hf), str(out), Topology(), False, 10**9)[0]
    assert (report["experts_streamed"], report["loader"]) == (streamed, loader)
    assert_same_checkpoint(hf, out)


def _export_under_the_live_sync_switch(*job_args: Any) -> dict:
    """export_job with ``VIME_GEMMA4_EXPERT_LAYOUT=per-expert`` in this rank's environment (vime's actor)."""
    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV, PER_EXPERT
    from vime_gemma4_bridge.runtime.world import environment

    with environment({EXPERT_LAYOUT_ENV: PER_EXPERT}):
        return export_job(*job_args)


@pytest.mark.parametrize("topology", [Topology(), Topology(ep=2)], ids=str)
def test_export_keeps_the_checkpoint_layout_under_the_live_sync_switch(
    local_world, single_rank, tmp_path, topology
) -> None:
    """The expert-layout variable switches vime's live sync alone: an export with it set writes the
    stacked experts, bitwise, through the model at EP2 (the bridge's grouped hook; fails without
    ``convert/model``'s stacked layout) and streamed at the default topology (experts read from the
    files, never through the hook: this road cannot be switched, and the test keeps it so)."""
    hf, out = single_rank["hf"], tmp_path / "hf"
    args = (str(single_rank["save"]), str(hf), str(out), topology, False, 10**9)
    report = local_world(2).run(_export_under_the_live_sync_switch, *args)[0]
    assert report["experts_streamed"] == (topology == Topology())
    assert_same_checkpoint(hf, out)


def _import_patched(owner: str, name: str, replacement: Any, *job_args: Any) -> dict:
    """import_job with ``owner.name`` replaced in this rank for the call (a fault planted on purpose).

    ``owner`` is a module, or ``module:Class``; the original is put back afterwards.
    """
    module, _, cls = owner.partition(":")
    target = importlib.import_module(module)
    target = getattr(target, cls) if cls else target
    had = name in vars(target)
    original = vars(target).get(name)
    setattr(target, name, replacement)
    try:
        return import_job(*job_args)
    finally:
        if had:
            setattr(target, name, original)
        else:
            delattr(target, name)


def _raise(error: type[Exception], message: str, *args: Any, **kwargs: Any) -> None:
    raise error(message)


def _shifted_hf_to_megatron(self: Any, hf_weights: Any, megatron_module: Any) -> Any:
    """Upstream's gate/up import, rolled by one row: a mapping that is not a plain slice of the HF tensor."""
    from megatron.bridge.models.conversion import param_mapping

    return param_mapping.FusedGatedExpertMapping.hf_to_megatron(self, hf_weights, megatron_module).roll(1, dims=0)


#: A failure after the torch_dist files are written, before the checkpoint is complete.
_IMPORT_FAILING_AFTER_SAVE = functools.partial(
    _import_patched,
    "vime_gemma4_bridge.io.torch_dist",
    "write_run_config",
    functools.partial(_raise, OSError, "disk full (injected)"),
)


def test_failed_import_leaves_nothing(local_world, checkpoints, tmp_path: Path) -> None:
    save, partial = tmp_path / "ckpt", tmp_path / ".ckpt.partial-test"
    with pytest.raises(RankError, match="disk full"):
        local_world(2).run(
            _IMPORT_FAILING_AFTER_SAVE, str(checkpoints["moe-vl"]), str(save), str(partial), Topology(ep=2)
        )
    assert not save.exists() and not partial.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _import_general_path(hf_checkpoint: str, save: str, partial: str, topology: Topology) -> dict:
    """import_job with the streaming plan declined: megatron-core saves every expert itself (the reference)."""
    from vime_gemma4_bridge.convert import stream_import

    original = stream_import.plan_import
    stream_import.plan_import = lambda *args: None
    try:
        return import_job(hf_checkpoint, save, partial, topology)
    finally:
        stream_import.plan_import = original


def assert_same_torch_dist(reference: Path, candidate: Path) -> None:
    """The same PyTorch checkpoint metadata (keys, shapes, dtypes, chunks, items, plans) and every chunk bitwise."""
    from torch.distributed.checkpoint import FileSystemReader

    from vime_gemma4_bridge.io.torch_dist_reader import TorchDistReader

    def layout(path: Path) -> tuple[dict, set, set]:
        metadata = FileSystemReader(str(path)).read_metadata()
        tensors = {
            key: (
                type(meta).__name__,
                tuple(getattr(meta, "size", ())),
                str(getattr(meta, "properties", "")),
                sorted((tuple(c.offsets), tuple(c.sizes)) for c in getattr(meta, "chunks", ())),
            )
            for key, meta in metadata.state_dict_metadata.items()
        }
        items = {(index.fqn, tuple(index.offset or ())) for index in metadata.storage_data}
        planned = {
            (item.index.fqn, tuple(item.index.offset or ())) for plan in metadata.all_local_plans for item in plan.items
        }
        return tensors, items, planned

    assert layout(reference) == layout(candidate)
    a, b = TorchDistReader(reference), TorchDistReader(candidate)
    tensors = layout(reference)[0]
    for key in a.tensor_keys():
        for offsets, sizes in tensors[key][3]:
            assert a.read(key, offsets, sizes).equal(b.read(key, offsets, sizes)), (key, offsets)


@pytest.mark.parametrize("checkpoint", ["moe-vl", "causal-irregular-32E"])
def test_default_topology_import_streams_experts_as_megatron_core_saves_them(
    local_world, checkpoints, tmp_path, checkpoint
) -> None:
    """Streamed from the HF shards, the torch_dist items and metadata are megatron-core's own, bitwise."""
    world = local_world(2)
    hf = str(checkpoints[checkpoint])
    streamed = world.run(import_job, hf, str(tmp_path / "streamed"), str(tmp_path / ".s"), Topology())[0]
    general = world.run(_import_general_path, hf, str(tmp_path / "general"), str(tmp_path / ".g"), Topology())[0]
    assert streamed["experts_streamed"] and not general["experts_streamed"]
    assert_same_torch_dist(tmp_path / "general" / ITERATION_DIR, tmp_path / "streamed" / ITERATION_DIR)
    files = sorted(p.name for p in (tmp_path / "streamed" / ITERATION_DIR).glob("*.distcp"))
    assert {"__0_streamed_0.distcp", "__0_streamed_1.distcp", "__0_streamed_2.distcp"} <= set(files), files


@pytest.fixture(scope="module")
def streamed_import(local_world, checkpoints, tmp_path_factory) -> Path:
    """The tiny VL checkpoint imported at the default topology on 2 ranks (experts streamed)."""
    out = tmp_path_factory.mktemp("streamed") / "torch_dist"
    report = local_world(2).run(import_job, str(checkpoints["moe-vl"]), str(out), str(out.parent / ".p"), Topology())
    assert report[0]["experts_streamed"]
    return out


@pytest.mark.parametrize(
    "loaded_at",
    [Topology(tp=2), Topology(pp=2, vpp=2), Topology(ep=2), Topology(tp=2, etp=2), Topology()],
    ids=str,
)
def test_streamed_import_loads_with_megatron_core_at_other_topologies(
    local_world, checkpoints, streamed_import, tmp_path, loaded_at
) -> None:
    """megatron-core's own loader (every topology but the default, which reads chunks directly) gets it right."""
    report = local_world(2).run(
        export_job, str(streamed_import), str(checkpoints["moe-vl"]), str(tmp_path / "hf"), loaded_at, False, 10**9
    )[0]
    assert report["loader"] == ("direct" if loaded_at == Topology() else "dist_checkpointing")
    assert_same_checkpoint(checkpoints["moe-vl"], tmp_path / "hf")


@pytest.mark.parametrize(
    ("job", "message"),
    [
        # The gate/up mapping is not a plain slice of the HF tensor: expert 0's check must stop the import.
        (
            functools.partial(
                _import_patched,
                "vime_gemma4_bridge.compat.mappings:FusedGatedExpertMapping",
                "hf_to_megatron",
                _shifted_hf_to_megatron,
            ),
            "is not a plain slice",
        ),
        # megatron-core's save fails while the expert files are being written.
        (
            functools.partial(
                _import_patched,
                "vime_gemma4_bridge.io.torch_dist",
                "save_torch_dist",
                functools.partial(_raise, OSError, "no space left on device (injected)"),
            ),
            "no space left",
        ),
    ],
    ids=["expert-0-check", "save-fails"],
)
def test_streaming_import_failures_leave_nothing(local_world, checkpoints, tmp_path, job, message) -> None:
    save, partial = tmp_path / "ckpt", tmp_path / ".ckpt.partial-test"
    with pytest.raises(RankError, match=message):
        local_world(2).run(job, str(checkpoints["moe-vl"]), str(save), str(partial), Topology())
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The scripts, as programs: under torchrun and with plain python
# --------------------------------------------------------------------------------------------


def test_scripts_under_torchrun_and_python(checkpoints, tmp_path: Path) -> None:
    hf = checkpoints["moe-vl"]
    save, out = tmp_path / "torch_dist", tmp_path / "hf"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "1"]
    script = str(ROOT / "scripts" / "convert_hf_to_torch_dist.py")
    proc = subprocess.run(
        [*torchrun, script, "--hf-checkpoint", str(hf), "--save", str(save), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["command"] == "import"
    script = str(ROOT / "scripts" / "convert_torch_dist_to_hf.py")
    proc = subprocess.run(
        [sys.executable, script, "--load", str(save), "--hf-checkpoint", str(hf), "--output", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("export OK: 88 language-model tensors")
    assert_same_checkpoint(hf, out)
