"""AutoBridge dispatches Gemma 4 to this plugin whatever the import order, and the opt-in autoload works.

Each scenario needs a fresh interpreter (import order is the point), so each runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vime_gemma4_bridge.compat.autoload import ENV_VAR, PTH_LINE

REPO = Path(__file__).resolve().parents[1]

DISPATCH = """
import transformers
from megatron.bridge.models.conversion import model_bridge
for name in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForCausalLM",
             "Gemma4UnifiedForConditionalGeneration"):
    try:
        print(name, type(model_bridge.get_model_bridge(getattr(transformers, name))).__name__)
    except NotImplementedError:  # Megatron-Bridge's dispatch has no bridge for it (upstream: none for the 12B's)
        print(name, "none")
"""

#: Installs the TE import guard without importing the package (whose import would register the plugin).
TE_GUARD_ONLY = (
    "import importlib.util as u\n"
    f"spec = u.spec_from_file_location('_te_guard', {str(REPO / 'vime_gemma4_bridge' / 'compat' / 'te_guard.py')!r})\n"
    "guard = u.module_from_spec(spec); spec.loader.exec_module(guard); guard.install()\n"
)

FOREIGN_PLUGIN = """
import transformers
from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge, get_model_bridge
from megatron.core.models.gpt.gpt_model import GPTModel

class ForeignBridge(MegatronModelBridge):
    pass

MegatronModelBridge.register_bridge(source="ForeignForCausalLM", target=GPTModel)(ForeignBridge)
get_model_bridge(transformers.LlamaForCausalLM)
"""

OURS = {
    "Gemma4ForCausalLM": "Gemma4CausalLMBridge",
    "Gemma4ForConditionalGeneration": "Gemma4ConditionalGenerationBridge",
    "Gemma4UnifiedForCausalLM": "Gemma4UnifiedCausalLMBridge",
    "Gemma4UnifiedForConditionalGeneration": "Gemma4UnifiedConditionalGenerationBridge",
}


def dispatch_after(prelude: str, env: dict[str, str] | None = None) -> dict[str, str]:
    run_env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    run_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + DISPATCH], capture_output=True, text=True, env=run_env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split() for line in proc.stdout.splitlines() if line.startswith(("Gemma4For", "Gemma4UnifiedFor")))


@pytest.mark.parametrize(
    "prelude",
    [
        "import vime_gemma4_bridge\n",
        # upstream's Gemma 4 bridges imported (and registered) before the plugin
        TE_GUARD_ONLY
        + "import megatron.bridge.models.gemma.gemma4_bridge, megatron.bridge.models.gemma_vl.gemma4_vl_bridge\n"
        "import vime_gemma4_bridge\n",
        # one of the plugin's own modules is the first to import megatron.bridge
        "import vime_gemma4_bridge.core.provider\n",
        # explicit registration, then upstream modules imported again
        "import vime_gemma4_bridge; vime_gemma4_bridge.register(); vime_gemma4_bridge.register()\n"
        "import importlib, megatron.bridge.models.gemma.gemma4_bridge as m; importlib.reload(m)\n",
        # vime's own plugin (vime_plugins.megatron_bridge) registers another architecture and a
        # bridge look-up runs before this plugin is imported
        TE_GUARD_ONLY + FOREIGN_PLUGIN + "import vime_gemma4_bridge\n",
    ],
    ids=["plugin-first", "upstream-first", "plugin-module-first", "explicit-and-upstream-reloaded", "foreign-first"],
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


#: Makes one import the plugin needs fail, as it would on a Megatron-Bridge build that lacks it.
BLOCK_PLUGIN_MODEL = (
    "import sys\n"
    "class Refuse:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'vime_gemma4_bridge.core.model':\n"
    "            raise ImportError('simulated: cannot import vime_gemma4_bridge.core.model')\n"
    "sys.meta_path.insert(0, Refuse())\n"
)


def test_autoload_fails_safe(tmp_path: Path) -> None:
    """Registration impossible: other architectures still convert, Gemma 4 look-ups fail in one line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from vime_gemma4_bridge.testing.spec import TinySpec
    from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

    torch.manual_seed(0)
    llama_config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(llama_config).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    gemma = write_tiny_checkpoint(tmp_path / "gemma", TinySpec(seed=5))
    (tmp_path / "vime_gemma4_bridge_autoload.pth").write_text(PTH_LINE + "\n")
    env = {**os.environ, ENV_VAR: "1"}
    script = REPO / "tests" / "autoload_failsafe.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), str(tmp_path / "llama"), str(gemma)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    (llama,) = [line for line in lines if line.startswith("llama ")]
    done, total = llama.split()[1].split("/")
    assert done == total and int(total) > 10, llama
    (gemma_line,) = [line for line in lines if line.startswith("gemma: ")]
    assert gemma_line.startswith("gemma: PluginUnavailable: vime-gemma4-bridge could not register"), gemma_line
    assert "simulated: cannot import vime_gemma4_bridge.core.model" in gemma_line
    logged = [line for line in (proc.stderr + proc.stdout).splitlines() if not line.startswith("gemma: ")]
    assert any("could not register its Gemma 4 bridges" in line for line in logged)  # logged, not swallowed


def test_explicit_register_raises_what_prevents_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_PLUGIN_MODEL + "import vime_gemma4_bridge; vime_gemma4_bridge.register()"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "ImportError: simulated: cannot import vime_gemma4_bridge.core.model" in proc.stderr


def test_dense_gemma4_needs_no_dense_provider_of_the_build(tmp_path: Path) -> None:
    """A build without Megatron-Bridge's Gemma4DenseProvider (simulated: removed after import; vime's fork
    @d063066b, ``models/gemma/__init__.py``, exports ``Gemma4ModelProvider`` only) builds the dense model,
    and ``env`` reports both models available (issue 22)."""
    from vime_gemma4_bridge.testing.spec import DENSE_SHAPES
    from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

    dense = write_tiny_checkpoint(tmp_path / "e2b", DENSE_SHAPES["e2b"])
    script = (
        "import argparse, vime_gemma4_bridge\nfrom megatron.bridge import AutoBridge\n"
        "import megatron.bridge.models.gemma as gemma, megatron.bridge.models.gemma.gemma4_provider as p\n"
        "del p.Gemma4DenseProvider, gemma.Gemma4DenseProvider\n"
        f"provider = AutoBridge.from_hf_pretrained({str(dense)!r}).to_megatron_provider(load_weights=False)\n"
        "print('provider', type(provider).__name__, provider.num_kv_shared_layers, provider.use_double_wide_mlp)\n"
        "from vime_gemma4_bridge.cli import env\n"
        "raise SystemExit(env.run(argparse.Namespace(vime=False, miles=False)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "provider Gemma4DenseTextModelProvider 5 True" in proc.stdout
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("Gemma 4 models")]
    assert row.split(None, 3)[3].startswith("MoE 26B-A4B (Gemma4TextModelProvider) and dense 31B / E4B / E2B"), row
    assert "unavailable" not in proc.stdout and "env OK" in proc.stdout
