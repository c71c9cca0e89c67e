"""Checksums on what we write (issue 37, item 1): a flipped byte is named before its tensor is used.

Before: a byte flipped inside a ``.distcp`` item (same size, not a truncation) was exported silently,
expert stack and embedding alike, on the default path and at EP2. Now ``import`` records a digest (XXH3-128) per
stored item (``iter_*/vime_gemma4.digests.json``), the HF writer one per tensor (safetensors header
metadata), and ``export``, ``import``, ``compare`` and ``verify-checkpoint`` check them first.
"""

from __future__ import annotations

import json
import mmap
import shutil
from pathlib import Path

import pytest
import xxhash

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.convert.torch_dist_jobs import export_job
from vime_gemma4_bridge.io.digests import DIGESTS_NAME
from vime_gemma4_bridge.io.torch_dist import ITERATION_DIR
from vime_gemma4_bridge.runtime.world import RankError
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

#: Which stored item a test damages: a routed expert's chunk, or the embedding.
KEYS = {"expert": "experts.linear_fc1.weight", "embedding": "embedding.word_embeddings.weight"}


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny VL MoE imported by ``vime-gemma4 import`` (one rank, in this process), and its export."""
    from vime_gemma4_bridge.cli import main as cli

    root = tmp_path_factory.mktemp("integrity")
    hf = write_tiny_checkpoint(root / "hf", TinySpec())
    save, out = root / "torch_dist", root / "exported"
    assert cli.main(["import", "--hf-checkpoint", str(hf), "--save", str(save), "--json"]) == 0
    assert cli.main(["export", "--load", str(save), "--hf-checkpoint", str(hf), "--output", str(out), "--json"]) == 0
    return {"hf": hf, "save": save, "exported": out}


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    from vime_gemma4_bridge.cli import main as cli

    capsys.readouterr()
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _flip_tensor_byte(save: Path, key: str, copy: Path) -> tuple[str, str]:
    """A copy of ``save`` with one bit flipped inside the data of the first stored chunk of ``key``: (file, chunk)."""
    from vime_gemma4_bridge.io.torch_dist_reader import _plain_tensor_location

    shutil.copytree(save, copy)
    record = json.loads((copy / ITERATION_DIR / DIGESTS_NAME).read_text())
    item = next(i for i in record["items"] if i["key"].endswith(key) and i["chunk"] is not None and i["chunk"][-1] == 0)
    with open(copy / ITERATION_DIR / item["file"], "r+b") as handle, mmap.mmap(handle.fileno(), 0) as data:
        start, _, _ = _plain_tensor_location(data, item["offset"], item["length"])
        data[start + 1] ^= 0x10  # a value's byte: size, zip and pickle intact, so every reader takes it
    return item["file"], str(item["chunk"])


def _named(line: str, *needles: str) -> None:
    for needle in needles:
        assert needle in line, line
    assert "do not match the digest recorded when it was written" in line, line


@pytest.mark.parametrize("kind", sorted(KEYS))
def test_flipped_distcp_byte_is_named_by_export_and_verify_checkpoint(
    local_world, imported, capsys, tmp_path: Path, kind: str
) -> None:
    damaged = tmp_path / "damaged"
    file, chunk = _flip_tensor_byte(imported["save"], KEYS[kind], damaged)
    needles = (str(damaged / ITERATION_DIR), file, KEYS[kind], f"shard at {chunk}")

    code, out, err = run_cli(capsys, "verify-checkpoint", damaged)
    assert code == 1 and out == ""
    _named(err.strip().splitlines()[-1], *needles)

    output = tmp_path / "out"  # the default path: experts streamed from the files, one rank in this process
    code, out, err = run_cli(capsys, "export", "--load", damaged, "--hf-checkpoint", imported["hf"], "--output", output)
    assert code == 1 and out == ""
    [line] = [line for line in err.splitlines() if line.startswith("vime-gemma4 export: error: ")]
    _named(line, *needles)
    assert not output.exists() and not list(tmp_path.glob(".out*")), "nothing may be written"

    # The check runs beside the write and is settled before the rename: an output --force would replace stays.
    shutil.copytree(imported["exported"], output)
    before = sorted((p.name, p.read_bytes()) for p in output.iterdir())
    argv = ("export", "--load", damaged, "--hf-checkpoint", imported["hf"], "--output", output, "--force")
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and out == ""
    _named(err.strip().splitlines()[-1], *needles)
    assert sorted((p.name, p.read_bytes()) for p in output.iterdir()) == before
    assert not list(tmp_path.glob(".out*"))

    from vime_gemma4_bridge.cli.errors import one_line

    job = export_job, str(damaged), str(imported["hf"]), str(tmp_path / "ep2"), Topology(ep=2), False, 1 << 30
    with pytest.raises(RankError) as failure:  # the EP2 path: megatron-core's loader, two ranks
        local_world(2).run(*job)
    _named(one_line(failure.value), *needles)
    assert not (tmp_path / "ep2").exists()


def test_intact_checkpoints_verify_and_the_format_needs_only_hashlib(imported, capsys) -> None:
    """``verify-checkpoint`` passes both outputs; the documented formats check with xxhash and json alone."""
    for path, kind in ((imported["save"], "torch_dist"), (imported["exported"], "HF")):
        code, out, _ = run_cli(capsys, "verify-checkpoint", path)
        assert code == 0 and out.startswith(f"verify-checkpoint OK: {kind} "), out

    iteration = imported["save"] / ITERATION_DIR  # docs/ARCHITECTURE.md, "Digests": the torch_dist record
    record = json.loads((iteration / DIGESTS_NAME).read_text())
    for item in record["items"]:
        with open(iteration / item["file"], "rb") as handle:
            handle.seek(item["offset"])
            assert xxhash.xxh3_128_hexdigest(handle.read(item["length"])) == item["digest"], item
    for name, digest in record["files"].items():
        assert xxhash.xxh3_128_hexdigest((iteration / name).read_bytes()) == digest, name
    assert record["algorithm"] == "xxh3_128"
    assert {".metadata", "metadata.json", "run_config.yaml", "vime_gemma4.json"} <= set(record["files"])

    tensors = 0  # the HF shards: xxh3_128:<name> in the header metadata, over the tensor's data_offsets
    for shard in sorted(imported["exported"].glob("*.safetensors")):
        data = shard.read_bytes()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + size])
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                digest = xxhash.xxh3_128_hexdigest(data[8 + size + begin : 8 + size + end])
                assert header["__metadata__"][f"xxh3_128:{name}"] == digest, name
                tensors += 1
        # the header's own: re-encoded as written, every xxh3_128: value 32 zeros, padded with spaces to 8 bytes
        metadata = {k: "0" * 32 if k.startswith("xxh3_128:") else v for k, v in header["__metadata__"].items()}
        encoded = json.dumps({**header, "__metadata__": metadata}, separators=(",", ":")).encode()
        assert xxhash.xxh3_128_hexdigest(encoded + b" " * (-len(encoded) % 8)) == metadata_of(header)["__header__"]
    assert tensors > 100


def test_streamed_import_reads_back_only_what_megatron_core_wrote(tmp_path: Path, monkeypatch) -> None:
    """The streaming import hashes the items it writes as it writes them: the record reads back only
    megatron-core's files and the other whole files; every digest is still the bytes' (the test above
    re-hashes the same kind of record from the files), the expert chunks' too, hashed an item behind
    their writes from the shard's memory (``HashingWriter.item(after=...)``)."""
    from vime_gemma4_bridge.cli import main as cli
    from vime_gemma4_bridge.convert import integrity

    read_back: list = []
    original = integrity._shared_digests

    def counted(spans: list) -> list[str]:
        read_back.extend(spans)
        return original(spans)

    monkeypatch.setattr(integrity, "_shared_digests", counted)
    hf = write_tiny_checkpoint(tmp_path / "hf", TinySpec())
    save = tmp_path / "save"
    assert cli.main(["import", "--hf-checkpoint", str(hf), "--save", str(save), "--json"]) == 0
    iteration = save / ITERATION_DIR
    record = json.loads((iteration / DIGESTS_NAME).read_text())
    streamed = [item for item in record["items"] if item["file"].startswith("__0_streamed_")]
    assert len(streamed) > 100 and len(read_back) < len(record["items"]) - len(streamed) + len(record["files"]) + 1
    assert not [span for span in read_back if span.file.name.startswith("__0_streamed_")]
    for item in streamed:
        with open(iteration / item["file"], "rb") as handle:
            handle.seek(item["offset"])
            assert xxhash.xxh3_128_hexdigest(handle.read(item["length"])) == item["digest"], item


