"""vime-gemma4-bridge: Gemma 4 for Megatron-Bridge, bitwise-correct at any TP/PP/VPP/EP/ETP.

Importing the package is cheap and does two things: it makes Megatron-Bridge importable on hosts
without Transformer Engine (:mod:`vime_gemma4_bridge.te_guard`), and it registers the Gemma 4
language-model bridges with ``AutoBridge`` before Megatron-Bridge looks up its first bridge
(:mod:`vime_gemma4_bridge.autoload`). :func:`register` does it at once; both are idempotent.
"""

from __future__ import annotations

from vime_gemma4_bridge import autoload, te_guard

te_guard.install()


def register() -> None:
    """Register the plugin's bridges for ``Gemma4ForCausalLM`` and ``Gemma4ForConditionalGeneration``."""
    from vime_gemma4_bridge import layer_pattern
    from vime_gemma4_bridge.bridge import register as _register_bridges

    layer_pattern.install()
    _register_bridges()


autoload.register_before_first_dispatch(register)

__all__ = ["register"]
