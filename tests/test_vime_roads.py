"""vime's roads through Megatron-Bridge, each driven as vime drives it, on the release and the fork double.

Each road is reproduced in our own words from the vime file and revision it cites (docs/VIME.md
lists them with their flags); the fork's behaviours are ``tests/fork_seams.py``'s (docs/SEAMS.md).
Tests are ordered by world size so each world is started once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from fork_seams import fork_seams

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

BUILDS = ["release", "fork"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("roads")
    return {
        "vl": write_tiny_checkpoint(root / "vl", TinySpec(seed=5)),
        "causal": write_tiny_checkpoint(root / "causal", TinySpec(causal_lm=True, seed=6)),
    }


def _build(name: str) -> contextlib.AbstractContextManager:
    return fork_seams() if name == "fork" else contextlib.nullcontext()


def assert_same_checkpoint(source: Path, written: Path) -> None:
    """Every source tensor, bitwise, with its name, dtype and shape; nothing missing, nothing extra."""
    a, b = HFCheckpoint(source), HFCheckpoint(written)
    assert sorted(a.names()) == sorted(b.names())
    left, right = a.load(a.names()), b.load(b.names())
    different = [n for n in left if left[n].dtype != right[n].dtype or not torch.equal(left[n], right[n])]
    assert different == [], different
    assert (written / "config.json").is_file() and (written / "tokenizer_config.json").is_file()


# ------------------------------------------------------------------------------------------------
# The fork double, pinned to the fork's files (tests/fork_seams.py cites each), where the plugin's roads meet it
# ------------------------------------------------------------------------------------------------


def test_fork_double_detects_parallelism_by_exact_class_name() -> None:
    """The fork's rule sends a differently named fused norm + linear to "Norm in the name -> replicated"."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    import vime_gemma4_bridge  # noqa: F401  (the TE guard)

    class LayerNormColumnParallelLinear(torch.nn.Module):  # the CPU twin's class name, nothing else
        pass

    mapping = AutoMapping("decoder.layers.0.self_attention.linear_qkv.weight", "model.layers.0.qkv.weight")
    assert mapping._detect_parallelism_type(LayerNormColumnParallelLinear()) == "column"
    with fork_seams():
        assert mapping._detect_parallelism_type(LayerNormColumnParallelLinear()) == "replicated"
    assert mapping._detect_parallelism_type(LayerNormColumnParallelLinear()) == "column"


def test_plugin_rows_state_their_parallelism() -> None:
    """No plugin-owned mapping asks a build to guess: each row (and each composite's TP delegate) is stated."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping

    import vime_gemma4_bridge  # noqa: F401
    from vime_gemma4_bridge.compat.mappings import StatedAutoMapping
    from vime_gemma4_bridge.core.mapping_table import MOE_MAPPING_TABLE, build_registry

    ours = {megatron_name for _, megatron_name, _ in MOE_MAPPING_TABLE}  # not the registry's own aliases
    for mapping in (m for m in build_registry(MOE_MAPPING_TABLE, "model.").mappings if m.megatron_param in ours):
        delegates = [mapping, *(v for v in vars(mapping).values() if isinstance(v, AutoMapping))]
        for delegate in delegates:
            if isinstance(delegate, AutoMapping) and not isinstance(delegate, StatedAutoMapping | GatedMLPMapping):
                stated = type(delegate)._detect_parallelism_type is not AutoMapping._detect_parallelism_type
                assert stated, f"{mapping.megatron_param}: {type(delegate).__name__} would detect its parallelism"


# ------------------------------------------------------------------------------------------------
# vime's HF save (hf_checkpoint_saver.save_hf_model_bridge_to_path @3c06ae51): save_hf_pretrained
# ------------------------------------------------------------------------------------------------


def _save_hf_job(hf_checkpoint: str, topology: Topology, build: str, out: str) -> list[str]:
    """vime's save: ``AutoBridge.from_hf_pretrained(..., trust_remote_code=True)`` with vime's HF-config
    patch, then on every rank ``bridge.save_hf_pretrained(model, path)`` under ``patch_megatron_model``
    and a barrier (the load before it as ``checkpoint._load_checkpoint_hf`` does it, under the same patch).
    Returns the live stream's names after it."""
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from vime_flow import patch_auto_bridge_hf_config, patch_megatron_model

    import vime_gemma4_bridge

    with _build(build):
        vime_gemma4_bridge.init_model_parallel(topology)
        bridge = patch_auto_bridge_hf_config(AutoBridge.from_hf_pretrained(hf_checkpoint, trust_remote_code=True))
        model = vime_gemma4_bridge.build_model(bridge, topology)
        with patch_megatron_model(model):
            bridge.load_hf_weights(model)
        with patch_megatron_model(model):
            bridge.save_hf_pretrained(model, out)
        dist.barrier()
        return sorted(name for name, *_ in bridge.export_hf_weights(model, cpu=True, show_progress=False))


