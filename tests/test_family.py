"""The dense Gemma 4 family (issues 22, 36): tiny 31B-, E4B-, E2B- and 12B-shaped checkpoints, on gloo CPU ranks.

What is special in each (testing/spec.DENSE_SHAPES): 31B, k_eq_v full layers with their own KV-head
count, no PLE; E4B, per-layer embeddings and the last half of the layers KV-shared; E2B, PLE, five
of eight layers KV-shared (their sources on the first pipeline stage at PP2) with a double-wide
MLP; 12B, the "Unified" classes (no PLE; embedders beside the text model) and one global KV head,
replicated over TP ranks. Each must round-trip bitwise at TP2·PP2 and PP2·VPP2 on the release and on the fork double,
match transformers' fp32 forward at TP2·PP2, convert through torch_dist across topologies, and
pass vime's weight sync. Worlds of 4 and 2 ranks are shared by every case of their size.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.testing.spec import DENSE_SHAPES
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.parity import FLOAT32_MAX_ABS_TOLERANCE

TP2_PP2, PP2_VPP2 = Topology(tp=2, pp=2), Topology(pp=2, vpp=2)
WORLD = {TP2_PP2: 4, PP2_VPP2: 2}


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family")
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in DENSE_SHAPES.items()}


def _roundtrip_on(build: str, hf_checkpoint: str, topology: Topology) -> dict:
    """``roundtrip_job`` on the release or, with ``build == "fork"``, on vime's fork seams (tests/fork_seams.py)."""
    from fork_seams import fork_seams

    from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

    with fork_seams() if build == "fork" else contextlib.nullcontext():
        return roundtrip_job(hf_checkpoint, topology, None, False, 10**9)


def test_kv_shared_layers_have_no_kv_weights(family) -> None:
    """HF has no k/v projection or k_norm on a KV-shared layer, and the Megatron model has none to leak."""
    source = HFCheckpoint(family["e2b"])
    shared = [name for name in source.language_model_names() if ".layers.3." in name]
    assert not [name for name in shared if any(p in name for p in ("k_proj", "v_proj", "k_norm"))]
    assert any(name.endswith("layers.3.self_attn.q_proj.weight") for name in shared)


@pytest.mark.parametrize("name", ["e4b", "12b"])
def test_family_streamed_default_import_loads_at_pp2_vpp2(local_world, family, tmp_path: Path, name: str) -> None:
    """At the default topology import and export stream a dense model weight by weight (one tensor in
    flight: the PLE table is the largest); the streamed torch_dist loads in megatron-core at PP2·VPP2.
    Every tensor of the export equals the source's: the 12B's vision and audio embedders are copied."""
    from test_torch_dist import assert_same_checkpoint

    from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job

    hf, save = family[name], tmp_path / "torch_dist"
    if name == "12b":
        outside = [n for n in HFCheckpoint(hf).names() if not n.startswith("model.language_model.")]
        assert (
            any(n.startswith("model.vision_embedder.") for n in outside)
            and "model.embed_audio.embedding_projection.weight" in outside
        )
    report = local_world(1).run(import_job, str(hf), str(save), str(tmp_path / ".partial"), Topology())[0]
    assert report["experts_streamed"], "the default-topology import of a dense model no longer streams"
    for topology, world in ((Topology(), 1), (PP2_VPP2, 2)):
        out = tmp_path / f"hf-{topology}"
        report = local_world(world).run(export_job, str(save), str(hf), str(out), topology, False, 10**9)[0]
        assert report["experts_streamed"] == (topology == Topology()), report
        assert_same_checkpoint(hf, out, ep=1)


CASES = [
    (topology, name, build)
    for topology in (PP2_VPP2, TP2_PP2)  # 2 ranks, then every 4-rank test of the module: one world each
    for name in sorted(DENSE_SHAPES)
    for build in ("release", "fork")
]


@pytest.mark.parametrize(("topology", "name", "build"), CASES, ids=str)
def test_family_roundtrip_is_bitwise(local_world, family, topology: Topology, name: str, build: str) -> None:
    result = local_world(WORLD[topology]).run(_roundtrip_on, build, str(family[name]), topology)[0]
    assert result["identical"], result["report"]
    total = result["total"]
    source = HFCheckpoint(family[name])
    assert total["count"] == total["equal"] == len(source.language_model_names())


@pytest.mark.parametrize("name", sorted(DENSE_SHAPES))
def test_family_fp32_parity_at_tp2_pp2(local_world, family, name: str) -> None:
    from test_parity import run_parity

    result = run_parity(local_world(4), family[name], TP2_PP2)
    assert result["topology"] == str(TP2_PP2)
    assert result["passed"], result
    assert result["max_abs"] <= FLOAT32_MAX_ABS_TOLERANCE["dense"] and result["argmax_agreement"] == 1.0


