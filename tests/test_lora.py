"""LoRA on Gemma 4 through the bridge, driven as vime drives it (``lora_utils.py`` @00ca8b39).

vime builds Megatron-Bridge's ``LoRA`` on ``linear_qkv`` / ``linear_proj`` and applies it as a pre-wrap
hook of the bridge's provider (``provider.register_pre_wrap_hook``), then exports the adapter with
``bridge.export_adapter_weights(model, cpu=False, show_progress=False)``. Checked here, with real
megatron-core and Megatron-Bridge on gloo ranks, at TP2 and PP2 on the MoE (attention targets), with
``CanonicalLoRA`` (``lora_type=canonical_lora``), on the MoE's MLP targets (every routed expert, at EP2
and TP2) and on a dense model with KV-shared layers and double-wide MLPs (every target):

* the trained forward equals transformers' forward on the merged export (fp32 parity bound): the
  adapter enters before ``linear_proj``'s post-norm and after ``linear_qkv``'s input norm, as in HF;
* the merged export equals merging the exported adapter into the source in fp32 on the HF side;
* adapter names are those HF PEFT and vLLM load: ``q/k/v/o_proj.lora_A/B.weight``, each ``lora_B`` split
  by its own layer's head shape; a k_eq_v full layer's ``v_proj`` adapter is its ``k_proj`` one (V is
  the adapted K; vLLM serving it: ``tests/test_vllm.py``). A KV-shared layer's query projection is
  ``linear_q``, which the ``linear_qkv`` target does not name: it gets no adapter (trained and served alike);
  the experts' adapters are per expert (``experts.<e>.<gate|up|down>_proj.lora_A/B.weight``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from fork_seams import fork_seams
from vime_flow import save_lora_adapter_for_vllm

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.hf_layout import STACK_NAME, STACK_PROJECTIONS, per_expert_name
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.io.hf_write import write_hf_checkpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.parity import FLOAT32_MAX_ABS_TOLERANCE, compare_logits, hf_logits

RANK, ALPHA = 4, 8
TARGETS = ["linear_qkv", "linear_proj"]
SEQ_LEN, BATCH = 24, 2


#: The dense case: KV-shared layers (``linear_q``, no K/V) and their double-wide MLPs, every vime target.
DENSE = TinySpec(moe=False, kv_shared_layers=2, double_wide_mlp=True, dtype="float32", seed=10)
DENSE_TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
#: The MoE's MLP targets: the dense MLP beside the experts and the routed experts (one adapter per expert).
MLP_TARGETS = ["linear_fc1", "linear_fc2"]
#: ``CanonicalLoRA``: one adapter per projection (vime's ``lora_type=canonical_lora``).
CANONICAL_TARGETS = ["linear_q", "linear_k", "linear_v", "linear_proj"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "moe": write_tiny_checkpoint(root / "moe", TinySpec(dtype="float32", seed=9)),
        "dense": write_tiny_checkpoint(root / "dense", DENSE),
    }


@pytest.fixture(scope="module")
def checkpoint(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["moe"]


def _trained_lora_model(hf_checkpoint: str, topology: Topology, targets: list[str] = TARGETS) -> tuple:
    """vime's model: LoRA as the provider's pre-wrap hook, HF weights, then "trained" adapters.

    Targets named as ``CanonicalLoRA`` names them (``linear_q`` ...) select it, as vime's ``lora_type``.
    """
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.lora import LoRA

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
    canonical = set(targets) <= set(CANONICAL_TARGETS)
    lora = (CanonicalLoRA if canonical else LoRA)(target_modules=targets, dim=RANK, alpha=ALPHA)
    to_provider = bridge.to_megatron_provider

    def provider_with_lora(*args, **kwargs):  # vime's model.py: provider.register_pre_wrap_hook(apply_lora_hook)
        provider = to_provider(*args, **kwargs)
        provider.register_pre_wrap_hook(lambda chunks: lora(chunks, training=True))
        return provider

    bridge.to_megatron_provider = provider_with_lora
    model = convert.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    torch.manual_seed(0)  # "trained" adapters: linear_out starts at zero; the same draw on every rank
    for chunk in model:
        for name, parameter in sorted(chunk.named_parameters()):
            if ".adapter." in name:
                torch.nn.init.normal_(parameter, std=0.05)
    return bridge, model


def _lora_job(hf_checkpoint: str, topology: Topology, input_ids: torch.Tensor, targets: list[str]) -> dict | None:
    """The trained forward's logits and both exports (rank 0)."""
    from vime_gemma4_bridge.verify.parity import megatron_logits_on_rank0

    bridge, model = _trained_lora_model(hf_checkpoint, topology, targets)
    logits = megatron_logits_on_rank0(model, input_ids)
    adapters = {name: tensor.clone() for name, tensor, *_ in bridge.export_adapter_weights(model, show_progress=False)}
    merged = {name: t.clone() for name, t, *_ in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    return {"logits": logits, "adapters": adapters, "merged": merged} if logits is not None else None


def hf_side_merge(name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor]) -> torch.Tensor:
    """``weight`` merged on the HF side in fp32 (``W + alpha / r * B @ A``); a stacked expert tensor from
    its experts' adapters (``gate_up``: the gate and up ``lora_B`` rows over their one shared ``lora_A``)."""
    stack = STACK_NAME.match(name)
    if stack is None:
        lora = {s: adapters.get(name.removesuffix(".weight") + f".lora_{s}.weight") for s in "AB"}
        return weight if lora["A"] is None else weight + ALPHA / RANK * (lora["B"] @ lora["A"])
    projections = STACK_PROJECTIONS[stack["stack"]]
    if per_expert_name(name, 0, projections[0]).removesuffix(".weight") + ".lora_A.weight" not in adapters:
        return weight
    merged = []
    for expert, expert_weight in enumerate(weight):
        heads = [per_expert_name(name, expert, p).removesuffix(".weight") + ".lora_" for p in projections]
        assert all(torch.equal(adapters[heads[0] + "A.weight"], adapters[h + "A.weight"]) for h in heads)
        b = torch.cat([adapters[h + "B.weight"] for h in heads])
        merged.append(expert_weight + ALPHA / RANK * (b @ adapters[heads[0] + "A.weight"]))
    return torch.stack(merged)


