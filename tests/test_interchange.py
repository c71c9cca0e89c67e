"""Checkpoints interchange: one torch_dist key set on every host, what we wrote before still reads, and a
checkpoint Megatron-LM's own training saved (one Adam step, three optimizer forms) exports the trained
weights bitwise and is checked against ``--hf-checkpoint`` by its ``args`` before any rank starts.

The TE side is derived on this TE-less machine without building a TE module: megatron-core's own
``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` runs with its ``TESpecProvider``
(megatron/core/extensions/transformer_engine_spec_provider.py, 0.19.2), which only names TE classes,
and the TE layer specs' ``sharded_state_dict_keys_map`` is read off them. Parameter names are the same
on both hosts by construction (core/cpu_modules.py twins; docs/MODEL.md), so the TE model's torch_dist
keys are the CPU model's with the TE maps in place of the local spec's. ``_extra_state`` items agree
too: every TE linear (``TransformerEngineBaseModule``) and its CPU twin or megatron-core's local linear
write one; ``TEDotProductAttention.sharded_state_dict`` writes none for vanilla softmax
(extensions/transformer_engine.py, ``softmax_type != "learnable"``), nor does the local attention;
the norms are ``Gemma4RMSNorm`` on both hosts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from test_torch_dist import assert_same_checkpoint

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.convert.torch_dist_jobs import export_job, import_job
from vime_gemma4_bridge.io.torch_dist import ITERATION_DIR
from vime_gemma4_bridge.io.torch_dist_layout import FORMER_KEYS, foreign_layout
from vime_gemma4_bridge.testing.spec import DENSE_SHAPES, TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

PRE_NORM_NOW, PRE_NORM_BEFORE = "decoder.layers.pre_mlp_layernorm.weight", next(iter(FORMER_KEYS))


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interchange")
    members = {"26b-a4b": TinySpec(), **DENSE_SHAPES}
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in members.items()}


@contextlib.contextmanager
def _te_spec_provider() -> Iterator[None]:
    """megatron-core's ``TESpecProvider`` and ``TENorm`` where TE does not import (gpt_layer_specs sets them to
    ``None``); the
    TE classes megatron-core stands in with ``MagicMock`` instances become named classes, as with TE (specs
    are deep-copied, and a mock is not), and the TE version is one that takes ``TENorm`` for q/k norms (1.9+)."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    with contextlib.ExitStack() as stack:
        for name, value in vars(provider).copy().items():
            if isinstance(value, mock.MagicMock):
                stack.enter_context(mock.patch.object(provider, name, type(name, (), {})))
        stack.enter_context(mock.patch.object(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider))
        stack.enter_context(mock.patch.object(gpt_layer_specs, "TENorm", provider.TENorm))
        stack.enter_context(mock.patch.object(provider, "is_te_min_version", lambda version: True))  # TE >= 1.9
        yield


def _keys(model: list) -> set[str]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from vime_gemma4_bridge.io.torch_dist_layout import sharded_state_dict

    return {item.key for item in nested_values(sharded_state_dict(model)[0]) if hasattr(item, "key")}


def _keys_on_both_hosts(hf_checkpoint: str) -> dict[str, Any]:
    """This CPU model's torch_dist keys, and the same model's keys under the TE spec's keys maps."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.utils import get_model_config

    from vime_gemma4_bridge.convert.model import build_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(Topology(), keep_if_same=True)
    model = build_model(open_bridge(hf_checkpoint), Topology(), initialize=False)
    with _te_spec_provider():
        te_specs = get_gpt_decoder_block_spec(get_model_config(model[0]), use_transformer_engine=True).layer_specs
    layers = list(model[0].decoder.layers)
    assert len(te_specs) == len(layers)
    cpu_maps = [layer.submodules_config.sharded_state_dict_keys_map for layer in layers]
    cpu = _keys(model)
    try:
        for layer, te_spec in zip(layers, te_specs, strict=True):
            layer.submodules_config.sharded_state_dict_keys_map = te_spec.submodules.sharded_state_dict_keys_map
        te = _keys(model)
    finally:
        for layer, keys_map in zip(layers, cpu_maps, strict=True):
            layer.submodules_config.sharded_state_dict_keys_map = keys_map
    return {"cpu": cpu, "te": te, "te_maps": [spec.submodules.sharded_state_dict_keys_map for spec in te_specs]}


@pytest.mark.parametrize("member", ["26b-a4b", *DENSE_SHAPES])
def test_one_key_set_on_both_hosts(local_world, family, member: str) -> None:
    """The CPU model's torch_dist keys are the keys the TE model asks for (item 0 of issue 48); on 60ed740
    the 26B-A4B's routed-expert pre-norm was ``mlp.linear_fc1.layer_norm_weight`` on CPU only."""
    keys = local_world(2).run(_keys_on_both_hosts, str(family[member]))[0]
    assert any(keys["te_maps"]), "megatron-core's TE spec no longer carries a keys map: re-derive this test"
    assert keys["cpu"] == keys["te"], (sorted(keys["cpu"] - keys["te"]), sorted(keys["te"] - keys["cpu"]))
    assert foreign_layout(keys["cpu"]) is None
    if member == "26b-a4b":
        assert PRE_NORM_NOW in keys["cpu"] and PRE_NORM_BEFORE not in keys["cpu"]
        assert any(key.endswith("._extra_state") for key in keys["cpu"])


def _import_as_before(*job_args: Any) -> dict:
    """``import_job`` writing what the plugin wrote on a CPU host up to 60ed740: the local spec's keys map
    left whole (``te_keys_map`` the identity), so the routed-expert pre-norm goes under the former key."""
    from vime_gemma4_bridge.core import spec

    with mock.patch.object(spec, "te_keys_map", dict):
        return import_job(*job_args)


@pytest.mark.parametrize(
    ("saved_at", "exported_at"),
    [(Topology(), Topology()), (Topology(ep=2), Topology(tp=2)), (Topology(pp=2), Topology(ep=2))],
    ids=str,
)
def test_checkpoint_with_the_former_cpu_key_still_exports_bitwise(
    local_world, family, tmp_path: Path, saved_at: Topology, exported_at: Topology
) -> None:
    """Checkpoints written before the fix (streamed import at the default topology, megatron-core's save
    otherwise) export bitwise on both export paths (the direct read and megatron-core's load)."""
    from megatron.core import dist_checkpointing

    world, hf = local_world(2), family["26b-a4b"]
    save, out = tmp_path / "torch_dist", tmp_path / "hf"
    world.run(_import_as_before, str(hf), str(save), str(tmp_path / ".partial"), saved_at)
    stored = dist_checkpointing.load_tensors_metadata(str(save / ITERATION_DIR))
    assert PRE_NORM_BEFORE in stored and PRE_NORM_NOW not in stored, "the former writer was not reproduced"
    world.run(export_job, str(save), str(hf), str(out), exported_at, False, 10**9)
    assert_same_checkpoint(hf, out)