def assert_saved(results: list, source: Path, written: Path) -> None:
    """The save is the source, bitwise; the live stream after it is still the language model only."""
    assert_same_checkpoint(source, written)
    language_model = sorted(HFCheckpoint(source).language_model_names())
    assert all(names == language_model for names in results)


@pytest.mark.parametrize("checkpoint", ["vl", "causal"])
@pytest.mark.parametrize("build", BUILDS)
def test_save_hf_pretrained_one_rank(local_world, checkpoints, tmp_path: Path, build: str, checkpoint: str) -> None:
    out = tmp_path / "saved"
    results = local_world(1).run(_save_hf_job, str(checkpoints[checkpoint]), Topology(), build, str(out))
    assert_saved(results, checkpoints[checkpoint], out)


def _loaded_at_one_rank(hf_checkpoint: str) -> tuple:
    """The checkpoint's bridge and its model at the default topology, loaded (in the caller's build)."""
    from megatron.bridge import AutoBridge

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(Topology())
    bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
    model = convert.build_model(bridge, Topology())
    bridge.load_hf_weights(model)
    return bridge, model


def _two_field_save_job(hf_checkpoint: str, out: str, case: str) -> str:
    """The fork's ``save_hf_weights`` on a config-only bridge (``hf_pretrained`` a ``PretrainedConfig``), or
    vime's ``save_hf_pretrained`` of a model modelopt calls quantized (a module of class ``TensorQuantizer``
    among its modules: modelopt's ``is_quantized``)."""
    with fork_seams():
        bridge, model = _loaded_at_one_rank(hf_checkpoint)
        if case == "config-only":
            bridge.hf_pretrained = bridge.hf_pretrained.config
        else:
            model[0].add_module("stand_in_quantizer", type("TensorQuantizer", (torch.nn.Module,), {})())
        try:
            bridge.save_hf_pretrained(model, out) if case == "quantized" else bridge.save_hf_weights(model, out)
        except ValueError as error:
            return str(error)
        return "saved"


@pytest.mark.parametrize("case", ["config-only", "quantized"])
def test_fork_double_saves_that_unpack_two_fields(local_world, checkpoints, tmp_path: Path, case: str) -> None:
    """``auto_bridge.py`` @d063066b ``save_hf_weights`` unpacks ``for name, tensor in ...`` twice: its
    config-only branch (``{name: tensor.contiguous().cpu() ...}``) and, on a modelopt-quantized model, its
    ``_filter_quant``. Either meets the fork's own three-field tuples, for any model (one rank: the others
    would wait for it); nothing is written. Neither is a vime road: vime's saves open the bridge on the
    checkpoint, and vime does not quantize the actor with modelopt."""
    out = tmp_path / "out"
    results = local_world(1).run(_two_field_save_job, str(checkpoints["vl"]), str(out), case)
    assert results == ["too many values to unpack (expected 2)"], results
    assert not list(out.glob("*.safetensors"))


