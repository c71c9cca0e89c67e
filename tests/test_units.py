"""The pure parts, fast (``make test-fast``): mapping tables against configs, layer pattern, pre-flight, errors.

No ranks, no conversion: what these check is decided by tables and small functions.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX
from vime_gemma4_bridge.core.layer_pattern import (
    FULL,
    SLIDING,
    has_double_wide_mlp,
    is_kv_shared_layer,
    is_kv_source_layer,
    is_sliding_layer,
    kv_shared_types,
    layer_group_rank,
    pattern_from_layer_types,
)
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

SPECS = {
    "moe-vl": TinySpec(),
    "moe-causal-irregular": TinySpec(
        causal_lm=True, layers=6, layer_types=("sliding", "full", "full", "sliding", "sliding", "full")
    ),
    "moe-no-k-eq-v": TinySpec(attention_k_eq_v=False),
    "dense-vl": TinySpec(moe=False),
    "unified-vl": TinySpec(moe=False, unified=True, per_layer_input_size=0, global_kv_heads=1),
    "unified-causal": TinySpec(moe=False, unified=True, per_layer_input_size=0, causal_lm=True),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("units")
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", SPECS)
def test_mapping_table_names_exactly_the_language_model(tiny: dict[str, Path], name: str) -> None:
    """Every HF language-model tensor the config implies is mapped; every row of the table names some."""
    import vime_gemma4_bridge  # noqa: F401  (TE guard)
    from vime_gemma4_bridge.core.mapping_table import DENSE_MAPPING_TABLE, MOE_MAPPING_TABLE, build_registry
    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.io.hf_model import expected_language_model

    checkpoint = HFCheckpoint(tiny[name])
    assert checkpoint.prefix == LANGUAGE_MODEL_PREFIX[checkpoint.config["architectures"][0]]
    table = MOE_MAPPING_TABLE if SPECS[name].moe else DENSE_MAPPING_TABLE
    registry = build_registry(table, checkpoint.prefix)
    expected = list(expected_language_model(checkpoint))
    assert [n for n in expected if registry.hf_to_megatron_lookup(n) is None] == [], "HF tensors without a mapping"
    if not SPECS[name].moe and not SPECS[name].per_layer_input_size:
        return  # a member without PLE (the 12B) leaves the table's PLE rows unused
    for _, megatron_name, hf in table:
        names = hf.values() if isinstance(hf, dict) else [hf]
        patterns = [re.escape(checkpoint.prefix + n).replace(r"\*", r"\d+") for n in names]
        assert any(re.fullmatch(p, n) for p in patterns for n in expected), f"{megatron_name}: names no HF tensor"


def test_layer_pattern() -> None:
    types = [SLIDING, SLIDING, FULL, FULL, SLIDING, FULL]
    config = dataclasses.make_dataclass("C", [("layer_types", list)])(pattern_from_layer_types(types))
    assert [is_sliding_layer(config, n) for n in range(1, 7)] == [True, True, False, False, True, False]
    config.num_layers = 6
    by_type = [layer_group_rank(config, n, lambda m: config.layer_types[m - 1]) for n in range(1, 7)]
    assert by_type == [(0, 3), (1, 3), (0, 3), (1, 3), (2, 3), (2, 3)]


def test_kv_sharing_pattern() -> None:
    """E2B-style: the last 3 of 6 layers read K/V; each shared type's source is its last earlier layer."""
    types = [SLIDING, FULL, SLIDING, SLIDING, SLIDING, FULL]
    config = SimpleNamespace(layer_types=types, num_layers=6, num_kv_shared_layers=3, use_double_wide_mlp=True)
    assert [is_kv_shared_layer(config, n) for n in range(1, 7)] == [False] * 3 + [True] * 3
    assert kv_shared_types(config) == [SLIDING, FULL]
    assert [is_kv_source_layer(config, n) for n in range(1, 7)] == [False, True, True, False, False, False]
    assert [has_double_wide_mlp(config, n) for n in range(1, 7)] == [False] * 3 + [True] * 3
    config.use_double_wide_mlp = False
    assert not any(has_double_wide_mlp(config, n) for n in range(1, 7))
    config.num_kv_shared_layers = 0
    assert not any(is_kv_shared_layer(config, n) or is_kv_source_layer(config, n) for n in range(1, 7))
    with pytest.raises(ValueError, match="unsupported Gemma 4 layer types"):
        pattern_from_layer_types([SLIDING, "chunked_attention"])


def test_preflight_accepts_what_transformers_writes(tiny: dict[str, Path]) -> None:
    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.io.hf_model import check_language_model

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