@pytest.mark.parametrize(
    ("kind", "topology"),
    [
        ("moe", Topology(tp=2)),
        ("moe", Topology(pp=2)),
        ("canonical", Topology(tp=2)),
        ("experts", Topology(ep=2)),
        ("experts", Topology(tp=2)),
        ("dense", Topology(tp=2)),
    ],
    ids=str,
)
def test_vime_lora_trains_what_the_merged_export_and_the_adapter_serve(
    local_world, checkpoints: dict[str, Path], tmp_path: Path, kind: str, topology: Topology
) -> None:
    checkpoint = checkpoints["dense" if kind == "dense" else "moe"]
    targets = {"dense": DENSE_TARGETS, "canonical": CANONICAL_TARGETS, "experts": MLP_TARGETS}.get(kind, TARGETS)
    source = HFCheckpoint(checkpoint)
    text = source.config.get("text_config", source.config)
    input_ids = torch.randint(0, text["vocab_size"], (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    job = _lora_job, str(checkpoint), topology, input_ids, targets
    [result] = [r for r in local_world(2).run(*job) if r is not None]
    prefix = "model.language_model.layers"

    adapters = result["adapters"]
    layers = range(len(text["layer_types"]))
    shared = range(len(layers) - text.get("num_kv_shared_layers", 0), len(layers))  # ``linear_q``: not a target
    expected = {f"{prefix}.{layer}.self_attn.o_proj" for layer in layers}
    expected |= {f"{prefix}.{layer}.self_attn.{p}_proj" for layer in layers for p in "qkv" if layer not in shared}
    if kind == "dense":
        expected |= {f"{prefix}.{layer}.mlp.{p}_proj" for layer in layers for p in ("gate", "up", "down")}
    if kind == "experts":  # the dense MLP beside the experts, and every routed expert, per expert
        projections = [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
        projections += [f"experts.{e}.{p}_proj" for e in range(text["num_experts"]) for p in ("gate", "up", "down")]
        expected = {f"{prefix}.{layer}.{p}" for layer in layers for p in projections}
    assert set(adapters) == {f"{module}.lora_{s}.weight" for module in expected for s in "AB"}
    for layer, layer_type in enumerate(text["layer_types"]):  # k_eq_v full layers: V is the adapted K
        if layer in shared or kind == "experts":
            continue
        k, v = (f"{prefix}.{layer}.self_attn.{p}_proj.lora_" for p in "kv")
        same = all(torch.equal(adapters[k + s + ".weight"], adapters[v + s + ".weight"]) for s in "AB")
        assert same == (layer_type == "full_attention" and text["attention_k_eq_v"]), (layer, layer_type)

    base = source.load(source.language_model_names())
    assert set(result["merged"]) == set(base)
    for name, weight in base.items():
        weight = hf_side_merge(name, weight, adapters)
        assert result["merged"][name].dtype == weight.dtype and torch.equal(result["merged"][name], weight), name

    merged = write_hf_checkpoint(tmp_path / "merged", result["merged"], source)
    max_abs, _, agreement = compare_logits(
        result["logits"], hf_logits(str(merged), input_ids, torch.float32), text["vocab_size"]
    )
    bound = FLOAT32_MAX_ABS_TOLERANCE["dense" if kind == "dense" else "moe"]
    assert max_abs <= bound and agreement == 1.0, (max_abs, agreement)


def _vime_save_job(
    hf_checkpoint: str, topology: Topology, build: str, out: str, targets: list[str] = TARGETS
) -> dict | str:
    """vime's ``save_lora_adapter_for_vllm`` on ``build`` (``release``, or ``fork`` with the double's
    ``model_bridge.py`` revision after ``@``); the release's own adapter export to compare with."""
    bridge, model = _trained_lora_model(hf_checkpoint, topology, targets)
    reference = {name: tensor for name, tensor, *_ in bridge.export_adapter_weights(model, show_progress=False)}
    fork, _, revision = build.partition("@")
    try:
        with fork_seams(revision or "1187a604") if fork == "fork" else contextlib.nullcontext():
            save_lora_adapter_for_vllm(bridge, model, targets, RANK, ALPHA, Path(out))
    except ValueError as error:  # every rank fails alike, before any collective of the save
        return str(error)
    return reference


@pytest.mark.parametrize("build", ["release", "fork"])
def test_vime_lora_adapter_for_vllm_on_each_build(local_world, checkpoint: Path, tmp_path: Path, build: str) -> None:
    """vime @00ca8b39 unpacks three fields from ``export_adapter_weights``: the fork's ``peft_bridge.py``
    @21018090 yields them (its adapter's local Megatron name third) and vime writes exactly the adapter the
    export streams, at TP2; the release yields two, and vime's loop stops at the first item."""
    out = tmp_path / "adapter"
    results = local_world(2).run(_vime_save_job, str(checkpoint), Topology(tp=2), build, str(out))
    if build == "release":
        assert results == ["not enough values to unpack (expected 3, got 2)"] * 2
        assert not out.exists()
        return
    saved = torch.load(out / "adapter_model.bin", weights_only=True)
    assert list(saved) == list(results[0]) and all(torch.equal(saved[n], results[0][n]) for n in saved)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"] and config["r"] == RANK
    assert (out / "STABLE").is_file()


def test_adapters_on_a_post_norm_linear_are_placed_or_refused() -> None:
    """A plain ``LoRALinear`` around a post-norm linear becomes the post-norm LoRA (twice is once); an input-norm
    linear returns its norm's output; any other adapter type around a post-norm linear is refused by name."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper
    from megatron.bridge.peft.lora_layers import LoRALinear

    from vime_gemma4_bridge.core.lora import PostNormLoRALinear, with_gemma4_adapters

    class PostNorm(torch.nn.Linear):
        post_layernorm = torch.nn.Identity()

    class InputNorm(torch.nn.Linear):
        return_layernorm_output = False

    class OtherAdapter(AdapterWrapper):
        pass

    identity = torch.nn.Identity()
    chunk = torch.nn.ModuleDict({"proj": LoRALinear(PostNorm(2, 2), identity)})
    chunk["qkv"] = LoRALinear(InputNorm(2, 2), identity)
    for _ in range(2):
        with_gemma4_adapters([chunk])
        assert type(chunk["proj"]) is PostNormLoRALinear and chunk["qkv"].to_wrap.return_layernorm_output
    chunk["proj"] = OtherAdapter(PostNorm(2, 2), torch.nn.Identity())
    with pytest.raises(ValueError, match=r"^proj: Gemma 4 normalises this linear's output .* OtherAdapter there"):
        with_gemma4_adapters([chunk])


def _refused_export_job(hf_checkpoint: str, case: str) -> str:
    """The adapter export of a model LoRA'd on ``linear_v`` alone, or LoRA'd after the build (not as a
    provider pre-wrap hook: Megatron-Bridge's own placement), or the build of a model LoRA'd on its routed
    experts at ETP2; its error, if any."""
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft.lora import LoRA

    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    try:
        if case == "v-only":
            bridge, model = _trained_lora_model(hf_checkpoint, Topology(), ["linear_v"])
        elif case == "experts-etp2":
            bridge, model = _trained_lora_model(hf_checkpoint, Topology(tp=2, etp=2), MLP_TARGETS)
        else:
            init_model_parallel(Topology())
            bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
            model = LoRA(target_modules=TARGETS, dim=RANK, alpha=ALPHA)(convert.build_model(bridge, Topology()))
        list(bridge.export_adapter_weights(model, show_progress=False))
    except ValueError as error:
        return str(error)
    return "exported"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        # CanonicalLoRA on linear_v alone: a full layer's V is K, so its V adapter never acted.
        ("v-only", "model.language_model.layers.1.self_attn.v_proj.lora_A.weight: a v_proj adapter of a k_eq_v"),
        # It trained post_norm(W x) + B A x, which neither export can represent; the line names the fix.
        ("late", "decoder.layers.0.self_attention.linear_proj: this adapter was applied after the Gemma 4 provider"),
        # Megatron-Bridge's expert adapter mixes partial products over ETP ranks (UPSTREAM 59): refused at build.
        ("experts-etp2", "decoder.layers.0.mlp.experts.linear_fc1: LoRA on routed experts at expert tensor parallel"),
    ],
)
def test_adapters_no_export_can_represent_are_refused(local_world, checkpoint: Path, case: str, message: str) -> None:
    [got, _] = local_world(2).run(_refused_export_job, str(checkpoint), case)
    assert got.startswith(message), got


@pytest.mark.parametrize("revision", ["1187a604", "d063066b"])
def test_vime_expert_lora_adapter_on_the_fork(local_world, checkpoint: Path, tmp_path: Path, revision: str) -> None:
    """vime's save of an MoE adapter (``linear_fc1`` / ``linear_fc2``: the dense MLP and every routed
    expert) on the fork double, at EP2. The fork's ``peft_bridge.py`` asks each expert's HF base names:
    given the stack's, @21018090 yields each expert's adapter under the stack's name (the plugin refused
    it: the experts cannot be told apart) and @d063066b packs the experts into stacks without a Megatron
    name. The plugin names each expert's own tensors, so both take the fork's per-expert road: vime writes
    exactly the release's export, ``experts.<e>.<gate|up|down>_proj.lora_A/B.weight``."""
    out = tmp_path / "adapter"
    build = f"fork@{revision}"
    results = local_world(2).run(_vime_save_job, str(checkpoint), Topology(ep=2), build, str(out), MLP_TARGETS)
    assert all(isinstance(result, dict) for result in results), results
    saved = torch.load(out / "adapter_model.bin", weights_only=True)
    assert list(saved) == list(results[0]) and all(torch.equal(saved[n], results[0][n]) for n in saved)
    text = HFCheckpoint(checkpoint).config["text_config"]
    layers, experts = range(len(text["layer_types"])), range(text["num_experts"])
    modules = [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    modules += [f"experts.{e}.{p}_proj" for e in experts for p in ("gate", "up", "down")]
    prefix = "model.language_model.layers"
    assert set(saved) == {f"{prefix}.{i}.{m}.lora_{s}.weight" for i in layers for m in modules for s in "AB"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["gate_proj", "up_proj", "down_proj"]


def test_the_adapter_stream_holds_only_k_eq_v_layers_k_adapters_and_passes_other_names() -> None:
    """``stream_adapter_weights_megatron_to_hf`` over a stand-in for upstream's stream (its
    ``HFWeightTuple`` items, in its q, k, v order): a name that is no ``.lora_[AB].weight`` passes through
    (it raised ``AttributeError`` on ``None.groups()``); a k_proj adapter is held only where the layer's
    v_proj is absent in HF (k_eq_v full layers) and only until that v_proj item (every layer's was kept
    to the end of the stream); the k_eq_v layer's v_proj adapter is its k_proj one."""
    import gc
    import weakref

    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple

    from vime_gemma4_bridge.core.lora import Gemma4AdapterExport

    def lora(layer: int, projection: str, side: str) -> HFWeightTuple:
        name = f"model.language_model.layers.{layer}.self_attn.{projection}.lora_{side}.weight"
        return HFWeightTuple(name, torch.full((2, 2), float(layer)))

    items = [lora(0, p, s) for p in ("q_proj", "k_proj", "v_proj") for s in "AB"]  # sliding: V of its own
    items += [HFWeightTuple("model.language_model.layers.0.self_attn.magnitude", torch.zeros(1))]
    items += [lora(1, p, s) for p in ("q_proj", "k_proj", "v_proj") for s in "AB"]  # full, k_eq_v: V is K
    sliding_k = weakref.ref(items[2].weight)
    full_k = items[9].weight

    class Upstream:
        def stream_adapter_weights_megatron_to_hf(self):
            while items:
                yield items.pop(0)

    class Bridge(Gemma4AdapterExport, Upstream):
        def _absent_in_hf(self, hf_name: str) -> bool:
            return hf_name.endswith("layers.1.self_attn.v_proj.weight")

    stream = Bridge().stream_adapter_weights_megatron_to_hf()
    names = []
    for item in stream:
        names.append(item.param_name)
        if item.param_name.endswith("magnitude"):
            gc.collect()
            assert sliding_k() is None, "a layer with its own V had its k_proj adapter held"
        if item.param_name.endswith("layers.1.self_attn.v_proj.lora_A.weight"):
            assert item.weight is full_k
        del item
    assert len(names) == 13 and names[6].endswith("magnitude")
