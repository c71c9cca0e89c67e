"""Numerical parity: the Megatron model (CPU build) computes what transformers computes.

A bitwise round trip cannot see a model that holds the right tensors but uses them wrongly (q/k
heads permuted, gate/up swapped, a misplaced norm, the wrong RoPE or window). Here the same
weights go through Megatron (loaded by the bridge at a topology, pipelined forward, TP-gathered
logits) and through transformers' own Gemma 4, on the same fixed token ids, longer than the
sliding window, and the logits are compared over the real vocabulary.

float32 cases run at ~5e-6 (MoE) / ~2e-5 (dense) and are held to the command's own default bounds
(2e-5 / 5e-5): a scale error that a following RMSNorm hides up to its eps (the expert-TP double
reduction this test found gave 4e-5) must fail the command's defaults. The negative controls
prove the comparison notices subtle breakage. Every case runs in one shared world of 4 ranks
(TP1 cases as 4 data-parallel replicas), so ranks are started once for the whole file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.parity import FLOAT32_MAX_ABS_TOLERANCE, parity_job

CHECKPOINTS = {
    "moe-vl": TinySpec(dtype="float32"),
    "moe-causal": TinySpec(causal_lm=True, dtype="float32"),
    "dense-vl": TinySpec(moe=False, dtype="float32"),
    # Added tokens: a vocabulary TP2 does not divide (Megatron pads it to 1002 rows there).
    "moe-vocab-1001": TinySpec(vocab_size=1001, dtype="float32", seed=5),
    "dense-vocab-1001": TinySpec(moe=False, vocab_size=1001, dtype="float32", seed=6),
}
#: max |Δlogit| accepted in float32: the command's default bounds.
FP32_BOUND = {
    "moe-vl": FLOAT32_MAX_ABS_TOLERANCE["moe"],
    "moe-causal": FLOAT32_MAX_ABS_TOLERANCE["moe"],
    "dense-vl": FLOAT32_MAX_ABS_TOLERANCE["dense"],
    "moe-vocab-1001": FLOAT32_MAX_ABS_TOLERANCE["moe"],
    "dense-vocab-1001": FLOAT32_MAX_ABS_TOLERANCE["dense"],
}
#: 3 x sliding_window (8) of the tiny checkpoints: every sliding layer drops context.
SEQ_LEN, BATCH = 24, 2
#: Ranks of the shared world: the smallest that fits TP2·PP2·EP2 and TP2·EP2·ETP2.
WORLD = 4

#: The bf16 case. A random router is nearly uniform (logits ~0.1), so transformers' bf16 softmax
#: produces exact ties among experts that it breaks by index while Megatron routes in fp32 (by
#: design): the expert choice then legitimately differs and the random model amplifies it (even
#: transformers bf16 vs float32 agree on only ~80% of argmaxes there). A trained router is
#: decisive: the router projection is scaled up to make it so, and two layers keep bf16 rounding
#: from compounding through random weights. 4 x 64 tokens make the 0.99 threshold meaningful.
BF16_SPEC = TinySpec(causal_lm=True, layers=2, dtype="float32")
BF16_ROUTER_SCALE = 32.0
BF16_SEQ_LEN, BF16_BATCH = 64, 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("parity")
    paths = {name: write_tiny_checkpoint(root / name, spec) for name, spec in CHECKPOINTS.items()}
    bf16 = write_tiny_checkpoint(root / "moe-causal-2l-decisive-router", BF16_SPEC)
    weights = bf16 / "model.safetensors"
    tensors = load_file(str(weights))
    routers = [name for name in tensors if name.endswith("router.proj.weight")]
    assert len(routers) == BF16_SPEC.layers
    for name in routers:
        tensors[name] = tensors[name] * BF16_ROUTER_SCALE
    save_file(tensors, str(weights), metadata={"format": "pt"})
    paths["bf16"] = bf16
    return paths


def run_parity(world, checkpoint: Path, topology: Topology, dtype: str = "float32", **kwargs) -> dict:
    seq_len = kwargs.pop("seq_len", SEQ_LEN)
    batch = kwargs.pop("batch", BATCH)
    results = world.run(parity_job, str(checkpoint), topology, dtype, seq_len, batch, **kwargs)
    return results[0]


def assert_fp32_parity(result: dict, bound: float) -> None:
    figures = f"max={result['max_abs']:.3e} mean={result['mean_abs']:.3e} argmax={result['argmax_agreement']}"
    assert result["passed"], figures
    assert result["argmax_agreement"] == 1.0, figures
    assert 0.0 < result["max_abs"] <= bound, figures  # 0.0 would mean the comparison compared nothing
    assert result["mean_abs"] <= bound / 5, figures
    assert result["batch"] == BATCH and result["seq_len"] == SEQ_LEN
    assert result["vocab_size"] in (300, 1001) and result["vocab_size"] <= result["padded_vocab_size"]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_fp32_parity_tp1(local_world, checkpoints: dict[str, Path], name: str) -> None:
    result = run_parity(local_world(WORLD), checkpoints[name], Topology())
    assert_fp32_parity(result, FP32_BOUND[name])


def test_bf16_parity_tp1(local_world, checkpoints: dict[str, Path]) -> None:
    result = run_parity(
        local_world(WORLD), checkpoints["bf16"], Topology(), "bfloat16", seq_len=BF16_SEQ_LEN, batch=BF16_BATCH
    )
    figures = f"max={result['max_abs']:.3e} mean={result['mean_abs']:.3e} argmax={result['argmax_agreement']}"
    assert result["passed"] and result["argmax_agreement"] >= 0.99, figures
    # bf16 rounding, not a different function: logits here span about +-5.
    assert result["max_abs"] < 0.5 and result["mean_abs"] < 0.03, figures
    assert result["dtype"] == "bfloat16" and result["seq_len"] * result["batch"] == 256


def shift_sliding_window(model: list) -> None:
    """Let every sliding layer see one token more than transformers' window."""
    from vime_gemma4_bridge.core.cpu_modules import HostDotProductAttention

    for chunk in model:
        for module in chunk.modules():
            if isinstance(module, HostDotProductAttention) and module.host_window is not None:
                module.host_window = (module.host_window[0] + 1, module.host_window[1])


