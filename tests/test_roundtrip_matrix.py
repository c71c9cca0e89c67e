"""HF1 → Megatron → HF2 is bitwise, across the parallel matrix, on real gloo CPU ranks.

This is the test that would have caught the original bug: at TP2·PP2·EP4 experts were copied
across expert-parallel boundaries (expert 0 == expert 32). Every tiny checkpoint has all tensors
distinct, so any swap, duplicate or misplacement shows; ``report.compare`` additionally checks the
experts on both sides of every EP boundary by id. Topologies are grouped by world size so each
world serves all the topologies of its size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

CHECKPOINTS = {
    "moe-vl": TinySpec(),
    "moe-causal": TinySpec(causal_lm=True),
    "dense-vl": TinySpec(moe=False),
    # A vocabulary TP does not divide (added tokens): padded in Megatron, exactly the HF rows back.
    "moe-vocab-1001": TinySpec(vocab_size=1001, seed=5),
    "dense-vocab-1001": TinySpec(moe=False, vocab_size=1001, seed=6),
}

# (world size, topology): every topology of the issue, on the smallest world it fits.
MOE_MATRIX = [
    (2, Topology()),  # TP1 (data parallel 2)
    (2, Topology(tp=2)),
    (2, Topology(pp=2)),
    (2, Topology(ep=2)),
    (2, Topology(pp=2, vpp=2)),
    (4, Topology(ep=4)),
    (4, Topology(tp=2, pp=2)),
    (4, Topology(tp=2, ep=4, etp=1)),
    (4, Topology(tp=4, ep=2)),
    (4, Topology(tp=2, pp=2, ep=2)),
    (8, Topology(ep=8)),
    (8, Topology(tp=2, pp=2, ep=2, etp=2)),
    (8, Topology(tp=2, pp=2, ep=4, etp=1)),
]
#: The reported topology (TP2·PP2·EP4, with ETP2 as in the upstream fix's validation): 16 ranks.
REPORTED = Topology(tp=2, pp=2, ep=4, etp=2)
# The dense model at TP (the family at PP and VPP: tests/test_family.py); it has no experts to split.
DENSE_MATRIX = [(2, Topology()), (2, Topology(tp=2)), (4, Topology(tp=4))]

CASES = sorted(
    [(world, topo, name) for world, topo in MOE_MATRIX for name in ("moe-vl", "moe-causal")]
    + [(world, topo, "dense-vl") for world, topo in DENSE_MATRIX]
    + [(2, Topology(tp=2), "moe-vocab-1001"), (4, Topology(tp=2, pp=2), "moe-vocab-1001")]
    + [(2, Topology(tp=2), "dense-vocab-1001"), (4, Topology(tp=4), "dense-vocab-1001")],
    key=lambda case: case[0],
)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in CHECKPOINTS.items()}


def assert_bitwise(result: dict) -> None:
    assert result["identical"], result["report"]
    assert not result["ep_boundary_failures"], result["ep_boundary_failures"]
    total = result["total"]
    assert total["count"] == total["equal"] > 0


@pytest.mark.parametrize(("world", "topology", "checkpoint"), CASES, ids=lambda v: str(v))
def test_roundtrip_is_bitwise(local_world, tiny_checkpoints, world: int, topology: Topology, checkpoint: str) -> None:
    result = local_world(world).run(roundtrip_job, str(tiny_checkpoints[checkpoint]), topology, None, False, 10**9)
    assert_bitwise(result[0])


def _roundtrip_with_one_changed_tensor(hf_checkpoint: str, output: str, changed: str) -> dict:
    """``roundtrip --output`` at TP2 whose export (rank 0's stream) has one element of ``changed`` off by one,
    or, with ``changed="extra"``, a tensor the source lacks after the rest."""
    from unittest import mock

    from vime_gemma4_bridge.convert import model

    export = model.export_to_rank0

    def changed_export(*args, **kwargs):
        for name, tensor in export(*args, **kwargs):
            if name == changed:
                tensor = tensor.clone()
                tensor.view(-1)[0] += 1
            yield name, tensor
        if changed == "extra" and model.is_rank0():
            yield "model.language_model.extra.weight", torch.zeros(2)

    with mock.patch.object(model, "export_to_rank0", changed_export):
        return roundtrip_job(hf_checkpoint, Topology(tp=2), output, False, 200_000)


@pytest.mark.parametrize("changed", ["model.language_model.norm.weight", "extra"])
def test_roundtrip_output_is_withheld_when_not_identical(local_world, tiny_checkpoints, tmp_path, changed) -> None:
    """``--output`` writes each tensor as it arrives, before the comparison's verdict: a round trip that is
    not bitwise (a changed value, a tensor the source lacks) leaves nothing, not even a partial directory."""
    out = tmp_path / "hf2"
    result = local_world(2).run(_roundtrip_with_one_changed_tensor, str(tiny_checkpoints["moe-vl"]), str(out), changed)
    assert not result[0]["identical"] and result[0]["output"] is None
    assert list(tmp_path.iterdir()) == []


def test_report_names_the_original_bug(tiny_checkpoints) -> None:
    """Planting the reported fault (expert 0 copied over expert E/EP) is caught by name."""
    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.verify.report import compare

    source = HFCheckpoint(tiny_checkpoints["moe-causal"])
    reference = source.load(source.language_model_names())
    broken = dict(reference)
    name = "model.layers.1.experts.gate_up_proj"
    experts = broken[name].clone()
    experts[8] = experts[0]  # 16 experts, EP2: expert 8 is the first expert of EP rank 1
    broken[name] = experts
    result = compare(reference, broken, ep=2)
    assert not result.identical
    assert result.different == [name]
    assert f"{name}: expert 8 is not in place" in result.ep_boundaries

    experts[8] = experts[7]  # a duplicate straddling the boundary is named as such
    result = compare(reference, {**broken, name: experts}, ep=2)
    assert f"{name}: experts 7 and 8 are duplicates across an EP boundary" in result.ep_boundaries


# Checkpoints the project has not seen elsewhere: other layer counts, layer patterns (irregular),
# expert counts, head dims and KV heads, both classes, fp32 and bf16.
UNSEEN = {
    "vl-6L-irregular-32E": TinySpec(
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
    "causal-8L-8E-no-keqv-fp32": TinySpec(
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
}


@pytest.mark.parametrize("name", sorted(UNSEEN))
def test_unseen_checkpoints_roundtrip_at_reported_topology(local_world, tmp_path: Path, name: str) -> None:
    """TP2·PP2·EP4·ETP1 on 8 ranks, with --output: HF2 is complete and computes HF1's logits."""
    import transformers

    spec = UNSEEN[name]
    hf1 = write_tiny_checkpoint(tmp_path / "hf1", spec)
    out = tmp_path / "hf2"
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    result = local_world(8).run(roundtrip_job, str(hf1), topology, str(out), False, 200_000)[0]
    assert_bitwise(result)
    assert result["output"] == str(out)
    index = "model.safetensors.index.json"
    side_files = [p.name for p in hf1.iterdir() if not p.name.endswith(".safetensors")]
    assert sorted(side_files) == sorted(p.name for p in out.iterdir() if not p.name.endswith((".safetensors", index)))
    assert (out / "model.safetensors.index.json").is_file(), "200 kB shards: the output must be sharded"

    cls = getattr(transformers, spec.architecture)
    model1 = cls.from_pretrained(hf1, dtype=torch.float32).eval()
    model2 = cls.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model2) is type(model1)
    state1, state2 = model1.state_dict(), model2.state_dict()
    assert state1.keys() == state2.keys()
    assert all(torch.equal(state1[k], state2[k]) for k in state1)
    ids = torch.arange(3, 3 + 2 * 24).reshape(2, 24) % spec.vocab_size
    with torch.no_grad():
        assert torch.equal(model1(input_ids=ids).logits, model2(input_ids=ids).logits)


@pytest.mark.parametrize("checkpoint", ["moe-vl", "moe-causal"])
def test_reported_topology_on_16_ranks(local_world, tiny_checkpoints, checkpoint: str) -> None:
    result = local_world(16).run(roundtrip_job, str(tiny_checkpoints[checkpoint]), REPORTED, None, False, 10**9)
    assert_bitwise(result[0])
