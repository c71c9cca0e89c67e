"""Checkpoints made for testing: the tiny Gemma 4 factory (the tests', ``vime-gemma4 tiny``, the demo's).

May import every layer below the command line; product code under ``cli/`` (bench, demo, ``tiny``)
may import it.
"""
