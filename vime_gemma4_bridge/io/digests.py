"""Digests (XXH3-128) of what this package writes, checked before those bytes are trusted again.

Why: neither megatron-core's torch_dist files nor safetensors carry a checksum. A checkpoint copied
between nodes or read back from a flaky file system can hold a flipped byte of the same size, and
every reader (ours, Megatron's, transformers', vLLM's) would hand training or rollouts the wrong
weights without a word. So every file set written here records a digest per stored item, and every
command that reads one checks them first and names the damaged file, tensor and shard.

Why XXH3-128 and not sha256: the digests guard against damage, not tampering (a checkpoint already
runs no code: :mod:`~vime_gemma4_bridge.io.safe_pickle`), and every byte converted is hashed twice
(its source checked, its output recorded). sha256 hashes ~1.8 GB/s on a core here, XXH3 ~9 GB/s
from memory and ~30 GB/s from the CPU's cache. ``xxhash`` is
Megatron-Bridge's own (through ``datasets``); ``xxh128sum`` checks a whole file.

Where the bytes are: a write hashes what it has just written, on its own thread (:func:`write_hashed`,
:class:`HashingWriter`: the HF shards, the streaming import's items), except the import's expert items,
hashed on a thread beside their writer two items behind their writes; and a conversion checks its
sources on a thread beside its own work (``convert/integrity.check_beside``). Only what megatron-core's writer
wrote is read back to be recorded (its pages are still cached; hundreds of short items, read a file
at a time), and ``verify-checkpoint`` reads everything.

Both formats are checkable with the ``xxhash`` package alone (no part of this package), as
docs/ARCHITECTURE.md ("Digests") shows:

* **torch_dist** (``import``): ``iter_*/vime_gemma4.digests.json``::

      {"format": "vime-gemma4-digests", "version": 1, "algorithm": "xxh3_128",
       "items": [{"file": "__0_0.distcp", "offset": B, "length": N, "key": KEY, "chunk": [o0, ...],
                  "digest": HEX}, ...],
       "files": {"metadata.json": HEX, ".metadata": HEX, "common.pt": HEX, ...}}

  One entry per item of PyTorch's checkpoint metadata (``storage_data``): the digest of the bytes
  ``[B, B+N)`` of ``file``, which hold tensor ``KEY``'s chunk at global offset ``chunk`` (``null`` for a
  non-tensor item). ``files`` are the whole files of the directory that are not ``.distcp`` files
  (the index, common state, run config, sidecar), so the offsets themselves cannot change unseen.
* **HF safetensors** (every shard :func:`~vime_gemma4_bridge.io.hf_write.Shards` writes): the
  header's ``__metadata__`` holds ``"xxh3_128:<tensor name>": HEX``, the digest of that tensor's data
  bytes (its ``data_offsets``), and ``"xxh3_128:__header__": HEX``, the digest of the header itself as
  written with every ``xxh3_128:`` value reading :data:`PLACEHOLDER` (:func:`header_digest`): a changed
  name, dtype, shape or offset would otherwise leave every data digest matching. Other readers ignore
  the extra metadata.

A file set without digests (a training run's save, a Hub checkpoint) is read as before.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

__all__ = [
    "ALGORITHM",
    "DIGESTS_FORMAT",
    "DIGESTS_NAME",
    "HF_PREFIX",
    "PLACEHOLDER",
    "DamagedCheckpoint",
    "Entry",
    "Hasher",
    "HashingWriter",
    "Span",
    "check_spans",
    "damaged",
    "digest_spans",
    "hashing_seconds",
    "header_digest",
    "held_up",
    "hf_spans",
    "digest_span",
    "torch_dist_entries",
    "torch_dist_spans",
    "write_hashed",
    "write_torch_dist_digests",
]

DIGESTS_NAME = "vime_gemma4.digests.json"
DIGESTS_FORMAT = "vime-gemma4-digests"
DIGESTS_VERSION = 1
ALGORITHM = "xxh3_128"
#: Header metadata key prefix of a safetensors tensor's digest.
HF_PREFIX = f"{ALGORITHM}:"
#: What a digest reads as before it is known (same length: the header is rewritten in place).
PLACEHOLDER = "0" * 32
#: The header's own digest key (no tensor is named ``__header__``: safetensors reserves ``__`` names).
HEADER_KEY = f"{HF_PREFIX}__header__"


class DamagedCheckpoint(ValueError):
    """Stored bytes differ from the digest recorded when they were written (exit 1: the data is bad, not the call)."""


#: What to do about a damaged checkpoint, by its kind.
REMEDIES = {"torch_dist": "copy it again or re-create it with vime-gemma4 import", "HF": "copy or write it again"}


def damaged(kind: str, path: Path | str, found: str) -> DamagedCheckpoint:
    """The one-line error for a ``kind`` checkpoint at ``path`` whose :func:`check_spans` found ``found``."""
    return DamagedCheckpoint(f"{kind} checkpoint {path} is damaged: {found}; {REMEDIES[kind]}")


class _HashingClock:
    """Wall seconds during which at least one of the conversion's threads was held up by hashing.

    A thread is held up while it hashes itself (:meth:`Hasher.update`, :func:`write_hashed`) or waits
    for a check running beside it (its ``settle``, :func:`held_up`); hashing beside the conversion's own work is
    not counted until something waits for it. Threads are held up at once (``xxhash`` releases the
    GIL), so the sum of their seconds would overstate the cost; and ``+=`` from several threads loses
    updates. The clock runs while any thread is held up, under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hashing = 0
        self._since = 0.0
        self._total = 0.0

    @contextlib.contextmanager
    def running(self) -> Any:
        with self._lock:
            if self._hashing == 0:
                self._since = time.perf_counter()
            self._hashing += 1
        try:
            yield
        finally:
            with self._lock:
                self._hashing -= 1
                if self._hashing == 0:
                    self._total += time.perf_counter() - self._since

    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._hashing else 0.0)


