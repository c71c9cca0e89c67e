"""Keep upstream's import-time noise out of normal output (``--verbose`` keeps it).

Importing Megatron-Bridge on a host without Transformer Engine logs a Python traceback per missing
optional symbol (``Import of FP8GlobalStateManager … failed``, through a handler of its own at INFO),
and megatron-core, torch and transformers warn about optional packages and deprecations. None of it
means anything to a user of the conversion commands, and a traceback in a normal run reads as a
failure. Installed by the command line and by every rank process it starts; never by a plain
``import vime_gemma4_bridge`` (a library import leaves the user's logging and warnings alone).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

#: How the warnings about optional packages that a CPU-only host is expected to lack begin.
OPTIONAL_PACKAGE_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "absl.logging is not installed",
    "Only transformer-engine>=",
)


def warning_filters() -> list[str]:
    """:data:`OPTIONAL_PACKAGE_WARNINGS` as ``PYTHONWARNINGS`` entries, for processes about to start.

    A spawned rank re-imports the launching script's ``__main__`` (so that job functions defined there
    unpickle) before any code of ours runs in it; a script that imports megatron warns there already,
    so :func:`install` would come too late and the filters must travel in the environment.
    """
    return [f"ignore:{prefix}" for prefix in OPTIONAL_PACKAGE_WARNINGS]


def install() -> None:
    """Silence INFO logging (Megatron-Bridge's import tracebacks), transformers' notices, and optional-package
    and deprecation warnings."""
    logging.disable(logging.INFO)
    # transformers configures its own logger from this variable (deprecation notices of old configs).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # torch warns "No CUDA runtime is found" on every CPU-only import of cpp_extension; megatron
    # warns about fusions it disables and APIs it deprecates.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    logging.getLogger("megatron").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"megatron(\.|$)")
    for prefix in OPTIONAL_PACKAGE_WARNINGS:
        warnings.filterwarnings("ignore", message=".*" + re.escape(prefix))
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(megatron|transformers|torch)(\.|$)")
