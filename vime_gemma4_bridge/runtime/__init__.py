"""Ranks for job functions: a persistent local world, torchrun's ranks, or one rank in this process.

Nothing here knows the model: a job function brings its own parallel state
(:func:`vime_gemma4_bridge.convert.topology.init_model_parallel`), so the same job runs unchanged
in all three settings. Imports :mod:`vime_gemma4_bridge.compat` only, and neither torch nor megatron
at module level (rank processes import this before they set thread counts and logging); the one
exception is :mod:`.warm`, the fork server's preload, whose purpose is those imports.
"""