def _tied_alias_job(hf_checkpoint: str) -> dict[str, list[str]]:
    """The fork's export names, from the source and config-only, and whether each alias is the embedding."""
    names: dict[str, list[str]] = {}
    with fork_seams():
        bridge, model = _loaded_at_one_rank(hf_checkpoint)
        for source in ("checkpoint", "config-only"):
            if source == "config-only":
                bridge.hf_pretrained = bridge.hf_pretrained.config
            items = {name: tensor for name, tensor, _ in bridge.export_hf_weights(model, show_progress=False)}
            names[source] = list(items)
            if "lm_head.weight" in items:
                assert torch.equal(items["lm_head.weight"], items["model.embed_tokens.weight"])
    return names


@pytest.mark.parametrize("checkpoint", ["vl", "causal"])
def test_fork_double_aliases_lm_head_by_literal_name_config_only(local_world, checkpoints, checkpoint) -> None:
    """``model_bridge.py`` @1187a604 / @d063066b, tied: after exactly ``model.embed_tokens.weight`` an
    ``lm_head.weight`` copy when the source holds one (no published Gemma 4 does), always when
    ``hf_pretrained`` is a ``PretrainedConfig`` ("Always emit lm_head.weight for config-only"). So a
    config-only export of the CausalLM layout carries the embedding twice; the VL layout's
    ``model.language_model.embed_tokens.weight`` never matches the literal name. One rank."""
    [names] = local_world(1).run(_tied_alias_job, str(checkpoints[checkpoint]))
    language_model = sorted(HFCheckpoint(checkpoints[checkpoint]).language_model_names())
    assert sorted(names["checkpoint"]) == language_model
    if checkpoint == "vl":
        assert names["config-only"] == names["checkpoint"]
        return
    embedding = names["checkpoint"].index("model.embed_tokens.weight")
    expected = names["checkpoint"][: embedding + 1] + ["lm_head.weight"] + names["checkpoint"][embedding + 1 :]
    assert names["config-only"] == expected


def _per_expert_actor_job(job: str, hf_checkpoint: str, topology: Topology, build: str, out: str) -> object:
    """``job`` (vime's save, or the round trip) with vime's live-sync switch in the actor's environment."""
    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV, PER_EXPERT
    from vime_gemma4_bridge.runtime.world import environment

    with environment({EXPERT_LAYOUT_ENV: PER_EXPERT}):
        if job == "save":
            return _save_hf_job(hf_checkpoint, topology, build, out)
        with _build(build):
            return roundtrip_job(hf_checkpoint, topology, None, False, 10**9)


@pytest.mark.parametrize("build", BUILDS)
def test_expert_layout_switch_leaves_saves_and_round_trips_stacked(local_world, checkpoints, tmp_path, build) -> None:
    """``VIME_GEMMA4_EXPERT_LAYOUT=per-expert`` is the live sync's switch alone: with it set, vime's
    ``save_hf_pretrained`` writes the checkpoint's own (stacked) layout, bitwise, while the live export
    right after it in the same job still streams per expert; the round trip is bitwise. EP2 (the
    gathered path) on 2 ranks."""
    from vime_gemma4_bridge.core.hf_layout import STACK_NAME, stack_of

    hf, out, topology = checkpoints["vl"], tmp_path / "saved", Topology(ep=2)
    results = local_world(2).run(_per_expert_actor_job, "save", str(hf), topology, build, str(out))
    assert_same_checkpoint(hf, out)
    stacks = {name for name in HFCheckpoint(hf).language_model_names() if STACK_NAME.match(name)}
    for live in results:
        assert stacks and not stacks & set(live), "the live sync must still follow the switch"
        assert {stack_of(name)[0] for name in live if stack_of(name)} == stacks
    result = local_world(2).run(_per_expert_actor_job, "roundtrip", str(hf), topology, build, "")[0]
    assert result["identical"], result["report"]


# ------------------------------------------------------------------------------------------------
# The fork's conversion code at TP >= 2 and VPP (2 ranks)
# ------------------------------------------------------------------------------------------------


