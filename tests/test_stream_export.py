"""The streaming export's file-level pieces: reading torch_dist items in place, writing safetensors lazily.

End-to-end behaviour (experts streamed or not, bitwise output) is in test_torch_dist.py; here the two
places where this plugin reads or writes a file format itself are checked against the libraries that
own the format: every item read in place must equal ``torch.load`` of it, anything that is not a
plain tensor must go to ``torch.load``, and every file written must read back with ``safetensors``.
"""

from __future__ import annotations

import io
import json
import mmap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vime_gemma4_bridge.io import hf as hf_io
from vime_gemma4_bridge.io import hf_write, torch_dist_reader
from vime_gemma4_bridge.io.digests import HEADER_KEY, header_digest


def _item_file(tmp_path: Path, values: list[object]) -> tuple[mmap.mmap, list[tuple[int, int]]]:
    """torch.save each value back to back in one file, as the torch_dist writer does; (mapping, [(offset, length)])."""
    spans, blob = [], io.BytesIO()
    for value in values:
        start = blob.tell()
        torch.save(value, blob)
        spans.append((start, blob.tell() - start))
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(blob.getvalue())
    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY), spans


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.bool])
def test_plain_items_are_located_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    values = [torch.randn(3, 5, 7).to(dtype), torch.randn(4).to(dtype), torch.tensor(1.5).to(dtype)]
    buffer, spans = _item_file(tmp_path, values)
    for value, (offset, length) in zip(values, spans, strict=True):
        start, got_dtype, shape = torch_dist_reader._plain_tensor_location(buffer, offset, length)
        assert (got_dtype, shape) == (value.dtype, tuple(value.shape))
        read = torch.frombuffer(buffer, dtype=got_dtype, count=value.numel(), offset=start).view(shape)
        assert torch.equal(read, value)
        assert torch.equal(read, torch.load(io.BytesIO(buffer[offset : offset + length]), weights_only=True))


def test_views_and_other_objects_are_left_to_torch_load(tmp_path: Path) -> None:
    base = torch.randn(6, 4)
    values = [base[2:4], base.t(), {"not": "a tensor"}, [torch.ones(2)]]
    buffer, spans = _item_file(tmp_path, values)
    for offset, length in spans:
        with pytest.raises(torch_dist_reader._NotPlain):
            torch_dist_reader._plain_tensor_location(buffer, offset, length)


def test_lazy_tensors_write_loadable_safetensors(tmp_path: Path) -> None:
    experts = torch.randn(4, 6, 3, dtype=torch.bfloat16)
    eager = {"a": torch.randn(2, 3), "scalar": torch.tensor(3.0), "strided": torch.arange(12).view(3, 4).t()}
    lazy = hf_io.LazyTensor((4, 6, 3), torch.bfloat16, lambda: iter(experts.unbind(0)))
    hf_write.save_safetensors(
        tmp_path / "x.safetensors", [*eager.items(), ("experts", lazy)], metadata={"format": "pt"}
    )
    with safe_open(tmp_path / "x.safetensors", framework="pt") as handle:
        metadata = handle.metadata()
        assert torch.equal(handle.get_tensor("experts"), experts)
        for name, value in eager.items():
            assert torch.equal(handle.get_tensor(name), value)
    # the caller's metadata, and each tensor's digest of the bytes written (strided and lazy ones too)
    import xxhash

    written = {**eager, "experts": experts}
    raw = {name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for name, t in written.items()}
    digests = {f"xxh3_128:{name}": xxhash.xxh3_128_hexdigest(data) for name, data in raw.items()}
    # and the header's own digest, of the header as written (its digest values blanked)
    with open(tmp_path / "x.safetensors", "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    assert metadata == {"format": "pt", **digests, HEADER_KEY: header_digest(header)}


def test_a_lazy_tensor_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    short = hf_io.LazyTensor((4, 2), torch.float32, lambda: iter([torch.zeros(3, 2)]))
    with pytest.raises(hf_io.CheckpointError, match="expected 32"):
        hf_write.save_safetensors(tmp_path / "x.safetensors", [("short", short)], metadata={})


def test_tensor_locations_are_the_safetensors_bytes(tmp_path: Path) -> None:
    """``HFCheckpoint.locate`` (the streaming import's reader) finds exactly the bytes safetensors reads."""
    from safetensors.torch import save_file

    tensors = {"model.language_model.a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int16)}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma4ForCausalLM"]}')
    source = hf_io.HFCheckpoint(tmp_path)
    for name, tensor in tensors.items():
        location = source.locate(name)
        assert (location.shape, location.dtype, location.nbytes) == (tuple(tensor.shape), tensor.dtype, tensor.nbytes)
        assert torch.equal(location.mapped(), tensor)
        with open(location.file, "rb") as handle:
            handle.seek(location.offset)
            assert handle.read(location.nbytes) == tensor.numpy().tobytes()


def test_expert_files_are_cut_in_order_by_bytes() -> None:
    from vime_gemma4_bridge.convert.stream_import import _balanced

    sizes = {"a": 4, "b": 4, "c": 1, "d": 3, "e": 4}
    assert _balanced(list(sizes), sizes.__getitem__, 2) == [["a", "b"], ["c", "d", "e"]]
    assert _balanced(list(sizes), sizes.__getitem__, 1) == [list(sizes)]
    assert _balanced(["a"], sizes.__getitem__, 4) == [["a"]]