#: The command modules that may use the test factory (testing/): the commands about it. ``tiny`` writes its
#: checkpoints, ``demo`` runs on the built-in tiny model, the bench (``bench`` and its report) on a synthetic one.
TEST_FACTORY_COMMANDS = {"tiny", "demo", "bench", "bench_report"}


def test_only_the_commands_about_it_import_the_test_factory() -> None:
    """Every other command runs on the user's checkpoints: what it needs lives in the layer that owns it, not in
    testing/, so the shipped command line reaches the test factory only through these commands."""
    users = {
        name.removeprefix("vime_gemma4_bridge.cli.")
        for name, imported in _package_imports().items()
        if name.startswith("vime_gemma4_bridge.cli.")
        and any(module.startswith("vime_gemma4_bridge.testing") for module in imported)
    }
    assert users == TEST_FACTORY_COMMANDS


REPO = Path(__file__).resolve().parents[1]
#: Where entries of docs/UPSTREAM.md are cited: the package, the scripts, the recipes, the tests and the docs.
CITING = ("vime_gemma4_bridge/**/*.py", "scripts/*", "recipes/*", "tests/*.py", "docs/*.md", "README.md")
#: A citation: ``UPSTREAM 12``, ``docs/UPSTREAM.md 2, 9, 16``, ``docs/UPSTREAM.md, entry 17``, ``UPSTREAM.md, P6``.
_CITATION = re.compile(r"UPSTREAM(?:\.md)?,?(?: entry| entries)? ((?:[PC]?\d+)(?:(?:, | and |/)[PC]?\d+)*)")
#: Inside UPSTREAM.md, entries point at each other as ``entry 18``.
_CROSS_REFERENCE = re.compile(r"\bentry (\d+)\b")
_LAYERED_NAME = re.compile(r"`((?:compat|core|io|runtime|convert|verify|testing|cli)[./][\w./]*?)(?:\(\))?`")


def _upstream_entries() -> tuple[dict[str, str], str]:
    """Entry id -> its text, and the whole of docs/UPSTREAM.md."""
    text = (REPO / "docs" / "UPSTREAM.md").read_text()
    starts = [(m.group(1), m.start()) for m in re.finditer(r"^([PC]?\d+)\. \*\*", text, flags=re.MULTILINE)]
    ends = [start for _, start in starts[1:]] + [len(text)]
    return {entry: text[start:end] for (entry, start), end in zip(starts, ends, strict=True)}, text


def _citations() -> dict[str, set[str]]:
    """Entry id -> the files citing it."""
    cited: dict[str, set[str]] = {}
    for pattern in CITING:
        for path in REPO.glob(pattern):
            if path.is_file() and "__pycache__" not in path.parts:
                text = path.read_text(errors="replace")
                for group in _CITATION.findall(text):
                    for entry in re.split(r", | and |/", group):
                        cited.setdefault(entry, set()).add(str(path.relative_to(REPO)))
    _, upstream = _upstream_entries()
    for entry in _CROSS_REFERENCE.findall(upstream):
        cited.setdefault(entry, set()).add("docs/UPSTREAM.md")
    return cited


def test_every_cited_upstream_entry_exists() -> None:
    """Each ``UPSTREAM n`` in code and docs names an entry of docs/UPSTREAM.md (issue 23: citations had drifted)."""
    entries, _ = _upstream_entries()
    cited = _citations()
    assert len(cited) >= 10, "the citation pattern no longer finds the citations"
    assert {e: sorted(files) for e, files in cited.items() if e not in entries} == {}
    # A package module citing an entry is the plugin's side of it, so the entry names the module.
    strays = []
    for entry, files in cited.items():
        for file in (f for f in files if f.startswith("vime_gemma4_bridge/")):
            module = file.removeprefix("vime_gemma4_bridge/").removesuffix(".py").removesuffix("/__init__")
            if module not in entries[entry] and module.replace("/", ".") not in entries[entry]:
                strays.append(f"{file} cites {entry}, which does not name it")
    assert strays == []


def _defined(path: Path, chain: list[str]) -> bool:
    """Whether ``chain`` (a class, then a method, ...) is defined at the top of the module at ``path``."""
    import ast

    body = ast.parse(path.read_text()).body
    for name in chain:
        found = None
        for node in body:
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            if name in names:
                found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def _resolves(name: str) -> bool:
    """``core/hf_layout.global_kv_heads``, ``compat.cuda.cpu_checkpointing``, ``io/hf.py``: is it in the package?"""
    root = REPO / "vime_gemma4_bridge"
    if name.endswith(".py"):
        return (root / name).is_file()
    parts = name.replace("/", ".").split(".")
    for cut in range(len(parts), 0, -1):
        module = root.joinpath(*parts[:cut])
        path = module.with_suffix(".py") if module.with_suffix(".py").is_file() else module / "__init__.py"
        if path.is_file():
            return _defined(path, parts[cut:])
    return False


