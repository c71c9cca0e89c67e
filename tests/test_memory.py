"""Memory at the shard (issue 35): the export delivered to its one consumer (compat/gather_to_one), and
26B-A4B's published widths at the seed's topology (TP2·PP2·EP4·ETP1) on 8 CPU ranks of a 24 GB host."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vime_gemma4_bridge.convert.live import export_live_job
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.testing.spec import TinySpec, preset
from vime_gemma4_bridge.testing.synthetic import write_synthetic_checkpoint
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.report import family_of
from vime_gemma4_bridge.verify.roundtrip import roundtrip_job
from vime_gemma4_bridge.verify.update import verify_update


def _gathered_to_rank0_job(hf_checkpoint: str, topology: Topology) -> dict:
    """Rank 0's export (``export_language_model``, gathered to it) against upstream's all-gathering
    export run right after it; what the other ranks got; what a second ``gathered_to`` says."""
    import torch
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    from vime_gemma4_bridge.compat.gather_to_one import gathered_to
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.core.bridge import in_expert_layout
    from vime_gemma4_bridge.core.hf_layout import STACKED

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.loaded_model(bridge, topology)
    upstream, all_gather = dict(vars(MegatronParamMapping)), torch.distributed.all_gather
    try:
        with gathered_to(0), gathered_to(0):
            pass
        nested = None
    except RuntimeError as error:
        nested = str(error)
    restored = dict(vars(MegatronParamMapping)) == upstream
    gathered = {name: tensor.clone() for name, tensor in convert.export_language_model(bridge, model)}
    # Out of the block, upstream's export again: every rank gets every tensor (vime's sync).
    everywhere = {
        item[0]: item[1] for item in in_expert_layout(STACKED, bridge.export_hf_weights(model, show_progress=False))
    }
    return {
        "names": sorted(gathered),
        "signatures": {name: (tuple(t.shape), t.dtype) for name, t in gathered.items()},
        "devices": sorted({t.device.type for t in gathered.values()}),
        "real": sorted(name for name, t in gathered.items() if t.device.type != "meta"),
        "everywhere_devices": sorted({t.device.type for t in everywhere.values()}),
        "equal_to_upstream": sorted(gathered) == sorted(everywhere)
        and all(gathered[n].dtype == everywhere[n].dtype and torch.equal(gathered[n], everywhere[n]) for n in gathered)
        if "meta" not in {t.device.type for t in gathered.values()}
        else None,
        "nested": nested,
        "restored": restored
        and dict(vars(MegatronParamMapping)) == upstream
        and torch.distributed.all_gather is all_gather,
    }


@pytest.mark.parametrize(
    "topology",
    [Topology(tp=2, pp=2, ep=2, etp=2), Topology(tp=2, pp=2, vpp=2, ep=4, etp=1)],
    ids=["tp2pp2ep2etp2", "tp2pp2vpp2ep4"],
)
def test_export_gathers_to_its_one_consumer(local_world, tmp_path: Path, topology: Topology) -> None:
    """``roundtrip`` / ``export`` / ``export-live`` consume on rank 0: it gets upstream's tensors byte for byte.
    Every other rank gets the same names, shapes and dtypes, and holds none of the gathered tensors
    (UPSTREAM 60): only the TP-replicated ones (norms, router, scalars) it already held, or received as
    the consumer's stage does, are real there. The switch does not nest, and leaves upstream's methods
    in place after an error and after the export: upstream's export run next is upstream's again."""
    hf = write_tiny_checkpoint(tmp_path / "hf", TinySpec(seed=5))
    results = local_world(8).run(_gathered_to_rank0_job, str(hf), topology)
    first = results[0]
    assert first["devices"] == ["cpu"] and first["equal_to_upstream"] is True
    assert any(".experts." in name for name in first["names"]) and any("embed_tokens" in n for n in first["names"])
    replicated = {"router", "q/k norms", "layer norms", "final norm", "layer scalar"}
    for rank, result in enumerate(results[1:], start=1):
        assert "meta" in result["devices"] and result["signatures"] == first["signatures"], rank
        assert {family_of(name) for name in result["real"]} <= replicated, (rank, result["real"])
    assert all(result["everywhere_devices"] == ["cpu"] for result in results)
    assert {result["nested"] for result in results} == {"gathered_to is already active in this process"}
    assert all(result["restored"] for result in results)


@pytest.mark.slow
def test_real_widths_round_trip_and_live_export_at_the_seed_topology(local_world, tmp_path: Path) -> None:
    """Acceptance (issue 35): 26B-A4B at its published widths, two layers (4.76 GB of language model),
    round-trips bitwise at TP2·PP2·EP4·ETP1 on 8 ranks, and ``export-live --expert-layout per-expert``
    there verifies with ``verify-update``. Before the export gathered to its consumer, the kernel's OOM
    killer ended a rank of the round trip on this 24 GB machine."""
    hf, _ = write_synthetic_checkpoint(tmp_path / "hf", preset("26b-a4b", 2))
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    world = local_world(8)
    try:
        result = world.run(roundtrip_job, str(hf), topology, None, False, 10**9)[0]
        assert result["identical"], result["report"]
        assert result["total"]["count"] == result["total"]["equal"] == 45, result["total"]
        dump = tmp_path / "dump"
        world.run(export_live_job, str(hf), topology, str(dump), 1 << 30, False, "per-expert")
        report = verify_update(hf, dump)
        assert report["ok"], report["problems"][:5]
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)  # ~10 GB of files: not kept, whatever the outcome


def _rss_file() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("RssFile:"))


@pytest.mark.fast
def test_compared_tensors_take_their_pages_with_them(tmp_path: Path) -> None:
    """``TensorFiles.get`` (the round trip's and verify-update's reads): a tensor read and dropped leaves no
    page of its file in this process, so comparing a checkpoint holds one tensor's pages, not the whole
    checkpoint's (issue 35: rank 0 of the real-width round trip held the 4.3 GB source mapped)."""
    import torch
    from safetensors.torch import save_file

    from vime_gemma4_bridge.verify.compare import TensorFiles

    names = [f"t{i}" for i in range(4)]
    save_file({name: torch.full((16 << 20,), i, dtype=torch.float32) for i, name in enumerate(names)}, tmp_path / "a")
    with TensorFiles.of_files([tmp_path / "a"]) as files:
        before = _rss_file()
        for i, name in enumerate(names):
            assert files.get(name).sum().item() == i * (16 << 20)  # touches every page of the tensor
        held = _rss_file() - before
    assert held < 64 << 20, f"{held >> 20} MB of the file's 256 MB still mapped after the reads"


@pytest.mark.fast
def test_a_build_without_the_seams_keeps_its_own_export(monkeypatch) -> None:
    """Feature detection: where ``MegatronParamMapping`` does not define the three collectives itself,
    ``gathered_to`` swaps nothing and every rank receives the export, as upstream gives it."""
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    from vime_gemma4_bridge.compat.gather_to_one import gathered_to

    monkeypatch.delattr(MegatronParamMapping, "gather_from_ep_ranks")
    before = dict(MegatronParamMapping.__dict__)
    with gathered_to(0) as receives:
        assert receives
        assert dict(MegatronParamMapping.__dict__) == before