_clock = _HashingClock()


def hashing_seconds() -> float:
    """Wall seconds digests have held this process's conversion up (``bench``'s ``checksum_overhead``)."""
    return _clock.seconds()


@contextlib.contextmanager
def held_up() -> Any:
    """Count the body's wall seconds in :func:`hashing_seconds` (a wait for hashing done elsewhere)."""
    with _clock.running():
        yield


#: Writes shorter than this are gathered and hashed together (:class:`Hasher`).
_SMALL = 64 << 10


class Hasher:
    """The digest of bytes as they are written; :meth:`update` counts in :func:`hashing_seconds`.

    Short writes are gathered and hashed :data:`_SMALL` bytes at a time. Why: ``xxhash`` lets go of
    the GIL for every update, however short, and ``torch.save`` writes an item's zip records in
    dozens of writes of a few bytes. With the streaming import's three writer threads, each of those
    releases handed the GIL to another thread and waited to get it back: ~0.1 ms per update, 0.8 s
    per 3 GB imported, where the bytes themselves hash in 0.15 s.
    """

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self._short = bytearray()

    def update(self, data: Any) -> None:
        with memoryview(data) as view:
            if view.nbytes < _SMALL:
                self._short += view
                if len(self._short) >= _SMALL:
                    self._flush()
                return
            self._flush()
            with _clock.running():
                self._hash.update(view)

    def _flush(self) -> None:
        if self._short:
            with _clock.running():
                self._hash.update(self._short)
            self._short = bytearray()

    def update_beside(self, data: Any) -> None:
        """:meth:`update` on a thread beside the conversion's own work: counted where something waits for it."""
        self._flush()
        self._hash.update(data)

    def hexdigest(self) -> str:
        self._flush()
        return self._hash.hexdigest()


_pools: dict[int, ThreadPoolExecutor] = {}


def _beside() -> ThreadPoolExecutor:
    """This process's hashing threads (a rank forked from a process that had some gets its own)."""
    pid = os.getpid()
    if pid not in _pools:
        _pools[pid] = ThreadPoolExecutor(max_workers=4, thread_name_prefix="vime-gemma4-hash")
    return _pools[pid]


def write_hashed(write: Callable[[Any], Any], data: Any, hasher: Hasher) -> int:
    """``write(data)``, then ``hasher`` takes the same bytes, on this thread; the bytes written.

    Why after, not beside: the write has just faulted the bytes in and left them in the CPU's caches,
    and XXH3 hashes them several times faster than the write copied them (~20 GB/s against ~4 GB/s
    on the AMD host of docs/PERFORMANCE.md's latest run), so no pass reads them back. Hashed on a
    thread beside the write instead, both touching the same pages of a memory-mapped source at
    once, the export's kernel time more than doubled (2.1-2.5 s became 5.0-5.4 s on 2 cores, an
    A/B in one world) while the clock counted 0.04 s. ``torch.save``'s zip records of a few bytes
    are gathered by :meth:`Hasher.update`.
    """
    with memoryview(data) as view, view.cast("B") as flat:
        write(flat)
        hasher.update(flat)
        return len(flat)


