"""The digests of :mod:`vime_gemma4_bridge.io.digests` inside a job: recorded and checked by all ranks together.

Each rank hashes every ``world_size``-th span and the ranks exchange the results, so recording or
checking costs one pass over the bytes split over the ranks. A damaged span fails every rank with
the same one-line :class:`~vime_gemma4_bridge.io.digests.DamagedCheckpoint` (exit 1) before any
byte of the checkpoint is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from vime_gemma4_bridge.io.digests import (
    Span,
    check_spans,
    damaged,
    digest_spans,
    torch_dist_entries,
    torch_dist_spans,
    write_torch_dist_digests,
)
from vime_gemma4_bridge.io.hf import HFCheckpoint

__all__ = ["each_rank_share", "record_torch_dist_digests", "verify_sources"]


def _share() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def each_rank_share(work: Callable[[list], list], items: Sequence) -> list[list]:
    """``work`` on this rank's share of ``items`` (every ``world_size``-th), the results of all ranks in rank order.

    Every rank must reach the exchange: a rank whose share raised ``OSError`` (a file it cannot read) sends
    the error instead, and every rank raises it, rather than leaving the others waiting in
    ``all_gather_object`` for a rank that is gone.
    """
    import torch.distributed as dist

    rank, world = _share()
    try:
        mine: tuple[str, object] = ("ok", work(list(items)[rank::world]))
    except OSError as error:
        mine = ("error", f"{type(error).__name__}: {error}")
    every: list = [mine]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, mine)
    failed = [payload for status, payload in every if status == "error"]
    if failed:
        raise OSError(failed[0])
    return [payload for _, payload in every]


def _shared_digests(spans: list[Span]) -> list[str]:
    _, world = _share()
    digests = [""] * len(spans)
    for r, share in enumerate(each_rank_share(digest_spans, spans)):
        digests[r::world] = share
    return digests


def record_torch_dist_digests(iteration_dir: Path, writer: bool) -> None:
    """Record a complete torch_dist directory's digests (collective; ``writer`` writes the file)."""
    entries = torch_dist_entries(iteration_dir)
    digests = _shared_digests([entry.span for entry in entries])
    if writer:
        write_torch_dist_digests(iteration_dir, entries, digests)


def _check_shared(expected: Sequence[tuple[Span, str]], kind: str, path: Path) -> int:
    found = [found for (found,) in each_rank_share(lambda share: [check_spans(share)], expected) if found]
    if found:
        raise damaged(kind, path, found[0])
    return len(expected)


def verify_sources(
    hf_checkpoint: str | Path | None = None, torch_dist_dir: Path | None = None, *, language_model: bool = True
) -> int:
    """Check the recorded digests of a job's inputs before it reads them (collective); the number of spans checked.

    ``language_model=False``: of the HF checkpoint, only the tensors outside the language model (an export
    takes the language model from the torch_dist checkpoint and the rest from the HF one).
    """
    checked = 0
    if torch_dist_dir is not None:
        spans = torch_dist_spans(torch_dist_dir)
        if spans is not None:
            checked += _check_shared(spans, "torch_dist", torch_dist_dir)
    if hf_checkpoint is not None:
        source = HFCheckpoint(hf_checkpoint)
        names = None
        if not language_model:
            language = set(source.language_model_names())
            names = [name for name in source.names() if name not in language]
        checked += _check_shared(source.digest_spans(names), "HF", source.path)
    return checked