def swap_first_two_experts(model: list) -> None:
    """Exchange experts 0 and 1 of layer 0 (a mix-up a round trip of swapped names would miss)."""
    fc1 = model[0].decoder.layers[0].mlp.experts.linear_fc1
    with torch.no_grad():
        first = fc1.weight0.clone()
        fc1.weight0.copy_(fc1.weight1)
        fc1.weight1.copy_(first)


def drop_logit_softcapping(model: list) -> None:
    """Skip final_logit_softcapping (30.0), which barely bends these logits (|logit| < 6)."""
    for chunk in model:
        if hasattr(chunk, "output_layer"):
            chunk.config.final_logit_softcapping = None


def double_routed_experts(model: list) -> None:
    """Scale the routed experts' output by 2: the post-MoE RMSNorm hides it up to its eps."""
    with torch.no_grad():
        for layer in model[0].decoder.layers:
            fc2 = layer.mlp.experts.linear_fc2
            for k in range(fc2.num_gemms):
                getattr(fc2, f"weight{k}").mul_(2.0)


@pytest.mark.parametrize(
    ("breakage", "min_max_abs"),
    [
        (shift_sliding_window, 0.1),
        (swap_first_two_experts, 0.1),
        (drop_logit_softcapping, 1e-3),
        (double_routed_experts, FP32_BOUND["moe-causal"]),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_parity_notices_breakage(local_world, checkpoints: dict[str, Path], breakage, min_max_abs: float) -> None:
    result = run_parity(local_world(WORLD), checkpoints["moe-causal"], Topology(), after_load=breakage)
    assert result["max_abs"] > min_max_abs, f"{breakage.__name__} went unnoticed: max={result['max_abs']:.3e}"
    assert not result["passed"], f"{breakage.__name__} passes the command's defaults (it would exit 0)"


MULTI_RANK_CASES = [
    ("moe-vl", Topology(tp=2, pp=2, ep=2)),
    ("moe-causal", Topology(tp=2, pp=2, ep=2)),
    ("dense-vl", Topology(tp=2)),  # dense at PP: tests/test_family.py
    ("moe-causal", Topology(tp=2, ep=2, etp=2)),
    ("moe-vl", Topology(tp=2, pp=2, vpp=2)),
    ("moe-vocab-1001", Topology(tp=2, pp=2, ep=2)),  # the padding rows are not compared: only the real ones
    ("dense-vocab-1001", Topology(tp=2)),
]


@pytest.mark.parametrize(("name", "topology"), MULTI_RANK_CASES, ids=lambda v: str(v))
def test_fp32_parity_multi_rank(local_world, checkpoints: dict[str, Path], name: str, topology: Topology) -> None:
    result = run_parity(local_world(WORLD), checkpoints[name], topology)
    assert result["topology"] == str(topology)
    assert_fp32_parity(result, FP32_BOUND[name])
    if name.endswith("vocab-1001"):
        assert result["padded_vocab_size"] == 1002


def parity_beside_a_gpu_it_does_not_own(*args, **kwargs) -> dict:
    """:func:`parity_job` on a rank that sees CUDA but joined a gloo world: ``--nproc 2`` on a one-GPU machine.

    There the model is built on the CPU, so megatron-core's ``torch.cuda.current_device()`` allocations must
    answer the CPU too (on an H200 they answered cuda:0: "found at least two devices", docs/GPU.md), and its
    compiled fusions must not compile against CUDA (here dynamo would initialise CUDA in a forked rank).
    """
    from unittest import mock

    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        return parity_job(*args, **kwargs)


def test_fp32_parity_gloo_ranks_beside_a_gpu(local_world, checkpoints: dict[str, Path]) -> None:
    topology = Topology(ep=2)
    results = local_world(WORLD).run(
        parity_beside_a_gpu_it_does_not_own, str(checkpoints["moe-vl"]), topology, "float32", SEQ_LEN, BATCH
    )
    assert results[0]["topology"] == str(topology)
    assert_fp32_parity(results[0], FP32_BOUND["moe-vl"])
