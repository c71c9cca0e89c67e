"""The conversions: the topology, the model built for it, the import/export jobs and their streaming paths, live export.

:mod:`~vime_gemma4_bridge.convert.topology` imports no torch (the launcher and the recipes use it
to refuse a bad topology at once); the rest needs Megatron-Bridge. Imports compat/, core/, io/ and
runtime/, never what verifies or commands.
"""
