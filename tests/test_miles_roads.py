"""miles' roads (radixark/miles @31f1ca96) driven through the plugin: tests/miles_flow.py pins miles' files.

What each test proves, and its negative control:

- the colocated weight sync (miles' bridge iterator, then SGLang's flattened buckets gathered per
  engine) delivers every language-model tensor of the HF checkpoint bitwise, each once, to every
  engine rank, on the fork's seams (tests/fork_seams.py) at TP2·PP2·EP4·ETP1 and at miles' recipe
  shape TP4·EP8 (8 ranks, engines of 4), stacked and per expert; a planted fault (one expert's
  backed-up weight given its neighbour's) is seen; on the installed release the sync fails at
  miles' three-field unpack, which :func:`vime_gemma4_bridge.convert.miles.launch_problems` refuses first;
- FP8 rollouts through miles' per-tensor FP8 quantizer: bitwise what the quantizer makes of the
  source, per expert; stacked experts meet its ``.weight`` assertion (refused at launch);
- ``--save-hf`` (miles' ``save_hf_model``): the whole VL checkpoint back, bitwise, and ``.complete``;
- the model builds with miles' own settings (``variable_seq_lengths=True``, alltoall) without TE;
- registration: a stand-in of the fork's ``Gemma4VLBridge`` registered first or last never serves;
- launches miles cannot carry with Gemma 4 are refused in one line naming what to use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vime_gemma4_bridge.convert.miles import launch_problems
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

THREE = "(hf_name, tensor, megatron_param_name)"
TWO = "(hf_name, tensor)"


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("miles") / "hf", TinySpec(seed=5))


# ------------------------------------------------------------------------------------------------
# The colocated sync, end to end on real ranks
# ------------------------------------------------------------------------------------------------


def _miles_model(hf_checkpoint: str, topology: Topology) -> tuple:
    """miles' bridge branch (``model_provider.py`` L163-196, ``checkpoint.py`` L179-187) on this host:
    the provider with miles' runtime settings (``_apply_bridge_runtime_config`` L27-96; ``arguments.py``
    L2713-2720 always sets ``variable_seq_lengths`` and the alltoall dispatcher), finalized, built, loaded
    inside ``patch_megatron_model``. (miles builds through Megatron-LM's ``get_model``; here the same
    provider builds through Megatron-Bridge's, on the CPU-host adapter.)"""
    from megatron.bridge import AutoBridge
    from miles_flow import patch_megatron_model

    import vime_gemma4_bridge
    from vime_gemma4_bridge.convert.cpu_host import provide_model

    vime_gemma4_bridge.init_model_parallel(topology)
    bridge = AutoBridge.from_hf_pretrained(hf_checkpoint, trust_remote_code=True)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = topology.tp
    provider.pipeline_model_parallel_size = topology.pp
    provider.virtual_pipeline_model_parallel_size = topology.vpp
    provider.expert_model_parallel_size = topology.ep
    provider.expert_tensor_parallel_size = topology.etp
    provider.sequence_parallel = False
    provider.variable_seq_lengths = True
    provider.moe_token_dispatcher_type = "alltoall"
    provider.use_cpu_initialization = True
    provider.finalize()
    model = provide_model(provider, wrap_with_ddp=False, use_cpu_initialization=True, init_model_with_meta_device=False)
    with patch_megatron_model(model):
        AutoBridge.from_hf_pretrained(hf_checkpoint, trust_remote_code=True).load_hf_weights(model)
    return bridge, model, provider


def _miles_sync_job(
    hf_checkpoint: str,
    topology: Topology,
    engine_ranks: int,
    buffer_size: int,
    expert_layout: str,
    fork: bool,
    quantization: dict | None = None,
    plant: bool = False,
) -> dict | None:
    """One miles colocated sync on every rank; each engine group's first rank checks what its engine got."""
    import contextlib

    from fork_seams import fork_seams
    from miles_flow import (
        MilesArgs,
        backed_up_weights,
        engine_loads,
        gather_groups,
        get_hf_weight_chunks,
        quantize_param_fp8,
    )

    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV
    from vime_gemma4_bridge.runtime.world import environment

    with environment({EXPERT_LAYOUT_ENV: expert_layout}), fork_seams() if fork else contextlib.nullcontext():
        bridge, model, provider = _miles_model(hf_checkpoint, topology)
        dispatcher = provider.moe_token_dispatcher_type
        weights = backed_up_weights(model)
        if plant:  # a fault: this rank's local expert 0 of the first MoE layer given expert 1's weight
            keys = sorted(k for k in weights if k.endswith("mlp.experts.linear_fc2.weight0"))
            weights[keys[0]] = weights[keys[0].removesuffix("0") + "1"].clone()
        group, src = gather_groups(engine_ranks)
        args = MilesArgs(hf_checkpoint, bridge.hf_pretrained.config.text_config.vocab_size, buffer_size)
        megatron_names: list = []
        received: list[list[tuple[str, torch.Tensor]]] = []
        chunks = 0
        try:
            for chunk in get_hf_weight_chunks(bridge, model, weights, args, quantization, names=megatron_names):
                chunks += 1
                per_dtype = _send(chunk, group, src)
                if per_dtype is not None:
                    for rank, tensors in enumerate(engine_loads(per_dtype)):
                        while len(received) <= rank:
                            received.append([])
                        received[rank].extend(tensors)
        except (ValueError, AssertionError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
    import torch.distributed as dist

    if dist.get_rank() != src:
        return None
    expected = _expected(HFCheckpoint(hf_checkpoint), expert_layout)
    report: dict = {"src": src, "engine_ranks": len(received), "chunks": chunks, "dispatcher": dispatcher}
    report["third_fields"] = sorted({type(name).__name__ for name in megatron_names})
    report["problems"] = []
    for rank, tensors in enumerate(received):
        got = dict(tensors)
        if len(tensors) != len(got):
            report["problems"].append(f"engine rank {rank}: a name twice")
        scales = {name for name in got if name.endswith(".weight_scale")}
        if set(got) - scales != set(expected):
            missing = sorted(set(expected) - set(got))[:3]
            extra = sorted(set(got) - scales - set(expected))[:3]
            report["problems"].append(f"engine rank {rank}: missing {missing}, extra {extra}")
            continue
        for name, reference in expected.items():
            if f"{name}_scale" in scales:
                reference = dict(quantize_param_fp8(name, reference, None))
                pair = {name: got[name], f"{name}_scale": got[f"{name}_scale"]}
                same = all(torch.equal(pair[k].view(torch.uint8), reference[k].view(torch.uint8)) for k in pair)
            else:
                same = got[name].dtype == reference.dtype and torch.equal(got[name], reference)
            if not same:
                report["problems"].append(f"engine rank {rank}: {name} differs")
        report.setdefault("quantized", sorted(name.removesuffix("_scale") for name in scales))
    return report


def _expected(source: HFCheckpoint, layout: str) -> dict[str, torch.Tensor]:
    """HF1's language model as the engine should receive it: stacks split per expert in that layout."""
    from vime_gemma4_bridge.core.hf_layout import STACK_NAME, split_expert

    expected = {}
    for name, tensor in source.load(source.language_model_names()).items():
        if layout == "per-expert" and STACK_NAME.match(name):
            for expert in range(tensor.shape[0]):
                expected.update(split_expert(name, expert, tensor[expert]))
        else:
            expected[name] = tensor
    return expected


def _send(chunk: list, group: object, src: int) -> list | None:
    from miles_flow import send_to_colocated_engine

    return send_to_colocated_engine(chunk, group, src)


def _reports(results: list) -> list[dict]:
    return [result for result in results if result is not None]


@pytest.mark.parametrize(
    ("topology", "layout"),
    [
        (Topology(tp=2, pp=2, ep=4, etp=1), "stacked"),
        (Topology(tp=2, pp=2, ep=4, etp=1), "per-expert"),
        (Topology(tp=4, ep=8, etp=1), "stacked"),
    ],
    ids=["TP2-PP2-EP4-ETP1-stacked", "TP2-PP2-EP4-ETP1-per-expert", "TP4-EP8-ETP1-stacked"],
)
def test_miles_colocated_sync_delivers_the_checkpoint(local_world, hf_vl: Path, topology: Topology, layout: str):
    """Every engine rank of both engines gets HF1's language model bitwise, each name once, in miles' chunks."""
    reports = _reports(local_world(8).run(_miles_sync_job, str(hf_vl), topology, 4, 50_000, layout, True))
    assert [r["src"] for r in reports] == [0, 4], reports
    for report in reports:
        assert report["problems"] == [], report["problems"]
        assert report["engine_ranks"] == 4 and report["chunks"] > 3, report
        assert report["third_fields"] == ["str"], "miles reads the third field as a str"
        assert report["dispatcher"] == "alltoall", "miles' settings: variable_seq_lengths with alltoall"


def test_miles_colocated_sync_sees_a_planted_fault(local_world, hf_vl: Path) -> None:
    """Negative control: one rank's expert 0 backed up as expert 1 reaches the engine, and is seen there."""
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    reports = _reports(
        local_world(8).run(_miles_sync_job, str(hf_vl), topology, 4, 50_000, "stacked", True, None, True)
    )
    assert all(any("experts.down_proj differs" in p for p in r["problems"]) for r in reports), reports


def test_miles_sync_on_the_release_fails_at_the_three_field_unpack(local_world, hf_vl: Path) -> None:
    """The installed release yields two fields: miles' unpack fails on every rank; the launch check says so first."""
    results = local_world(4).run(_miles_sync_job, str(hf_vl), Topology(tp=2, pp=2), 4, 50_000, "stacked", False)
    assert {r["error"] for r in results} == {"ValueError: not enough values to unpack (expected 3, got 2)"}
    args = _args(hf_vl)
    assert launch_problems(args, export_tuple=TWO) == [
        "miles' bridge weight sync unpacks (hf_name, tensor, megatron_name) and this Megatron-Bridge "
        "yields two fields: install radixark's Megatron-Bridge fork, as miles' image does"
    ]
    assert launch_problems(args, export_tuple=THREE) == []


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def test_miles_fp8_sync_per_expert_is_the_quantized_checkpoint(local_world, hf_vl: Path) -> None:
    """Through miles' per-tensor FP8 quantizer: each weight it quantizes is what it makes of the source, bitwise."""
    topology = Topology(tp=2, pp=2, ep=4, etp=1)
    reports = _reports(local_world(8).run(_miles_sync_job, str(hf_vl), topology, 4, 50_000, "per-expert", True, FP8))
    for report in reports:
        assert report["problems"] == [], report["problems"]
        quantized = report["quantized"]
        assert any(".experts.3.gate_proj.weight" in n for n in quantized)
        assert any(".self_attn.q_proj.weight" in n for n in quantized)
        assert any(".mlp.down_proj.weight" in n for n in quantized)
        assert not any("norm" in n or "router" in n or "embed" in n for n in quantized)


def test_miles_fp8_sync_with_stacked_experts_is_refused(local_world, hf_vl: Path, tmp_path: Path) -> None:
    """Negative control: stacked expert names meet miles' quantizer's ``.weight`` assertion; the launch
    check names the switch."""
    topology = Topology(tp=2, pp=2)
    results = local_world(4).run(_miles_sync_job, str(hf_vl), topology, 4, 50_000, "stacked", True, FP8)
    assert all(r["error"].startswith("AssertionError: Expected weight parameter, got") for r in results), results
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    config = json.loads((hf_vl / "config.json").read_text()) | {"quantization_config": FP8}
    (fp8 / "config.json").write_text(json.dumps(config))
    assert launch_problems(_args(fp8), export_tuple=THREE) == [
        "miles' FP8 quantizer takes per-expert names only (quantizer_fp8.py asserts '.weight'): "
        "set VIME_GEMMA4_EXPERT_LAYOUT=per-expert on the training ranks"
    ]


# ------------------------------------------------------------------------------------------------
# --save-hf
# ------------------------------------------------------------------------------------------------


def _save_hf_job(hf_checkpoint: str, topology: Topology, out: str, plant: bool) -> dict | None:
    import torch.distributed as dist
    from fork_seams import fork_seams
    from miles_flow import save_hf_model

    with fork_seams("d063066b"):
        bridge, model, _ = _miles_model(hf_checkpoint, topology)
        if plant:
            for name, param in model[0].named_parameters():
                if name.endswith("mlp.experts.linear_fc1.weight0"):
                    with torch.no_grad():
                        param.add_(1.0)
                    break
        save_hf_model(bridge, model, Path(out))
    if dist.get_rank() != 0:
        return None
    source, saved = HFCheckpoint(hf_checkpoint), HFCheckpoint(Path(out))
    differ = [n for n in source.names() if not torch.equal(source.load([n])[n], saved.load([n])[n])]
    return {"names": sorted(saved.names()) == sorted(source.names()), "differ": differ}


@pytest.mark.parametrize("plant", [False, True], ids=["bitwise", "planted-fault"])
def test_miles_save_hf_is_the_checkpoint(local_world, hf_vl: Path, tmp_path: Path, plant: bool) -> None:
    """miles' ``--save-hf`` at TP2·PP2·EP4·ETP1: every tensor of HF1 (vision tower too), bitwise, then ``.complete``."""
    out = tmp_path / "hf_save"
    result = local_world(8).run(_save_hf_job, str(hf_vl), Topology(tp=2, pp=2, ep=4, etp=1), str(out), plant)[0]
    assert result["names"] and (out / ".complete").exists()
    if plant:
        assert result["differ"] and all(n.endswith("experts.gate_up_proj") for n in result["differ"]), result
    else:
        assert result["differ"] == []


# ------------------------------------------------------------------------------------------------
# Launch checks, registration, the provider with miles' settings
# ------------------------------------------------------------------------------------------------


def _args(hf: Path, **overrides: object) -> SimpleNamespace:
    """miles' args for its Gemma 4 recipe (``scripts/run_gemma_4_26b_a4b.py`` @31f1ca96): bridge mode, colocated."""
    fields = {"hf_checkpoint": str(hf), "megatron_to_hf_mode": "bridge", "colocate": True, "lora_rank": 0}
    return SimpleNamespace(**(fields | overrides))


@pytest.mark.fast
def test_launches_miles_cannot_carry_are_refused_naming_what_to_use(hf_vl: Path, tmp_path: Path) -> None:
    assert launch_problems(_args(hf_vl), export_tuple=THREE) == []
    assert launch_problems(_args(hf_vl, megatron_to_hf_mode="raw"), export_tuple=THREE) == [
        "miles' raw weight road has no Gemma 4 (megatron_to_hf.convert_to_hf: Unsupported model): "
        "launch with --megatron-to-hf-mode bridge"
    ]
    for mode in ("broadcast", "p2p", "disk-delta"):
        assert launch_problems(_args(hf_vl, colocate=False, update_weight_transfer_mode=mode), export_tuple=THREE) == [
            f"miles' non-colocated weight sync (--update-weight-transfer-mode {mode}) converts with its own "
            "converters, which have no Gemma 4: launch with --colocate (or sync a LoRA adapter only)"
        ]
    # A LoRA run never pushes the base on those paths (mixin.py L369-384): its adapter goes through the bridge.
    assert launch_problems(_args(hf_vl, colocate=False, lora_rank=8), export_tuple=THREE) == []
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert launch_problems(_args(other, megatron_to_hf_mode="raw", colocate=False), export_tuple=TWO) == []


@pytest.mark.fast
def test_provider_builds_with_miles_dispatcher_settings_without_te(hf_vl: Path) -> None:
    """miles always sets ``variable_seq_lengths`` and alltoall; the TE-less provider keeps alltoall (megatron-core
    refuses allgather with variable sequence lengths), and still switches to allgather otherwise."""
    from megatron.bridge import AutoBridge

    for variable, expected in ((True, "alltoall"), (False, "allgather")):
        provider = AutoBridge.from_hf_pretrained(str(hf_vl)).to_megatron_provider(load_weights=False)
        provider.variable_seq_lengths = variable
        provider.moe_token_dispatcher_type = "alltoall"
        provider.finalize()
        assert provider.moe_token_dispatcher_type == expected


REGISTRATION = textwrap.dedent(
    """
    import json, sys, types
    from vime_gemma4_bridge.convert.miles import MilesLaunchRefused, miles_init, serving_bridges
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.core.models.gpt import GPTModel

    def stand_in():  # the fork's registration (gemma_vl/gemma4_vl_bridge.py @1187a604 L65-70), by class name
        for name in ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"):
            cls = type("Gemma4VLBridge", (MegatronModelBridge,), {"__module__": "fork_stand_in"})
            MegatronModelBridge.register_bridge(source=name, target=GPTModel)(cls)

    hf, order = sys.argv[1], sys.argv[2]
    args = types.SimpleNamespace(hf_checkpoint=hf, megatron_to_hf_mode="bridge", colocate=True, lora_rank=0)
    if order == "first":
        stand_in()
    try:
        miles_init(args)
    except MilesLaunchRefused as error:
        refused = str(error)
    else:
        refused = None
    if order == "last":
        stand_in()
    args.colocate = False
    try:
        miles_init(args)
    except MilesLaunchRefused as error:
        disaggregated = str(error)
    print(json.dumps({"serving": serving_bridges(), "refused": refused, "disaggregated": disaggregated}))
    """
)


@pytest.mark.parametrize("order", ["first", "last"])
def test_plugin_serves_gemma4_whatever_the_fork_registered(hf_vl: Path, order: str) -> None:
    """miles' init hook in a fresh interpreter: the fork's stand-in registered before or after it never serves."""
    run = subprocess.run(
        [sys.executable, "-c", REGISTRATION, str(hf_vl), order], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(result["serving"]) >= {"Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"}
    assert all(v.startswith("vime_gemma4_bridge.core.bridge.") for v in result["serving"].values()), result
    # The release is installed: its two-field export is refused in the hook, before the model is built.
    assert result["refused"].startswith("vime-gemma4-bridge: miles' bridge weight sync unpacks"), result
    assert "\n" not in result["refused"] and "--colocate" in result["disaggregated"]


# ------------------------------------------------------------------------------------------------
# LoRA: miles' adapter sync through export_adapter_weights
# ------------------------------------------------------------------------------------------------

LORA_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _miles_lora_job(hf_checkpoint: str, topology: Topology, fork: bool) -> dict:
    """miles' LoRA sync (``update_weight_from_tensor.py`` L284-312): the bridge iterator's ``lora`` chunks
    accumulated, assembled over PP; and the release's own adapter export of this rank to compare with."""
    import contextlib

    from fork_seams import fork_seams
    from miles_flow import MilesArgs, get_hf_weight_chunks, pp_assemble_full_adapter
    from test_lora import _trained_lora_model

    bridge, model = _trained_lora_model(hf_checkpoint, topology, LORA_TARGETS)
    reference = {n: t.clone() for n, t, *_ in bridge.export_adapter_weights(model, cpu=True, show_progress=False)}
    args = MilesArgs(hf_checkpoint, bridge.hf_pretrained.config.text_config.vocab_size, 1 << 30)
    try:
        with fork_seams("d063066b") if fork else contextlib.nullcontext():
            chunks = get_hf_weight_chunks(bridge, model, {}, args, None, weight_type="lora")
            accumulated = [item for chunk in chunks for item in chunk]
    except ValueError as error:
        return {"error": str(error)}
    return {"assembled": dict(pp_assemble_full_adapter(accumulated)), "reference": reference}


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "release"])
def test_miles_lora_sync_is_the_adapter(local_world, tmp_path: Path, fork: bool) -> None:
    """At PP2·EP2 every rank ends with the whole adapter (dense MLP, every routed expert, attention),
    bitwise the adapter export's, each expert under its own name; on the release miles' unpack fails."""
    hf = write_tiny_checkpoint(tmp_path / "moe", TinySpec(dtype="float32", seed=9))
    results = local_world(4).run(_miles_lora_job, str(hf), Topology(pp=2, ep=2), fork)
    if not fork:
        assert [r["error"] for r in results] == ["not enough values to unpack (expected 3, got 2)"] * 4
        return
    whole = {name: t for result in results for name, t in result["reference"].items()}
    for result in results:
        assembled = result["assembled"]
        assert set(assembled) == set(whole)
        assert all(torch.equal(assembled[name], whole[name]) for name in whole)
    assert any(".experts.15.down_proj.lora_B.weight" in name for name in whole)
    assert any(".self_attn.q_proj.lora_A.weight" in name for name in whole)
