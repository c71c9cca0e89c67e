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


#: Rank processes kept alive between tests (~1 GB each): worlds of several sizes stay up together
#: (say 4 and 8 ranks) so that tests alternating between them do not respawn them.
MAX_IDLE_RANKS = 12


@pytest.fixture(scope="session")
def local_world() -> Iterator[Callable[[int], LocalWorld]]:
    """``local_world(n)`` → a shared LocalWorld of ``n`` ranks (started on its first ``run``).

    Worlds are kept by size, most recently used last; asking for a size that would take the ranks
    alive past :data:`MAX_IDLE_RANKS` closes the least recently used ones first (a 16-rank world
    runs alone). A world killed by a failing test respawns on its next ``run``. All are closed at
    the end of the session. ``local_world.alive_pids()`` lists the ranks of every world kept.
    """
    from vime_gemma4_bridge.runtime.world import LocalWorld

    worlds: dict[int, LocalWorld] = {}

    def get(nproc: int) -> LocalWorld:
        world = worlds.pop(nproc, None)
        if world is None:
            while worlds and sum(worlds) + nproc > MAX_IDLE_RANKS:
                worlds.pop(next(iter(worlds))).close()
            world = LocalWorld(nproc, error_grace=TEST_ERROR_GRACE)
        worlds[nproc] = world  # most recently used last
        return world

    get.alive_pids = lambda: {pid for world in worlds.values() for pid in world.pids}  # type: ignore[attr-defined]
    try:
        yield get
    finally:
        for world in worlds.values():
            world.close()


#: Modules whose tests without rank processes (no ``local_world``) make up the fast unit layer.
FAST_MODULES = {"test_units", "test_doctor", "test_seams", "test_tiny", "test_stream_export", "test_rollout"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test-fast`` (``-m fast``): the doctor's diagnosis rules, the seams, the tiny factory, the units."""
    for item in items:
        ranks = "local_world" in getattr(item, "fixturenames", ())
        if item.module.__name__ in FAST_MODULES and not ranks and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)