@pytest.mark.fast
def test_write_hashed_hashes_after_the_write_on_its_thread() -> None:
    """A write is hashed once it is written, on the writer's thread, never while it is written: hashed
    on a thread beside the write (both touching the same pages of a memory-mapped source), the export's
    kernel time more than doubled while the held-up clock counted 0.04 s. The bytes written are the
    data and the digest is theirs; a write that fails is not hashed."""
    import threading

    import xxhash as xx

    from vime_gemma4_bridge.io import digests

    events: list[tuple[str, int]] = []

    class Recording(digests.Hasher):
        def update(self, data: object) -> None:
            events.append(("hash", threading.get_ident()))
            super().update(data)

    written = bytearray()

    def write(piece: memoryview) -> None:
        events.append(("write", threading.get_ident()))
        written.extend(piece)
        events.append(("written", threading.get_ident()))

    data = bytes(range(256)) * (64 << 12)  # 64 MB
    hasher = Recording()
    assert digests.write_hashed(write, data, hasher) == len(data)
    assert bytes(written) == data and hasher.hexdigest() == xx.xxh3_128_hexdigest(data)
    me = threading.get_ident()
    assert events == [("write", me), ("written", me), ("hash", me)], events

    def failing(piece: memoryview) -> None:
        raise OSError("No space left on device")

    events.clear()
    with pytest.raises(OSError, match="No space"):
        digests.write_hashed(failing, data, Recording())
    assert events == []


