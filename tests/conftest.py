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


class _Worlds:
    """The session's one live :class:`LocalWorld` (at most one at a time, to cap memory)."""

    def __init__(self) -> None:
        self.current: LocalWorld | None = None

    def get(self, nproc: int) -> LocalWorld:
        from vime_gemma4_bridge.runtime.world import LocalWorld

        if self.current is not None and self.current.nproc == nproc:
            return self.current
        self.close()
        self.current = LocalWorld(nproc, error_grace=TEST_ERROR_GRACE)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


@pytest.fixture(scope="session")
def _worlds() -> Iterator[_Worlds]:
    worlds = _Worlds()
    try:
        yield worlds
    finally:
        worlds.close()


@pytest.fixture(scope="session")
def local_world(_worlds: _Worlds) -> Callable[[int], LocalWorld]:
    """``local_world(n)`` → a shared LocalWorld of ``n`` ranks (started on its first ``run``).

    At most one world is alive at a time, to cap memory: asking for another size closes the
    current world first. A world killed by a failing test restarts on its next ``run``.
    """
    return _worlds.get


@pytest.fixture(scope="module", autouse=True)
def _no_idle_world_after_the_module(_worlds: _Worlds) -> Iterator[None]:
    """Close the world when a module ends: restarting one costs under a second (warm ranks), while an
    idle one is not free. Each gloo communicator its ranks hold has an event loop that wakes every
    10 ms (gloo ``transport/tcp/loop.cc``, ``Loop::run``: ``epoll_wait(..., 10)``); a 4-rank world
    left up after many topologies had 236 such loops on rank 0 and slowed the next module's
    subprocess tests."""
    yield
    _worlds.close()


#: Modules whose tests without rank processes (no ``local_world``) make up the fast unit layer.
FAST_MODULES = {
    "test_units",
    "test_doctor",
    "test_seams",
    "test_tiny",
    "test_stream_export",
    "test_rollout",
    "test_docs",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test-fast`` (``-m fast``): the doctor's diagnosis rules, the seams, the tiny factory, the units."""
    for item in items:
        ranks = "local_world" in getattr(item, "fixturenames", ())
        if item.module.__name__ in FAST_MODULES and not ranks and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.fast)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Lines counting the tests with an engine in the loop (tests/test_vllm.py, tests/test_sglang.py), so a
    run shows they ran."""
    for marker, label in (("vllm", "vLLM"), ("sglang", "SGLang")):
        counts = {}
        for outcome in ("passed", "failed", "error", "skipped"):
            reports = terminalreporter.stats.get(outcome, [])
            counts[outcome] = sum(1 for r in reports if marker in getattr(r, "keywords", {}) and r.when != "teardown")
        if any(counts.values()):
            summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            terminalreporter.write_line(f"{label} engine tests: {summary}")