class HashingWriter:
    """A binary file that digests each item written to it, as it is written (``torch.save`` writes through it).

    ``item()`` brackets one item: its offset, and its digest once the body has written it. The bytes
    are hashed as they pass (:func:`write_hashed`), or after the item on a thread beside the writer
    (``item(after=True)``), so recording an item's digest reads nothing back.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._hasher: Hasher | None = None
        self._held: list[Any] | None = None
        self._kept = (0, 0)

    def write(self, data: Any) -> int:
        if self._held is None:
            return write_hashed(self._handle.write, data, self._hasher)
        view = memoryview(data).cast("B")
        self._handle.write(view)
        start = _address(view)
        if self._kept[0] <= start and start + view.nbytes <= self._kept[1]:
            self._held.append(view)  # inside the memory the caller keeps: hashed from there, no copy
        elif self._held and isinstance(self._held[-1], bytearray):
            self._held[-1] += view
        else:
            self._held.append(bytearray(view))
        return view.nbytes

    def flush(self) -> None:
        self._handle.flush()

    def tell(self) -> int:
        return self._handle.tell()

    @contextlib.contextmanager
    def item(self, *, after: Any = None) -> Any:
        """Yield a dict that holds ``offset``, ``length`` and ``digest`` of what the body wrote, after it.

        ``after`` (a buffer, e.g. the memory of the tensor the body saves): the body's writes are not
        hashed as they are written: the item is hashed on a thread beside the writer once the body
        is done, and ``digest`` is a ``Future`` of its digest. Why: a writer that waits for each
        item's hash waits for a core and the GIL as often as it writes; one that collects the digest
        a few items later does not wait. Writes from inside ``after`` (``torch.save`` writes a
        tensor's data straight from its storage) are hashed from there, and the hash holds a view of
        ``after`` until it is done, so the memory stays mapped even if the caller gives up on the
        item (the caller must not change it). Every other write is copied, as its buffer may be
        ``torch.save``'s own, reused once the write returns.
        """
        record: dict[str, Any] = {"offset": self._handle.tell()}
        kept = None
        if after is not None:
            kept = memoryview(after).cast("B")
            start = _address(kept)
            self._kept, self._held = (start, start + kept.nbytes), []
        else:
            self._hasher = Hasher()
        try:
            yield record
            record["length"] = self._handle.tell() - record["offset"]
            if kept is not None:
                record["digest"] = _beside().submit(_digest_of, self._held, kept)
                kept = None  # the hash's now
            else:
                record["digest"] = self._hasher.hexdigest()
        finally:
            self._hasher, self._held, self._kept = None, None, (0, 0)
            if kept is not None:
                kept.release()


def _digest_of(pieces: Sequence[Any], kept: memoryview) -> str:
    """The digest of ``pieces`` in order; then ``kept``, the memory some of them point into, is let go."""
    with kept:
        hasher = xxhash.xxh3_128()
        for piece in pieces:
            hasher.update(piece)
        return hasher.hexdigest()


def _address(view: memoryview) -> int:
    """Where a contiguous buffer's bytes start in this process."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


@dataclass(frozen=True)
class Span:
    """Bytes ``[offset, offset + length)`` of ``file`` (``length`` None: the whole file), and what they hold."""

    file: Path
    offset: int
    length: int | None
    what: str


#: Bytes mapped at a time: unmapping each window keeps a pass over a 50 GB checkpoint off the RSS. Up to
#: 8 threads of each rank hold one populated window each: 16 MB keeps that at 128 MB a rank.
_WINDOW = 16 << 20
#: Fault a window's pages in with one call (Linux) instead of one fault per page as they are hashed.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


#: Spans up to this long are read with one ``pread`` each, many to a task with their file opened once:
#: a torch_dist checkpoint's non-expert items are hundreds of spans of a few KB, for which opening,
#: mapping and unmapping cost far more than copying the bytes (0.15 s of an import's 0.2 s record).
_READ = 1 << 20
#: Short spans of one file hashed by one task (the rest of the file's run goes to the next task).
_RUN = 256


def digest_span(span: Span, *, beside: bool = False) -> str:
    """The digest of a span's bytes (a short file differs): a span longer than :data:`_READ` is hashed
    in place window by window (no copy), a shorter one read.

    ``beside``: hashed beside the conversion (a check that runs while it loads), not counted here.
    """
    return _digest_run([span], beside)[0]


def _digest_run(spans: Sequence[Span], beside: bool) -> list[str]:
    """:func:`digest_span` of spans of one file, opened once."""
    if not spans[0].file.is_file():
        return ["missing"] * len(spans)
    with open(spans[0].file, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        return [_digest_open(handle.fileno(), size, span, beside) for span in spans]


def _digest_open(fd: int, size: int, span: Span, beside: bool) -> str:
    hasher = Hasher()
    update = hasher.update_beside if beside else hasher.update
    end = size if span.length is None else min(size, span.offset + span.length)
    if _short(span):
        update(os.pread(fd, max(0, end - span.offset), span.offset))
    else:
        position = span.offset
        while position < end:
            base = position - position % mmap.ALLOCATIONGRANULARITY
            stop = min(end, base + _WINDOW)
            flags = mmap.MAP_SHARED | _POPULATE
            with mmap.mmap(fd, stop - base, flags=flags, prot=mmap.PROT_READ, offset=base) as window:
                with memoryview(window) as view, view[position - base : stop - base] as piece:
                    update(piece)
            position = stop
    if span.length is not None and end - span.offset != span.length:
        return "short"
    return hasher.hexdigest()


def _short(span: Span) -> bool:
    return span.length is not None and span.length <= _READ


def _runs(spans: Sequence[Span]) -> list[list[Span]]:
    """``spans`` in order, as tasks: a long span alone, up to :data:`_RUN` consecutive short ones of a file together."""
    runs: list[list[Span]] = []
    for span in spans:
        last = runs[-1] if runs else []
        if _short(span) and last and _short(last[-1]) and last[0].file == span.file and len(last) < _RUN:
            last.append(span)
        else:
            runs.append([span])
    return runs


def digest_spans(
    spans: Sequence[Span], *, advance: Callable[[], None] = lambda: None, beside: bool = False
) -> list[str]:
    """:func:`digest_span` of each span, in order, hashed by a few threads at once (short spans of a file together)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = []
        for run in pool.map(lambda run: _digest_run(run, beside), _runs(spans)):
            for digest in run:
                digests.append(digest)
                advance()
    return digests


def check_spans(
    expected: Sequence[tuple[Span, str]], *, advance: Callable[[], None] = lambda: None, beside: bool = False
) -> str | None:
    """The first span (in ``expected``'s order) whose bytes do not hash to its digest, described; None if all do."""
    found = digest_spans([span for span, _ in expected], advance=advance, beside=beside)
    bad = next(((span, digest) for (span, digest), got in zip(expected, found, strict=True) if got != digest), None)
    if bad is None:
        return None
    first, digest = bad
    if not first.file.is_file():
        return f"{first.file.name} ({first.what}) is missing"
    where = "" if first.length is None else f" bytes {first.offset:,}..{first.offset + first.length:,}"
    return f"{first.file.name}{where} ({first.what}) do not match the digest recorded when it was written"


# ---- torch_dist ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """What a torch_dist digest is recorded for: a stored item (its key and chunk offset) or a whole file (no key)."""

    span: Span
    key: str | None = None
    chunk: list[int] | None = None


def torch_dist_entries(iteration_dir: Path) -> list[Entry]:
    """Every stored item of PyTorch's checkpoint metadata (file order), then every other file of the directory."""
    from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

    metadata = read_checkpoint_metadata(iteration_dir)
    items = []
    for index, info in metadata.storage_data.items():
        chunk = list(index.offset) if index.offset is not None else None
        span = Span(iteration_dir / info.relative_path, info.offset, info.length, _what(index.fqn, chunk))
        items.append(Entry(span, index.fqn, chunk))
    items.sort(key=lambda entry: (entry.span.file.name, entry.span.offset))
    files = sorted(
        p for p in iteration_dir.iterdir() if p.is_file() and p.suffix != ".distcp" and p.name != DIGESTS_NAME
    )
    return items + [Entry(Span(p, 0, None, f"file {p.name}")) for p in files]


def write_torch_dist_digests(iteration_dir: Path, entries: Sequence[Entry], digests: Sequence[str]) -> None:
    """Write ``vime_gemma4.digests.json``: each of :func:`torch_dist_entries` with its digest, an item a line.

    Each line is encoded on its own: ``json.dumps`` with ``indent`` runs the pure-Python encoder,
    ~30 ms for an import's 1,300 items, all of it spent while the conversion waits.
    """
    pairs = list(zip(entries, digests, strict=True))
    head = {"format": DIGESTS_FORMAT, "version": DIGESTS_VERSION, "algorithm": ALGORITHM}
    items = [
        {"file": e.span.file.name, "offset": e.span.offset, "length": e.span.length, "key": e.key}
        | {"chunk": e.chunk, "digest": digest}
        for e, digest in pairs
        if e.key is not None
    ]
    files = {e.span.file.name: digest for e, digest in pairs if e.key is None}
    lines = [
        json.dumps(head)[:-1] + ', "items": [',
        ",\n".join(map(json.dumps, items)),
        f'], "files": {json.dumps(files)}}}',
    ]
    (iteration_dir / DIGESTS_NAME).write_text("\n".join(lines) + "\n")


def torch_dist_spans(iteration_dir: Path) -> list[tuple[Span, str]] | None:
    """The recorded (span, digest) pairs of a torch_dist directory; None when it records none."""
    from vime_gemma4_bridge.io.torch_dist_layout import ConversionError

    path = iteration_dir / DIGESTS_NAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record.get("format") != DIGESTS_FORMAT or record.get("algorithm") != ALGORITHM:
            raise ValueError(f"format {record.get('format')!r}")
        spans = [(_item_span(iteration_dir, item), item["digest"]) for item in record["items"]]
        spans += [(Span(iteration_dir / name, 0, None, f"file {name}"), hex_) for name, hex_ in record["files"].items()]
    except (ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"{path} is damaged ({error}); the checkpoint's digests cannot be read") from None
    return spans


def _item_span(iteration_dir: Path, item: Mapping[str, Any]) -> Span:
    what = _what(item["key"], item["chunk"])
    return Span(iteration_dir / item["file"], int(item["offset"]), int(item["length"]), what)


def _what(key: str, chunk: list[int] | None) -> str:
    return f"tensor {key}, shard at {chunk}" if chunk is not None else f"item {key}"


# ---- HF safetensors -----------------------------------------------------------------------------


def header_digest(header: Mapping[str, Any]) -> str:
    """The digest of a safetensors header as its writer encodes it, every ``xxh3_128:`` value a :data:`PLACEHOLDER`.

    ``header`` is the parsed JSON (key order kept). The writer records it under :data:`HEADER_KEY`
    before the data digests are known; a reader re-encodes what it parsed the same way, so a header
    another tool re-serialised, or one whose names, dtypes, shapes or offsets changed, differs.
    """
    metadata = {
        key: PLACEHOLDER if key.startswith(HF_PREFIX) else value for key, value in header["__metadata__"].items()
    }
    encoded = json.dumps({**header, "__metadata__": metadata}, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(encoded + b" " * (-len(encoded) % 8))


def hf_spans(path: Path, shards: Mapping[str, Iterable[str]]) -> list[tuple[Span, str]]:
    """The recorded (span, digest) pairs of tensors, ``{shard file: tensor names}``.

    A shard that records no digest (transformers' writer) gives none. In a shard that records some, the
    header itself is checked here first against :data:`HEADER_KEY` (:class:`DamagedCheckpoint` when it
    differs or is missing): it covers the digest keys too, so a removed or renamed one cannot switch its
    tensor's check off, and every tensor then has its digest."""
    spans = []
    for file, names in shards.items():
        wanted = set(names)
        with open(path / file, "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        recorded = header.get("__metadata__") or {}
        records = any(key.startswith(HF_PREFIX) for key in recorded)
        if records and HEADER_KEY not in recorded:
            raise damaged("HF", path, f"{file}'s header has no digest of its own where its writer recorded one")
        if records and recorded[HEADER_KEY] != header_digest(header):
            raise damaged(
                "HF",
                path,
                f"{file}'s header (tensor names, dtypes, shapes, offsets) does not match the digest recorded "
                "when it was written",
            )
        for name, entry in header.items():
            if name in wanted and records:
                digest = recorded[HF_PREFIX + name]
                begin, end = entry["data_offsets"]
                spans.append((Span(path / file, 8 + size + begin, end - begin, f"tensor {name}"), digest))
    return spans
