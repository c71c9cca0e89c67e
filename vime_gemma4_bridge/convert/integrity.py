"""The digests of :mod:`vime_gemma4_bridge.io.digests` inside a job: recorded and checked by all ranks together.

Each rank hashes every ``world_size``-th span and the ranks exchange the results, so recording or
checking costs one pass over the bytes split over the ranks. A damaged span fails every rank with
the same one-line :class:`~vime_gemma4_bridge.io.digests.DamagedCheckpoint` (exit 1).

A conversion checks its sources *beside* its own work (:func:`check_beside`): each rank hashes its
share on a thread while the job builds and loads, reading the pages the load reads, and the job
settles the check before anything it wrote is committed, so a damaged source still leaves nothing
behind. A job that uses the bytes at once (a live export, a parity run) checks first
(:func:`verify_sources`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vime_gemma4_bridge.io.digests import (
    Span,
    check_spans,
    damaged,
    digest_spans,
    held_up,
    torch_dist_entries,
    torch_dist_spans,
    write_torch_dist_digests,
)
from vime_gemma4_bridge.io.hf import HFCheckpoint

__all__ = ["Check", "check_beside", "each_rank_share", "record_torch_dist_digests", "verify_sources"]


def _share() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _attempt(work: Callable[[list], list], share: list) -> tuple[str, object]:
    try:
        return ("ok", work(share))
    except OSError as error:
        return ("error", f"{type(error).__name__}: {error}")


def _exchange(mine: tuple[str, object]) -> list:
    """Every rank's ``(status, payload)`` in rank order; the first rank's ``OSError`` raised on every rank."""
    import torch.distributed as dist

    every: list = [mine]
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    failed = [payload for status, payload in every if status == "error"]
    if failed:
        raise OSError(failed[0])
    return [payload for _, payload in every]


def each_rank_share(work: Callable[[list], list], items: Sequence) -> list[list]:
    """``work`` on this rank's share of ``items`` (every ``world_size``-th), the results of all ranks in rank order.

    Every rank must reach the exchange: a rank whose share raised ``OSError`` (a file it cannot read) sends
    the error instead, and every rank raises it, rather than leaving the others waiting in
    ``all_gather_object`` for a rank that is gone.
    """
    rank, world = _share()
    return _exchange(_attempt(work, list(items)[rank::world]))


def _shared_digests(spans: list[Span]) -> list[str]:
    _, world = _share()
    digests = [""] * len(spans)
    for r, share in enumerate(each_rank_share(digest_spans, spans)):
        digests[r::world] = share
    return digests


def record_torch_dist_digests(
    iteration_dir: Path, writer: bool, known: Mapping[tuple[str, int, int], str] | None = None
) -> None:
    """Record a complete torch_dist directory's digests (collective; ``writer`` writes the file).

    ``known``: digests already computed as items were written, by ``(file name, offset, length)``, on
    the writer's rank (the streaming import's); only the other items and files are read back. All of it
    is digests' work, so all of it counts in :func:`~vime_gemma4_bridge.io.digests.hashing_seconds`.
    """
    from vime_gemma4_bridge.convert.model import broadcast_from_rank0

    with held_up():
        known = dict(known or {})
        if _share()[1] > 1:
            known = broadcast_from_rank0(known if writer else None)
        entries = torch_dist_entries(iteration_dir)
        keys = [(entry.span.file.name, entry.span.offset, entry.span.length) for entry in entries]
        unknown = [entry.span for entry, key in zip(entries, keys, strict=True) if key not in known]
        read_back = iter(_shared_digests(unknown))
        digests = [known[key] if key in known else next(read_back) for key in keys]
        if writer:
            write_torch_dist_digests(iteration_dir, entries, digests)


@dataclass(frozen=True)
class _Expected:
    spans: list[tuple[Span, str]]
    kind: str
    path: Path


def _expected(hf_checkpoint: str | Path | None, torch_dist_dir: Path | None, language_model: bool) -> list[_Expected]:
    """What a job's inputs record: the torch_dist spans, then the HF ones (their headers are checked here)."""
    groups = []
    if torch_dist_dir is not None:
        spans = torch_dist_spans(torch_dist_dir)
        if spans is not None:
            groups.append(_Expected(spans, "torch_dist", torch_dist_dir))
    if hf_checkpoint is not None:
        source = HFCheckpoint(hf_checkpoint)
        names = None
        if not language_model:
            language = set(source.language_model_names())
            names = [name for name in source.names() if name not in language]
        groups.append(_Expected(source.digest_spans(names), "HF", source.path))
    return groups


def _check_each(shares: list[list[tuple[Span, str]]]) -> list[str | None]:
    return [check_spans(share, beside=True) for share in shares]


class Check:
    """A check of a job's inputs running beside it; :meth:`settle` (collective) waits and refuses damage."""

    def __init__(self, groups: list[_Expected]) -> None:
        self._groups = groups
        rank, world = _share()
        shares = [group.spans[rank::world] for group in groups]
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vime-gemma4-check")
        self._mine: Future = pool.submit(_attempt, _check_each, shares)
        pool.shutdown(wait=False)

    def settle(self) -> int:
        """Wait for this rank's share, exchange with the others; the number of spans checked.

        Raises :class:`~vime_gemma4_bridge.io.digests.DamagedCheckpoint` (the first damaged span, in the
        groups' order, on every rank) or the first rank's ``OSError``. Every rank must call it.
        """
        with held_up():
            mine = self._mine.result()
        every = _exchange(mine)
        for g, group in enumerate(self._groups):
            found = next((found[g] for found in every if found[g]), None)
            if found:
                raise damaged(group.kind, group.path, found)
        return sum(len(group.spans) for group in self._groups)


def check_beside(
    hf_checkpoint: str | Path | None = None, torch_dist_dir: Path | None = None, *, language_model: bool = True
) -> Check:
    """Start checking the recorded digests of a job's inputs on a thread beside it (this rank's share).

    A header that differs from its digest is refused here, at once. ``language_model=False``: of the HF
    checkpoint, only the tensors outside the language model (an export takes the language model from
    the torch_dist checkpoint and the rest from the HF one).
    """
    return Check(_expected(hf_checkpoint, torch_dist_dir, language_model))


def verify_sources(
    hf_checkpoint: str | Path | None = None, torch_dist_dir: Path | None = None, *, language_model: bool = True
) -> int:
    """Check the recorded digests of a job's inputs before it reads them (collective); the number of spans checked."""
    return check_beside(hf_checkpoint, torch_dist_dir, language_model=language_model).settle()
