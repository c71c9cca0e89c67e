"""AutoBridge dispatches Gemma 4 to this plugin whatever the import order, and the opt-in autoload works.

Each scenario needs a fresh interpreter (import order is the point), so each runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime_gemma4_bridge.autoload import ENV_VAR, PTH_LINE

REPO = Path(__file__).resolve().parents[1]

DISPATCH = """
import transformers
from megatron.bridge.models.conversion import model_bridge
for name in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):
    print(name, type(model_bridge.get_model_bridge(getattr(transformers, name))).__name__)
"""

#: Installs the TE import guard without importing the package (whose import would register the plugin).
TE_GUARD_ONLY = (
    "import importlib.util as u\n"
    f"spec = u.spec_from_file_location('_te_guard', {str(REPO / 'vime_gemma4_bridge' / 'te_guard.py')!r})\n"
    "guard = u.module_from_spec(spec); spec.loader.exec_module(guard); guard.install()\n"
)

OURS = {
    "Gemma4ForCausalLM": "Gemma4CausalLMBridge",
    "Gemma4ForConditionalGeneration": "Gemma4ConditionalGenerationBridge",
}


def dispatch_after(prelude: str, env: dict[str, str] | None = None) -> dict[str, str]:
    run_env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    run_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + DISPATCH], capture_output=True, text=True, env=run_env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split() for line in proc.stdout.splitlines() if line.startswith("Gemma4For"))


@pytest.mark.parametrize(
    "prelude",
    [
        "import vime_gemma4_bridge\n",
        # upstream's Gemma 4 bridges imported (and registered) before the plugin
        TE_GUARD_ONLY
        + "import megatron.bridge.models.gemma.gemma4_bridge, megatron.bridge.models.gemma_vl.gemma4_vl_bridge\n"
        "import vime_gemma4_bridge\n",
        # one of the plugin's own modules is the first to import megatron.bridge
        "import vime_gemma4_bridge.provider\n",
        # explicit registration, then upstream modules imported again
        "import vime_gemma4_bridge; vime_gemma4_bridge.register(); vime_gemma4_bridge.register()\n"
        "import importlib, megatron.bridge.models.gemma.gemma4_bridge as m; importlib.reload(m)\n",
    ],
    ids=["plugin-first", "upstream-first", "plugin-module-first", "explicit-and-upstream-reloaded"],
)
def test_autobridge_dispatches_to_the_plugin(prelude: str) -> None:
    assert dispatch_after(prelude) == OURS


def test_pth_file_matches_the_autoload_line() -> None:
    assert (REPO / "vime_gemma4_bridge_autoload.pth").read_text().strip() == PTH_LINE


def test_autoload_is_opt_in(tmp_path: Path) -> None:
    """With the .pth on the path, VIME_GEMMA4_BRIDGE_AUTOLOAD=1 activates the plugin without any import."""
    (tmp_path / "vime_gemma4_bridge_autoload.pth").write_text(PTH_LINE + "\n")
    prelude = TE_GUARD_ONLY + f"import site; site.addsitedir({str(tmp_path)!r})\n"
    assert dispatch_after(prelude, {ENV_VAR: "1"}) == OURS
    upstream = dispatch_after(prelude)
    assert upstream["Gemma4ForConditionalGeneration"] == "Gemma4VLBridge"


def test_wheel_ships_the_autoload_pth(tmp_path: Path) -> None:
    import zipfile

    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("vime_gemma4_bridge-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("vime_gemma4_bridge_autoload.pth").decode().strip() == PTH_LINE
