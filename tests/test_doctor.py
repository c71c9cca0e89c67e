"""The checkpoint doctor names planted faults; the probe follows experts through the real export.

Each ``compare`` test plants one fault of the kind a broken conversion leaves (the original bug:
expert 0 copied over expert E/EP) into a copy of a tiny checkpoint (every tensor distinct, config
and tokenizer kept) and checks the diagnosis, the first line and the exit status. The probe tests
run Megatron-Bridge's own export on shared gloo CPU ranks: on a correct checkpoint every stage
matches; with the original EP bug re-created inside the bridge, the EP gather is flagged first.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vime_gemma4_bridge.cli import compare as compare_command
from vime_gemma4_bridge.cli import probe as probe_command
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify import probe
from vime_gemma4_bridge.verify.report import ep_boundary_pairs

SPEC = TinySpec()  # VL, MoE: 4 layers (sliding, full, sliding, full), 16 experts, bf16
E = SPEC.experts
P = "model.language_model."
L = P + "layers."


@pytest.fixture(scope="module")
def hf1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("doctor") / "hf1", SPEC)


def plant(source: Path, out: Path, mutate: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy ``source`` (config, tokenizer and all) to ``out`` and rewrite its weights through ``mutate``."""
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    mutate(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


def compare(a: Path, b: Path, *options: str) -> tuple[int, str]:
    """Run the ``compare`` sub-command in this process: (exit status, stdout)."""
    import contextlib
    import io

    parser = argparse.ArgumentParser()
    compare_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["compare", str(a), str(b), *options])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = args.func(args)
    return status, out.getvalue()


def diagnose(a: Path, b: Path, *options: str) -> tuple[int, str, dict]:
    """(exit status, human text, JSON report) of one comparison."""
    status, text = compare(a, b, *options)
    json_status, raw = compare(a, b, "--json", *options)
    assert json_status == status
    return status, text, json.loads(raw)


def first_cause(report: dict) -> dict:
    assert report["causes"], report["summary"]
    return report["causes"][0]


# ----------------------------------------------------------------------------------- compare


def test_identical_checkpoints_exit_0(hf1: Path, tmp_path: Path) -> None:
    copy = plant(hf1, tmp_path / "copy", lambda t: None)
    status, text, report = diagnose(hf1, copy)
    assert status == 0
    assert re.match(r"IDENTICAL: \d+ tensors$", text.splitlines()[0])
    assert report["identical"] and not report["causes"]
    assert report["counts"]["equal"] == report["counts"]["compared"] > 0
    experts = report["experts"]["1"]["gate_up_proj"]
    assert len(experts) == E and all(row["status"] == "ok" and row["a"] == row["b"] for row in experts)
    assert all(re.fullmatch(r"[0-9a-f]{10}", row["a"]["hash"]) for row in experts)


def test_expert_copied_over_expert_half_is_named(hf1: Path, tmp_path: Path) -> None:
    """Acceptance: expert 0 copied over expert E/2 in one layer → exit != 0, a 'duplicat…' line naming E/2."""

    def mutate(t: dict[str, torch.Tensor]) -> None:
        for kind in ("gate_up_proj", "down_proj"):
            t[f"{L}1.experts.{kind}"][E // 2] = t[f"{L}1.experts.{kind}"][0]

    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "dup", mutate))
    assert status != 0
    assert text.startswith("DIFFERENT: ")
    lines = [line for line in text.splitlines() if "duplicat" in line and re.search(rf"\bexpert {E // 2}\b", line)]
    assert lines and lines[0] == text.splitlines()[0], text
    assert "copy of expert 0" in lines[0] and "EP2" in lines[0]
    assert first_cause(report)["kind"] == "expert-duplicate"
    rows = report["experts"]["1"]["gate_up_proj"]
    assert rows[E // 2]["status"] == "copy of expert 0"
    assert rows[E // 2]["b"]["hash"] == rows[0]["a"]["hash"]


def test_expert_gate_up_swap_is_named(hf1: Path, tmp_path: Path) -> None:
    """Acceptance: gate/up halves swapped in experts.gate_up_proj → named with gate, up and swap."""

    def mutate(t: dict[str, torch.Tensor]) -> None:
        gate, up = t[f"{L}2.experts.gate_up_proj"].chunk(2, dim=1)
        t[f"{L}2.experts.gate_up_proj"] = torch.cat([up, gate], dim=1)

    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "gu", mutate))
    assert status == 1
    first = text.splitlines()[0]
    assert all(word in first for word in ("gate", "up", "swap")), first
    assert first_cause(report)["kind"] == "gate-up-swap"
    assert "layer 2" in first and f"all {E} experts" in first


