"""The pure parts, fast (``make test-fast``): mapping tables against configs, layer pattern, pre-flight, errors.

No ranks, no conversion: what these check is decided by tables and small functions.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX
from vime_gemma4_bridge.core.layer_pattern import (
    FULL,
    SLIDING,
    is_sliding_layer,
    layer_type_rank,
    pattern_from_layer_types,
)
from vime_gemma4_bridge.testing.tiny import TinySpec, write_tiny_checkpoint

SPECS = {
    "moe-vl": TinySpec(),
    "moe-causal-irregular": TinySpec(
        causal_lm=True, layers=6, layer_types=("sliding", "full", "full", "sliding", "sliding", "full")
    ),
    "moe-no-k-eq-v": TinySpec(attention_k_eq_v=False),
    "dense-vl": TinySpec(moe=False),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("units")
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", SPECS)
def test_mapping_table_names_exactly_the_language_model(tiny: dict[str, Path], name: str) -> None:
    """Every HF language-model tensor the config implies is mapped; every row of the table names some."""
    import vime_gemma4_bridge  # noqa: F401  (TE guard)
    from vime_gemma4_bridge.cli.preflight import expected_language_model
    from vime_gemma4_bridge.core.bridge import DENSE_MAPPING_TABLE, MOE_MAPPING_TABLE, build_registry
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    checkpoint = HFCheckpoint(tiny[name])
    assert checkpoint.prefix == LANGUAGE_MODEL_PREFIX[checkpoint.config["architectures"][0]]
    table = MOE_MAPPING_TABLE if SPECS[name].moe else DENSE_MAPPING_TABLE
    registry = build_registry(table, checkpoint.prefix)
    expected = list(expected_language_model(checkpoint))
    assert [n for n in expected if registry.hf_to_megatron_lookup(n) is None] == [], "HF tensors without a mapping"
    for _, megatron_name, hf in table:
        names = hf.values() if isinstance(hf, dict) else [hf]
        patterns = [re.escape(checkpoint.prefix + n).replace(r"\*", r"\d+") for n in names]
        assert any(re.fullmatch(p, n) for p in patterns for n in expected), f"{megatron_name}: names no HF tensor"


def test_layer_pattern() -> None:
    types = [SLIDING, SLIDING, FULL, FULL, SLIDING, FULL]
    config = dataclasses.make_dataclass("C", [("layer_types", list)])(pattern_from_layer_types(types))
    assert [is_sliding_layer(config, n) for n in range(1, 7)] == [True, True, False, False, True, False]
    assert [layer_type_rank(config, n) for n in range(1, 7)] == [(0, 3), (1, 3), (0, 3), (1, 3), (2, 3), (2, 3)]
    with pytest.raises(ValueError, match="unsupported Gemma 4 layer types"):
        pattern_from_layer_types([SLIDING, "chunked_attention"])


def test_preflight_accepts_what_transformers_writes(tiny: dict[str, Path]) -> None:
    from vime_gemma4_bridge.cli.preflight import check_language_model
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    for path in tiny.values():
        check_language_model(HFCheckpoint(path))


def test_errors_are_one_line() -> None:
    from vime_gemma4_bridge.cli.errors import one_line
    from vime_gemma4_bridge.runtime.world import RankError

    trace = "Traceback (most recent call last):\n  File ...\nvime_gemma4_bridge.io.hf.CheckpointError: bad shard"
    assert one_line(RankError("job", {0: trace})) == "bad shard"
    assert one_line(RankError("job", {1: "Traceback ...\nRuntimeError: boom"})) == "RuntimeError: boom"
    assert one_line(OSError(28, "No space left on device")) == "OSError: [Errno 28] No space left on device"
    assert one_line(ValueError("--ep 3 does not divide 16 experts")) == "--ep 3 does not divide 16 experts"


def _package_imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in its body), from the source."""
    import ast

    root = Path(__file__).resolve().parents[1] / "vime_gemma4_bridge"
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vime_gemma4_bridge"):
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    found.add(candidate if candidate in modules else node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("vime_gemma4_bridge"))
        graph[name] = found - {name, "vime_gemma4_bridge"}
    return graph


#: The package's layers, lowest first: a module imports only from its own layer and those below it.
LAYERS = ("compat", "core", "io", "runtime", "convert", "verify", "testing", "cli")
#: The most lines a package module may have (issue 15): past it, a module holds more than one concern.
MAX_MODULE_LINES = 600


def _layer(module: str) -> str:
    """The layer of a package module (``root`` for the package itself), from its path."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1] if parts[1] in LAYERS else f"<{parts[1]}: in no layer>"


def test_import_layers() -> None:
    """Imports go down the layers only (the package root: compat/ and core/), no cycle, no module over 600 lines."""
    graph = _package_imports()
    assert [m for m in graph if _layer(m).startswith("<")] == [], f"modules outside the layers of {LAYERS}"
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for name, imported in graph.items():
        ceiling = rank["core"] if _layer(name) == "root" else rank[_layer(name)]
        upward += [f"{name} -> {m}" for m in sorted(imported) if rank[_layer(m)] > ceiling]
    assert upward == [], f"imports of a higher layer (order: {' < '.join(LAYERS)})"

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and not seen.add(nxt) and reaches(nxt, target, seen)):
                return True
        return False

    cycles = sorted(name for name in graph if reaches(name, name, set()))
    assert cycles == [], f"modules in an import cycle: {cycles}"

    root = Path(__file__).resolve().parents[1] / "vime_gemma4_bridge"
    sizes = {path.relative_to(root.parent): len(path.read_text().splitlines()) for path in root.rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > MAX_MODULE_LINES} == {}, f"modules over {MAX_MODULE_LINES} lines"
