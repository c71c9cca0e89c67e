"""The fork server's preload: CPU ranks fork from a process that has imported megatron already.

Importing ``megatron.bridge`` is most of a rank's start-up (~10 s of CPU per rank; an 8-rank world
on two cores took a minute). On a host without a GPU, :class:`~vime_gemma4_bridge.runtime.world.LocalWorld`
starts its ranks from multiprocessing's fork server with this module preloaded, so the imports
happen once per owner process and every rank forks from them (and shares their pages). It sets up
what :func:`~vime_gemma4_bridge.runtime.rank.bootstrap` would before those imports: a root logging
handler (megatron.training's import-time ``basicConfig`` becomes a no-op) and the quiet filters; the
server only serves quiet worlds.

Nothing is lost when an import fails here (the fork server itself would die of anything but an
``ImportError``, so every error is dropped): each rank repeats
:func:`~vime_gemma4_bridge.runtime.rank.prepare_imports`, where the error is reported as that rank's
start-up failure.
"""

from __future__ import annotations

import contextlib
import gc
import logging

from vime_gemma4_bridge.compat import quiet
from vime_gemma4_bridge.runtime.rank import prepare_imports
from vime_gemma4_bridge.runtime.world import DEFAULT_PRELOAD

logging.basicConfig(level=logging.WARNING)
quiet.install()
with contextlib.suppress(Exception):
    prepare_imports(DEFAULT_PRELOAD)
# Every object the imports made goes to the collector's permanent generation (Python's advice for a
# process that forks without exec): a rank's collections write into the header of each object they
# visit, so the first one copied the pages those objects share with the server, 157 MB a rank.
gc.freeze()