def test_mlp_gate_up_swap_is_named(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        t[f"{L}3.mlp.gate_proj.weight"], t[f"{L}3.mlp.up_proj.weight"] = (
            t[f"{L}3.mlp.up_proj.weight"],
            t[f"{L}3.mlp.gate_proj.weight"],
        )

    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "mlp-gu", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "gate-up-swap"
    assert all(word in cause["message"] for word in ("gate", "up", "swap", "layer 3"))
    assert sorted(cause["tensors"]) == [f"{L}3.mlp.gate_proj.weight", f"{L}3.mlp.up_proj.weight"]


def test_experts_shifted_by_an_ep_block(hf1: Path, tmp_path: Path) -> None:
    block = E // 4  # what an EP4 reconstruction error shifts by

    def mutate(t: dict[str, torch.Tensor]) -> None:
        for kind in ("gate_up_proj", "down_proj"):  # B's expert e = A's expert (e + block) mod E
            t[f"{L}1.experts.{kind}"] = torch.roll(t[f"{L}1.experts.{kind}"], shifts=-block, dims=0)

    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "shift", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "expert-shift"
    assert f"shifted by {block}" in cause["message"] and "EP4" in cause["message"]
    assert text.splitlines()[0] == f"DIFFERENT: {cause['message']}"
    assert report["experts"]["1"]["down_proj"][0]["status"] == f"holds expert {block} (shift {block})"


def test_q_heads_permuted(hf1: Path, tmp_path: Path) -> None:
    head_dim = SPEC.head_dim  # layer 0 is a sliding layer

    def mutate(t: dict[str, torch.Tensor]) -> None:
        q = t[f"{L}0.self_attn.q_proj.weight"].clone()
        t[f"{L}0.self_attn.q_proj.weight"] = torch.cat([q[head_dim : 2 * head_dim], q[:head_dim], q[2 * head_dim :]])

    status, _, report = diagnose(hf1, plant(hf1, tmp_path / "heads", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "head-permutation"
    assert "q_proj" in cause["message"] and f"head_dim {head_dim}" in cause["message"]
    assert "B head i = A head [1, 0, 2, 3" in cause["message"]


def test_k_and_v_confused(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        k, v = f"{L}0.self_attn.k_proj.weight", f"{L}0.self_attn.v_proj.weight"
        t[k], t[v] = t[v], t[k]

    status, _, report = diagnose(hf1, plant(hf1, tmp_path / "kv", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "kv-swap"
    assert "k_proj and v_proj are swapped" in cause["message"] and "layer 0" in cause["message"]


def test_tied_lm_head_disagreeing(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t[f"{P}embed_tokens.weight"] * 1.5

    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "lm_head", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "tied-embedding" and cause["tensors"] == ["lm_head.weight"]
    assert "lm_head.weight differs from its" in cause["message"] and "tie_word_embeddings" in cause["message"]
    assert len(report["causes"]) == 1  # the extra tensor is this fault, not a second one


def test_tied_lm_head_saved_twice(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        t["lm_head.weight"] = t[f"{P}embed_tokens.weight"].clone()

    status, _, report = diagnose(hf1, plant(hf1, tmp_path / "lm_head_copy", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "extra" and "a copy of" in cause["message"] and "saved twice" in cause["message"]


def test_tied_embedding_changed(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        t[f"{P}embed_tokens.weight"] = t[f"{P}embed_tokens.weight"] * 2

    status, _, report = diagnose(hf1, plant(hf1, tmp_path / "embed", mutate))
    assert status == 1
    assert first_cause(report)["kind"] == "tied-embedding"


def test_two_layers_swapped(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.startswith(f"{L}0.")]:
            other = name.replace(f"{L}0.", f"{L}2.", 1)
            t[name], t[other] = t[other], t[name]

    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "layers", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "layer-swap" and "layers 0 and 2 swapped" in cause["message"]
    per_layer = sum(1 for name in load_file(hf1 / "model.safetensors") if name.startswith(f"{L}0."))
    assert len(cause["tensors"]) == 2 * per_layer
    assert len(report["causes"]) == 1


def test_dtype_change(hf1: Path, tmp_path: Path) -> None:
    name = f"{L}0.input_layernorm.weight"

    def mutate(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name].float()

    status, _, report = diagnose(hf1, plant(hf1, tmp_path / "dtype", mutate))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "dtype" and cause["tensors"] == [name]
    assert "bfloat16 → float32 (values preserved)" in cause["message"]


def test_dtype_change_does_not_hide_a_duplicated_expert(hf1: Path, tmp_path: Path) -> None:
    def mutate(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.startswith(L)]:
            t[name] = t[name].float()  # an fp32 export of a bf16 checkpoint: lossless
        t[f"{L}3.experts.down_proj"][E - 1] = t[f"{L}3.experts.down_proj"][E // 4 - 1]

    status, _, report = diagnose(hf1, plant(hf1, tmp_path / "fp32-dup", mutate))
    assert status == 1
    kinds = [cause["kind"] for cause in report["causes"]]
    assert kinds == ["expert-duplicate", "dtype"]  # the lossless dtype change is not the likely cause
    assert report["causes"][1]["value_preserving"] and "lossless cast" in report["causes"][1]["message"]
    dup = report["causes"][0]["message"]
    assert f"layer 3 expert {E - 1} is a copy of expert {E // 4 - 1}" in dup and "EP4" in dup


def test_missing_tensor(hf1: Path, tmp_path: Path) -> None:
    name = f"{L}3.post_feedforward_layernorm.weight"
    status, text, report = diagnose(hf1, plant(hf1, tmp_path / "missing", lambda t: t.pop(name)))
    assert status == 1
    assert first_cause(report)["kind"] == "missing"
    assert text.splitlines()[0] == f"DIFFERENT: missing in B: {name}"
    assert report["counts"]["missing"] == 1


def test_atol_tolerance(hf1: Path, tmp_path: Path) -> None:
    name = f"{L}0.input_layernorm.weight"

    def mutate(t: dict[str, torch.Tensor]) -> None:
        t[name] = t[name] + 0.01  # a bf16 rounding-sized change, not a reordering

    b = plant(hf1, tmp_path / "noise", mutate)
    status, text, report = diagnose(hf1, b)
    assert status == 1 and first_cause(report)["kind"] == "values"
    delta = next(r for r in report["tensors"] if r["name"] == name)["max_abs"]
    assert 0 < delta < 0.05
    status, text, report = diagnose(hf1, b, "--atol", "0.05")
    assert status == 0 and report["identical"]
    assert text.splitlines()[0].startswith("IDENTICAL: ") and "within --atol 0.05" in text.splitlines()[0]
    status, _, _ = diagnose(hf1, b, "--atol", str(delta / 2))
    assert status == 1


def test_bad_input_exits_2(hf1: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = compare(hf1, tmp_path / "does-not-exist")
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vime-gemma4 compare: error: ") and "\n" not in err
    status, _ = compare(hf1, hf1, "--atol", "-1")
    assert status == 2


def test_registered_in_cli(hf1: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vime_gemma4_bridge.cli.main import build_parser

    assert build_parser().parse_args(["compare", str(hf1), str(hf1)]).func is compare_command.run
    assert build_parser().parse_args(["probe", "--hf-checkpoint", str(hf1)]).func is probe_command.run


# ------------------------------------------------------------------------------------- probe


PROBE_TOPOLOGIES = [Topology(tp=2, pp=2, ep=2), Topology(tp=2, ep=2, etp=2)]


@pytest.mark.parametrize("topology", PROBE_TOPOLOGIES, ids=str)
def test_probe_all_stages_ok(local_world, hf1: Path, topology: Topology) -> None:
    results = local_world(4).run(probe.probe_job, str(hf1), topology, None, None)
    result = results[0]
    assert result["ok"], probe.format_probe(result)
    boundary = {e for pair in ep_boundary_pairs(E, topology.ep) for e in pair}
    assert {entry["expert"] for entry in result["entries"]} == boundary | {0, E - 1}
    assert {entry["layer"] for entry in result["entries"]} == set(range(SPEC.layers))
    for entry in result["entries"]:
        for row in entry["stages"]:
            for kind in ("gate_up_proj", "down_proj"):
                expected = "skipped" if row["stage"] == "etp" and topology.etp == 1 else "ok"
                assert row[kind]["status"] == expected, (entry["layer"], entry["expert"], row)
        final = entry["stages"][-1]
        assert final["gate_up_proj"]["fingerprints"] == [entry["source"]["gate_up_proj"]["digest"][:10]]
    text = probe.format_probe(result)
    assert text.splitlines()[-1].startswith("probe OK: ")


def _probe_under_the_live_sync_switch(hf_checkpoint: str, topology: Topology) -> dict:
    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV, PER_EXPERT
    from vime_gemma4_bridge.runtime.world import environment

    with environment({EXPERT_LAYOUT_ENV: PER_EXPERT}):
        return probe.probe_job(hf_checkpoint, topology, None, None)


def test_probe_follows_stacks_under_the_live_sync_switch(local_world, hf1: Path) -> None:
    """``VIME_GEMMA4_EXPERT_LAYOUT=per-expert`` in the environment (vime's actor) does not reach the probe,
    whose stages are the stacked tensors'."""
    result = local_world(4).run(_probe_under_the_live_sync_switch, str(hf1), PROBE_TOPOLOGIES[0])[0]
    assert result["ok"], probe.format_probe(result)


def _probe_with_the_reported_ep_bug(hf_checkpoint: str, topology: Topology, experts: list[int], layers: list[int]):
    """Runs on every rank: the original bug (every EP slot receives EP rank 0's expert) re-created
    inside Megatron-Bridge's own EP gather, then the probe; the bridge is restored afterwards."""
    from megatron.bridge.models.conversion import param_mapping

    original = param_mapping.MegatronParamMapping.gather_from_ep_ranks

    def broken(self, megatron_weights, megatron_module, hf_param_name):
        gathered = original(self, megatron_weights, megatron_module, hf_param_name)
        if self.ep_size == 1:
            return gathered
        return {name: value[:1].expand_as(value).clone() for name, value in gathered.items()}

    param_mapping.MegatronParamMapping.gather_from_ep_ranks = broken
    try:
        return probe.probe_job(hf_checkpoint, topology, experts, layers)
    finally:
        param_mapping.MegatronParamMapping.gather_from_ep_ranks = original


def test_probe_flags_the_ep_gather_first(local_world, hf1: Path) -> None:
    topology = Topology(tp=2, pp=2, ep=2)
    result = local_world(4).run(_probe_with_the_reported_ep_bug, str(hf1), topology, [0, E // 2], [1])[0]
    assert not result["ok"]
    by_expert = {entry["expert"]: entry for entry in result["entries"]}
    assert by_expert[0]["first_mismatch"] is None  # EP rank 0's own expert survives the bug
    bad = by_expert[E // 2]
    assert bad["first_mismatch"].startswith("gate_up_proj after EP gather")
    assert "expert 0" in bad["first_mismatch"]
    status = {row["stage"]: row["down_proj"]["status"] for row in bad["stages"]}
    assert status == {"local": "ok", "pp": "ok", "etp": "skipped", "ep": "MISMATCH", "final": "MISMATCH"}
    assert probe.format_probe(result).splitlines()[-1].startswith("probe FAILED: ")
