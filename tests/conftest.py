"""Shared fixtures.

Tests share one :class:`~vime_gemma4_bridge.runtime.world.LocalWorld` per size and re-initialise
megatron-core's parallel state per topology inside it. Starting a world is cheap on CPU (ranks fork
from a server that imported megatron.bridge once); a world that is up still serves the next test of
its size, and one world at a time caps the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vime_gemma4_bridge.runtime.world import LocalWorld

#: Seconds a world waits for the other ranks after one failed; short, tests provoke failures.
TEST_ERROR_GRACE = 2.0


@pytest.fixture(scope="session")
def local_world() -> Iterator[Callable[[int], LocalWorld]]:
    """``local_world(n)`` → a shared LocalWorld of ``n`` ranks (started on its first ``run``).

    At most one world is alive at a time, to cap memory: asking for another size closes the
    current world first. A world killed by a failing test respawns on its next ``run``. All are
    closed at the end of the session.
    """
    from vime_gemma4_bridge.runtime.world import LocalWorld

    current: list[LocalWorld] = []

    def get(nproc: int) -> LocalWorld:
        if current and current[0].nproc == nproc:
            return current[0]
        while current:
            current.pop().close()
        world = LocalWorld(nproc, error_grace=TEST_ERROR_GRACE)
        current.append(world)
        return world

    try:
        yield get
    finally:
        while current:
            current.pop().close()


#: Modules whose tests without rank processes (no ``local_world``) make up the fast unit layer.
FAST_MODULES = {"test_units", "test_doctor", "test_seams", "test_tiny", "test_stream_export", "test_rollout"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test-fast`` (``-m fast``): the doctor's diagnosis rules, the seams, the tiny factory, the units."""
    for item in items:
        ranks = "local_world" in getattr(item, "fixturenames", ())
        if item.module.__name__ in FAST_MODULES and not ranks and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)
