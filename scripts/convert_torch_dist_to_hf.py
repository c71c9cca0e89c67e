#!/usr/bin/env python
"""Convert a Megatron torch_dist checkpoint of Gemma 4 back to HF (``vime-gemma4 export``), at any topology.

    python scripts/convert_torch_dist_to_hf.py --load DIR --hf-checkpoint HF --output OUT --ep 2 --nproc 2
    torchrun --nproc-per-node 2 scripts/convert_torch_dist_to_hf.py --load DIR --hf-checkpoint HF --output OUT --ep 2

``--hf-checkpoint`` is the HF checkpoint the model came from: it supplies the config, tokenizer and
non-language tensors. ``--help`` lists every flag. The work is done by :mod:`vime_gemma4_bridge.cli.import_export`.
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
    from vime_gemma4_bridge.cli.import_export import main_export

    return main_export(argv, prog=Path(__file__).name)


if __name__ == "__main__":
    from vime_gemma4_bridge.cli.errors import exit_program

    exit_program(main())
