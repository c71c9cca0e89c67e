"""Checkpoints interchange (issue 48): one torch_dist key set on every host, and what we wrote before still reads.

The TE side is derived on this TE-less machine without building a TE module: megatron-core's own
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` runs with its ``TESpecProvider``
(megatron/core/extensions/transformer_engine_spec_provider.py, 0.19.2), which only names TE classes,
and the TE layer specs' ``sharded_state_dict_keys_map`` is read off them. Parameter names are the same
on both hosts by construction (core/cpu_modules.py twins; docs/MODEL.md), so the TE model's torch_dist
keys are the CPU model's with the TE maps in place of the local spec's. ``_extra_state`` items agree
too: every TE linear (``TransformerEngineBaseModule``) and its CPU twin or megatron-core's local linear
write one; ``TEDotProductAttention.sharded_state_dict`` writes none for vanilla softmax
(extensions/transformer_engine.py, ``softmax_type != "learnable"``), nor does the local attention;
the norms are ``Gemma4RMSNorm`` on both hosts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from test_torch_dist import assert_same_checkpoint

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job
from vime_gemma4_bridge.io.torch_dist import ITERATION_DIR
from vime_gemma4_bridge.io.torch_dist_layout import FORMER_KEYS
from vime_gemma4_bridge.testing.spec import DENSE_SHAPES, TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

PRE_NORM_NOW, PRE_NORM_BEFORE = "decoder.layers.pre_mlp_layernorm.weight", next(iter(FORMER_KEYS))


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interchange")
    members = {"26b-a4b": TinySpec(), **DENSE_SHAPES}
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in members.items()}


@contextlib.contextmanager
def _te_spec_provider() -> Iterator[None]:
    """megatron-core's ``TESpecProvider`` where TE does not import (gpt_layer_specs sets it to ``None``)."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import gpt_layer_specs

    with mock.patch.object(gpt_layer_specs, "TESpecProvider", TESpecProvider):
        yield


def _keys(model: list) -> set[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from vime_gemma4_bridge.io.torch_dist_layout import sharded_state_dict

    return {item.key for item in nested_values(sharded_state_dict(model)[0]) if hasattr(item, "key")}


def _keys_on_both_hosts(hf_checkpoint: str) -> dict[str, Any]:
    """This CPU model's torch_dist keys, and the same model's keys under the TE spec's keys maps."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.utils import get_model_config

    from vime_gemma4_bridge.convert.model import build_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(Topology(), keep_if_same=True)
    model = build_model(open_bridge(hf_checkpoint), Topology(), initialize=False)
    with _te_spec_provider():
        te_specs = get_gpt_decoder_block_spec(get_model_config(model[0]), use_transformer_engine=True).layer_specs
    layers = list(model[0].decoder.layers)
    assert len(te_specs) == len(layers)
    cpu_maps = [layer.submodules_config.sharded_state_dict_keys_map for layer in layers]
    cpu = _keys(model)
    try:
        for layer, te_spec in zip(layers, te_specs, strict=True):
            layer.submodules_config.sharded_state_dict_keys_map = te_spec.submodules.sharded_state_dict_keys_map
        te = _keys(model)
    finally:
        for layer, keys_map in zip(layers, cpu_maps, strict=True):
            layer.submodules_config.sharded_state_dict_keys_map = keys_map
    return {"cpu": cpu, "te": te, "te_maps": [spec.submodules.sharded_state_dict_keys_map for spec in te_specs]}


@pytest.mark.parametrize("member", ["26b-a4b", *DENSE_SHAPES])
def test_one_key_set_on_both_hosts(local_world, family, member: str) -> None:
    """The CPU model's torch_dist keys are the keys the TE model asks for (item 0 of issue 48); on 60ed740
    the 26B-A4B's routed-expert pre-norm was ``mlp.linear_fc1.layer_norm_weight`` on CPU only."""
    keys = local_world(2).run(_keys_on_both_hosts, str(family[member]))[0]
    assert any(keys["te_maps"]), "megatron-core's TE spec no longer carries a keys map: re-derive this test"
    assert keys["cpu"] == keys["te"], (sorted(keys["cpu"] - keys["te"]), sorted(keys["te"] - keys["cpu"]))
    if member == "26b-a4b":
        assert PRE_NORM_NOW in keys["cpu"] and PRE_NORM_BEFORE not in keys["cpu"]
        assert any(key.endswith("._extra_state") for key in keys["cpu"])


def _import_as_before(*job_args: Any) -> dict:
    """``import_job`` writing what the plugin wrote on a CPU host up to 60ed740: the local spec's keys map
    left whole (``te_keys_map`` the identity), so the routed-expert pre-norm goes under the former key."""
    from vime_gemma4_bridge.core import spec

    with mock.patch.object(spec, "te_keys_map", dict):
        return import_job(*job_args)


@pytest.mark.parametrize(
    ("saved_at", "exported_at"),
    [(Topology(), Topology()), (Topology(ep=2), Topology(tp=2)), (Topology(pp=2), Topology(ep=2))],
    ids=str,
)
def test_checkpoint_with_the_former_cpu_key_still_exports_bitwise(
    local_world, family, tmp_path: Path, saved_at: Topology, exported_at: Topology
) -> None:
    """Checkpoints written before the fix (streamed import at the default topology, megatron-core's save
    otherwise) export bitwise on both export paths (the direct read and megatron-core's load)."""
    from megatron.core import dist_checkpointing

    world, hf = local_world(2), family["26b-a4b"]
    save, out = tmp_path / "torch_dist", tmp_path / "hf"
    world.run(_import_as_before, str(hf), str(save), str(tmp_path / ".partial"), saved_at)
    stored = dist_checkpointing.load_tensors_metadata(str(save / ITERATION_DIR))
    assert PRE_NORM_BEFORE in stored and PRE_NORM_NOW not in stored, "the former writer was not reproduced"
    world.run(export_job, str(save), str(hf), str(out), exported_at, False, 10**9)
    assert_same_checkpoint(hf, out)