def swap_per_layer_inputs(model: list) -> None:
    """Give layer 1 layer 2's PLE gate on every chunk that holds both (a consistently wrong mapping)."""
    import torch

    for chunk in model:
        layers = {layer.layer_number: layer for layer in chunk.decoder.layers}
        if 1 in layers and 2 in layers:
            with torch.no_grad():
                first, second = layers[1].per_layer_input_gate.weight, layers[2].per_layer_input_gate.weight
                first.copy_(second)


def break_kv_sharing(model: list) -> None:
    """Shared layers read zeros instead of their source's K/V: the source layers stop handing them on."""
    for chunk in model:
        for layer in chunk.decoder.layers:
            layer.self_attention.keeps_kv = False


@pytest.mark.parametrize("breakage", [swap_per_layer_inputs, break_kv_sharing], ids=lambda f: f.__name__)
def test_family_parity_notices_breakage(local_world, family, breakage) -> None:
    from test_parity import run_parity

    result = run_parity(local_world(4), family["e2b"], TP2_PP2, after_load=breakage)
    assert not result["passed"] and result["max_abs"] > 1e-3, result


def test_family_vime_weight_sync_at_tp2_pp2(local_world, family, tmp_path: Path) -> None:
    """vime's bridge weight sync (fork seams) of E4B at TP2·PP2: the dump is the language model, bitwise."""
    from test_live import _vime_sync_job, check_dump

    dump, buffer_size = tmp_path / "weight_v000001", 20_000
    result = local_world(4).run(_vime_sync_job, str(family["e4b"]), TP2_PP2, str(dump), buffer_size)[0]
    assert result["buffer_tasks"] == []
    assert result["tensors"] == len(HFCheckpoint(family["e4b"]).language_model_names())
    check_dump(dump, family["e4b"], buffer_size)


def test_family_vime_save_hf_and_sleeping_sync_at_tp2_pp2(local_world, family, tmp_path: Path) -> None:
    """vime's other roads for a dense VL checkpoint (E2B), fork seams, TP2·PP2: its full HF save
    (``--save-hf``) is the source bitwise, and a sleeping colocated actor's sync is the language model."""
    from test_live import check_dump
    from test_vime_roads import _save_hf_job, _sleeping_sync_job, assert_saved

    hf, out = family["e2b"], tmp_path / "saved"
    assert_saved(local_world(4).run(_save_hf_job, str(hf), TP2_PP2, "fork", str(out)), hf, out)
    dump = tmp_path / "weight_v000002"
    result = local_world(4).run(_sleeping_sync_job, str(hf), TP2_PP2, str(dump), 20_000)
    assert result[0]["tensors"] == len(HFCheckpoint(hf).language_model_names())
    check_dump(dump, hf, 20_000)


def test_family_torch_dist_across_topologies(local_world, family, tmp_path: Path) -> None:
    """E2B imported at TP2·PP2 exports at PP2·VPP2 and at the default topology, bitwise (torch_dist stacks
    per layer group: sliding, full, KV-shared sliding/full attention, and the double-wide MLP)."""
    from test_torch_dist import assert_same_checkpoint

    from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job
    from vime_gemma4_bridge.io.torch_dist_reader import TorchDistReader

    hf, save = family["e2b"], tmp_path / "torch_dist"
    local_world(4).run(import_job, str(hf), str(save), str(tmp_path / ".partial"), TP2_PP2)
    reader = TorchDistReader(save / "iter_0000000")
    try:
        keys = set(reader.tensor_keys())
    finally:
        reader.close()
    stacks = {"self_attention_sliding", "self_attention_global", "self_attention_sliding_kv_shared"}
    stacks |= {"self_attention_global_kv_shared", "mlp", "mlp_double_wide"}
    assert {key.split(".")[2] for key in keys if key.startswith("decoder.layers.")} >= stacks, sorted(keys)
    assert "decoder.layers.self_attention_sliding_kv_shared.linear_q.weight" in keys
    for topology, world in ((PP2_VPP2, 2), (Topology(), 2)):
        out = tmp_path / f"hf-{topology}"
        local_world(world).run(export_job, str(save), str(hf), str(out), topology, False, 10**9)
        assert_same_checkpoint(hf, out, ep=1)


