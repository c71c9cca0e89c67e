"""``python -m vime_gemma4_bridge.cli``: the ``vime-gemma4`` command, where the script is not on PATH (recipes)."""

from vime_gemma4_bridge.cli.main import program

program()
