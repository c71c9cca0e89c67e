"""The Megatron-Bridge build seams the plugin detects, on the installed release and on the fork's shape.

The fork cannot be installed here: ``tests/fork_seams.py`` patches the installed release into the
fork's shape (its docstring says how, seam by seam). The end-to-end proof on that shape, vime's
weight sync at TP2·PP2·EP4·ETP1 and PP2·VPP2, is ``tests/test_live.py::test_vime_weight_sync_contract``.
"""

from __future__ import annotations

import pytest
import torch
from fork_seams import fork_seams, sourced_export

from vime_gemma4_bridge.compat import seams

RELEASE = {
    "build": "release",
    "export tuple": "(hf_name, tensor)",
    "build_conversion_tasks weight_dtype": True,
    "mappings keep _pg_collection": True,
}
FORK = {
    "build": "vime fork",
    "export tuple": "(hf_name, tensor, megatron_param_name)",
    "build_conversion_tasks weight_dtype": False,
    "mappings keep _pg_collection": False,
}
#: upstream's #6074 (the fork @04c0fd03): the release's seams but the opt-in sourced tuple.
SOURCED = {**RELEASE, "build": "sourced export", "export tuple": seams.SOURCED}


def test_seams_are_detected_by_feature() -> None:
    import vime_gemma4_bridge  # noqa: F401  (the TE guard, for importing Megatron-Bridge here)

    assert seams.describe() == RELEASE
    with fork_seams():
        assert seams.describe() == FORK
    assert seams.describe() == RELEASE
    with sourced_export():
        assert seams.describe() == SOURCED
    assert seams.describe() == RELEASE


def test_weight_dtype_is_passed_only_where_the_build_takes_it() -> None:
    import vime_gemma4_bridge  # noqa: F401

    assert seams.conversion_task_kwargs(torch.float32) == {"weight_dtype": torch.float32}
    with fork_seams():
        assert seams.conversion_task_kwargs(None) == {}
        with pytest.raises(ValueError, match="cannot export in another dtype"):
            seams.conversion_task_kwargs(torch.float32)


def test_cpu_safe_auto_mapping_without_pg_collection() -> None:
    """The fork's mappings keep no ``_pg_collection``: the CPU-safe delegate is built without one."""
    import vime_gemma4_bridge  # noqa: F401
    from vime_gemma4_bridge.compat.mappings import AutoMapping, ReplicatedMapping

    with fork_seams():
        mapping = AutoMapping(megatron_param="decoder.final_layernorm.weight", hf_param="model.norm.weight")
        assert not hasattr(mapping, "_pg_collection")
        assert type(mapping._get_or_create_mapping("replicated")) is ReplicatedMapping


def test_env_names_versions_and_vime_and_miles_readiness(capsys) -> None:
    import importlib.metadata

    from vime_gemma4_bridge.cli import main as cli

    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0].strip(): line for line in out}
    for component, distribution in (
        ("megatron-core", "megatron-core"),
        ("Megatron-Bridge", "megatron-bridge"),
        ("transformers", "transformers"),
    ):
        assert importlib.metadata.version(distribution) in rows[component]
    assert "release" in rows["Megatron-Bridge"] and "CPU twins" in rows["modules"]
    assert "Gemma4ForConditionalGeneration -> Gemma4ConditionalGenerationBridge" in rows["registration"]
    assert out[-1] == "env OK: the plugin works here"

    assert cli.main(["env", "--vime"]) == 1
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .startswith("env FAILED: vime's bridge weight sync unpacks three fields; this build's export yields two")
    )
    with fork_seams():
        assert cli.main(["env", "--vime"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "env OK: the plugin works here and vime's bridge mode can use it"
    assert cli.main(["env", "--miles"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("env FAILED: miles' bridge weight sync unpacks three fields; this build's export")
    with fork_seams():
        assert cli.main(["env", "--miles"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0].strip(): line for line in out}
    assert "--custom-megatron-init-path vime_gemma4_bridge.miles_init" in rows["miles bridge road"]
    assert "(the plugin's, in any order)" in rows["registration"]
    assert out[-1] == "env OK: the plugin works here and miles' bridge road can use it"
    with sourced_export():
        assert cli.main(["env", "--vime"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["export", "tuple", *seams.SOURCED.split()] for line in out)
    assert out[-1].startswith(
        "env FAILED: vime's bridge weight sync unpacks three fields without asking with_megatron_names"
    )


def _sharded_source(root) -> object:
    """A two-shard source checkpoint with an index, as Megatron-Bridge's state source reads it."""
    import json

    from megatron.bridge.models.hf_pretrained.state import SafeTensorsStateSource
    from safetensors.torch import save_file

    root.mkdir()
    save_file({"a": torch.zeros(2, 2)}, root / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(2, 2), "c": torch.zeros(2)}, root / "model-00002-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    weight_map["c"] = "model-00002-of-00002.safetensors"
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 40}, "weight_map": weight_map})
    )
    return SafeTensorsStateSource(root)


def test_fork_double_saves_as_the_forks_state_py(tmp_path, capsys) -> None:
    """The double's ``save_generator`` does what the fork's ``hf_pretrained/state.py`` @d063066b does, not the release.

    Read there: ``save_file(tensors_to_save, output_file_path)`` with no ``.contiguous()``; incomplete
    shards only printed ("Error: N tensors from the original checkpoint were not written") and the index
    still written from ``all_saved_keys``; ``_save_generator_distributed``'s no-index fallback
    ``buffered_tensors = dict(generator)``.
    """
    import json

    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple

    source = _sharded_source(tmp_path / "src")
    strided = torch.arange(8.0).view(2, 4)[:, ::2]  # a view: not contiguous
    with fork_seams():
        from megatron.bridge.models.conversion.model_bridge import HFWeightTuple as ForkTuple

        with pytest.raises(Exception, match="non contiguous"):
            source.save_generator(iter([ForkTuple("a", strided)]), tmp_path / "fork-strided")
        source.save_generator(iter([ForkTuple("a", torch.ones(2, 2))]), tmp_path / "fork-partial")
        assert "Error: 2 tensors from the original checkpoint were not written" in capsys.readouterr().out
        index = json.loads((tmp_path / "fork-partial" / "model.safetensors.index.json").read_text())
        assert index == {"metadata": {"total_size": 40}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
        (tmp_path / "no-shards").mkdir()  # a source without shards or index: the fallback path
        single = type(source)(tmp_path / "no-shards")
        with pytest.raises(ValueError, match="has length 3; 2 is required"):
            single.save_generator(iter([ForkTuple("a", torch.ones(1), "m")]), tmp_path / "dist", distributed_save=True)
    # the release: contiguous copies, and an incomplete save raises before any index is written
    source.save_generator(
        iter([HFWeightTuple("a", strided), HFWeightTuple("b", strided), HFWeightTuple("c", torch.ones(2))]),
        tmp_path / "release",
    )
    with pytest.raises(RuntimeError, match="were not written"):
        source.save_generator(iter([HFWeightTuple("a", torch.ones(2, 2))]), tmp_path / "release-partial")
    assert not (tmp_path / "release-partial" / "model.safetensors.index.json").exists()
