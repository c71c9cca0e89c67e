"""What an upstream pull request would contain: the Gemma 4 bridge, model, provider and spec.

Imports megatron-core, Megatron-Bridge, torch and :mod:`vime_gemma4_bridge.compat` only.
"""
