"""The ``vime-gemma4`` command line: one thin module per command over a shared pre-flight and one error formatter.

:mod:`~vime_gemma4_bridge.cli.main` builds the parser from each command module's ``add_parser``;
:mod:`~vime_gemma4_bridge.cli.preflight` refuses bad input before any rank starts and
:mod:`~vime_gemma4_bridge.cli.errors` prints every failure as one line. The top layer: it may import
every other one; :mod:`vime_gemma4_bridge.testing` only in the commands about it (``tiny``, ``demo``,
the bench), which ``tests/test_units.py`` holds.
"""
