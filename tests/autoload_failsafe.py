"""Run as a script by tests/test_registration.py: the autoload with registration made impossible.

``autoload_failsafe.py PTH_DIR LLAMA_DIR GEMMA_DIR``: one import the plugin needs is made to fail,
the autoload ``.pth`` is activated, then a tiny Llama goes HF -> Megatron -> HF through Megatron-Bridge
on one gloo rank (``llama N/M bitwise``), and a Gemma 4 look-up is tried (``gemma: <error>``).
"""

import sys

BLOCKED = "vime_gemma4_bridge.core.model"


class Refuse:
    """Simulates an import the plugin needs failing (as on a Megatron-Bridge build that lacks it)."""

    def find_spec(self, name, path=None, target=None):
        if name == BLOCKED:
            raise ImportError(f"simulated: cannot import {BLOCKED}")
        return None


sys.meta_path.insert(0, Refuse())
pth_dir, llama_dir, gemma_dir = sys.argv[1:4]
import site  # noqa: E402

site.addsitedir(pth_dir)  # the autoload .pth, with VIME_GEMMA4_BRIDGE_AUTOLOAD=1 in the environment
assert "vime_gemma4_bridge" in sys.modules, "the .pth did not load the plugin"

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from vime_gemma4_bridge.convert.topology import Topology, init_model_parallel  # noqa: E402
from vime_gemma4_bridge.runtime.group import single_process_group  # noqa: E402

with single_process_group("gloo"):
    init_model_parallel(Topology())
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(llama_dir)
    from megatron.bridge.models.gpt_provider import local_layer_spec

    provider = bridge.to_megatron_provider(load_weights=False)
    provider.transformer_layer_spec = local_layer_spec  # no Transformer Engine here
    for name in (
        "gradient_accumulation_fusion",
        "bias_activation_fusion",
        "masked_softmax_fusion",
        "apply_rope_fusion",
        "persist_layer_norm",
    ):
        setattr(provider, name, False)  # CUDA kernels
    provider.finalize()
    model = provider.provide_distributed_model(
        wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
    )
    bridge.load_hf_weights(model)
    exported = {n: t.clone() for n, t, *_ in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    source = load_file(f"{llama_dir}/model.safetensors")
    same = sum(1 for n, t in source.items() if n in exported and torch.equal(exported[n], t))
    print(f"llama {same}/{len(source)} bitwise, {len(exported)} exported")
    try:
        AutoBridge.from_hf_pretrained(gemma_dir).to_megatron_provider(load_weights=False)
        print("gemma: no error")
    except Exception as error:  # noqa: BLE001
        print(f"gemma: {type(error).__name__}: {error}")