@pytest.mark.fast
def test_an_item_hashed_after_it_is_written(tmp_path: Path, monkeypatch) -> None:
    """``HashingWriter.item(after=memory)`` (the import's expert items): the writer only writes; the item
    is hashed on another thread, the tensor's data from the memory the caller keeps (not copied) and
    every other write from a copy (``torch.save`` reuses its own buffers: its 400-byte zip directory
    held as a view, a first try, gave wrong digests), in order; the ``Future`` gives the digest of the
    bytes in the file. An item written the usual way after it, in the same file, gets its own digest."""
    import threading
    from concurrent.futures import Future

    import torch

    from vime_gemma4_bridge.io import digests

    seen: list[tuple[int, list]] = []
    original = digests._digest_of

    def recording(pieces: list, kept: memoryview) -> str:
        seen.append((threading.get_ident(), list(pieces)))
        return original(pieces, kept)

    monkeypatch.setattr(digests, "_digest_of", recording)
    tensor = torch.arange(1 << 16, dtype=torch.int32)
    path = tmp_path / "items"
    with open(path, "wb") as handle:
        out = digests.HashingWriter(handle)
        with out.item(after=tensor.numpy()) as later:
            torch.save(tensor, out)
        with out.item() as now:
            torch.save(tensor[:10].clone(), out)
    assert isinstance(later["digest"], Future) and isinstance(now["digest"], str)
    later["digest"] = later["digest"].result()
    data = path.read_bytes()
    for record in (later, now):
        assert record["digest"] == xxhash.xxh3_128_hexdigest(data[record["offset"] :][: record["length"]])
    ((thread, pieces),) = seen
    assert thread != threading.get_ident()
    views = [piece for piece in pieces if isinstance(piece, memoryview)]
    assert len(views) == 1 and views[0].nbytes == tensor.nbytes, [type(piece) for piece in pieces]
    assert digests._address(views[0]) == tensor.data_ptr()


