"""Listening to the collectives of Megatron-Bridge's export, per mapping instance (UPSTREAM 24).

The probe (``vime-gemma4 probe``) fingerprints an expert (a dense checkpoint: a layer's MLP) after
each stage of the bridge's own export: PP broadcast, (E)TP gather, EP gather. Megatron-Bridge has
no hook for that, so the probe shadows ``broadcast_from_pp_rank`` / ``gather_from_tp_ranks`` /
``gather_from_ep_ranks`` on the mapping instances of the conversion tasks it runs: on those
instances only, calling through, so the export itself is unchanged. Which instance gathers is
private to the mapping classes: a gated expert mapping's ``_gated_mapping``, an ``AutoMapping``'s
``_mapping`` (created on first use by ``_get_or_create_mapping``), else the mapping itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def tap(obj: Any, method: str, listener: Callable[[tuple, Any], None]) -> None:
    """Shadow ``obj.method`` (this instance only) with a call-through that reports args and result."""
    original = getattr(obj, method)

    def call_through(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        listener(args, result)
        return result

    setattr(obj, method, call_through)


def on_gathering_mapping(task: Any, watch: Callable[[Any], None]) -> None:
    """Call ``watch`` with the mapping object that does a conversion task's gathers.

    Expert fc1 (gated): the gated delegate, at once; a dense MLP's fc1 (``GatedMLPMapping``)
    gathers itself; fc2: an ``AutoMapping``'s Column/RowParallelMapping, at once if it exists, else
    when ``_get_or_create_mapping`` creates it during the export.
    """
    mapping = task.mapping
    gated = getattr(mapping, "_gated_mapping", None)
    if gated is not None:
        watch(gated)
        return
    if not hasattr(mapping, "_get_or_create_mapping"):
        watch(mapping)
        return
    if getattr(mapping, "_mapping", None) is not None:
        watch(mapping._mapping)
        return
    create = mapping._get_or_create_mapping

    def create_and_watch(parallelism_type: str) -> Any:
        delegate = create(parallelism_type)
        watch(delegate)
        return delegate

    mapping._get_or_create_mapping = create_and_watch