def _fork_roundtrip_job(hf_checkpoint: str, topology: Topology) -> dict:
    with fork_seams():
        return roundtrip_job(hf_checkpoint, topology, None, False, 10**9)


def _fork_tied_broadcast_job(hf_checkpoint: str) -> str:
    """The fork's own ``_broadcast_shared_embeddings`` at PP2·VPP2 fails; the plugin's bridge owns the step."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.core import parallel_state

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    with fork_seams():
        topology = Topology(pp=2, vpp=2)
        init_model_parallel(topology)
        bridge = convert.open_bridge(hf_checkpoint)
        model = convert.build_model(bridge, topology, initialize=False)
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return "first stage"  # it would wait in the broadcast for the last stage, which raised
        try:
            MegatronModelBridge._broadcast_shared_embeddings(bridge._model_bridge, model)
        except AssertionError as error:
            return str(error)
        return "no error"


@pytest.mark.parametrize("topology", [Topology(tp=2, ep=2), Topology(pp=2, vpp=2), Topology(tp=2)], ids=str)
def test_fork_roundtrip_two_ranks(local_world, checkpoints, topology: Topology) -> None:
    result = local_world(2).run(_fork_roundtrip_job, str(checkpoints["vl"]), topology)[0]
    assert result["identical"], result["report"]
    assert (
        result["total"]["count"]
        == result["total"]["equal"]
        == len(HFCheckpoint(checkpoints["vl"]).language_model_names())
    )


def _ep1_gather_job() -> dict[str, list[int]]:
    """``gather_from_ep_ranks`` at EP1 on a ``[1, 3]`` expert weight: the release's, then the fork double's."""
    from types import SimpleNamespace

    from megatron.bridge.models.conversion.param_mapping import ColumnParallelMapping

    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(Topology(tp=2))
    module = SimpleNamespace(config=SimpleNamespace(num_moe_experts=4))
    shapes = {}
    for build in ("release", "fork"):
        with _build(build):
            mapping = ColumnParallelMapping("decoder.layers.0.mlp.experts.linear_fc1.weight0", "m.experts.0.w")
            (weight,) = mapping.gather_from_ep_ranks(torch.ones(1, 3), module, "m.experts.0.w").values()
            shapes[build] = list(weight.shape)
    return shapes


def test_fork_double_gathers_experts_at_ep1_as_param_mapping_py(local_world) -> None:
    """The fork's ``gather_from_ep_ranks`` (``param_mapping.py`` @d063066b) has no EP=1 return and ``.squeeze()``s:
    a size-1 dimension of an expert weight is lost there, kept by the release (its first statement returns)."""
    assert local_world(2).run(_ep1_gather_job) == [{"release": [1, 3], "fork": [3]}] * 2


def test_fork_double_tied_broadcast_fails_at_vpp(local_world, checkpoints) -> None:
    results = local_world(2).run(_fork_tied_broadcast_job, str(checkpoints["vl"]))
    assert results == ["first stage", "Output layer not found"], results


# ------------------------------------------------------------------------------------------------
# Megatron-LM's --load / --ref-load (megatron.training.checkpointing.load_checkpoint, strict=True)
# ------------------------------------------------------------------------------------------------


def _megatron_lm_load_job(hf_checkpoint: str, load_dir: str, topology: Topology) -> dict:
    """Megatron-LM's own loader on a freshly built (random) model; then the export must be HF1, bitwise."""
    import sys
    from unittest import mock

    from megatron.training import arguments, checkpointing, global_vars
    from megatron.training.checkpointing import load_checkpoint

    from vime_gemma4_bridge.compat.cuda import cpu_checkpointing
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology)  # random weights: the load must replace every one
    argv, sys.argv = sys.argv, ["megatron-lm", "--load", load_dir, "--ckpt-format", "torch_dist"]
    try:
        args = arguments.parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    args.no_load_optim = args.no_load_rng = True
    args.tensor_model_parallel_size, args.pipeline_model_parallel_size = topology.tp, topology.pp
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = topology.ep, topology.etp
    args.virtual_pipeline_model_parallel_size = topology.vpp
    global_vars.set_args(args)
    calls: list[tuple[bool, str]] = []
    for chunk in model:
        original = chunk.load_state_dict

        def spy(state_dict, strict=True, *rest, _original=original, **kwargs):
            try:
                result = _original(state_dict, strict, *rest, **kwargs)
            except Exception as error:
                calls.append((strict, f"{type(error).__name__}: {str(error)[:300]}"))
                raise
            calls.append((strict, "ok"))
            return result

        chunk.load_state_dict = spy
    release_read_metadata = checkpointing.read_metadata

    def read_metadata_on_host(tracker_filename):
        # Megatron-LM agrees on the iteration with an all-reduce of a tensor made on device="cuda";
        # the same agreement over gloo (the rest of the loader is Megatron-LM's, unchanged).
        with mock.patch.object(torch.distributed, "is_initialized", return_value=False):
            iteration, release = release_read_metadata(tracker_filename)
        agreed = torch.tensor([iteration])
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        return int(agreed.item()), release

    with mock.patch.object(checkpointing, "read_metadata", read_metadata_on_host), cpu_checkpointing():
        iteration = load_checkpoint(model, None, None, strict=True)
    exported = {name: tensor.clone() for name, tensor in convert.export_to_rank0(bridge, model)}
    result = {"iteration": iteration, "calls": calls}
    if convert.is_rank0():
        source = HFCheckpoint(hf_checkpoint)
        reference = source.load(source.language_model_names())
        result["different"] = sorted(
            name for name in reference if name not in exported or not torch.equal(reference[name], exported[name])
        )
        result["extra"] = sorted(set(exported) - set(reference))
    return result