# ------------------------------------------------------------------------------------------------
# A checkpoint Megatron-LM's own training saved (tests/megatron_lm_training.py)
# ------------------------------------------------------------------------------------------------

TRAINED_AT = Topology(tp=2, pp=2, ep=2)
#: optimizer form -> (topology exported at, world size): every form also exports at another topology.
EXPORTS = {
    "no_dist_opt": (Topology(), 2),
    "dp_reshardable": (TRAINED_AT, 8),
    "fully_reshardable": (Topology(ep=2), 2),
}


@pytest.fixture(scope="module")
def trained(local_world, family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One Adam step at TP2·PP2·EP2 on 8 ranks, saved at iteration 7 by Megatron-LM's ``save_checkpoint``,
    in each optimizer form; the trained weights (Megatron-Bridge's export) beside it as the reference."""
    from megatron_lm_training import FORMS, train_and_save_job

    root, hf = tmp_path_factory.mktemp("trained"), family["26b-a4b"]
    results = {}
    for form in FORMS:
        save, reference = root / form / "save", root / form / "reference"
        report = local_world(8).run(train_and_save_job, str(hf), str(save), str(reference), TRAINED_AT, form)[0]
        results[form] = {**report, "save": save, "reference": reference, "hf": hf}
    return results


@pytest.mark.parametrize("form", list(EXPORTS))
def test_megatron_lm_training_checkpoint_exports_the_trained_weights(local_world, trained, tmp_path, form) -> None:
    """Model, optimizer (this form), RNG and args are in the checkpoint; ``export`` gives the trained
    weights bitwise (not the source's: the step changed them)."""
    import torch
    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from vime_gemma4_bridge.io.hf import HFCheckpoint

    run = trained[form]
    assert run["changed"] >= run["tensors"] - 4, run["unchanged"]  # every weight but the frozen layer scalars
    assert all(value for moments in run["moments"] for name, value in moments.items() if name != "loss")
    iteration_dir = Path(run["iteration_dir"])
    assert iteration_dir.name == "iter_0000007"
    common = dist_checkpointing.load_common_state_dict(str(iteration_dir))
    assert common["iteration"] == 7 and common["args"].use_distributed_optimizer == (form != "no_dist_opt")
    stored = FileSystemReader(str(iteration_dir)).read_metadata().state_dict_metadata  # objects included
    assert any(key.startswith("rng_state") for key in stored), sorted(stored)[:5]
    assert any("optimizer" in key or key.startswith("chained_") for key in stored), sorted(stored)[:5]

    topology, nproc = EXPORTS[form]
    out = tmp_path / "hf"
    local_world(nproc).run(export_job, str(run["save"]), str(run["hf"]), str(out), topology, False, 10**9)
    reference, exported = load_file(str(run["reference"] / "model.safetensors")), HFCheckpoint(out).load()
    assert reference and set(reference) <= set(exported)
    assert [name for name in reference if not torch.equal(reference[name], exported[name])] == []


def test_preflight_reads_a_training_checkpoints_args(trained, family, capsys, tmp_path: Path) -> None:
    """No sidecar, no run config: the ``args`` Megatron-LM keeps in the common state are checked against
    ``--hf-checkpoint`` before any rank starts (exit 2, one line); the matching source passes."""
    from test_torch_dist import assert_refused

    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint

    run = trained["fully_reshardable"]
    checkpoint = TorchDistCheckpoint(run["save"])
    assert checkpoint.sidecar is None and checkpoint.training_args()["num_layers"] == 4
    for each in trained.values():  # every optimizer form's keys read as the plugin's own layout
        TorchDistCheckpoint(each["save"]).check_files()
    checkpoint.check_matches(HFCheckpoint(run["hf"]))
    other = family["31b"]
    argv = ["export", "--load", run["save"], "--hf-checkpoint", other, "--output", tmp_path / "out"]
    line = assert_refused(capsys, argv, ("holds a different model", "there and", "here"), tmp_path / "out")
    assert any(field in line for field in ("num_layers", "hidden_size", "num_attention_heads", "num_experts")), line


# ------------------------------------------------------------------------------------------------
# Layouts the plugin reads only after migrate: refused in one line before any rank starts
# ------------------------------------------------------------------------------------------------


def _rekeyed_copy(save: Path, out: Path, rename: Any, extra: dict[str, Any] | None = None) -> Path:
    """``save`` (one process, PyTorch's own checkpoint reader and writer) with every model key renamed (or
    dropped where ``rename`` gives ``None``) and ``extra`` items added; no sidecar, digests or run config (as
    other code writes it)."""
    import shutil

    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint

    source = TorchDistCheckpoint(save).iteration_dir
    state = _items(save)[0]
    target = out / source.name
    target.mkdir(parents=True)
    renamed = {}
    for key, value in state.items():
        new = key if key.startswith("common_state") else rename(key)
        if new is not None:  # None: dropped
            renamed[new] = value
    renamed.update(extra or {})
    writer, planner = FileSystemWriter(str(target)), DefaultSavePlanner(flatten_state_dict=False)
    dcp_save(renamed, storage_writer=writer, planner=planner, no_dist=True)
    shutil.copy(source / "metadata.json", target / "metadata.json")
    shutil.copy(save / "latest_checkpointed_iteration.txt", out / "latest_checkpointed_iteration.txt")
    return out


@pytest.mark.parametrize(
    ("layout", "rename", "needles"),
    [
        (
            "per-layer",
            lambda key: key.replace("decoder.layers.", "decoder.layers.0.", 1),
            ("one key per layer", "migrate"),
        ),
        (
            "dense-upstream",
            lambda key: key.replace("post_ffn_layernorm", "post_mlp_layernorm"),
            ("dense Gemma 4", "migrate --load DIR --to ours"),
        ),
    ],
    ids=["per-layer", "dense-upstream"],
)
def test_a_layout_the_plugin_cannot_read_is_refused_by_name(
    local_world, family, capsys, tmp_path: Path, layout: str, rename: Any, needles: tuple[str, ...]
) -> None:
    """Keys as that writer names them (the cited files, docs/INTERCHANGE.md), written by PyTorch's own
    checkpoint writer: ``export`` refuses in one line naming the layout, not from inside megatron-core."""
    from test_torch_dist import assert_refused

    hf, save = family["26b-a4b"], tmp_path / "ours"
    local_world(2).run(import_job, str(hf), str(save), str(tmp_path / ".partial"), Topology())
    foreign = _rekeyed_copy(save, tmp_path / layout, rename)
    argv = ["export", "--load", foreign, "--hf-checkpoint", hf, "--output", tmp_path / "out"]
    assert_refused(capsys, argv, ("is in the layout of", *needles), tmp_path / "out")
    argv = ["export", "--load", str(save), "--hf-checkpoint", str(hf), "--output", str(tmp_path / "out"), "--json"]
    from vime_gemma4_bridge.cli import main as cli

    assert cli.main(argv) == 0  # the same tensors under our keys: exported


def _save_as_upstream_dense(hf_checkpoint: str, save: str) -> dict[str, Any]:
    """A checkpoint written by upstream Megatron-Bridge's own dense Gemma 4 (the installed release's
    ``Gemma4Bridge`` and ``Gemma4DenseProvider``, gemma4_bridge.py L207-255, gemma4_provider.py L125-265,
    its local spec modeling_gemma4.py L744-776, all built on this CPU host), loaded from ``hf_checkpoint``
    by that bridge and saved by megatron-core. One piece is stood in: ``Gemma4DenseRotaryEmbedding``,
    which ``build`` constructs without ``use_cpu_initialization`` (megatron-core's ``RotaryEmbedding``
    then asks CUDA for a device); it holds no state, so the checkpoint is what that code writes."""
    from megatron.bridge.models.gemma import gemma4_provider
    from megatron.bridge.models.gemma.gemma4_bridge import Gemma4Bridge
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM

    from vime_gemma4_bridge.convert.model import is_rank0
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io.torch_dist import ITERATION, TRACKER_NAME, save_torch_dist

    init_model_parallel(Topology(), keep_if_same=True)
    hf, bridge = PreTrainedCausalLM.from_pretrained(hf_checkpoint), Gemma4Bridge()
    provider = bridge.provider_bridge(hf)
    provider.use_cpu_initialization, provider.perform_initialization = True, False
    provider.finalize()
    stand_in = mock.patch.object(gemma4_provider, "Gemma4DenseRotaryEmbedding", lambda config: None)
    with stand_in:
        model = provider.provide()
    bridge.load_weights_hf_to_megatron(hf, [model])
    iteration_dir = Path(save) / ITERATION_DIR
    iteration_dir.mkdir(parents=True)
    save_torch_dist([model], iteration_dir)
    if is_rank0():
        (Path(save) / TRACKER_NAME).write_text(str(ITERATION))
    return {"class": type(provider).__name__}


@pytest.fixture(scope="module")
def upstream_dense(local_world, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per dense member: a causal-LM HF checkpoint (vocabulary a multiple of 128: upstream's provider pads
    the embedding to one and its load does not pad the HF rows, UPSTREAM 69; the published 262,144 is),
    the checkpoint upstream's own code wrote from it (:func:`_save_as_upstream_dense`) and our import."""
    import dataclasses

    root, world, made = tmp_path_factory.mktemp("upstream_dense"), local_world(1), {}
    for member in ("31b", "e4b", "e2b"):
        spec = dataclasses.replace(DENSE_SHAPES[member], causal_lm=True, vocab_size=384)
        hf = write_tiny_checkpoint(root / member / "hf", spec)
        report = world.run(_save_as_upstream_dense, str(hf), str(root / member / "upstream"))[0]
        assert report["class"] == "Gemma4DenseProvider"
        world.run(import_job, str(hf), str(root / member / "ours"), str(root / member / ".p"), Topology())
        made[member] = {"hf": hf, "upstream": root / member / "upstream", "ours": root / member / "ours"}
    return made


def _model_items(save: Path) -> dict[str, Any]:
    """A checkpoint's stored items less its common state (a save's own: args, versions)."""
    return {key: value for key, value in _items(save)[0].items() if not key.startswith("common_state")}


@pytest.mark.parametrize("member", ["31b", "e4b", "e2b"])
def test_upstream_dense_checkpoint_its_own_code_wrote_is_refused_by_name(
    upstream_dense, capsys, tmp_path: Path, member: str
) -> None:
    """A checkpoint upstream Megatron-Bridge's own dense Gemma 4 wrote (:func:`_save_as_upstream_dense`)
    is refused by ``export`` in one line naming that layout and ``migrate``, before any rank starts —
    E2B's too, which that code keys one layer at a time (``use_double_wide_mlp`` sets
    ``hetereogenous_dist_checkpoint``) and which the per-layer test alone would call vime-native."""
    from test_torch_dist import assert_refused

    from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

    made = upstream_dense[member]
    keys = read_checkpoint_metadata(made["upstream"] / ITERATION_DIR).state_dict_metadata
    per_layer = any(key.startswith("decoder.layers.0.") for key in keys)
    assert per_layer == (member == "e2b"), sorted(keys)[:5]
    assert foreign_layout(keys) is not None
    argv = ["export", "--load", made["upstream"], "--hf-checkpoint", made["hf"], "--output", tmp_path / "out"]
    needle = "is in the layout of upstream Megatron-Bridge's dense Gemma 4"
    line = assert_refused(capsys, argv, (needle, "migrate --load DIR --to ours"), tmp_path / "out")
    assert "native" not in line


@pytest.mark.parametrize("member", ["31b", "e4b", "e2b"])
def test_dense_migrate_writes_what_upstream_writes_and_reads_it_bitwise(
    local_world, upstream_dense, tmp_path: Path, member: str
) -> None:
    """``migrate --to upstream`` of our import is, item for item (names, dtypes, shapes, values, the
    ``_extra_state`` objects), the checkpoint upstream's own code wrote from the same HF checkpoint —
    KV-shared layers' zero K/V rows and unit key norms, float32 tensors and E2B's per-layer keys
    included; ``migrate --to ours`` of upstream's checkpoint is our import, item for item, and exports
    the HF checkpoint bitwise; ours -> upstream -> ours is the identity. Two ranks move the layers."""
    import torch

    from vime_gemma4_bridge.convert.migrate import migrate_job
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    made, world = upstream_dense[member], local_world(2)
    config = HFCheckpoint(made["hf"]).config
    ours, upstream = _model_items(made["ours"]), _model_items(made["upstream"])
    written, read, back = tmp_path / "written", tmp_path / "read", tmp_path / "back"
    world.run(migrate_job, str(made["ours"]), str(written), str(tmp_path / ".p1"), "upstream", config)
    assert set(_model_items(written)) == set(upstream)
    assert [key for key, value in _model_items(written).items() if _differences(value, upstream[key])] == []
    world.run(migrate_job, str(made["upstream"]), str(read), str(tmp_path / ".p2"), "ours", config)
    world.run(migrate_job, str(written), str(back), str(tmp_path / ".p3"), "ours", config)
    for result in (read, back):
        items = _model_items(result)
        assert set(items) == set(ours)
        assert [key for key, value in items.items() if _differences(value, ours[key])] == []
    world.run(export_job, str(read), str(made["hf"]), str(tmp_path / "hf"), Topology(tp=2), False, 10**9)
    source, exported = HFCheckpoint(made["hf"]).load(), HFCheckpoint(tmp_path / "hf").load()
    assert set(source) == set(exported)
    assert [
        name
        for name in source
        if not (source[name].dtype == exported[name].dtype and torch.equal(source[name], exported[name]))
    ] == []


@pytest.mark.parametrize("form", ["no_dist_opt", "fully_reshardable"])
def test_dense_training_checkpoint_migrates_with_its_optimizer_state(
    local_world, upstream_dense, tmp_path: Path, form: str
) -> None:
    """E4B after one Adam step (Megatron-LM's ``save_checkpoint``, TP2, name-keyed optimizer state):
    ours -> upstream -> ours gives every item back bitwise, model and optimizer state, RNG and common
    state; in upstream's layout the optimizer state sits under upstream's keys with its parameter's
    shape, the KV-shared layers' created K/V rows zero in Adam's moments."""
    import torch
    from megatron_lm_training import train_and_save_job

    from vime_gemma4_bridge.convert.migrate import migrate_job
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    made = upstream_dense["e4b"]
    save, world = tmp_path / "trained", local_world(2)
    world.run(train_and_save_job, str(made["hf"]), str(save), str(tmp_path / "reference"), Topology(tp=2), form)
    config = HFCheckpoint(made["hf"]).config
    there, back = tmp_path / "upstream", tmp_path / "back"
    world.run(migrate_job, str(save), str(there), str(tmp_path / ".p1"), "upstream", config)
    world.run(migrate_job, str(there), str(back), str(tmp_path / ".p2"), "ours", config)
    (before, common_before), (after, common_after) = _items(save), _items(back)
    assert set(before) == set(after)
    assert [key for key in before if _differences(before[key], after[key])] == []
    assert _differences(common_before, common_after) == []
    upstream = _items(there)[0]
    moments = [key for key in upstream if "exp_avg" in key and key.endswith("self_attention_sliding.linear_qkv.weight")]
    assert moments, sorted(upstream)[:8]
    for key in moments:
        shared = upstream[key][3:]  # sliding layers 4-6 of E4B (layers 3, 4, 5 of the stack) are KV-shared
        # per KV group (2): its 2 query heads of 8 rows, then K and V (8 rows each)
        assert torch.count_nonzero(shared[:, 16:32]) == 0 and torch.count_nonzero(shared[:, 48:64]) == 0, key
        assert torch.count_nonzero(shared[:, :16]) > 0, key  # the query rows' moments moved with them


def test_dense_migrate_to_vime_native_and_its_refusals(local_world, upstream_dense, capsys, tmp_path: Path) -> None:
    """31B: ours -> vime-native -> ours is the identity, the native checkpoint one key per layer under its
    names (docs/INTERCHANGE.md) with a float32 ``layer_scalar``. Refused in one line before any rank
    starts: E4B to vime-native (its code builds no per-layer embeddings or KV sharing), a dense checkpoint
    without ``--hf-checkpoint``, upstream's and the native checkpoint with one key renamed (named), upstream's
    without one (named)."""
    import torch
    from test_torch_dist import assert_refused

    from vime_gemma4_bridge.convert.migrate import migrate_job
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    made, world = upstream_dense["31b"], local_world(2)
    config = HFCheckpoint(made["hf"]).config
    native, back = tmp_path / "native", tmp_path / "back"
    world.run(migrate_job, str(made["ours"]), str(native), str(tmp_path / ".p1"), "vime-native", config)
    world.run(migrate_job, str(native), str(back), str(tmp_path / ".p2"), "ours", config)
    ours, items = _model_items(made["ours"]), _model_items(back)
    assert set(items) == set(ours) and [key for key, value in items.items() if _differences(value, ours[key])] == []
    stored = _model_items(native)
    assert stored["decoder.layers.3.layer_scalar"].dtype == torch.float32
    assert torch.equal(
        stored["decoder.layers.3.pre_mlp_layernorm.weight"], ours["decoder.layers.mlp.linear_fc1.layer_norm_weight"][3]
    )
    assert torch.equal(
        stored["decoder.layers.3.post_attention_layernorm.weight"],
        ours["decoder.layers.self_attention_global.linear_proj.post_layernorm.weight"][0],
    )
    e4b = upstream_dense["e4b"]
    cases = [
        (
            ["--load", e4b["ours"], "--to", "vime-native", "--hf-checkpoint", e4b["hf"]],
            ("builds the 31B dense model only",),
        ),
        (["--load", made["ours"], "--to", "upstream"], ("holds a dense Gemma 4: pass --hf-checkpoint",)),
    ]
    renamed = _rekeyed_copy(
        made["upstream"], tmp_path / "renamed", lambda key: key.replace("pre_mlp_layernorm", "pre_mlp_norm")
    )
    cases.append(
        (["--load", renamed, "--to", "ours", "--hf-checkpoint", made["hf"]], ("decoder.layers.pre_mlp_norm.weight",))
    )
    renamed_native = _rekeyed_copy(native, tmp_path / "renamed_native", lambda key: key.replace("feedforward", "ffn"))
    cases.append(
        (
            ["--load", renamed_native, "--to", "ours", "--hf-checkpoint", made["hf"]],
            ("post_ffn_layernorm", "in the vime-native layout"),
        )
    )
    lacking = _rekeyed_copy(made["upstream"], tmp_path / "lacking", lambda key: None if "post_mlp" in key else key)
    cases.append(
        (["--load", lacking, "--to", "ours", "--hf-checkpoint", made["hf"]], ("lacks layer 0's post_mlp_norm",))
    )
    for argv, needles in cases:
        assert_refused(capsys, ["migrate", *argv, "--save", tmp_path / "out"], needles, tmp_path / "out")


def _te_norm_extra_states(layers: int, sliding: int) -> dict[str, Any]:
    """The 8 ``_extra_state`` objects upstream Megatron-Bridge 0.6.2's Gemma 4 MoE text model writes and the
    plugin does not: its ``TENorm`` q/k norms, ``linear_proj.post_layernorm`` (per attention type),
    ``pre_mlp_layernorm`` and final norm (modeling_gemma4.py L1517-1549, common/te_layers.py L26-47;
    megatron-core ``TENorm`` is a plain ``te.pytorch.RMSNorm``, extensions/transformer_engine.py
    L796-853, whose state holds an empty uint8 ``_extra_state`` without FP8 — TE's ops-based RMSNorm).
    ShardedObject unique keys (megatron-core dist_checkpointing/mapping.py L397-403), one per layer, each
    stored as megatron-core's torch_dist strategy stores an object (strategies/torch.py L316-320)."""

    import torch

    def payload() -> list:
        return [torch.empty(0, dtype=torch.uint8)]  # megatron-core pickles a list per object (L316-320)

    counts = {"sliding": sliding, "global": layers - sliding}
    items = {"decoder.final_layernorm._extra_state/shard_0_1": payload()}
    for i in range(layers):
        items[f"decoder.layers.pre_mlp_layernorm._extra_state/shard_{i}_{layers}"] = payload()
    for kind, count in counts.items():
        for i in range(count):
            for norm in ("q_layernorm", "k_layernorm", "linear_proj.post_layernorm"):
                items[f"decoder.layers.self_attention_{kind}.{norm}._extra_state/shard_{i}_{count}"] = payload()
    return items


@pytest.mark.parametrize("exported_at", [Topology(), Topology(tp=2)], ids=str)
def test_upstream_megatron_bridge_moe_text_layout_exports_bitwise(
    local_world, family, tmp_path: Path, exported_at: Topology
) -> None:
    """Upstream's MoE text layout, pinned from its files (the keys are ours plus the 8 TE-norm objects;
    docs/INTERCHANGE.md), re-keyed by PyTorch's own writer: exported bitwise on both export paths; with
    one key named otherwise (``router.scale``) the ranks refuse, naming the key the model needs."""
    from vime_gemma4_bridge.runtime.world import RankError

    world, hf = local_world(2), family["26b-a4b"]
    save = tmp_path / "ours"
    world.run(import_job, str(hf), str(save), str(tmp_path / ".partial"), Topology())
    upstream = _rekeyed_copy(save, tmp_path / "upstream", lambda key: key, _te_norm_extra_states(4, 2))
    out = tmp_path / "hf"
    world.run(export_job, str(upstream), str(hf), str(out), exported_at, False, 10**9)
    assert_same_checkpoint(hf, out)

    renamed = _rekeyed_copy(save, tmp_path / "renamed", lambda key: key.replace("router.scale", "router.gain"))
    with pytest.raises(RankError, match=r"decoder\.layers\.mlp\.router\.scale"):
        world.run(export_job, str(renamed), str(hf), str(tmp_path / "hf2"), exported_at, False, 10**9)


# ------------------------------------------------------------------------------------------------
# Read there: what the plugin writes is what upstream Megatron-Bridge's Gemma 4 MoE model asks for
# ------------------------------------------------------------------------------------------------


def _upstream_te_norm_keys(model: list) -> set[str]:
    """The ``_extra_state`` keys upstream's Gemma 4 MoE model asks for besides ours, derived from the installed
    release: its block spec (``gemma4_block_spec``, megatron/bridge/models/gemma/modeling_gemma4.py L1517-1549,
    built on megatron-core's TE spec with ``TESpecProvider``'s classes named, none instantiated) puts ``TENorm``
    where a norm's state carries ``_extra_state``; its ``linear_proj`` class adds a ``TENorm`` post-norm
    (common/te_layers.py L47); its attention re-keys per layer type as ours does (L1565-1629)."""
    from megatron.bridge.models.common.te_layers import TERowParallelLinearLayerNorm
    from megatron.bridge.models.gemma.modeling_gemma4 import gemma4_block_spec
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.utils import get_model_config

    with _te_spec_provider():
        block = gemma4_block_spec(get_model_config(model[0]), use_transformer_engine=True)
        te_norms = {TESpecProvider().layer_norm(), TESpecProvider().layer_norm(has_residual=True)}
    te_norm = TESpecProvider().layer_norm()  # TENorm (the residual-fused adapter builds one too)
    keys = {"decoder.final_layernorm._extra_state"} if block.layer_norm is te_norm else set()
    for layer, spec in zip(model[0].decoder.layers, block.layer_specs, strict=True):
        attention = f"decoder.layers.self_attention_{'sliding' if layer.self_attention.is_sliding else 'global'}."
        submodules = spec.submodules.self_attention.submodules
        keys |= {
            f"{attention}{norm}._extra_state"
            for norm in ("q_layernorm", "k_layernorm")
            if getattr(submodules, norm) is te_norm
        }
        if submodules.linear_proj is TERowParallelLinearLayerNorm:
            keys.add(f"{attention}linear_proj.post_layernorm._extra_state")
        if spec.submodules.pre_mlp_layernorm in te_norms:
            keys.add("decoder.layers.pre_mlp_layernorm._extra_state")
    return keys


def _import_without_te_norm_states(*job_args: Any) -> dict:
    """``import_job`` writing what the plugin wrote up to 8c14aa5: no TE-norm objects."""
    from vime_gemma4_bridge.io import torch_dist

    with mock.patch.object(torch_dist, "upstream_te_norm_states", lambda state: {}):
        return import_job(*job_args)


def _load_as_upstream(save: str, hf_checkpoint: str, topology: Topology) -> dict[str, Any]:
    """megatron-core's load of ``save`` into the plugin's model plus upstream's TE-norm objects, at
    Megatron-Bridge's default strictness (``assume_ok_unexpected``, training/checkpointing.py L2182-2229):
    what upstream's load of this checkpoint asks for. Returns the derived keys and the missing-key error."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    from vime_gemma4_bridge.compat.cuda import cpu_checkpointing
    from vime_gemma4_bridge.convert.model import build_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io.torch_dist_layout import sharded_state_dict, upstream_te_norm_states

    init_model_parallel(topology, keep_if_same=True)
    model = build_model(open_bridge(hf_checkpoint), topology, initialize=False)
    derived = _upstream_te_norm_keys(model)
    state = sharded_state_dict(model)[0]
    objects = upstream_te_norm_states(state["model"])
    state["model"].update(objects)
    iteration_dir = str(Path(save) / ITERATION_DIR)
    error = ""
    try:
        with cpu_checkpointing():
            dist_checkpointing.load(state, iteration_dir, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except (CheckpointingException, CheckpointException) as caught:  # megatron-core's check, or PyTorch's planner
        error = str(caught)
    return {"derived": derived, "asked": {item.key for item in objects.values()}, "ours": _keys(model), "error": error}


@pytest.mark.parametrize(
    ("saved_at", "loaded_at"), [(Topology(), Topology(pp=2)), (Topology(tp=2), Topology())], ids=str
)
def test_our_moe_checkpoint_holds_every_key_upstream_asks_for(
    local_world, family, tmp_path: Path, saved_at: Topology, loaded_at: Topology
) -> None:
    """The key set of what ``import`` writes equals ours plus the 8 TE-norm objects upstream's model asks for
    (derived from the installed Megatron-Bridge's spec), and a load asking for all of them at upstream's
    default strictness passes at another topology. Negative control: the same import without the objects
    (as up to 8c14aa5) is refused by that load for a missing ``_extra_state``."""
    from torch.distributed.checkpoint import FileSystemReader

    from vime_gemma4_bridge.io.torch_dist_layout import NON_MODEL_KEY

    world, hf = local_world(2), family["26b-a4b"]
    save = tmp_path / "ours"
    world.run(import_job, str(hf), str(save), str(tmp_path / ".partial"), saved_at)
    report = world.run(_load_as_upstream, str(save), str(hf), loaded_at)
    assert report[0]["error"] == "" and report[1]["error"] == ""
    derived = set().union(*(each["derived"] for each in report))
    assert len(derived) == 8 and derived == set().union(*(each["asked"] for each in report)), derived
    stored = FileSystemReader(str(save / ITERATION_DIR)).read_metadata().state_dict_metadata
    written = {key.split("/shard_")[0] for key in stored if not NON_MODEL_KEY.search(key)}
    ours = set().union(*(each["ours"] for each in report))
    assert written == ours | derived, (sorted(written - ours - derived), sorted((ours | derived) - written))

    before = tmp_path / "before"
    world.run(_import_without_te_norm_states, str(hf), str(before), str(tmp_path / ".partial2"), saved_at)
    report = world.run(_load_as_upstream, str(before), str(hf), loaded_at)
    assert "Missing key" in report[0]["error"] and "_extra_state" in report[0]["error"], report[0]["error"][:300]


# ------------------------------------------------------------------------------------------------
# Resume safely: positional optimizer state of a model that orders its parameters otherwise
# ------------------------------------------------------------------------------------------------


def test_resume_of_positional_optimizer_state_from_upstream_is_refused(trained, tmp_path: Path) -> None:
    """A Megatron-LM training checkpoint in upstream Megatron-Bridge's layout (the plugin's run, re-keyed as
    its files name the keys: ours plus its TE norms' 8 objects) is refused for resume by miles' hook where
    the optimizer state is positional (``dp_reshardable``), naming both ways out, and passes where it is
    keyed by name or not loaded; the plugin's own checkpoints pass in every form. The premise is checked
    too: the name-keyed forms' optimizer keys carry the model's keys, the positional form's do not."""
    from argparse import Namespace

    from torch.distributed.checkpoint import FileSystemReader

    from vime_gemma4_bridge.compat import seams
    from vime_gemma4_bridge.convert.miles import launch_problems
    from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint
    from vime_gemma4_bridge.io.torch_dist_layout import NON_MODEL_KEY

    def problems(load: Path, **flags: Any) -> list[str]:
        args = Namespace(
            hf_checkpoint=str(trained["dp_reshardable"]["hf"]),
            load=str(load),
            colocate=True,
            megatron_to_hf_mode="bridge",
            no_load_optim=False,
            finetune=False,
        )
        vars(args).update(flags)
        return launch_problems(args, export_tuple=seams.THIRD_FIELD)

    for form, run in trained.items():
        assert TorchDistCheckpoint(run["save"]).optimizer_order_hazard() is None, form
        assert problems(run["save"]) == [], form
        stored = FileSystemReader(str(Path(run["iteration_dir"]))).read_metadata().state_dict_metadata
        model_keys = {key for key in stored if not NON_MODEL_KEY.search(key)}
        optimizer = [key for key in stored if "optimizer" in key and ".exp_avg" in key]
        by_name = [key for key in optimizer if any(model_key in key for model_key in model_keys)]
        assert optimizer and (by_name == optimizer if form != "dp_reshardable" else by_name == []), (
            form,
            optimizer[:4],
        )

        upstream = _rekeyed_copy(run["save"], tmp_path / form, lambda key: key, _te_norm_extra_states(4, 2))
        hazard = TorchDistCheckpoint(upstream).optimizer_order_hazard()
        if form != "dp_reshardable":
            assert hazard is None and problems(upstream) == [], (form, hazard)
            continue
        assert hazard and "--no-load-optim" in hazard and "--dist-ckpt-optim-fully-reshardable" in hazard, hazard
        assert problems(upstream) == [hazard] and "\n" not in hazard
        assert problems(upstream, no_load_optim=True) == [] and problems(upstream, finetune=True) == []


# ------------------------------------------------------------------------------------------------
# The vision-language layout: Megatron-Bridge's Gemma4VLModel (upstream; miles' runs on the fork)
# ------------------------------------------------------------------------------------------------

TOWER_DELTA = 1.0


def _save_as_gemma4_vl_model(hf_checkpoint: str, ours: str, save: str, topology: Topology) -> dict[str, Any]:
    """A checkpoint written by Megatron-Bridge's own ``Gemma4VLModel`` (the installed release's class,
    megatron/bridge/models/gemma_vl/modeling_gemma4_vl.py L143-179, built on this CPU host): its towers are
    transformers' modules from the HF config with the source's weights plus ``TOWER_DELTA`` (a training
    run changed them), its language model the plugin's loaded from ``ours`` (upstream's own needs TE; its
    keys are ours plus the TE norms' objects, which the save writes). megatron-core's save, as upstream's."""
    import copy

    import torch
    from megatron.bridge.models.gemma_vl.modeling_gemma4_vl import Gemma4VLModel
    from megatron.core.utils import get_model_config
    from transformers import AutoConfig

    from vime_gemma4_bridge.convert.model import build_model, is_rank0, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel
    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.io.torch_dist import ITERATION, TRACKER_NAME, load_torch_dist, save_torch_dist

    init_model_parallel(topology, keep_if_same=True)
    model = build_model(open_bridge(hf_checkpoint), topology, initialize=False)
    load_torch_dist(model, Path(ours) / ITERATION_DIR)
    hf_config = AutoConfig.from_pretrained(hf_checkpoint)
    provider = copy.copy(get_model_config(model[0]))
    provider.vision_config, provider.text_config = hf_config.vision_config, hf_config.text_config
    provider.provide_language_model = lambda **kwargs: model[0]
    vl = Gemma4VLModel(provider)
    source = HFCheckpoint(hf_checkpoint)
    with torch.no_grad():
        for module in ("vision_tower", "embed_vision"):
            prefix = f"model.{module}."
            weights = source.load([name for name in source.names() if name.startswith(prefix)])
            getattr(vl, module).load_state_dict({name[len(prefix) :]: value for name, value in weights.items()})
            for parameter in getattr(vl, module).parameters():
                parameter.add_(TOWER_DELTA)
    iteration_dir = Path(save) / ITERATION_DIR
    iteration_dir.mkdir(parents=True, exist_ok=True)
    save_torch_dist([vl], iteration_dir)
    if is_rank0():
        (Path(save) / TRACKER_NAME).write_text(str(ITERATION))
    return {
        "towers": sorted(f"model.{name}" for name, _ in vl.named_parameters() if not name.startswith("language_model."))
    }


@pytest.fixture(scope="module")
def vl_layout(local_world, family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root, hf = tmp_path_factory.mktemp("vl"), family["26b-a4b"]
    world = local_world(2)
    world.run(import_job, str(hf), str(root / "ours"), str(root / ".partial"), Topology())
    report = world.run(_save_as_gemma4_vl_model, str(hf), str(root / "ours"), str(root / "vl"), Topology())[0]
    return {**report, "save": root / "vl", "hf": hf, "root": root}


@pytest.mark.parametrize("exported_at", [Topology(), Topology(tp=2)], ids=str)
def test_gemma4_vl_model_layout_exports_bitwise_with_its_towers(
    local_world, vl_layout, tmp_path: Path, exported_at: Topology
) -> None:
    """The language model under ``language_model.*`` exports bitwise on both export paths, and the towers
    the checkpoint holds (changed by the run) go to the HF output in place of the source's, named, shaped
    and typed as the source's; the report names the layout."""
    import torch
    from megatron.core import dist_checkpointing

    from vime_gemma4_bridge.io.hf import HFCheckpoint

    save, hf = vl_layout["save"], vl_layout["hf"]
    stored = dist_checkpointing.load_tensors_metadata(str(save / ITERATION_DIR))
    assert any(key.startswith("language_model.decoder.") for key in stored)
    assert any(key.startswith("vision_tower.") for key in stored), sorted(stored)[:5]
    out = tmp_path / "hf"
    report = local_world(2).run(export_job, str(save), str(hf), str(out), exported_at, False, 10**9)[0]
    assert "vision-language" in report["layout"] and report["towers_carried"] == len(vl_layout["towers"]) > 0
    source, exported = HFCheckpoint(hf), HFCheckpoint(out)
    assert exported.names() == source.names()
    assert exported.signatures(exported.names()) == source.signatures(source.names())
    towers = set(vl_layout["towers"])
    ours, theirs = exported.load(), source.load()
    changed = [name for name in theirs if not torch.equal(ours[name], theirs[name])]
    assert sorted(changed) == sorted(towers), sorted(set(changed) ^ towers)[:5]
    assert all(torch.equal(ours[name], theirs[name] + TOWER_DELTA) for name in towers)


def test_gemma4_vl_model_layout_refusals_name_the_key(local_world, vl_layout, family, capsys, tmp_path: Path) -> None:
    """Negative controls: a tower key renamed (no place for it in ``--hf-checkpoint``) is refused before any
    rank starts, naming the key; a language-model key renamed is refused by the ranks, naming the key the
    model needs."""
    from test_torch_dist import assert_refused

    from vime_gemma4_bridge.runtime.world import RankError

    save, hf = vl_layout["save"], vl_layout["hf"]
    renamed = _rekeyed_copy(save, tmp_path / "tower", lambda key: key.replace("vision_tower.", "vision_tower.x", 1))
    argv = ["export", "--load", renamed, "--hf-checkpoint", hf, "--output", tmp_path / "out"]
    assert_refused(
        capsys, argv, ("holds the tower tensor vision_tower.x", "has no model.vision_tower.x"), tmp_path / "out"
    )

    renamed = _rekeyed_copy(save, tmp_path / "router", lambda key: key.replace("router.scale", "router.gain"))
    with pytest.raises(RankError, match=r"language_model\.decoder\.layers\.mlp\.router\.scale"):
        local_world(2).run(export_job, str(renamed), str(hf), str(tmp_path / "hf2"), Topology(), False, 10**9)


# ------------------------------------------------------------------------------------------------
# migrate: ours <-> upstream, ours <-> vime-native, model and optimizer, bitwise
# ------------------------------------------------------------------------------------------------


def _items(save: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every stored item of a checkpoint (tensors and objects, PyTorch's own reader in one process) and its
    common state (megatron-core's reader)."""
    import io

    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint

    where = TorchDistCheckpoint(save).iteration_dir
    metadata = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    state: dict[str, Any] = {
        key: io.BytesIO()
        if isinstance(meta, BytesStorageMetadata)
        else torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
    }
    load(state, storage_reader=FileSystemReader(str(where)), no_dist=True)
    for key, value in state.items():  # a byte item comes back as its bytes: the object (a writer pickles it again)
        if isinstance(value, io.BytesIO):
            value.seek(0)
            state[key] = torch.load(value, weights_only=False)
    return state, dist_checkpointing.load_common_state_dict(str(where))


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: tensors bitwise (dtype and shape included), containers item by item."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(a, b) else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b), key=str)[:4]}"]
        return [d for key in a for d in _differences(a[key], b[key], f"{where}.{key}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{where}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _differences(x, y, f"{where}[{i}]")]
    if hasattr(a, "__dict__") and type(a) is type(b) and not callable(a):
        return _differences(vars(a), vars(b), where)
    return [] if a == b else [where]


@pytest.fixture(scope="module")
def imported(local_world, family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("imported")
    local_world(2).run(import_job, str(family["26b-a4b"]), str(root / "ours"), str(root / ".partial"), Topology())
    return root / "ours"


@pytest.mark.parametrize("via", ["vime-native", "upstream"])
@pytest.mark.parametrize("source", ["import", "no_dist_opt", "fully_reshardable"])
def test_migrate_round_trips_are_bitwise(local_world, imported, trained, tmp_path: Path, source: str, via: str) -> None:
    """ours -> ``via`` -> ours gives every stored item back bitwise — model, optimizer state (keyed by name),
    RNG and common state — on an imported checkpoint and on Megatron-LM training checkpoints; the only
    addition is the TE norms' states a training save lacks and ``ours`` holds. The native checkpoint has
    one key per layer with the two pre-feed-forward norms crossed (the join on HF names)."""
    from vime_gemma4_bridge.convert.migrate import migrate_job
    from vime_gemma4_bridge.io.torch_dist_layout import UPSTREAM_TE_NORM_STATE

    world = local_world(2)
    save = imported if source == "import" else trained[source]["save"]
    there, back = tmp_path / via, tmp_path / "back"
    world.run(migrate_job, str(save), str(there), str(tmp_path / ".p1"), via, None)
    world.run(migrate_job, str(there), str(back), str(tmp_path / ".p2"), "ours", None)
    (before, common_before), (after, common_after) = _items(save), _items(back)
    added = set(after) - set(before)
    assert set(before) <= set(after) and all(UPSTREAM_TE_NORM_STATE.match(key) for key in added), sorted(added)[:4]
    assert len(added) == (0 if source == "import" else 4 + 3 * (2 + 2) + 1)  # 4 layers, 2 of each type
    assert [key for key in before if _differences(before[key], after[key])] == []
    assert _differences(common_before, common_after) == []
    if via == "vime-native":
        _check_native(_items(there)[0], before)


def _check_native(native: dict[str, Any], ours: dict[str, Any]) -> None:
    """Spots of the native layout against ours (docs/INTERCHANGE.md's table; layers S, F, S, F)."""
    import torch

    assert not any(key.startswith("decoder.layers.mlp.") for key in native)
    pairs = {
        "decoder.layers.1.pre_mlp_layernorm.weight": ("decoder.layers.pre_shared_expert_layernorm.weight", 1),
        "decoder.layers.1.mlp.pre_feedforward_layernorm_2.weight": ("decoder.layers.pre_mlp_layernorm.weight", 1),
        "decoder.layers.3.mlp.router.proj.weight": ("decoder.layers.mlp.router.weight", 3),
        "decoder.layers.1.self_attention.linear_qkv.weight": (
            "decoder.layers.self_attention_global.linear_qkv.weight",
            0,
        ),
        "decoder.layers.2.self_attention.linear_qkv.weight": (
            "decoder.layers.self_attention_sliding.linear_qkv.weight",
            1,
        ),
        "decoder.layers.2.post_attention_layernorm.weight": (
            "decoder.layers.self_attention_sliding.linear_proj.post_layernorm.weight",
            1,
        ),
        "decoder.layers.0.dense_mlp.linear_fc1.weight": ("decoder.layers.mlp.shared_experts.linear_fc1.weight", 0),
    }
    if "optimizer.state.exp_avg.decoder.layers.mlp.router.weight" in ours:
        pairs["optimizer.state.exp_avg.decoder.layers.3.mlp.router.proj.weight"] = (
            "optimizer.state.exp_avg.decoder.layers.mlp.router.weight",
            3,
        )
    for key, (stacked, index) in pairs.items():
        assert torch.equal(native[key], ours[stacked][index]), key
    assert not torch.equal(
        native["decoder.layers.1.pre_mlp_layernorm.weight"], ours["decoder.layers.pre_mlp_layernorm.weight"][1]
    )
    assert all(f"decoder.layers.{n}.post_feedforward_layernorm._extra_state/shard_0_1" in native for n in range(4))


def test_migrate_command_and_its_refusals(local_world, imported, trained, family, capsys, tmp_path) -> None:
    """``vime-gemma4 migrate`` as a user runs it (two ranks, the HF config's layer types) writes the native
    layout; refused in one line before any rank starts, writing nothing: positional optimizer state
    (naming the flag that saves it by name), a native key renamed (named)."""
    import json

    from test_torch_dist import assert_refused

    from vime_gemma4_bridge.cli import main as cli

    out = tmp_path / "native"
    argv = ["migrate", "--load", str(imported), "--to", "vime-native", "--save", str(out)]
    assert cli.main([*argv, "--hf-checkpoint", str(family["26b-a4b"]), "--nproc", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["from"] == "ours"
        and report["to"] == "vime-native"
        and report["layer_types"][:2] == ["sliding", "global"]
    )
    assert (out / "latest_checkpointed_iteration.txt").is_file()

    positional = [
        "migrate",
        "--load",
        trained["dp_reshardable"]["save"],
        "--to",
        "vime-native",
        "--save",
        tmp_path / "x",
    ]
    assert_refused(capsys, positional, ("keyed by position", "--dist-ckpt-optim-fully-reshardable"), tmp_path / "x")
    renamed = _rekeyed_copy(out, tmp_path / "renamed", lambda key: key.replace(".router.proj.", ".router.gate.", 1))
    argv = ["migrate", "--load", renamed, "--to", "ours", "--save", tmp_path / "y"]
    assert_refused(capsys, argv, ("decoder.layers.", "router.gate.weight", "native"), tmp_path / "y")


def test_migrate_reads_the_vision_language_layout(local_world, vl_layout, tmp_path: Path) -> None:
    """``migrate --to ours`` of the checkpoint Megatron-Bridge's ``Gemma4VLModel`` wrote drops ``language_model.``
    (the plugin's model is a text model; the towers stay under their own keys), and ``export`` of the result
    equals the export of the original: the language model bitwise, the towers the run changed carried."""
    import torch

    from vime_gemma4_bridge.convert.migrate import migrate_job
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    world, hf = local_world(2), vl_layout["hf"]
    text = tmp_path / "text"
    report = world.run(migrate_job, str(vl_layout["save"]), str(text), str(tmp_path / ".p"), "ours", None)[0]
    assert "vision-language" in report["from"]
    keys = set(_items(text)[0])
    assert not any(key.startswith("language_model.") for key in keys) and any(
        key.startswith("vision_tower.") for key in keys
    )
    outputs = {}
    for name, save in (("vl", vl_layout["save"]), ("text", text)):
        outputs[name] = tmp_path / f"hf-{name}"
        world.run(export_job, str(save), str(hf), str(outputs[name]), Topology(), False, 10**9)
    a, b = HFCheckpoint(outputs["vl"]).load(), HFCheckpoint(outputs["text"]).load()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert sum(not torch.equal(a[name], value) for name, value in HFCheckpoint(hf).load().items()) == len(
        vl_layout["towers"]
    )


def test_miles_refuses_a_load_the_plugins_model_cannot_read(local_world, imported, vl_layout, tmp_path: Path) -> None:
    """miles' hook refuses ``--load`` of vime's native layout and of the vision-language layout in one line
    naming the layout and ``migrate``, before the model is built (megatron-core would fail inside its load);
    the plugin's own layout passes, and a ``--load`` that holds no checkpoint yet is miles' to handle."""
    from argparse import Namespace

    from vime_gemma4_bridge.compat import seams
    from vime_gemma4_bridge.convert.migrate import migrate_job
    from vime_gemma4_bridge.convert.miles import launch_problems

    native = tmp_path / "native"
    local_world(2).run(migrate_job, str(imported), str(native), str(tmp_path / ".p"), "vime-native", None)

    def problems(load: Path) -> list[str]:
        args = Namespace(
            hf_checkpoint=str(vl_layout["hf"]), load=str(load), colocate=True, megatron_to_hf_mode="bridge"
        )
        return launch_problems(args, export_tuple=seams.THIRD_FIELD)

    assert problems(imported) == [] and problems(tmp_path / "empty") == []
    (line,) = problems(native)
    assert "one key per layer" in line and "migrate" in line and "\n" not in line
    (line,) = problems(vl_layout["save"])
    assert "Gemma4VLModel" in line and f"migrate --load {vl_layout['save']} --to ours" in line
