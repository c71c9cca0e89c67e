"""Bitwise means bytes: NaN, Inf and signed zeros survive every conversion and every check compares bytes.

A diverged run's checkpoint (NaN / Inf weights) is what someone wants to inspect or roll back; value
comparisons (``torch.equal``: NaN is never equal to itself, ``-0.0`` equals ``0.0``) failed its round
trip and the streamed import's slice check, and would pass a sign flip (issue 37).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.compare import tensors_identical
from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

EMBED = "model.language_model.embed_tokens.weight"
EXPERTS = ("model.language_model.layers.1.experts.gate_up_proj", "model.language_model.layers.2.experts.down_proj")
SPECIALS = (float("nan"), float("inf"), float("-inf"), -0.0)


def test_same_bytes_sees_what_values_hide() -> None:
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.bfloat16)
    assert same_bytes(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    other_nan = nan.view(torch.int16).clone()
    other_nan[0] += 1  # another NaN payload
    assert not same_bytes(nan, other_nan.view(torch.bfloat16))
    zero = torch.zeros(2)
    assert torch.equal(zero, -zero) and not same_bytes(zero, -zero)
    assert not same_bytes(zero, zero.double()) and not same_bytes(zero, zero.reshape(1, 2))
    assert tensors_identical(nan, nan.clone()) and not tensors_identical(zero, -zero)


@pytest.fixture(scope="module")
def diverged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny checkpoint with NaN, ±Inf and -0.0 in the embedding (tied) and in two layers' expert stacks."""
    root = tmp_path_factory.mktemp("bitwise")
    good = write_tiny_checkpoint(root / "good", TinySpec(seed=21))
    out = root / "diverged"
    shutil.copytree(good, out)
    shards = sorted(out.glob("*.safetensors"))
    for shard in shards:
        with safe_open(shard, framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        for name in (EMBED, *EXPERTS):
            if name in tensors:
                flat = tensors[name].view(-1)
                for offset, value in enumerate(SPECIALS):
                    flat[offset * 7 + 3] = value
        save_file(tensors, shard, metadata={"format": "pt"})
    planted = HFCheckpoint(out).load([EMBED, *EXPERTS])
    assert all(t.isnan().any() and t.isinf().any() for t in planted.values())
    assert json.loads((out / "config.json").read_text())
    return out


def assert_same_bytes(source: Path, written: Path) -> None:
    a, b = HFCheckpoint(source), HFCheckpoint(written)
    assert sorted(a.names()) == sorted(b.names())
    left, right = a.load(a.names()), b.load(b.names())
    assert [name for name in left if not same_bytes(left[name], right[name])] == []


def test_roundtrip_keeps_nan_and_inf_at_tp2_pp2_ep2(local_world, diverged: Path) -> None:
    """PP2 also runs the tied-embedding check across stages on a NaN embedding (bytes, not values)."""
    result = local_world(4).run(roundtrip_job, str(diverged), Topology(tp=2, pp=2, ep=2), None, False, 10**9)[0]
    assert result["identical"], result["report"]


def test_import_export_keep_nan_and_inf(diverged: Path, tmp_path: Path) -> None:
    """``import`` then ``export`` at the default topology: both stream, with the slice check on every tensor."""
    from vime_gemma4_bridge.cli.main import main as cli

    save, out = tmp_path / "torch_dist", tmp_path / "hf"
    assert cli(["import", "--hf-checkpoint", str(diverged), "--save", str(save)]) == 0
    assert cli(["export", "--load", str(save), "--hf-checkpoint", str(diverged), "--output", str(out)]) == 0
    assert_same_bytes(diverged, out)
