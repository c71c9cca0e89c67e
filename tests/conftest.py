"""Shared fixtures.

Rank processes are expensive (each imports megatron.bridge: ~1 GB RSS, ~10 s), so tests share
one :class:`~vime_gemma4_bridge.runtime.world.LocalWorld` per session and re-initialise
megatron-core's parallel state per topology inside it.
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


#: Tests whose world has no neighbour of its size (16 ranks): run last, so that the 8-rank world the
#: tests before them leave up is still there for the next module's 8-rank tests (~70 s a restart).
RUN_LAST = ("test_reported_topology_on_16_ranks",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test-fast`` (``-m fast``): the doctor's diagnosis rules, the seams, the tiny factory, the units.

    And the 16-rank tests last (:data:`RUN_LAST`; a stable reorder, every other test keeps its place).
    """
    items.sort(key=lambda item: getattr(item, "originalname", item.name) in RUN_LAST)
    for item in items:
        ranks = "local_world" in getattr(item, "fixturenames", ())
        if item.module.__name__ in FAST_MODULES and not ranks and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)