def test_shards_filled_in_any_order_are_the_files_of_a_write_in_order(tmp_path: Path) -> None:
    """The export at a topology puts tensors as Megatron-Bridge's tasks produce them: the files (bytes,
    digests, index) must be those of a write in the layout's order, and a layout not filled is refused."""
    generator = torch.Generator().manual_seed(3)
    tensors = [
        (f"t{i}", torch.randn(size, generator=generator).to(dtype))
        for i, (size, dtype) in enumerate(
            zip(
                [(300,), (17, 5), (1000,), (4,), (2, 2, 9)] * 2, [torch.bfloat16] * 5 + [torch.float32] * 5, strict=True
            )
        )
    ]
    for directory in ("ordered", "shuffled", "refused"):
        (tmp_path / directory).mkdir()
    hf_write.write_shards(tmp_path / "ordered", tensors, max_shard_size=1500)
    order = torch.randperm(len(tensors), generator=generator).tolist()
    assert order != sorted(order)
    with hf_write.Shards(tmp_path / "shuffled", tensors, max_shard_size=1500) as shards:
        for i in order:
            shards.put(*tensors[i])
    files = sorted(p.name for p in (tmp_path / "ordered").iterdir())
    assert len(files) > 3 and files == sorted(p.name for p in (tmp_path / "shuffled").iterdir())
    assert all((tmp_path / "ordered" / f).read_bytes() == (tmp_path / "shuffled" / f).read_bytes() for f in files)

    name, tensor = tensors[0]
    refusals = {
        "never came": [tensors[0]],
        "came twice": [tensors[0], tensors[0]],
        "is not a tensor of": [("other", tensor)],
        "came as F32\\[300\\] but the layout has BF16\\[300\\]": [(name, tensor.float())],
    }
    for message, puts in refusals.items():
        with pytest.raises(hf_io.CheckpointError, match=message):
            with hf_write.Shards(tmp_path / "refused", tensors, max_shard_size=1500) as shards:
                for put in puts:
                    shards.put(*put)


def test_the_round_trip_reads_its_reference_a_block_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """``report.compare`` against files reads each reference tensor in blocks of rows (``TensorLocation.rows``:
    read, not mapped, so the pages do not stay): every byte still counts, in the last block as in the first."""
    from safetensors.torch import save_file

    from vime_gemma4_bridge.verify import report
    from vime_gemma4_bridge.verify.compare import TensorFiles

    tensors = {
        "model.language_model.embed": torch.randn(37, 5).to(torch.bfloat16),
        "model.language_model.mask": torch.rand(9, 2) > 0.5,
        "model.language_model.scalar": torch.tensor(2.5),
        "model.language_model.empty": torch.zeros(0, 3),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma4ForCausalLM"]}')
    location = hf_io.HFCheckpoint(tmp_path).locate("model.language_model.embed")
    assert torch.equal(location.rows(30, 99), tensors["model.language_model.embed"][30:])
    monkeypatch.setattr(report, "BLOCK", 40)  # 4 rows of the embedding at a time
    source = hf_io.HFCheckpoint(tmp_path)
    with TensorFiles.of_checkpoint(source) as reference:
        assert report.compare(reference, list(tensors.items())).identical
        for name in ("model.language_model.embed", "model.language_model.mask", "model.language_model.scalar"):
            changed = tensors[name].clone()
            flat = changed.view(-1)
            flat[-1] = ~flat[-1] if changed.dtype == torch.bool else flat[-1] + 1
            result = report.compare(reference, [*((n, t) for n, t in tensors.items() if n != name), (name, changed)])
            assert result.different == [name], name


def test_the_export_stream_holds_nothing_while_the_next_tensor_is_made() -> None:
    """Each layer between Megatron-Bridge's export and its consumer (``in_expert_layout``,
    ``export_language_model``, ``export_to_rank0``, the round trip's comparison) lets go of a tensor once
    it is handed on: a loop variable kept it alive while the next was made, so a layer's stacked experts
    (1 GB at 26B-A4B) lived on beside the next stack on rank 0."""
    import weakref

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import Topology, init_model_parallel
    from vime_gemma4_bridge.runtime.group import single_process_group
    from vime_gemma4_bridge.verify import report

    made: list[weakref.ref] = []
    alive: list[int] = []

    class Bridge:
        def export_hf_weights(self, model, **kwargs):
            for index in range(4):
                alive.append(sum(ref() is not None for ref in made))  # what is still held as the next is made
                tensor = torch.full((8,), float(index))
                made.append(weakref.ref(tensor))
                yield f"w{index}", tensor
                del tensor

    reference = {f"w{index}": torch.full((8,), float(index)) for index in range(4)}
    with single_process_group("gloo"):
        init_model_parallel(Topology())
        result = report.compare(reference, convert.export_to_rank0(Bridge(), [], conversion_tasks=[]))
    assert result.identical and alive == [0, 0, 0, 0], alive
