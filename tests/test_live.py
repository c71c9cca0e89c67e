"""The live export path (vime's bridge mode) and the weight-update check, on real gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vime_gemma4_bridge.cli import main as cli
from vime_gemma4_bridge.convert.live import chunk_by_bytes, export_live_job
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.parity import excluded_token_ids, fixed_token_ids
from vime_gemma4_bridge.verify.update import verify_update


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("live") / "hf", TinySpec(seed=3))


def _names_job(hf_checkpoint: str, topology: Topology) -> list[tuple[str, str, tuple[int, ...], str]]:
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.live import iter_hf_weights
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    return [(h, m, tuple(t.shape), str(t.dtype)) for h, t, m in iter_hf_weights(bridge, model, cpu=True)]


def test_chunk_by_bytes_is_vimes_rule() -> None:
    """The plugin's chunking against vime's rule as tests/vime_flow.py states it (once, from the cited file),
    for every buffer size from 1 byte to past the whole stream, on a stream with empty, small and large
    tensors; and the hand-checked case: a chunk closes before it would reach 5 bytes."""
    from vime_flow import chunks as vime_chunks

    sizes = [3, 3, 10, 1, 2, 2, 0, 7, 1, 1, 4]
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.uint8), f"m{i}") for i, n in enumerate(sizes)]
    for buffer_size in range(1, sum(sizes) + 2):
        ours = [[name for name, *_ in chunk] for chunk in chunk_by_bytes(tensors, buffer_size)]
        vimes = [[name for name, *_ in chunk] for chunk in vime_chunks(((n, t) for n, t, _ in tensors), buffer_size)]
        assert ours == vimes, buffer_size
    first = [[name for name, *_ in chunk] for chunk in chunk_by_bytes(tensors[:6], 5)]
    assert first == [["t0"], ["t1"], ["t2"], ["t3", "t4"], ["t5"]]
    with pytest.raises(ValueError, match="at least 1 byte"):
        list(chunk_by_bytes(tensors, 0))


def test_stream_is_the_language_model_with_megatron_names(local_world, hf_vl: Path) -> None:
    results = local_world(4).run(_names_job, str(hf_vl), Topology(tp=2, pp=2, ep=2))
    assert all(r == results[0] for r in results), "every rank sees the same stream"
    stream = results[0]
    source = HFCheckpoint(hf_vl)
    reference = source.load(source.language_model_names())
    assert sorted(h for h, *_ in stream) == sorted(reference)
    assert {h: (shape, dtype) for h, _, shape, dtype in stream} == {
        name: (tuple(t.shape), str(t.dtype)) for name, t in reference.items()
    }
    megatron = {h: m for h, m, *_ in stream}
    assert megatron["model.language_model.layers.1.experts.gate_up_proj"] == (
        "decoder.layers.1.mlp.experts.linear_fc1.weight"
    )
    assert megatron["model.language_model.layers.0.self_attn.k_proj.weight"] == (
        "decoder.layers.0.self_attention.linear_qkv.weight"
    )
    assert megatron["model.language_model.embed_tokens.weight"] == "embedding.word_embeddings.weight"
    assert not any("vision" in h or "lm_head" in h for h in megatron)
    assert "model.language_model.layers.1.self_attn.v_proj.weight" not in megatron  # k_eq_v global layer


def _task_order_job(hf_checkpoint: str, topology: Topology) -> tuple[list[str], list[str]]:
    """This rank's task names as the plugin orders them, and as Megatron-Bridge's own build orders them."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    from vime_gemma4_bridge.compat import seams
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology, initialize=False)
    ours = bridge.get_conversion_tasks(model)
    upstream = MegatronModelBridge.build_conversion_tasks(
        bridge._model_bridge, bridge.hf_pretrained, model, **seams.conversion_task_kwargs(None)
    )
    return [t.global_param_name for t in ours if t is not None], [t.global_param_name for t in upstream if t]


def test_expert_tasks_are_ordered_one_stack_at_a_time(local_world, hf_vl: Path) -> None:
    """Each layer's gate_up stack completes before its down stack starts filling: the live peak holds one chunk less."""
    for ours, upstream in local_world(4).run(_task_order_job, str(hf_vl), Topology(pp=2, ep=2)):
        assert sorted(ours) == sorted(upstream) and len(ours) == len(upstream), "a permutation of upstream's tasks"
        assert ours != upstream, "upstream interleaves the stacks, so the order must differ"
        experts = [name for name in ours if ".mlp.experts." in name]
        assert experts, "the tiny model is an MoE on every stage"
        for layer in sorted({name.split(".mlp.")[0] for name in experts}):
            kinds = [name.split(".experts.")[1] for name in experts if name.startswith(layer + ".")]
            fc1 = [kind for kind in kinds if kind.startswith("linear_fc1")]
            assert kinds == fc1 + [kind for kind in kinds if kind.startswith("linear_fc2")], (layer, kinds)
            assert fc1 == sorted(fc1, key=lambda kind: int(kind.removeprefix("linear_fc1.weight"))), fc1