@pytest.mark.parametrize("topology", [Topology(ep=2), Topology(pp=2, vpp=2)], ids=str)
def test_megatron_lm_loads_an_import_strictly(local_world, checkpoints, tmp_path: Path, topology: Topology) -> None:
    from vime_gemma4_bridge.convert.torch_dist_jobs import import_job

    world = local_world(2)
    save = tmp_path / "torch_dist"
    world.run(import_job, str(checkpoints["vl"]), str(save), str(tmp_path / ".partial"), topology)
    results = world.run(_megatron_lm_load_job, str(checkpoints["vl"]), str(save), topology)
    for result in results:
        assert result["calls"] and all(call == (True, "ok") for call in result["calls"]), result["calls"]
    assert results[0]["different"] == [] and results[0]["extra"] == []


# ------------------------------------------------------------------------------------------------
# vime's HF load into wrapped chunks (checkpoint._load_checkpoint_hf: load_hf_weights(ddp_model)) and its
# sparse-seed iterator (hf_weight_iterator_sparse_bridge.py @9413317f: export without tasks, two fields)
# ------------------------------------------------------------------------------------------------


def _wrapped_load_sparse_export_job(hf_checkpoint: str, topology: Topology) -> dict | None:
    from megatron.bridge import AutoBridge
    from megatron.core.transformer.module import Float16Module

    import vime_gemma4_bridge
    from vime_gemma4_bridge.convert.model import is_rank0

    with fork_seams():
        vime_gemma4_bridge.init_model_parallel(topology)
        bridge = AutoBridge.from_hf_pretrained(hf_checkpoint, trust_remote_code=True)
        model = vime_gemma4_bridge.build_model(bridge, topology)  # random weights
        wrapped = [Float16Module(chunk.config, chunk) for chunk in model]  # what training hands over
        bridge.load_hf_weights(wrapped)
        exported = {}
        for item in bridge.export_hf_weights(wrapped, cpu=False, show_progress=False):
            name, tensor = item[:2]
            assert name not in exported, f"{name} twice"
            exported[name] = tensor.detach().cpu().clone() if is_rank0() else None
    if not is_rank0():
        return None
    source = HFCheckpoint(hf_checkpoint)
    reference = source.load(source.language_model_names())
    return {
        "different": sorted(n for n in reference if n not in exported or not torch.equal(reference[n], exported[n])),
        "extra": sorted(set(exported) - set(reference)),
    }


