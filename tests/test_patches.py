"""No process-wide patch of upstream outlives a job: after each of the plugin's jobs, no attribute of a
megatron / transformers / torch module or class holds the plugin's code.

The scan (:func:`plugin_code_in_upstream`) walks every loaded module of those packages and every class
they define, and names each attribute whose value is the plugin's: a function or lambda whose code
lies in ``vime_gemma4_bridge/`` (also behind ``staticmethod`` / ``classmethod`` / ``property`` /
``functools.partial`` / ``__wrapped__``), a class of the plugin, or an instance of one. What the
plugin may still swap while it works (``compat/cuda``'s CPU stand-ins, the LoRA transform's
adapter-attribute lookup, the registration on first use) is listed in docs/SEAMS.md; each must be
gone when its block ends, which is what this checks, in the rank processes that ran the job.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import FunctionType
from typing import Any

import pytest

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

UPSTREAM_PACKAGES = ("megatron", "transformers", "torch")


def _is_plugin_code(value: Any, root: str) -> bool:
    """Whether ``value`` is the plugin's code (function, class, instance of a plugin class), unwrapped.

    Only types are asked for attributes (an arbitrary upstream object may compute one: torch's lazy
    CUDA state initialises CUDA when asked).
    """
    for _ in range(8):  # the value, then what it wraps: the plugin's code on either side is the plugin's
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        elif isinstance(value, property):
            value = value.fget
        elif isinstance(value, functools.partial):
            value = value.func
        if isinstance(value, FunctionType):
            if value.__code__.co_filename.startswith(root):
                return True
            if "__wrapped__" in vars(value):
                value = vars(value)["__wrapped__"]
                continue
            return False
        owner = value if isinstance(value, type) else type(value)
        return str(vars(owner).get("__module__", "")).startswith("vime_gemma4_bridge")
    return False


#: How a module was loaded, not what it holds: on a host without TE, the import guard's loaders (docs/SEAMS.md).
LOADING = frozenset({"__loader__", "__spec__", "__builtins__"})


def plugin_code_in_upstream() -> list[str]:
    """``module.attribute`` / ``module.Class.attribute`` of every upstream attribute that holds the plugin's code.

    Not counted: :data:`LOADING`, and the placeholder a guarded module's own ``import transformer_engine``
    statement bound on a host without TE (compat/te_guard): neither replaces an attribute upstream set.
    """
    import vime_gemma4_bridge
    from vime_gemma4_bridge.compat.te_guard import is_placeholder

    root = str(Path(vime_gemma4_bridge.__file__).parent)
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.partition(".")[0] not in UPSTREAM_PACKAGES:
            continue
        for name, value in list(vars(module).items()):
            if name in LOADING or is_placeholder(value):
                continue
            if _is_plugin_code(value, root):
                found.append(f"{module_name}.{name}")
            if isinstance(value, type) and value.__module__ == module_name:
                found += [
                    f"{module_name}.{name}.{attribute}"
                    for attribute, member in list(vars(value).items())
                    if _is_plugin_code(member, root)
                ]
    return sorted(set(found))


def _save_job(hf_checkpoint: str, topology: Topology, out: str) -> None:
    """vime's HF save: ``save_hf_pretrained`` of the loaded model (the save completion runs on it)."""
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    bridge.save_hf_pretrained(convert.loaded_model(bridge, topology), out)


def _lora_job(hf_checkpoint: str, topology: Topology) -> None:
    """A LoRA transform as vime's provider pre-wrap hook, on the routed experts' CPU twins."""
    from test_lora import MLP_TARGETS, _trained_lora_model

    _trained_lora_model(hf_checkpoint, topology, MLP_TARGETS)


def _job_then_scan(job: str, *args: Any) -> dict[str, list[str]]:
    """Run one of the plugin's jobs on this rank, then scan; the scan before it is returned too."""
    from vime_gemma4_bridge.convert.live import export_live_job
    from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job
    from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

    jobs = {
        "roundtrip": roundtrip_job,
        "import": import_job,
        "export": export_job,
        "export-live": export_live_job,
        "save": _save_job,
        "lora": _lora_job,
    }
    before = plugin_code_in_upstream()
    jobs[job](*args)
    return {"before": before, "after": plugin_code_in_upstream()}


def test_the_scan_finds_a_patch_and_its_end(monkeypatch) -> None:
    """Negative control: the scan names a plugin function put on an upstream class and a module, wrapped or not.

    (This process may hold the registration's stand-in, ``model_bridge.get_model_bridge`` before its first
    use: the expectation is relative to what the scan found first.)"""
    from megatron.bridge.models.conversion import param_mapping

    from vime_gemma4_bridge.compat import seams
    from vime_gemma4_bridge.compat.gather_to_one import ToOneConsumer

    baseline = plugin_code_in_upstream()
    gather = ToOneConsumer.gather_from_tp_ranks
    monkeypatch.setattr(param_mapping.MegatronParamMapping, "gather_from_tp_ranks", gather)
    monkeypatch.setattr(param_mapping, "split_qkv_weights", functools.partial(seams.build_kind))
    monkeypatch.setattr(param_mapping, "merge_qkv_weights", functools.wraps(seams.build_kind)(lambda: None))
    added = set(plugin_code_in_upstream()) - set(baseline)
    assert added == {
        "megatron.bridge.models.conversion.param_mapping.MegatronParamMapping.gather_from_tp_ranks",
        "megatron.bridge.models.conversion.param_mapping.split_qkv_weights",
        "megatron.bridge.models.conversion.param_mapping.merge_qkv_weights",
    }
    monkeypatch.undo()
    assert plugin_code_in_upstream() == baseline


def test_no_upstream_attribute_stays_patched_after_a_job(local_world, tmp_path: Path) -> None:
    """roundtrip, import, export, export-live, vime's save and a LoRA build at PP2·EP2 (4 ranks): after
    each, on every rank, no upstream attribute holds the plugin's code. Before the LoRA lookup was scoped,
    the first job (roundtrip) already failed: the provider rebound ``peft.lora.get_adapter_attributes_from_linear``
    for the rest of the process."""
    hf = write_tiny_checkpoint(tmp_path / "hf", TinySpec(seed=3))
    topology = Topology(pp=2, ep=2)
    world = local_world(4)
    runs = {
        "roundtrip": (str(hf), topology, None, False, 10**9),
        "import": (str(hf), str(tmp_path / "ckpt"), str(tmp_path / "ckpt.partial"), topology),
        "export": (str(tmp_path / "ckpt"), str(hf), str(tmp_path / "exported"), topology, False, 10**9),
        "export-live": (str(hf), topology, str(tmp_path / "dump"), 1 << 20, False),
        "save": (str(hf), topology, str(tmp_path / "saved")),
        "lora": (str(hf), topology),
    }
    for job, args in runs.items():
        results = world.run(_job_then_scan, job, *args)
        assert [result["after"] for result in results] == [[]] * 4, (job, results[0])


@pytest.mark.fast
def test_the_lora_lookup_is_upstreams_outside_its_block() -> None:
    """``compat.seams.peft_reads_module_attributes`` rebinds the LoRA transform's lookup for its block only,
    and gives upstream's back when the block raises."""
    from megatron.bridge.peft import lora

    from vime_gemma4_bridge.compat import seams

    upstream = lora.get_adapter_attributes_from_linear
    with pytest.raises(RuntimeError, match="inside"), seams.peft_reads_module_attributes():
        assert lora.get_adapter_attributes_from_linear is not upstream
        raise RuntimeError("inside")
    assert lora.get_adapter_attributes_from_linear is upstream
