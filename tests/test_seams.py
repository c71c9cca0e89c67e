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


def test_env_names_versions_and_vime_readiness(capsys) -> None:
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
    with sourced_export():
        assert cli.main(["env", "--vime"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.split() == ["export", "tuple", *seams.SOURCED.split()] for line in out)
    assert out[-1].startswith(
        "env FAILED: vime's bridge weight sync unpacks three fields without asking with_megatron_names"
    )