@pytest.mark.fast
def test_an_item_hashed_after_it_is_written_keeps_its_memory_mapped(tmp_path: Path, monkeypatch) -> None:
    """The hash of an ``item(after=...)`` holds its own view of that memory: a mapping the writer gives up on
    (the import's expert thread stopping on another thread's failure) cannot be unmapped under it. Before,
    the hash read through ``torch.save``'s raw pointer and the rank died of SIGSEGV when the mapping went."""
    import threading

    import torch

    from vime_gemma4_bridge.io import digests

    go = threading.Event()
    original = digests._digest_of

    def held_back(pieces: list, kept: memoryview) -> str:
        assert go.wait(timeout=30)
        return original(pieces, kept)

    monkeypatch.setattr(digests, "_digest_of", held_back)
    source = tmp_path / "shard"
    source.write_bytes(bytes(range(256)) * 4096)
    with open(source, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    chunk = torch.frombuffer(mapping, dtype=torch.uint8, count=1 << 19, offset=4096)
    with open(tmp_path / "items", "wb") as out_file:
        out = digests.HashingWriter(out_file)
        with memoryview(mapping)[4096 : 4096 + (1 << 19)] as memory, out.item(after=memory) as item:
            torch.save(chunk, out)
    del chunk
    with pytest.raises(BufferError):
        mapping.close()  # the pending hash's view of it
    go.set()
    data = (tmp_path / "items").read_bytes()
    assert item["digest"].result() == xxhash.xxh3_128_hexdigest(data[item["offset"] :][: item["length"]])
    mapping.close()


@pytest.mark.fast
def test_short_spans_of_a_file_are_read_from_one_open(tmp_path: Path, monkeypatch) -> None:
    """``digest_spans`` over hundreds of short spans (megatron-core's items, read back to be recorded)
    opens each file once per run of them instead of once per span (0.15 s of an import's 0.2 s
    record before); every digest is still its span's, a long span is hashed in place, a missing file
    is ``missing`` and a span past a file's end ``short``, in the spans' order."""
    import builtins
    import os

    from vime_gemma4_bridge.io import digests

    blobs = {name: os.urandom(size) for name, size in (("a", 300_000), ("b", 3 * digests._READ))}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    spans = [digests.Span(tmp_path / "a", 1000 * i, 900, "t") for i in range(300)]
    spans.insert(150, digests.Span(tmp_path / "b", 7, 2 * digests._READ + 5, "long"))
    spans += [digests.Span(tmp_path / "gone", 0, 10, "t"), digests.Span(tmp_path / "a", 299_990, 20, "t")]
    opened: list[str] = []

    def counting_open(file: object, *args: object, **kwargs: object) -> object:
        opened.append(Path(str(file)).name)
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(digests, "open", counting_open, raising=False)
    got = digests.digest_spans(spans)
    expected = [
        xxhash.xxh3_128_hexdigest(blobs[span.file.name][span.offset : span.offset + span.length]) for span in spans[:-2]
    ]
    assert got == [*expected, "missing", "short"]
    assert opened.count("b") == 1 and opened.count("a") <= 2 + 300 // digests._RUN, opened


def test_recording_digests_counts_whole_in_checksum_seconds(imported, monkeypatch) -> None:
    """Recording a torch_dist checkpoint's digests is digests' work from end to end: reading the index,
    opening the files, writing the record count in ``hashing_seconds`` (bench's ``checksum_overhead``),
    not only the hash calls inside it (0.005 s counted of an import's 0.2 s record, before)."""
    import time

    from vime_gemma4_bridge.convert import integrity
    from vime_gemma4_bridge.io.digests import hashing_seconds

    original = integrity.torch_dist_entries

    def slow(iteration_dir: Path) -> list:
        time.sleep(0.3)  # stands in for reading a large checkpoint's index
        return original(iteration_dir)

    monkeypatch.setattr(integrity, "torch_dist_entries", slow)
    before = hashing_seconds()
    integrity.record_torch_dist_digests(imported["save"] / ITERATION_DIR, writer=False)
    assert hashing_seconds() - before >= 0.3


@pytest.mark.fast
def test_short_writes_are_hashed_together() -> None:
    """``torch.save``'s records of a few bytes each are gathered and hashed ``_SMALL`` bytes at a time (each
    hash call hands the GIL to another thread), interleaved with large ones in order: same digest as one
    hash of all the bytes."""
    import random

    import xxhash as xx

    from vime_gemma4_bridge.io import digests

    calls: list[int] = []

    class Counting:
        def __init__(self) -> None:
            self.real = xx.xxh3_128()

        def update(self, data: object) -> None:
            calls.append(memoryview(data).nbytes)
            self.real.update(data)

        def hexdigest(self) -> str:
            return self.real.hexdigest()

    rng = random.Random(0)
    pieces = [rng.randbytes(rng.choice([1, 8, 300, 5000])) for _ in range(2000)]
    pieces[700:700] = [rng.randbytes(digests._SMALL * 3)]  # a large write between short ones
    hasher = digests.Hasher()
    hasher._hash = Counting()
    for piece in pieces:
        digests.write_hashed(lambda _: None, piece, hasher)
    assert hasher.hexdigest() == xx.xxh3_128_hexdigest(b"".join(pieces))
    total = sum(map(len, pieces))
    assert len(calls) <= 2 * (total // digests._SMALL) + 3, (len(calls), total)
    assert len(calls) < len(pieces) / 10


def metadata_of(header: dict) -> dict[str, str]:
    """A shard header's recorded digests by name (``xxh3_128:`` dropped)."""
    return {k.removeprefix("xxh3_128:"): v for k, v in header["__metadata__"].items() if k.startswith("xxh3_128:")}


def test_flipped_hf_byte_is_named_by_import_compare_and_verify_checkpoint(imported, capsys, tmp_path: Path) -> None:
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    damaged = tmp_path / "damaged"
    shutil.copytree(imported["exported"], damaged)
    name = next(n for n in HFCheckpoint(damaged).language_model_names() if n.endswith("experts.down_proj"))
    location = HFCheckpoint(damaged).locate(name)
    with open(location.file, "r+b") as handle:
        handle.seek(location.offset + 3)
        byte = handle.read(1)[0]
        handle.seek(location.offset + 3)
        handle.write(bytes([byte ^ 0x01]))
    needles = (str(damaged), location.file.name, f"tensor {name}")

    save = tmp_path / "save"
    for argv in (
        ["import", "--hf-checkpoint", damaged, "--save", save],
        ["compare", imported["exported"], damaged],
        ["verify-checkpoint", damaged],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and out == "", (argv, out)
        [line] = [line for line in err.splitlines() if line.startswith(f"vime-gemma4 {argv[0]}: error: ")]
        _named(line, *needles)
    assert not save.exists() and not list(tmp_path.glob(".save*"))


def test_a_tensor_whose_digest_entry_was_removed_is_named(imported, capsys, tmp_path: Path) -> None:
    """A shard's header edited so that one tensor's digest key is gone (the same length, so every reader
    still takes the file): its check is not switched off — ``verify-checkpoint`` names the shard's header,
    whose own digest covers the keys. Before, ``hf_spans`` skipped a tensor without a digest, and the file
    verified."""
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    edited = tmp_path / "edited"
    shutil.copytree(imported["exported"], edited)
    name = next(n for n in HFCheckpoint(edited).language_model_names() if n.endswith("embed_tokens.weight"))
    file = HFCheckpoint(edited).locate(name).file
    data = file.read_bytes()
    key = f'"xxh3_128:{name}"'.encode()
    assert data.count(key) == 1
    file.write_bytes(data.replace(key, key.replace(b"xxh3_128:", b"xxh3_12X:")))
    code, out, err = run_cli(capsys, "verify-checkpoint", edited)
    assert code == 1 and out == "", err
    assert f"{file.name}'s header (tensor names, dtypes, shapes, offsets) does not match" in err, err


@pytest.mark.parametrize(
    ("edit", "found"),
    [
        # a dtype of the same byte width: every data digest still matches, the values would be read as float16
        ((b'"dtype":"BF16"', b'"dtype":"F16" '), "header (tensor names, dtypes, shapes, offsets) does not match"),
        ((b'"xxh3_128:__header__"', b'"xxh3_128:__headXr__"'), "header has no digest of its own"),
    ],
    ids=["dtype", "header-digest-removed"],
)
def test_a_header_edit_that_keeps_every_data_digest_is_named(imported, capsys, tmp_path: Path, edit, found) -> None:
    """A shard header edited in place (same length, so every reader still takes the file): ``verify-checkpoint``
    exits 1 naming the shard's header. Before the header carried a digest of its own, the dtype edit verified."""
    edited = tmp_path / "edited"
    shutil.copytree(imported["exported"], edited)
    shard = next(p for p in sorted(edited.glob("*.safetensors")) if edit[0] in p.read_bytes())
    data = shard.read_bytes()
    shard.write_bytes(data.replace(edit[0], edit[1], 1))
    code, out, err = run_cli(capsys, "verify-checkpoint", edited)
    assert code == 1 and out == "", err
    assert f"{shard.name}'s {found}" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.fast
def test_hashing_seconds_are_wall_seconds_of_threads_hashing_at_once() -> None:
    """``bench``'s ``checksum_overhead`` counts the wall time during which any thread hashed: four threads
    hashing at once on two cores add about the wall time, not four threads' seconds (the sum, unlocked,
    before)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from vime_gemma4_bridge.io.digests import Hasher, hashing_seconds

    data = bytes(256 << 20)

    def hash_it(_: int) -> str:
        hasher = Hasher()
        hasher.update(data)
        return hasher.hexdigest()

    before, start = hashing_seconds(), time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert len(set(pool.map(hash_it, range(4)))) == 1
    wall, counted = time.perf_counter() - start, hashing_seconds() - before
    assert 0 < counted <= wall, (counted, wall)


def _verify_with_rank_1_unable_to_read(hf_checkpoint: str) -> str:
    """``verify_sources`` on every rank, rank 1's reads failing as an unreadable file's would (root reads
    every file here, so the failure is stood in): what this rank raised."""
    from unittest import mock

    import torch.distributed as dist

    from vime_gemma4_bridge.convert import integrity

    original = integrity.check_spans

    def check_spans(expected: list, **kwargs: object) -> str | None:
        if dist.get_rank() == 1:
            raise PermissionError(13, "Permission denied", "model.safetensors")
        return original(expected, **kwargs)

    with mock.patch.object(integrity, "check_spans", check_spans):
        try:
            integrity.verify_sources(hf_checkpoint)
        except OSError as error:
            return str(error)
    return "no error"


def test_one_ranks_read_error_fails_every_rank(local_world, imported) -> None:
    """A rank that cannot read its share of the spans sends the error to the exchange: every rank raises it,
    instead of the others waiting in ``all_gather_object`` for a rank that is gone (up to this change the
    failing rank raised before the exchange)."""
    errors = local_world(2).run(_verify_with_rank_1_unable_to_read, str(imported["exported"]))
    assert errors == ["PermissionError: [Errno 13] Permission denied: 'model.safetensors'"] * 2, errors


def test_verify_checkpoint_refuses_what_records_no_digests_or_a_damaged_record(
    imported, capsys, tmp_path: Path
) -> None:
    """A Hub-style checkpoint (transformers' writer) and a training save have nothing to check against: exit 2;
    a damaged whole file (the run config) and an unreadable record are named."""
    code, _, err = run_cli(capsys, "verify-checkpoint", imported["hf"])
    assert code == 2 and "records no digests" in err, err

    bare = tmp_path / "bare"
    shutil.copytree(imported["save"], bare)
    (bare / ITERATION_DIR / DIGESTS_NAME).unlink()
    code, _, err = run_cli(capsys, "verify-checkpoint", bare)
    assert code == 2 and "records no digests" in err and "present and complete" in err, err

    edited = tmp_path / "edited"
    shutil.copytree(imported["save"], edited)
    run_config = edited / ITERATION_DIR / "run_config.yaml"
    run_config.write_text(run_config.read_text().replace("num_layers: 4", "num_layers: 5"))
    code, _, err = run_cli(capsys, "verify-checkpoint", edited)
    assert code == 1, err
    _named(err.strip().splitlines()[-1], "run_config.yaml", "file run_config.yaml")

    gone = tmp_path / "gone"
    shutil.copytree(imported["save"], gone)
    (gone / ITERATION_DIR / "run_config.yaml").unlink()
    code, _, err = run_cli(capsys, "verify-checkpoint", gone)
    assert code == 1 and "run_config.yaml (file run_config.yaml) is missing" in err, err

    torn = tmp_path / "torn"
    shutil.copytree(imported["save"], torn)
    record = torn / ITERATION_DIR / DIGESTS_NAME
    record.write_text(record.read_text()[:100])
    code, _, err = run_cli(capsys, "verify-checkpoint", torn)
    assert code == 2 and f"{record} is damaged" in err, err
