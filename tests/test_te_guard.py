"""The TE guard makes ``megatron.bridge`` importable on a TE-less host without faking TE globally.

Checked in a fresh interpreter: the test process has long imported megatron already, and the
point is what a clean import does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from vime_gemma4_bridge.compat import seams

pytestmark = pytest.mark.skipif(seams.te_available(), reason="Transformer Engine is installed: nothing to guard")

_PROBE = textwrap.dedent(
    """
    import json, sys
    import vime_gemma4_bridge.compat.te_guard as g

    active = g.install()
    assert g.install() == active  # idempotent
    import megatron.bridge
    from megatron.bridge import AutoBridge
    import megatron.core.extensions.transformer_engine as mte
    import megatron.bridge.peft.module_matcher as matcher
    import megatron.bridge.peft.utils as peft_utils

    try:
        import transformer_engine  # noqa: F401
        te_import = "imported"
    except ModuleNotFoundError:
        te_import = "ModuleNotFoundError"
    print(json.dumps({
        "active": active,
        "auto_bridge": AutoBridge.__name__,
        "have_te": mte.HAVE_TE,
        "peft_have_te": [peft_utils.HAVE_TE, matcher.HAVE_TE],
        "te_stand_in": type(mte.TELinear).__name__,
        "te_modules": sorted(m for m in sys.modules if m.startswith("transformer_engine")),
        "te_import": te_import,
        "guards": sum(type(f).__name__ == "_GuardFinder" for f in sys.meta_path),
    }))
    """
)


def test_megatron_bridge_imports_and_megatron_core_still_sees_no_te() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "active": True,
        "auto_bridge": "AutoBridge",
        "have_te": False,
        "peft_have_te": [False, False],  # Megatron-Bridge's own test would say True: megatron-core's stand-ins
        "te_stand_in": "MagicMock",
        "te_modules": [],
        "te_import": "ModuleNotFoundError",
        "guards": 1,
    }