def _probe_after_load(hf_checkpoint: str, topology: Topology, breakage=None) -> dict:
    """``probe_job`` with ``breakage`` applied to the model chunks right after the HF load."""
    from megatron.bridge.models.conversion.utils import unwrap_model

    from vime_gemma4_bridge.convert import model as convert_model
    from vime_gemma4_bridge.verify.probe import probe_job

    original = convert_model.open_bridge

    def open_and_break(path: str):
        bridge = original(path)
        load = bridge.load_hf_weights

        def load_then_break(model, *args, **kwargs):
            loaded = load(model, *args, **kwargs)
            breakage(unwrap_model(model))
            return loaded

        bridge.load_hf_weights = load_then_break
        return bridge

    if breakage is not None:
        convert_model.open_bridge = open_and_break
    try:
        return probe_job(hf_checkpoint, topology, None, None)
    finally:
        convert_model.open_bridge = original


def give_layer_1_the_mlp_of_layer_2(model: list) -> None:
    """Layer 1's fc1 holds layer 2's (each TP rank its own shard of it): a mapping off by one layer."""
    import torch

    for chunk in model:
        layers = {layer.layer_number: layer for layer in chunk.decoder.layers}  # 1-based
        if 2 in layers and 3 in layers:
            with torch.no_grad():
                layers[2].mlp.linear_fc1.weight.copy_(layers[3].mlp.linear_fc1.weight)


def test_family_probe_follows_dense_mlps_at_tp2_pp2(local_world, family) -> None:
    """The probe on a dense checkpoint follows each layer's MLP (column- and row-split) through the
    bridge's export: every stage ok, and a layer given its neighbour's weights is named at its shard."""
    from vime_gemma4_bridge.verify.probe import DENSE_STAGES, format_probe

    result = local_world(4).run(_probe_after_load, str(family["e2b"]), TP2_PP2)[0]
    assert result["ok"] and result["dense"], format_probe(result)
    assert [entry["layer"] for entry in result["entries"]] == list(range(DENSE_SHAPES["e2b"].layers))
    for entry in result["entries"]:
        assert [row["stage"] for row in entry["stages"]] == [stage for stage, _ in DENSE_STAGES]
        for row in entry["stages"]:
            assert row["gate_up_proj"]["status"] == row["down_proj"]["status"] == "ok", (entry["layer"], row)
    assert format_probe(result).splitlines()[-1].startswith("probe OK: the MLP of layers 0")

    broken = local_world(4).run(_probe_after_load, str(family["e2b"]), TP2_PP2, give_layer_1_the_mlp_of_layer_2)[0]
    assert not broken["ok"]
    by_layer = {entry["layer"]: entry for entry in broken["entries"]}
    assert [layer for layer, entry in by_layer.items() if entry["first_mismatch"]] == [1]
    first = by_layer[1]["first_mismatch"]
    assert first.startswith("gate_up_proj local shard: ") and "= layer 2 TP shard 0" in first, first
    assert format_probe(broken).splitlines()[-1].startswith("probe FAILED: the MLP of 1 layer(s) diverges")


def test_family_doctor_reads_a_dense_checkpoint(family, tmp_path: Path) -> None:
    """``compare`` (the doctor) on E2B-shaped checkpoints: a copy is IDENTICAL, and two layers' PLE
    gates swapped are diagnosed as a layer swap naming both tensors."""
    from test_doctor import L, diagnose, first_cause, plant

    def swap_gates(t: dict) -> None:
        a, b = f"{L}1.per_layer_input_gate.weight", f"{L}2.per_layer_input_gate.weight"
        t[a], t[b] = t[b], t[a]

    status, text, _ = diagnose(family["e2b"], plant(family["e2b"], tmp_path / "copy", lambda t: None))
    assert status == 0 and text.startswith("IDENTICAL: "), text
    status, text, report = diagnose(family["e2b"], plant(family["e2b"], tmp_path / "swapped", swap_gates))
    assert status == 1
    cause = first_cause(report)
    assert cause["kind"] == "layer-swap" and "layers 1 and 2 swapped" in cause["message"], cause
    assert sorted(cause["tensors"]) == [f"{L}1.per_layer_input_gate.weight", f"{L}2.per_layer_input_gate.weight"]


def test_unified_causal_lm_roundtrip_is_bitwise_at_tp2(local_world, tmp_path: Path) -> None:
    """The 12B's text-only class (``Gemma4UnifiedForCausalLM``, names under ``model.``) takes the same bridge:
    bitwise at TP2, its one global KV head on both ranks."""
    import dataclasses

    hf = write_tiny_checkpoint(tmp_path / "12b-causal", dataclasses.replace(DENSE_SHAPES["12b"], causal_lm=True))
    assert HFCheckpoint(hf).config["architectures"] == ["Gemma4UnifiedForCausalLM"]
    result = local_world(2).run(_roundtrip_on, "release", str(hf), Topology(tp=2))[0]
    assert result["identical"] and result["total"]["count"] == len(HFCheckpoint(hf).language_model_names())