def check_dump(dump: Path, hf: Path, buffer_size: int) -> None:
    seen: set[str] = set()
    index = json.loads((dump / "model.safetensors.index.json").read_text())["weight_map"]
    for file in sorted(dump.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            names = list(handle.keys())
            sizes = [handle.get_tensor(n).numel() * handle.get_tensor(n).element_size() for n in names]
        assert len(names) == 1 or sum(sizes) < buffer_size, f"{file.name} reaches the buffer"
        assert not seen & set(names), "a tensor was pushed twice"
        seen |= set(names)
        assert all(index[n] == file.name for n in names)
    report = verify_update(hf, dump)
    assert report["ok"], report["problems"]


def test_export_live_at_the_reported_topology(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """Acceptance shape: TP2·PP2·EP4·ETP1 on 8 ranks, chunks within the buffer, union == LM tensors."""
    buffer_size = 60_000
    result = local_world(8).run(
        export_live_job, str(hf_vl), Topology(tp=2, pp=2, ep=4, etp=1), str(tmp_path / "dump"), buffer_size, False
    )[0]
    assert result["chunks"] > 5 and result["tensors"] == len(HFCheckpoint(hf_vl).language_model_names())
    check_dump(tmp_path / "dump", hf_vl, buffer_size)


def test_verify_update_names_every_mismatch(hf_vl: Path, tmp_path: Path, capsys) -> None:
    source = HFCheckpoint(hf_vl)
    names = source.language_model_names()
    tensors = source.load(names)
    dump = tmp_path / "weight_v000003"
    dump.mkdir()
    experts = "model.language_model.layers.0.experts.down_proj"
    broken = tensors[experts].clone()
    broken[8] = broken[0]
    first = {n: tensors[n] for n in names[: len(names) // 2]}
    second = {n: tensors[n] for n in names[len(names) // 2 :] if n != names[-1]}
    first[experts] = broken
    second.pop(experts, None)
    second[names[0]] = tensors[names[0]]  # pushed twice
    save_file(first, dump / "model-00001-of-00002.safetensors")
    save_file(second, dump / "model-00002-of-00002.safetensors")

    assert cli.main(["verify-update", "--hf-checkpoint", str(hf_vl), "--dump", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH {experts}: values differ (fingerprint" in out
    assert f"MISMATCH {names[0]}: pushed twice" in out
    assert f"MISMATCH {names[-1]}: missing from the update" in out
    assert "verify-update FAILED" in out.splitlines()[-1]


def test_verify_update_refuses_bad_input(hf_vl: Path, tmp_path: Path, capsys) -> None:
    assert cli.main(["verify-update", "--hf-checkpoint", str(hf_vl), "--dump", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["verify-update", "--hf-checkpoint", str(hf_vl), "--dump", str(tmp_path)]) == 2
    assert "no .safetensors" in capsys.readouterr().err


def test_export_live_refuses_before_launching(hf_vl: Path, tmp_path: Path, capsys) -> None:
    args = ["export-live", "--hf-checkpoint", str(hf_vl), "--dump", str(tmp_path / "d"), "--buffer-size", "1MB"]
    assert cli.main([*args, "--ep", "3", "--nproc", "3"]) == 2
    assert "16 experts do not divide by --ep 3" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_verify_accepts_a_dtype_or_shape_change_as_mismatch(hf_vl: Path, tmp_path: Path) -> None:
    source = HFCheckpoint(hf_vl)
    tensors = source.load(source.language_model_names())
    name = "model.language_model.norm.weight"
    tensors[name] = tensors[name].float()
    dump = tmp_path / "d"
    dump.mkdir()
    save_file(tensors, dump / "model-00001-of-00001.safetensors")
    report = verify_update(hf_vl, dump)
    assert not report["ok"]
    assert report["problems"] == [f"{name}: torch.float32 (64,) pushed, checkpoint has torch.bfloat16 (64,)"]


# ------------------------------------------------------------------------------------------------
# vime's weight-sync contract: the plugin driven exactly as vime's bridge iterator drives it
# ------------------------------------------------------------------------------------------------


def _vime_sync_job(
    hf_checkpoint: str,
    topology: Topology,
    dump: str,
    buffer_size: int,
    expert_layout: str | None = None,
    rollout_checkpoint: str | None = None,
    revision: str = "1187a604",
) -> dict | None:
    """One vime weight sync (tests/vime_flow.py) on every rank, on vime's fork seams (tests/fork_seams.py).

    ``expert_layout``: the actor's ``VIME_GEMMA4_EXPERT_LAYOUT`` (vime's zero-edit switch), set for this job only.
    ``rollout_checkpoint``: vime's ``--hf-checkpoint`` when it is not the trained weights' checkpoint (an
    FP8 one for FP8 rollouts): the bridge is opened on it, the model loaded from ``hf_checkpoint``.
    ``revision``: the fork's ``model_bridge.py`` the double follows (tests/fork_seams.fork_seams).
    """
    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV
    from vime_gemma4_bridge.runtime.world import environment

    with environment({EXPERT_LAYOUT_ENV: expert_layout} if expert_layout is not None else {}):
        return _vime_sync(hf_checkpoint, topology, dump, buffer_size, rollout_checkpoint or hf_checkpoint, revision)


def _vime_sync(
    hf_checkpoint: str, topology: Topology, dump: str, buffer_size: int, rollout_checkpoint: str, revision: str
) -> dict | None:
    import torch.distributed as dist
    from fork_seams import fork_seams
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.utils import persistent_buffers
    from vime_flow import sync_weights, write_disk_update

    import vime_gemma4_bridge
    from vime_gemma4_bridge.compat import seams

    with fork_seams(revision):
        assert seams.build_kind() == "vime fork"
        vime_gemma4_bridge.init_model_parallel(topology)
        bridge = AutoBridge.from_hf_pretrained(rollout_checkpoint, trust_remote_code=True)
        model = vime_gemma4_bridge.build_model(bridge, topology)
        AutoBridge.from_hf_pretrained(hf_checkpoint).load_hf_weights(model)
        task_names = {task.param_name for task in bridge.get_conversion_tasks(model) if task is not None}
        buffers = {name for chunk in model for name, _ in persistent_buffers(chunk)}
        unnamed: list[str] = []
        stream = sync_weights(bridge, model, buffer_size, unnamed)
        if dist.get_rank() != 0:
            for _ in stream:
                pass
            return None
        written = write_disk_update(stream, rollout_checkpoint, Path(dump))
        return {"tensors": written, "buffer_tasks": sorted(task_names & buffers), "unnamed": unnamed}


def _logits(model_dir: Path, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import Gemma4ForConditionalGeneration

    model, info = Gemma4ForConditionalGeneration.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


@pytest.mark.parametrize(
    "topology", [Topology(tp=2, pp=2, ep=4, etp=1), Topology(pp=2, vpp=2)], ids=["TP2-PP2-EP4-ETP1", "PP2-VPP2"]
)
def test_vime_weight_sync_contract(local_world, hf_vl: Path, tmp_path: Path, topology: Topology) -> None:
    """vime's flow on the fork seams: the dump is HF1's language model bitwise, and serves HF1's logits."""
    buffer_size = 60_000
    dump = tmp_path / "weight_v000001"
    result = local_world(8).run(_vime_sync_job, str(hf_vl), topology, str(dump), buffer_size)[0]
    assert result["buffer_tasks"] == [], "a persistent buffer is a conversion task"
    assert result["unnamed"] == [], "at 1187a604 every item names its Megatron parameter"
    source = HFCheckpoint(hf_vl)
    assert result["tensors"] == len(source.language_model_names())
    check_dump(dump, hf_vl, buffer_size)

    # What vLLM would serve: HF1's vision tower with the pushed language model, loaded by transformers.
    served = tmp_path / "served"
    served.mkdir()
    for side_file in ("config.json", "generation_config.json"):
        if (hf_vl / side_file).exists():
            (served / side_file).write_bytes((hf_vl / side_file).read_bytes())
    vision = source.load([name for name in source.names() if name not in set(source.language_model_names())])
    pushed = HFCheckpoint(dump)
    save_file({**vision, **pushed.load(pushed.names())}, served / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_vl / "config.json").read_text())
    input_ids = fixed_token_ids(config["text_config"]["vocab_size"], 2, 24, excluded_token_ids(config))
    assert torch.equal(_logits(served, input_ids), _logits(hf_vl, input_ids))


def _refusals_job(hf_checkpoint: str) -> dict:
    """What ``get_conversion_tasks`` says of a persistent buffer mapped as a task and of a dropped mapping;
    and the classes the built model is made of."""
    from megatron.bridge import AutoBridge

    import vime_gemma4_bridge
    from vime_gemma4_bridge.core import bridge as gemma4_bridge
    from vime_gemma4_bridge.core import mapping_table

    topology = Topology()
    vime_gemma4_bridge.init_model_parallel(topology)
    bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
    model = vime_gemma4_bridge.build_model(bridge, topology, initialize=False)
    errors = []
    layer = model[0].decoder.layers[0]
    scalar = layer._parameters.pop("layer_scalar")
    layer.register_buffer("layer_scalar", scalar.data)  # what the model had before: a persistent buffer
    try:
        bridge.get_conversion_tasks(model)
    except gemma4_bridge.IncompleteMapping as error:
        errors.append(str(error))
    layer._buffers.pop("layer_scalar")
    layer.layer_scalar = scalar
    table = mapping_table.MOE_MAPPING_TABLE
    mapping_table.MOE_MAPPING_TABLE = tuple(row for row in table if row[1] != "decoder.layers.*.mlp.router.scale")
    try:
        bridge.get_conversion_tasks(model)
    except gemma4_bridge.IncompleteMapping as error:
        errors.append(str(error))
    finally:
        mapping_table.MOE_MAPPING_TABLE = table
    bridge.get_conversion_tasks(model)  # and the model as built passes
    classes = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model[0].modules()})
    return {"errors": errors, "classes": classes}


def test_vime_weight_sync_of_a_padded_vocabulary(local_world, tmp_path: Path) -> None:
    """A vocabulary TP2 does not divide (1001): Megatron pads it, vime's stream carries exactly the HF rows."""
    hf = write_tiny_checkpoint(tmp_path / "hf", TinySpec(vocab_size=1001, seed=5))
    dump = tmp_path / "weight_v000001"
    result = local_world(8).run(_vime_sync_job, str(hf), Topology(tp=2, pp=2, ep=4, etp=1), str(dump), 60_000)[0]
    assert result["tensors"] == len(HFCheckpoint(hf).language_model_names())
    check_dump(dump, hf, 60_000)


def test_conversion_tasks_refuse_buffers_and_unmapped_parameters(local_world, hf_vl: Path) -> None:
    result = local_world(8).run(_refusals_job, str(hf_vl))[0]
    assert [c for c in result["classes"] if c.startswith("megatron.bridge.models")] == [], "an upstream model class"
    assert any(c.endswith("core.model.Gemma4TransformerLayer") for c in result["classes"])
    errors = result["errors"]
    assert errors == [
        "persistent buffer 'decoder.layers.0.layer_scalar' is a conversion task; vime's weight sync reads "
        "parameters only (make it a frozen parameter)",
        "Megatron parameter 'decoder.layers.0.mlp.router.scale' has no Gemma 4 mapping; the export would drop it",
    ]


def _diverged_tied_copies_job(hf_checkpoint: str) -> str:
    """At PP2 the last stage holds its own copy of the tied embedding: change it, then export."""
    from megatron.bridge import AutoBridge

    import vime_gemma4_bridge
    from vime_gemma4_bridge.core.tied import TiedEmbeddingMismatch

    topology = Topology(pp=2)
    vime_gemma4_bridge.init_model_parallel(topology)
    bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
    model = vime_gemma4_bridge.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    output_layer = getattr(model[-1], "output_layer", None)
    if output_layer is not None:  # last stage
        with torch.no_grad():
            output_layer.weight[0, 0] += 1.0
    try:
        for _ in bridge.export_hf_weights(model, cpu=True, show_progress=False):
            pass
    except TiedEmbeddingMismatch as error:
        return str(error)
    return "exported"


def test_diverged_tied_embeddings_refuse_export(local_world, hf_vl: Path) -> None:
    messages = local_world(8).run(_diverged_tied_copies_job, str(hf_vl))
    assert len(set(messages)) == 1, "every rank refuses, none waits in a collective"
    assert messages[0].startswith("tied embeddings diverged: the last pipeline stage's output_layer.weight differs")


def _tied_check_peak_job(vocab: int, hidden: int, flip: bool) -> dict:
    """``check_tied_embeddings`` at TP2·PP2 on bf16 shards of ``vocab // 2`` x ``hidden`` (random bit patterns,
    NaNs among them): the peak RSS it adds on this rank, and its refusal when ``flip`` changes one element of
    the last stage's copy on TP rank 0."""
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from vime_gemma4_bridge.cli.bench_jobs import PeakRSS
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.core.tied import TiedEmbeddingMismatch, check_tied_embeddings

    init_model_parallel(Topology(tp=2, pp=2))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    shard = torch.empty(vocab // 2, hidden, dtype=torch.bfloat16)
    shard.view(torch.int16).random_(generator=torch.Generator().manual_seed(tp_rank))
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(shard, requires_grad=False)
    model = torch.nn.Module()
    model.config = SimpleNamespace(share_embeddings_and_output_weights=True)
    if parallel_state.is_pipeline_first_stage():
        model.embedding = torch.nn.Module()
        model.embedding.word_embeddings = holder
    else:
        model.output_layer = holder
        if flip and tp_rank == 0:
            shard.view(torch.int16)[vocab // 4, 7] ^= 1
    message = None
    with PeakRSS() as peak:
        try:
            check_tied_embeddings([model])
        except TiedEmbeddingMismatch as error:
            message = str(error)
    return {"extra": peak.extra, "exact": peak.exact, "message": message}


@pytest.mark.parametrize("flip", [False, True], ids=["tied", "diverged"])
def test_tied_check_adds_at_most_64_mb_at_26b_a4b_widths(local_world, flip: bool) -> None:
    """26B-A4B's embedding (262144 x 2816, bf16) at TP2·PP2: comparing the last stage's copy with stage 0's
    costs each rank at most 64 MB over its weights (issue 35; it cloned the 0.7 GB shard, and built float64
    differences of it where they differed), and a one-bit change is still refused on every rank."""
    results = local_world(4).run(_tied_check_peak_job, 262144, 2816, flip)
    assert all(r["extra"] <= 64 << 20 for r in results), [r["extra"] >> 20 for r in results]
    messages = {r["message"] for r in results}
    if flip:
        assert len(messages) == 1 and next(iter(messages)).startswith("tied embeddings diverged"), messages
    else:
        assert messages == {None}


# ------------------------------------------------------------------------------------------------
# Rollout-ready streams: one expert at a time, block FP8 (fast checks: tests/test_rollout.py)
# ------------------------------------------------------------------------------------------------


def _dump_names(dump: Path) -> list[str]:
    return list(json.loads((dump / "model.safetensors.index.json").read_text())["weight_map"])


def _per_expert_names(hf: Path) -> set[str]:
    from vime_gemma4_bridge.core.hf_layout import STACK_NAME, STACK_PROJECTIONS, per_expert_name

    config = json.loads((hf / "config.json").read_text())["text_config"]
    return {
        per_expert_name(stack, e, projection)
        for stack in HFCheckpoint(hf).language_model_names()
        if (match := STACK_NAME.match(stack))
        for e in range(config["num_experts"])
        for projection in STACK_PROJECTIONS[match["stack"]]
    }


def test_export_live_per_expert_at_the_reported_topology(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """Acceptance: TP2·PP2·EP4·ETP1 on 8 ranks, --buffer-size 300000, --expert-layout per-expert."""
    from vime_gemma4_bridge.core.hf_layout import STACK_NAME

    dump, buffer_size = tmp_path / "dump", 300_000
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    local_world(8).run(export_live_job, str(hf_vl), topology, str(dump), buffer_size, False, "per-expert")
    names = _dump_names(dump)
    assert len(names) == len(set(names)) and not any(STACK_NAME.match(name) for name in names)
    assert {name for name in names if ".experts." in name} == _per_expert_names(hf_vl)
    check_dump(dump, hf_vl, buffer_size)  # verify-update: restacked, bitwise the HF stacks


def _fork_export_live_job(*args: object) -> dict:
    from fork_seams import fork_seams

    with fork_seams():
        return export_live_job(*args)


def test_export_live_fp8_on_the_fork_seams(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """--quantize fp8 at TP2·PP2·EP4·ETP1 on vime's fork: the FP8 layout, every bf16 tensor bitwise."""
    from vime_gemma4_bridge.convert.fp8 import SCALE_SUFFIX, is_quantized

    dump, buffer_size = tmp_path / "dump", 300_000
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    local_world(8).run(_fork_export_live_job, str(hf_vl), topology, str(dump), buffer_size, False, "per-expert", "fp8")
    report = verify_update(hf_vl, dump)  # against the checkpoint quantized the same way: bitwise
    assert report["ok"] and report["fp8"] and report["expert_layout"] == "per-expert", report["problems"]
    pushed, source = HFCheckpoint(dump), HFCheckpoint(hf_vl)
    weights = pushed.load(pushed.names())
    kept = [n for n in source.language_model_names() if not is_quantized(n) and ".experts." not in n]
    assert any("router.proj" in n for n in kept) and any("embed_tokens" in n for n in kept)
    reference = source.load(kept)
    for name in kept:  # router, norms, embeddings, layer_scalar: bitwise
        assert weights[name].dtype == reference[name].dtype and torch.equal(weights[name], reference[name]), name
    for name, tensor in weights.items():
        if is_quantized(name):
            assert tensor.dtype == torch.float8_e4m3fn and weights[name + SCALE_SUFFIX].dtype == torch.float32


def test_vime_switch_streams_one_expert_at_a_time(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """VIME_GEMMA4_EXPERT_LAYOUT=per-expert: vime's own sync, no edit to vime, yields the per-expert layout."""
    dump = tmp_path / "weight_v000001"
    result = local_world(8).run(
        _vime_sync_job, str(hf_vl), Topology(tp=2, pp=2, ep=4, etp=1), str(dump), 60_000, "per-expert"
    )[0]
    assert {name for name in _dump_names(dump) if ".experts." in name} == _per_expert_names(hf_vl)
    assert result["tensors"] == len(_dump_names(dump))
    check_dump(dump, hf_vl, 60_000)


def _newest_fork_call_job(hf_checkpoint: str, topology: Topology) -> dict[str, list[str]]:
    """The export as vime's fork from 04c0fd03 calls the hook: with ``grouped_sources=`` (model_bridge.py L1808)."""
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.live import iter_hf_weights
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.core.bridge import Gemma4LanguageModelBridge

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    sources: dict[str, list[str]] = {}
    hook = Gemma4LanguageModelBridge._accumulate_grouped_export

    def newest_fork(self, *args):  # the fork's call always adds the keyword
        return hook(self, *args, grouped_sources=sources)

    Gemma4LanguageModelBridge._accumulate_grouped_export = newest_fork
    try:
        names = [name for name, *_ in iter_hf_weights(bridge, model, cpu=True, expert_layout="per-expert")]
    finally:
        Gemma4LanguageModelBridge._accumulate_grouped_export = hook
    return {"names": names, **{name: sorted(params) for name, params in sources.items()}}


def test_expert_hook_takes_the_newest_fork_call(local_world, hf_vl: Path) -> None:
    """The hook keeps its per-expert path (it used to fall back to upstream's stacks) and records each expert's task."""
    result = local_world(8).run(_newest_fork_call_job, str(hf_vl), Topology(tp=2, pp=2, ep=4, etp=1))[0]
    experts = {name for name in result["names"] if ".experts." in name}
    assert experts == _per_expert_names(hf_vl)
    assert set(result) - {"names"} == experts  # every name yielded has its source
    name = "model.language_model.layers.0.experts.5.gate_proj.weight"
    assert result[name] == ["decoder.layers.0.mlp.experts.linear_fc1.weight1"]  # EP4 of 16: local expert 1


def _sourced_export_job(hf_checkpoint: str, topology: Topology, expert_layout: str) -> dict:
    """``export_hf_weights`` on upstream's #6074 shape (tests/fork_seams.sourced_export), names asked and not.

    ``expert_layout``: the actor's ``VIME_GEMMA4_EXPERT_LAYOUT``, as vime's sync would run under it.
    """
    from fork_seams import sourced_export
    from megatron.bridge import AutoBridge

    import vime_gemma4_bridge  # noqa: F401  (the TE guard, then Megatron-Bridge)
    from vime_gemma4_bridge.compat import seams
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.live import iter_hf_weights
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV
    from vime_gemma4_bridge.runtime.world import environment

    with sourced_export(), environment({EXPERT_LAYOUT_ENV: expert_layout}):
        assert seams.export_tuple() == seams.SOURCED
        init_model_parallel(topology)
        bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
        model = convert.build_model(bridge, topology)
        bridge.load_hf_weights(model)
        plain = [(type(item).__name__, len(item)) for item in bridge.export_hf_weights(model, cpu=True)]
        sourced = [
            (type(item).__name__, item.param_name, item.weight, item.megatron_param_names, item.megatron_param_name)
            for item in bridge.export_hf_weights(model, cpu=True, with_megatron_names=True)
        ]
        ours = [(h, m) for h, _, m in iter_hf_weights(bridge, model, cpu=True, expert_layout=expert_layout)]
    return {"plain": plain, "sourced": sourced, "ours": ours}


@pytest.mark.parametrize("expert_layout", ["stacked", "per-expert"])
def test_sourced_export_tuple_names_each_weights_megatron_sources(local_world, hf_vl: Path, expert_layout: str) -> None:
    """Upstream's ``HFSourcedWeightTuple`` (#6074; the fork @04c0fd03) at TP2·PP2·EP4·ETP1: opt-in, bitwise, sourced.

    Off, the export stays two fields; on, every item carries the local names of the Megatron parameters
    behind it: one for a converted weight, every contributing expert task of this rank for a stack (EP4
    of 16 experts: 4), the one expert task for a per-expert tensor. The plugin's own live stream keeps
    its three fields on this build.
    """
    result = local_world(8).run(_sourced_export_job, str(hf_vl), Topology(tp=2, pp=2, ep=4, etp=1), expert_layout)[0]
    assert result["plain"] and set(result["plain"]) == {("HFWeightTuple", 2)}
    source = HFCheckpoint(hf_vl)
    reference = source.load(source.language_model_names())
    sourced = {name: rest for kind, name, *rest in result["sourced"] if kind == "HFSourcedWeightTuple"}
    assert len(sourced) == len(result["sourced"]) == len(result["plain"]), "every item sourced, no name twice"
    experts = {name for name in sourced if ".experts." in name}
    if expert_layout == "per-expert":
        assert experts == _per_expert_names(hf_vl)
        assert set(sourced) - experts == set(reference) - {n for n in reference if ".experts." in n}
    else:
        assert set(sourced) == set(reference)
        for name, tensor in reference.items():
            assert torch.equal(sourced[name][0], tensor) and sourced[name][0].dtype == tensor.dtype, name
    for name, (_, names, single) in sourced.items():
        assert isinstance(names, tuple) and names, name
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            fc = "linear_fc1" if name.endswith("gate_up_proj") else "linear_fc2"
            layer = name.split(".layers.")[1].split(".")[0]
            assert names == tuple(f"decoder.layers.{layer}.mlp.experts.{fc}.weight{k}" for k in range(4)), names
            assert single is None
        else:
            assert len(names) == 1 and single == names[0], (name, names)
    assert sourced["model.language_model.embed_tokens.weight"][1] == ("embedding.word_embeddings.weight",)
    if expert_layout == "per-expert":
        assert sourced["model.language_model.layers.0.experts.5.gate_proj.weight"][1] == (
            "decoder.layers.0.mlp.experts.linear_fc1.weight1",  # EP4 of 16: expert 5 is rank 1's local 1
        )
    assert [name for name, _ in result["ours"]] == list(sourced)


def _fp8_rollout_checkpoint(hf: Path, out: Path) -> Path:
    """``hf`` in block FP8 as ``export --quantize fp8`` writes it: the checkpoint vLLM serves FP8 rollouts from.

    Per-expert FP8 pairs (``NAME`` e4m3, ``NAME_scale_inv``), the towers and norms as they are, and the
    config's ``quantization_config`` (convert/fp8.py).
    """
    from vime_gemma4_bridge.convert.fp8 import config_fields, quantize_stream
    from vime_gemma4_bridge.core.hf_layout import STACK_NAME, split_expert

    source = HFCheckpoint(hf)
    language_model = []
    for name, tensor in source.load(source.language_model_names()).items():
        if STACK_NAME.match(name):
            language_model += [(n, t, "") for e, piece in enumerate(tensor) for n, t in split_expert(name, e, piece)]
        else:
            language_model.append((name, tensor, ""))
    tensors = {name: tensor.contiguous() for name, tensor, _ in quantize_stream(language_model)}
    tensors.update(source.load([n for n in source.names() if n not in set(source.language_model_names())]))
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for side in hf.iterdir():
        if side.is_file() and not side.name.endswith(".safetensors") and side.name != "config.json":
            (out / side.name).write_bytes(side.read_bytes())
    config = json.loads((hf / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_fields(source)}, indent=2))
    return out


def test_vime_fp8_rollout_sync_is_the_rollout_checkpoint(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """vime's FP8 rollouts in bridge mode (issue 34, item 1), through vime's processors, TP2·PP2·EP4·ETP1, fork double.

    vime opens the bridge on its FP8 ``--hf-checkpoint`` and hands each export item to
    ``postprocess_hf_param`` and ``quantize_params`` (tests/vime_flow.py), whose FP8 quantizer never sees
    a name it acts on: the bridge itself sends every weight in the format that checkpoint stores. The
    dump is the rollout checkpoint's language model, byte for byte (FP8 weights, scales, bf16 rest).
    """
    rollout = _fp8_rollout_checkpoint(hf_vl, tmp_path / "fp8")
    dump = tmp_path / "weight_v000001"
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    result = local_world(8).run(_vime_sync_job, str(hf_vl), topology, str(dump), 60_000, None, str(rollout))[0]
    served, pushed = HFCheckpoint(rollout), HFCheckpoint(dump)
    assert result["tensors"] == len(pushed.names())
    assert sorted(pushed.names()) == sorted(served.language_model_names())
    expected, got = served.load(served.language_model_names()), pushed.load(pushed.names())
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert any(t.dtype == torch.float8_e4m3fn for t in got.values())


def _fp8_rollout_release_job(hf_checkpoint: str, rollout_checkpoint: str, topology: Topology) -> dict:
    """The release's two-field export on a bridge opened on the FP8 rollout checkpoint; and a save's stream."""
    from megatron.bridge import AutoBridge

    import vime_gemma4_bridge
    from vime_gemma4_bridge.compat import seams

    vime_gemma4_bridge.init_model_parallel(topology)
    bridge = AutoBridge.from_hf_pretrained(rollout_checkpoint)
    model = vime_gemma4_bridge.build_model(bridge, topology)
    AutoBridge.from_hf_pretrained(hf_checkpoint).load_hf_weights(model)
    live = [  # as bytes: float8 tensors do not travel back from a rank (torch's pickling of their storage)
        (type(item).__name__, item[0], str(item[1].dtype), item[1].contiguous().view(torch.uint8))
        for item in bridge.export_hf_weights(model, cpu=True)
    ]
    saved = seams.model_bridge_of(bridge).in_checkpoint_layout(bridge.export_hf_weights(model, cpu=True))
    return {"live": live, "saved": [(name, str(tensor.dtype)) for name, tensor in saved]}


def test_fp8_rollout_on_the_release_and_only_for_the_live_sync(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """The release's export is the rollout checkpoint's FP8 too; a save of the same bridge keeps bf16 stacks."""
    rollout = _fp8_rollout_checkpoint(hf_vl, tmp_path / "fp8")
    result = local_world(8).run(_fp8_rollout_release_job, str(hf_vl), str(rollout), Topology(ep=2))[0]
    served = HFCheckpoint(rollout)
    expected = served.load(served.language_model_names())
    assert {kind for kind, *_ in result["live"]} == {"HFWeightTuple"}
    assert sorted(name for _, name, *_ in result["live"]) == sorted(expected)
    for _, name, dtype, data in result["live"]:
        assert dtype == str(expected[name].dtype) and torch.equal(data, expected[name].view(torch.uint8)), name
    source = HFCheckpoint(hf_vl)
    assert sorted(result["saved"]) == sorted(
        (n, str(t.dtype)) for n, t in source.load(source.language_model_names()).items()
    )


def _grouped_names_job(hf_checkpoint: str, topology: Topology) -> dict[str, list]:
    """The fork double @d063066b's own stream (Megatron-Bridge's class method) and the plugin's export: third fields."""
    from fork_seams import fork_seams
    from megatron.bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    import vime_gemma4_bridge
    from vime_gemma4_bridge.compat import seams

    with fork_seams("d063066b"):
        vime_gemma4_bridge.init_model_parallel(topology)
        bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
        model = vime_gemma4_bridge.build_model(bridge, topology)
        bridge.load_hf_weights(model)
        fork = MegatronModelBridge.stream_weights_megatron_to_hf(
            seams.model_bridge_of(bridge), model, bridge.hf_pretrained
        )
        return {
            "fork": [(item[0], item[2]) for item in fork],
            "plugin": [(item[0], item[2]) for item in bridge.export_hf_weights(model, cpu=True)],
        }


def test_vime_sync_on_the_fork_at_d063066b(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """The fork's ``model_bridge.py`` @d063066b yields grouped experts with ``megatron_param_name=None``.

    Its grouped branch builds ``HFWeightTuple(hf_name, tensor)`` with two arguments; vime's FP8 quantizer
    ``re.match``es that ``None`` (``TypeError``). The plugin's export fills in the expert task that completed
    the stack, as 1187a604 does (UPSTREAM 51), so vime's bf16 sync and its FP8 rollouts both run there.
    PP2·EP2 on the 8-rank world (two replicas): gathered experts across stages, at a fraction of the reported
    topology's cost (that one runs on the fork at 1187a604: ``test_vime_weight_sync_contract``).
    """
    topology = Topology(pp=2, ep=2)
    names = local_world(8).run(_grouped_names_job, str(hf_vl), topology)[0]
    stacks = {
        n
        for n in HFCheckpoint(hf_vl).language_model_names()
        if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    assert {name for name, megatron in names["fork"] if megatron is None} == stacks
    plugin = dict(names["plugin"])
    assert all(plugin.values()) and plugin.keys() == dict(names["fork"]).keys()
    assert (
        plugin["model.language_model.layers.0.experts.down_proj"] == "decoder.layers.0.mlp.experts.linear_fc2.weight7"
    )
    dump = tmp_path / "bf16"
    result = local_world(8).run(_vime_sync_job, str(hf_vl), topology, str(dump), 60_000, None, None, "d063066b")[0]
    assert result["unnamed"] == []
    check_dump(dump, hf_vl, 60_000)
    rollout = _fp8_rollout_checkpoint(hf_vl, tmp_path / "fp8")
    fp8 = tmp_path / "fp8-sync"
    result = local_world(8).run(_vime_sync_job, str(hf_vl), topology, str(fp8), 60_000, None, str(rollout), "d063066b")
    served, pushed = HFCheckpoint(rollout), HFCheckpoint(fp8)
    assert result[0]["unnamed"] == [] and sorted(pushed.names()) == sorted(served.language_model_names())
