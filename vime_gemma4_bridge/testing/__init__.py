"""Checkpoints made for testing: the tiny Gemma 4 factory and the bench's synthetic 26B-A4B-shaped checkpoint.

May import every layer below the command line; product code under ``cli/`` (bench, demo, ``tiny``)
may import it.
"""
