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
from collections.abc import Iterable
from typing import Any

from vime_gemma4_bridge.convert.topology import Topology


def roundtrip_job(
    hf_checkpoint: str, topology: Topology, output: str | None, force: bool, max_shard_size: int
) -> dict[str, Any]:
    """Runs on every rank. Returns rank 0's comparison (as a dict) on all ranks.

    With ``output``, rank 0 also writes the exported model as a complete HF checkpoint, but only
    when it is bitwise identical (``result["output"]`` is then its path, else ``None``).
    """
    from vime_gemma4_bridge.convert.integrity import verify_sources
    from vime_gemma4_bridge.convert.model import (
        broadcast_from_rank0,
        collect_on_rank0,
        export_language_model,
        is_rank0,
        loaded_model,
        open_bridge,
        to_rank0,
    )
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
        if output is not None:  # --output keeps the export (it is written once proven identical)
            exported = collect_on_rank0(bridge, model)
            comparison = compare_on_rank0(source, exported, topology)
        else:
            with to_rank0(bridge, model) as tasks:
                comparison = compare_on_rank0(source, export_language_model(bridge, model, tasks), topology)
    if is_rank0():
        result = comparison.as_dict()
        result["report"] = report.format_report(comparison, f"round trip at {topology}")
        result["total"] = vars(comparison.total)
        if output is not None:
            if not comparison.identical:
                result["output"] = None  # never write a checkpoint we know is wrong
            else:
                written = hf_io.write_hf_checkpoint(
                    output, exported, source, max_shard_size=max_shard_size, force=force
                )
                result["output"] = str(written)
    return broadcast_from_rank0(result)


def compare_on_rank0(source: Any, exported: Iterable[tuple[str, Any]], topology: Topology) -> Any:
    """Rank 0: ``exported`` (the export's stream, or what rank 0 collected) compared with ``source``'s
    language model, each tensor as it comes against the source's read one at a time, so the check
    itself holds nothing; the comparison (``None`` on the other ranks, which only drain their part of
    the export's collectives)."""
    from vime_gemma4_bridge.convert.model import is_rank0
    from vime_gemma4_bridge.verify import report
    from vime_gemma4_bridge.verify.compare import TensorFiles

    if not is_rank0():
        for _ in exported:
            pass
        return None
    with TensorFiles.of_checkpoint(source, source.language_model_names()) as reference:
        return report.compare(reference, exported, ep=topology.ep)