def test_wrapped_load_and_sparse_export_pp2_vpp2(local_world, checkpoints) -> None:
    result = local_world(2).run(_wrapped_load_sparse_export_job, str(checkpoints["vl"]), Topology(pp=2, vpp=2))[0]
    assert result == {"different": [], "extra": []}


# ------------------------------------------------------------------------------------------------
# save_hf_pretrained at TP2·PP2·EP2 (4 ranks)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", ["vl", "causal"])
@pytest.mark.parametrize("build", BUILDS)
def test_save_hf_pretrained_tp2_pp2_ep2(local_world, checkpoints, tmp_path: Path, build: str, checkpoint: str) -> None:
    out = tmp_path / "saved"
    topology = Topology(tp=2, pp=2, ep=2)
    results = local_world(4).run(_save_hf_job, str(checkpoints[checkpoint]), topology, build, str(out))
    assert_saved(results, checkpoints[checkpoint], out)


# ------------------------------------------------------------------------------------------------
# 8 ranks: the reported topology under the fork, and the sleeping colocated actor
# ------------------------------------------------------------------------------------------------


def test_fork_roundtrip_reported_topology(local_world, checkpoints) -> None:
    result = local_world(8).run(_fork_roundtrip_job, str(checkpoints["vl"]), Topology(tp=2, pp=2, ep=4))[0]
    assert result["identical"], result["report"]


def test_wrapped_load_and_sparse_export_reported_topology(local_world, checkpoints) -> None:
    topology = Topology(tp=2, pp=2, ep=4)
    result = local_world(8).run(_wrapped_load_sparse_export_job, str(checkpoints["vl"]), topology)[0]
    assert result == {"different": [], "extra": []}


def _sleeping_sync_job(hf_checkpoint: str, topology: Topology, dump: str, buffer_size: int) -> dict | None:
    """vime's colocated sync: the weight dict holds CPU backups; the live parameters cannot be read."""
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from vime_flow import LazyTasks, chunks, weight_dict, write_disk_update

    import vime_gemma4_bridge

    with fork_seams():
        vime_gemma4_bridge.init_model_parallel(topology)
        bridge = AutoBridge.from_hf_pretrained(hf_checkpoint, trust_remote_code=True)
        model = vime_gemma4_bridge.build_model(bridge, topology)
        bridge.load_hf_weights(model)
        backups = {name: tensor.detach().clone() for name, tensor in weight_dict(model).items()}
        tasks = bridge.get_conversion_tasks(model)
        for chunk in model:  # the actor sleeps: its memory is paused
            for param in chunk.parameters():
                param.data = torch.empty(0, dtype=param.dtype)

        import dataclasses

        def replace(task):
            if task is None or task.param_weight is None:
                return task
            return dataclasses.replace(task, param_weight=backups[f"vp_stages.{task.vp_stage}.{task.param_name}"])

        def named():
            for hf_name, weight, _ in bridge.export_hf_weights(
                model, cpu=False, conversion_tasks=LazyTasks(replace, tasks)
            ):
                yield hf_name, weight

        stream = chunks(named(), buffer_size)
        if dist.get_rank() != 0:
            for _ in stream:
                pass
            return None
        return {"tensors": write_disk_update(stream, hf_checkpoint, Path(dump))}


def test_sleeping_actor_sync_is_bitwise(local_world, checkpoints, tmp_path: Path) -> None:
    from test_live import check_dump

    dump = tmp_path / "weight_v000002"
    result = local_world(8).run(
        _sleeping_sync_job, str(checkpoints["vl"]), Topology(tp=2, pp=2, ep=4), str(dump), 60_000
    )
    assert result[0]["tensors"] == len(HFCheckpoint(checkpoints["vl"]).language_model_names())
    check_dump(dump, checkpoints["vl"], 60_000)