def test_every_plugin_name_upstream_md_gives_exists() -> None:
    """Each module, function or class of the plugin that docs/UPSTREAM.md names is still there."""
    _, text = _upstream_entries()
    names = set(_LAYERED_NAME.findall(text))
    assert len(names) >= 20, "the name pattern no longer finds the plugin's names"
    assert sorted(n for n in names if not _resolves(n)) == []
    # The checks fire: a name that is gone and a citation of an entry that is not there.
    assert not _resolves("core/provider._install_rounded_embedding_scale")
    assert _CITATION.findall("see UPSTREAM.md, P6 and docs/UPSTREAM.md 2, 9") == ["P6", "2, 9"]


def test_help_imports_no_torch() -> None:
    """``vime-gemma4 --help`` and every command's ``--help`` build without torch, transformers or megatron.

    Building the parser imported torch through the tiny factory (2.2 s of a 2.65 s ``--help``, issue 23).
    """
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from vime_gemma4_bridge.cli.main import build_parser\n"
        "parser = build_parser()\n"
        "commands = parser._subparsers._group_actions[0].choices\n"
        "texts = [parser.format_help()] + [c.format_help() for c in commands.values()]\n"
        "assert len(commands) >= 10 and all(texts)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'megatron')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_upstream_private_names_only_in_compat() -> None:
    """A build that moves a private name breaks one seam in compat/, not a module of each layer.

    Decided from the code, not from a list of names (``tests/private_names.upstream_private_uses``
    reads every module with ``ast``). Outside compat/, a module may not:

    * name a private attribute (``_name``, not a dunder) as ``x._name``, ``getattr`` / ``hasattr`` /
      ``setattr(x, "_name")`` or ``from megatron.x import _name``, unless the package defines that name
      itself (a def, class, assignment or attribute store anywhere in the package; overrides do not
      count), and never on ``self`` / ``super()`` where the class's upstream classes have it; a few
      standard-library names, public by design, are allowed by name (``private_names.STDLIB_ALLOWED``);
    * override a private method of megatron, transformers or torch (a ``def _name`` in a class whose
      upstream classes, looked up on the real classes, have ``_name``; a mixin answers for the classes
      deriving from it);
    * assign ``x.__class__``, or store into a megatron / transformers / torch module or class.

    Each failure is listed as ``path:line name (why)``.
    """
    from private_names import package_sources, upstream_private_uses

    import vime_gemma4_bridge  # noqa: F401  (TE guard: the checker imports the upstream classes)

    sources = package_sources(REPO / "vime_gemma4_bridge")
    assert upstream_private_uses(sources) == []
    # compat/ is exempt, not unseen: the checker finds the seams' own private names there.
    seams = [use for use in upstream_private_uses(sources, exempt=None) if "compat/seams.py" in use]
    assert len(seams) >= 5, seams


#: One of each kind of reach into upstream (negative control), beside what the package may do.
_REACHING = """\
import torch
from torch import nn
from torch._C import _get_tracing_state


class Mixin:
    def _apply(self, fn):
        return fn


class Layer(Mixin, nn.Module):
    def __init__(self):
        super().__init__()
        self._own = 1

    def _load_from_state_dict(self, *args):
        return super()._load_from_state_dict(*args) and self._own


def reach(module, item):
    hasattr(module, "_buffers")
    module.__class__ = Layer
    torch.nn.Linear = Layer
    return module._parameters, item._replace(a=1)
"""


def test_private_name_checker_fires() -> None:
    """The checker names each kind of reach (import, override, a mixin's override, attribute, getattr by
    string, class swap, store into torch) and passes the package's own names and compat/."""
    from private_names import upstream_private_uses

    sources = {
        "vime_gemma4_bridge.core.reaching": ("reaching.py", _REACHING),
        "vime_gemma4_bridge.compat.seam": ("seam.py", "def parameters(module):\n    return module._parameters\n"),
    }
    assert upstream_private_uses(sources) == [
        "reaching.py:3 torch._C._get_tracing_state (import)",
        "reaching.py:7 _apply (override of Module)",
        "reaching.py:16 _load_from_state_dict (override of Module)",
        "reaching.py:17 _load_from_state_dict (Module's)",
        "reaching.py:21 _buffers (not the package's)",
        "reaching.py:22 __class__ (class swap)",
        "reaching.py:23 torch.nn.Linear (store into upstream)",
        "reaching.py:24 _parameters (not the package's)",
    ]


