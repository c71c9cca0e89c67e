#!/usr/bin/env python
"""Convert a Gemma 4 HF checkpoint to a Megatron torch_dist checkpoint (``vime-gemma4 import``).

    python scripts/convert_hf_to_torch_dist.py --hf-checkpoint HF --save DIR --tp 2 --pp 2 --ep 4 --nproc 8
    torchrun --nproc-per-node 8 scripts/convert_hf_to_torch_dist.py --hf-checkpoint HF --save DIR --tp 2 --pp 2 --ep 4

Flags as in vime's tools/convert_hf_to_torch_dist.py (``--hf-checkpoint``, ``--save``) plus the topology;
``--help`` lists them. The work is done by :mod:`vime_gemma4_bridge.cli.import_export`; this file only runs it,
so that the conversion also works from a checkout that is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

# A checkout that is not pip-installed: make the package importable. Nothing else runs at import
# time, because spawned ranks re-import this file (as __mp_main__) before they set themselves up.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import logging

    # Megatron logs INFO lines to stdout while it is imported (as in the ranks, they are dropped), so
    # that stdout carries only the report (--json: one JSON document). Warnings and errors still show.
    logging.basicConfig(level=logging.WARNING)
    logging.disable(logging.INFO)
    from vime_gemma4_bridge.cli.import_export import main_import

    return main_import(argv, prog=Path(__file__).name)


if __name__ == "__main__":
    from vime_gemma4_bridge.cli.errors import exit_program

    exit_program(main())
