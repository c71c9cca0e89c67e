"""Checkpoints on disk: HF safetensors checkpoints, torch_dist files, and the one atomic directory commit.

:mod:`~vime_gemma4_bridge.io.hf` reads HF checkpoints and writes them with the one safetensors shard
writer; :mod:`~vime_gemma4_bridge.io.torch_dist` and its neighbours read and write torch_dist checkpoints;
:mod:`~vime_gemma4_bridge.io.commit` makes every output directory appear only complete. Imports
compat/ and core/, never the layers that run ranks, convert, verify or command.
"""
