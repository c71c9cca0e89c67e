"""The round trip: HF → Megatron (at a topology) → HF, proven bitwise (``vime-gemma4 roundtrip``).

This is the check that would have caught the original bug report (experts copied across EP
boundaries at TP2·PP2·EP4): every language-model tensor must come back byte for byte equal to the
source, with the same name, dtype and shape, nothing missing, nothing extra, and the experts on
both sides of every EP boundary distinct and in place (:func:`vime_gemma4_bridge.verify.report.compare`).
It lives with the proofs, not with the conversions it is built from: it judges them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert.topology import Topology


def roundtrip_job(
    hf_checkpoint: str, topology: Topology, output: str | None, force: bool, max_shard_size: int
) -> dict[str, Any]:
    """Runs on every rank. Returns rank 0's comparison (as a dict) on all ranks.

    With ``output``, rank 0 also writes the exported model as a complete HF checkpoint, each tensor as
    it arrives, committed only when bitwise identical (``result["output"]`` is then its path, else ``None``).
    """
    from vime_gemma4_bridge.convert.integrity import verify_sources
    from vime_gemma4_bridge.convert.model import broadcast_from_rank0, is_rank0, loaded_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io import hf as hf_io
    from vime_gemma4_bridge.verify import report

    init_model_parallel(topology)
    verify_sources(hf_checkpoint)  # the digests it records, before its bytes are used
    source = hf_io.HFCheckpoint(hf_checkpoint)
    result: dict[str, Any] | None = None
    with contextlib.redirect_stdout(sys.stderr):  # megatron-core's and the bridge's chatter: stdout is the report's
        bridge = open_bridge(hf_checkpoint)
        model = loaded_model(bridge, topology)
        write = {"max_shard_size": max_shard_size, "force": force}
        comparison, written = roundtrip_on_rank0(bridge, model, source, topology, output, **write)
    if is_rank0():
        result = comparison.as_dict()
        result["report"] = report.format_report(comparison, f"round trip at {topology}")
        result["total"] = vars(comparison.total)
        if output is not None:
            result["output"] = None if written is None else str(written)  # never a checkpoint we know is wrong
    return broadcast_from_rank0(result)


class _Withheld(Exception):
    """The comparison found a difference: the checkpoint being written is dropped, never committed."""


def roundtrip_on_rank0(
    bridge: Any, model: list, source: Any, topology: Topology, output: str | None, **write: Any
) -> tuple[Any, Path | None]:
    """The export (every rank) compared on rank 0 with ``source``'s language model as it streams; with
    ``output``, each tensor also written as it arrives (:func:`~vime_gemma4_bridge.io.hf_write.writing_hf_checkpoint`,
    ``write``: its options), and committed only when the comparison is bitwise identical.

    Returns (the comparison, the written path or ``None``) on rank 0, ``(None, None)`` elsewhere.
    Rank 0 holds one exported tensor and its reference at a time, with or without ``output``.
    """
    from vime_gemma4_bridge.convert.model import export_to_rank0, is_rank0
    from vime_gemma4_bridge.io.hf_write import writing_hf_checkpoint

    stream = export_to_rank0(bridge, model)
    if output is None or not is_rank0():
        return compare_on_rank0(source, stream, topology), None
    try:
        with writing_hf_checkpoint(output, source, **write) as writer:
            comparison = compare_on_rank0(source, _written(stream, writer), topology)
            if not comparison.identical:
                raise _Withheld
    except _Withheld:
        return comparison, None
    return comparison, writer.path


def _written(stream: Iterable[tuple[str, Any]], writer: Any) -> Iterator[tuple[str, Any]]:
    """``stream``, each tensor written before it is passed on, until one the output cannot take (a name,
    shape or dtype the source lacks): the comparison then reports it, and the output is withheld."""
    writing = True
    for name, tensor in stream:
        writing = writing and writer.accepts(name, tensor) is None
        if writing:
            writer.put(name, tensor)
        yield name, tensor
        del tensor  # not held while the next one is made


def compare_on_rank0(source: Any, exported: Iterable[tuple[str, Any]], topology: Topology) -> Any:
    """Rank 0: ``exported`` (the export's stream) compared with ``source``'s language model, each tensor
    as it comes against the source's read one at a time, so the check itself holds nothing; the
    comparison (``None`` on the other ranks, which only drain their part of the export's collectives)."""
    from vime_gemma4_bridge.convert.model import is_rank0
    from vime_gemma4_bridge.verify import report
    from vime_gemma4_bridge.verify.compare import TensorFiles

    if not is_rank0():
        for _ in exported:
            pass
        return None
    with TensorFiles.of_checkpoint(source, source.language_model_names()) as reference:
        return report.compare(reference, exported, ep=topology.ep)