def test_no_module_imports_upstream_gemma_models() -> None:
    """Both Gemma 4 models are the plugin's: no module imports Megatron-Bridge's gemma / gemma_vl code (issue 22)."""
    root = REPO / "vime_gemma4_bridge"
    hits = [str(path) for path in root.rglob("*.py") if "megatron.bridge.models.gemma" in path.read_text()]
    assert hits == []


def test_core_is_liftable() -> None:
    """core/ (the upstream pull request) reaches compat/ only for its seams and mapping classes, no run-time patch.

    The seams include the two hook classes (compat/layer_hooks.py, compat/bridge_hooks.py): core/'s layers
    and bridge subclass them so that the upstream private methods they replace are overridden there
    only; they patch nothing, and an upstream pull request would make those steps public instead. The
    bridge's export completes a HF save from the source through compat/hf_save.py (on the save's own
    source object; UPSTREAM 30 proposes the upstream hook instead).
    """
    imported = {
        f"{module} -> {target}"
        for module, targets in _package_imports().items()
        if module.startswith("vime_gemma4_bridge.core")
        for target in targets
        if target.startswith("vime_gemma4_bridge.compat")
    }
    allowed = {
        f"vime_gemma4_bridge.compat.{name}" for name in ("seams", "mappings", "layer_hooks", "bridge_hooks", "hf_save")
    }
    assert {edge for edge in imported if edge.rpartition(" -> ")[2] not in allowed} == set()
    assert imported, "the import graph no longer sees core's imports"


