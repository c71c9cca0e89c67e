"""vime-gemma4-bridge: Gemma 4 for Megatron-Bridge, bitwise-correct at any TP/PP/VPP/EP/ETP.

Importing the package is cheap and does two things: it makes Megatron-Bridge importable on hosts
without Transformer Engine (:mod:`vime_gemma4_bridge.compat.te_guard`), and it registers the Gemma 4
language-model bridges with ``AutoBridge`` before Megatron-Bridge looks up its first bridge
(:mod:`vime_gemma4_bridge.compat.autoload`). :func:`register` does it at once; both are idempotent.

Building on ranks (``torch.distributed`` initialised, e.g. under ``torchrun``)::

    topology = vime_gemma4_bridge.Topology(tp=2, pp=2, ep=4)
    vime_gemma4_bridge.init_model_parallel(topology)
    bridge = AutoBridge.from_hf_pretrained(path)
    model = vime_gemma4_bridge.build_model(bridge, topology)  # this rank's model chunks, CPU or GPU

miles (the trainer that keeps ``--megatron-to-hf-mode bridge``) takes the plugin with
``--custom-megatron-init-path vime_gemma4_bridge.miles_init`` (:mod:`vime_gemma4_bridge.convert.miles`).
"""

from __future__ import annotations

import importlib
from typing import Any

from vime_gemma4_bridge.compat import autoload, te_guard
from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX

te_guard.install()


def register() -> None:
    """Register the plugin's bridges for ``Gemma4ForCausalLM`` and ``Gemma4ForConditionalGeneration``.

    Raises whatever prevents it (an explicit call is never fail-safe; the autoload is).
    """
    from vime_gemma4_bridge.core.bridge import register as register_bridges

    register_bridges()


autoload.register_before_first_dispatch(register, architectures=tuple(LANGUAGE_MODEL_PREFIX))

#: Public names imported on first use, so that ``import vime_gemma4_bridge`` stays cheap.
_LAZY = {
    "Topology": "vime_gemma4_bridge.convert.topology",
    "init_model_parallel": "vime_gemma4_bridge.convert.topology",
    "build_model": "vime_gemma4_bridge.convert.model",
    "miles_init": "vime_gemma4_bridge.convert.miles",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vime_gemma4_bridge' has no attribute {name!r}")


__all__ = ["Topology", "build_model", "init_model_parallel", "miles_init", "register"]
