"""The conversion jobs' building blocks: the topology, the model built for it, and weights through the bridge.

:mod:`~vime_gemma4_bridge.convert.topology` imports no torch (the launcher and the recipes use it
to refuse a bad topology at once); :mod:`~vime_gemma4_bridge.convert.model` needs Megatron-Bridge.
Imports compat/, core/, the I/O modules and runtime/, never what verifies or commands.
"""