def test_rollout_check_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    """``rollout-check``: counts below 1, an unreadable HF directory and a server that is down: exit 2, one line."""
    import socket

    from vime_gemma4_bridge.cli.main import main

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{sock.getsockname()[1]}"
    hf = write_tiny_checkpoint(tmp_path / "hf", TinySpec())
    capsys.readouterr()
    cases = [
        (["--hf-checkpoint", str(hf), "--server", down, "--prompts", "0"], "--prompts must be >= 1"),
        (["--hf-checkpoint", str(tmp_path / "missing"), "--server", down], "config.json"),
        (["--hf-checkpoint", str(hf), "--server", down], "cannot reach a server"),
    ]
    for argv, message in cases:
        assert main(["rollout-check", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.strip().count("\n") == 0, err


def test_digest_span_hashes_across_mapping_windows_and_refuses_short_files(tmp_path: Path) -> None:
    """io/digests hashes a span window by window over memory mappings: every span, whichever windows it
    crosses, has the digest of its bytes; a span past the file's end (a truncated copy) never matches."""
    import os

    import xxhash

    from vime_gemma4_bridge.io import digests

    data = os.urandom(2 * digests._WINDOW + 12345)
    path = tmp_path / "blob"
    path.write_bytes(data)
    window = digests._WINDOW
    for offset, length in ((0, None), (5, 100), (window - 3, 10), (4097, window + 7), (len(data) - 10, 10)):
        expected = data[offset:] if length is None else data[offset : offset + length]
        assert digests.digest_span(digests.Span(path, offset, length, "t")) == xxhash.xxh3_128_hexdigest(expected)
    short = digests.Span(path, len(data) - 10, 20, "tensor t")
    assert digests.check_spans([(short, xxhash.xxh3_128_hexdigest(data[-10:]))]) == (
        f"blob bytes {len(data) - 10:,}..{len(data) + 10:,} (tensor t) do not match the digest recorded when it "
        "was written"
    )


def test_remove_own_partials_spares_the_output_set_aside(tmp_path: Path) -> None:
    """What a rank removes when its launcher is gone: its uncommitted partials, never an output, old or new."""
    from vime_gemma4_bridge.io import commit

    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("the previous output")
    writing = commit.partial_path(out)
    writing.mkdir()
    (writing / "new").write_text("complete")
    replace = commit.os.replace
    aside: list[Path] = []

    def end_mid_commit(src, dst):  # the launcher goes between setting the old output aside and the new in
        replace(src, dst)
        if Path(src) == out:
            aside.append(Path(dst))
            commit.remove_own_partials()
            assert not writing.exists() and (Path(dst) / "old").exists()

    commit.os.replace = end_mid_commit
    try:
        with pytest.raises(FileNotFoundError):
            commit.commit_directory(writing, out)
    finally:
        commit.os.replace = replace
    assert aside, "the commit did not set the old output aside"
    assert (out / "old").read_text() == "the previous output", "the old output was not put back"
    committed = commit.partial_path(out)
    committed.mkdir()
    commit.commit_directory(committed, out)
    commit.remove_own_partials()
    assert out.is_dir() and not (out / "old").exists(), "a committed output was removed"


#: text_config of google/gemma-4-12B @56820d7d as issue 36 quotes it (the fields the topology check reads).
GEMMA4_12B_UNIFIED_TEXT = {
    "model_type": "gemma4_unified_text",
    "num_hidden_layers": 48,
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "vocab_size": 262144,
}


def test_topology_replicates_fewer_global_kv_heads_than_tp_ranks() -> None:
    """The 12B's one global KV head: any TP that is a multiple of it (each rank a copy); a TP that neither
    divides nor is divided by the global KV heads is refused in one line, naming them."""
    from vime_gemma4_bridge.convert.topology import Topology
    from vime_gemma4_bridge.core.model_split import TopologyError, validate_model_topology

    config = {"model_type": "gemma4_unified", "text_config": GEMMA4_12B_UNIFIED_TEXT}
    for tp in (1, 2, 4, 8):
        validate_model_topology(config, Topology(tp=tp, pp=2))
    three = {**GEMMA4_12B_UNIFIED_TEXT, "num_key_value_heads": 6, "num_attention_heads": 12, "intermediate_size": 15360}
    validate_model_topology({"text_config": {**three, "num_global_key_value_heads": 3}}, Topology(tp=3))
    with pytest.raises(TopologyError, match=r"^2 global KV heads do not divide by --tp 3; choose a divisor of 2$"):
        validate_model_topology({"text_config": {**three, "num_global_key_value_heads": 2}}, Topology(tp=3))
    with pytest.raises(TopologyError, match="is not Gemma 4"):
        validate_model_topology({"text_config": {**GEMMA4_12B_UNIFIED_TEXT, "model_type": "llama"}}, Topology())


def test_compare_takes_an_export_stream_against_tensor_files(tmp_path: Path) -> None:
    """The round trip's comparison: the export's ``(name, tensor)`` pairs one at a time against the source read
    tensor by tensor; a name yielded twice, a missing one and a foreign one are each reported."""
    import torch
    from safetensors.torch import save_file

    from vime_gemma4_bridge.verify.compare import TensorFiles
    from vime_gemma4_bridge.verify.report import compare

    source = {"a.weight": torch.arange(6.0).view(2, 3), "b.weight": torch.ones(4), "c.weight": torch.zeros(2)}
    save_file(source, tmp_path / "model.safetensors")
    with TensorFiles.of_files([tmp_path / "model.safetensors"]) as reference:
        same = compare(reference, iter([(n, t.clone()) for n, t in source.items()]))
        assert same.identical and same.total.count == 3 and same.total.equal == 3
        stream = [("a.weight", source["a.weight"]), ("b.weight", -source["b.weight"]), ("a.weight", source["a.weight"])]
        result = compare(reference, iter(stream + [("z.weight", torch.ones(1))]))
    assert (result.different, result.missing) == (["b.weight"], ["c.weight"])
    assert result.extra == ["a.weight (yielded again)", "z.weight"] and not result.identical


@pytest.mark.fast
def test_the_spec_refuses_a_field_megatron_core_renamed() -> None:
    """The Gemma 4 layer spec is built with ``dataclasses.replace`` on megatron-core's: where a build renamed a
    field (here ``pre_mlp_layernorm``), building raises naming it instead of setting an attribute nothing reads."""
    import dataclasses

    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from vime_gemma4_bridge.core import spec
    from vime_gemma4_bridge.core.model import Gemma4RMSNorm, Gemma4TransformerLayer

    def layer_spec(submodules_class: type) -> ModuleSpec:
        attention = ModuleSpec(module=SelfAttention, submodules=SelfAttentionSubmodules(None, None, None))
        moe = ModuleSpec(module=MoELayer, submodules=MoESubmodules(experts=None))
        layer = submodules_class(self_attention=attention, mlp=moe, sharded_state_dict_keys_map={})
        return ModuleSpec(module=TransformerLayer, submodules=layer)

    built = spec._moe_layer(layer_spec(TransformerLayerSubmodules), use_te=False)
    assert built.module is Gemma4TransformerLayer and built.submodules.pre_mlp_layernorm is Gemma4RMSNorm
    renamed = dataclasses.make_dataclass(
        "TransformerLayerSubmodules",
        [
            ("pre_ffn_layernorm" if f.name == "pre_mlp_layernorm" else f.name, object, dataclasses.field(default=None))
            for f in dataclasses.fields(TransformerLayerSubmodules)
        ],
    )
    with pytest.raises(TypeError, match="pre_mlp_layernorm"):
        spec._moe_layer(layer_spec(renamed), use_te=False)
