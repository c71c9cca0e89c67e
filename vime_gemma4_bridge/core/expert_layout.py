"""Which layout an export yields the routed experts in: stacked ``[E, ...]`` (a checkpoint's) or one expert at a time.

vime's live sync chooses with an environment variable (``VIME_GEMMA4_EXPERT_LAYOUT``, read by
:func:`expert_layout`), since it calls Megatron-Bridge's export itself; a save, round trip or
export of the plugin sets the layout it needs around each step of the export
(:func:`in_expert_layout`), which overrides the variable there and nowhere else. The bridge's
grouped-export hook reads it (core/bridge.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV, STACKED, check_expert_layout

_EXPERT_LAYOUT: ContextVar[str | None] = ContextVar("vime_gemma4_expert_layout", default=None)


def expert_layout() -> str:
    """The expert layout now: :func:`exporting_experts`' inside one, else the environment's, else stacked."""
    return _EXPERT_LAYOUT.get() or check_expert_layout(os.environ.get(EXPERT_LAYOUT_ENV) or STACKED, EXPERT_LAYOUT_ENV)


@contextlib.contextmanager
def exporting_experts(layout: str) -> Iterator[None]:
    """Export experts in ``layout`` inside this block (it overrides the environment); wrap each step of an export."""
    token = _EXPERT_LAYOUT.set(check_expert_layout(layout))
    try:
        yield
    finally:
        _EXPERT_LAYOUT.reset(token)


def in_expert_layout(layout: str, stream: Iterable[Any]) -> Iterator[Any]:
    """``stream``'s items, each made inside :func:`exporting_experts` (``layout``); wrap an export with it.

    The layout is set around each step of ``stream`` and reset before the item is handed on: set
    inside a generator, a context variable would stay set in its consumer between items.
    """
    items = iter(stream)
    while True:
        with exporting_experts(layout):
            item = next(items, _END)
        if item is _END:
            return
        yield item
        del item  # not held while the next one is made (a layer's stacked experts: 1 GB at 26B-A4B)


_END = object()


def set_by_the_caller() -> bool:
    """Whether an export of the plugin set the layout (:func:`exporting_experts`): a save, round trip or export,
    not vime's live sync."""
    return _EXPERT_LAYOUT.get() is not None
