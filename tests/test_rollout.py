"""Rollout-ready streams without ranks: block FP8, the per-expert layout, their views and vLLM's naming rules.

The multi-rank streams (TP2·PP2·EP4 on 8 ranks, the default topology, the fork seams, vime's switch)
are in tests/test_live.py, beside the live export they share a world with.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vime_gemma4_bridge.convert.fp8 import (
    BLOCK,
    FP8_MAX,
    SCALE_SUFFIX,
    dequantize_block_fp8,
    ignored_layers,
    is_quantized,
    quantize_block_fp8,
    quantize_stream,
    quantized_checkpoint,
)
from vime_gemma4_bridge.core.hf_layout import STACK_NAME, split_expert, stack_of
from vime_gemma4_bridge.io.hf import HFCheckpoint, LazyTensor
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.update import verify_update

P = "model.language_model."


@pytest.fixture(scope="module")
def hf_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("rollout") / "hf", TinySpec(seed=5))


def per_expert_stream(source: HFCheckpoint) -> list[tuple[str, torch.Tensor]]:
    """The language model in the per-expert layout, as the bridge's hook splits each expert."""
    out = []
    for name, tensor in source.load(source.language_model_names()).items():
        if STACK_NAME.match(name):
            out += [part for e, piece in enumerate(tensor) for part in split_expert(name, e, piece)]
        else:
            out.append((name, tensor))
    return out


def write_dump(directory: Path, named: list[tuple[str, torch.Tensor]], files: int = 3) -> Path:
    directory.mkdir(parents=True)
    step = -(-len(named) // files)
    for index in range(files):
        part = {name: tensor.contiguous() for name, tensor in named[index * step : (index + 1) * step]}
        save_file(part, directory / f"model-{index + 1:05d}-of-{files:05d}.safetensors")
    return directory


# ------------------------------------------------------------------------------------ block FP8


def test_block_fp8_scales_are_block_maxima_and_dequantise_within_e4m3_rounding() -> None:
    torch.manual_seed(0)
    weight = (torch.randn(300, 260) * torch.logspace(-3, 1, 260)).to(torch.bfloat16)  # ragged edge blocks
    weight[128:256, 128:256] = 0  # an all-zero block
    q, scale = quantize_block_fp8(weight)
    assert q.dtype == torch.float8_e4m3fn and q.shape == weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 3)  # ceil(300/128), ceil(260/128)
    for i in range(3):
        for j in range(3):
            block = weight[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].float()
            amax = block.abs().max()
            assert scale[i, j] == (amax / FP8_MAX if amax > 0 else 1.0), (i, j)
    exact = weight.float()
    error = (dequantize_block_fp8(q, scale) - exact).abs()
    per_element = scale.repeat_interleave(BLOCK, 0)[:300].repeat_interleave(BLOCK, 1)[:, :260]
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value) above 2^-6; subnormal steps of 2^-9 below
    bound = torch.maximum(exact.abs() * 2**-4, per_element * 2**-10)
    assert bool((error <= bound * 1.0001).all()), float((error / bound).max())
    assert torch.equal(dequantize_block_fp8(q, scale)[128:256, 128:256], torch.zeros(128, 128))
    assert q.float().abs().max() <= FP8_MAX


def test_block_fp8_refuses_what_it_cannot_quantize() -> None:
    with pytest.raises(ValueError, match="2-D weights"):
        quantize_block_fp8(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="per-expert expert layout"):
        list(quantize_stream([(P + "layers.0.experts.gate_up_proj", torch.zeros(2, 4, 4), "m")]))


def test_fp8_quantizes_exactly_the_gemm_weights(hf_vl: Path) -> None:
    source = HFCheckpoint(hf_vl)
    quantized = {name for name, _ in per_expert_stream(source) if is_quantized(name)}
    kinds = {name.split(".layers.")[1].split(".", 1)[1] for name in quantized}
    kinds = {"experts.E." + k.split(".", 2)[2] if k.startswith("experts.") else k for k in kinds}
    assert kinds == {
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "experts.E.gate_proj.weight",
        "experts.E.up_proj.weight",
        "experts.E.down_proj.weight",
    }
    for name in source.names():  # never a tower's layer, a norm, the router, an embedding, layer_scalar
        if not name.startswith(P) or any(k in name for k in ("norm", "router", "embed", "layer_scalar")):
            assert not is_quantized(name), name


# ------------------------------------------------------------------------------- per-expert layout


def test_per_expert_names_round_trip() -> None:
    stack = P + "layers.3.experts.gate_up_proj"
    parts = split_expert(stack, 7, torch.arange(8.0).reshape(4, 2))
    assert [name for name, _ in parts] == [
        P + "layers.3.experts.7.gate_proj.weight",
        P + "layers.3.experts.7.up_proj.weight",
    ]
    assert torch.equal(parts[1][1], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))  # up rows follow gate rows
    assert stack_of(parts[0][0]) == (stack, 7, "gate_proj")
    assert stack_of(P + "layers.3.experts.7.down_proj.weight" + SCALE_SUFFIX) == (
        P + "layers.3.experts.down_proj" + SCALE_SUFFIX,
        7,
        "down_proj",
    )
    assert stack_of(P + "layers.3.mlp.down_proj.weight") is None


def test_verify_update_restacks_a_per_expert_update_bitwise(hf_vl: Path, tmp_path: Path) -> None:
    source = HFCheckpoint(hf_vl)
    dump = write_dump(tmp_path / "ok", per_expert_stream(source))
    report = verify_update(hf_vl, dump)
    assert report["ok"] and report["expert_layout"] == "per-expert", report["problems"]
    assert report["matched"] == len(source.language_model_names())

    named = per_expert_stream(source)
    one = P + "layers.2.experts.5.up_proj.weight"
    stray = P + "layers.1.experts.3.down_proj.weight"
    named = [(n, t.flip(0) if n == one else t) for n, t in named if n != stray]  # one expert wrong, one missing
    report = verify_update(hf_vl, write_dump(tmp_path / "bad", named))
    problems = "\n".join(report["problems"])
    assert f"{P}layers.2.experts.gate_up_proj: values differ" in problems
    assert f"{P}layers.1.experts.down_proj: missing from the update" in problems  # incomplete: not restacked
    assert f"{P}layers.1.experts.0.down_proj.weight: not a language-model tensor" in problems


def test_verify_update_checks_an_fp8_update_bitwise(hf_vl: Path, tmp_path: Path) -> None:
    source = HFCheckpoint(hf_vl)
    named = [(n, t) for n, t, _ in quantize_stream((n, t, "") for n, t in per_expert_stream(source))]
    report = verify_update(hf_vl, write_dump(tmp_path / "ok", named))
    assert report["ok"] and report["fp8"], report["problems"]
    scale = P + "layers.0.self_attn.o_proj.weight" + SCALE_SUFFIX
    named = [(n, t * 2 if n == scale else t) for n, t in named]
    report = verify_update(hf_vl, write_dump(tmp_path / "bad", named))
    assert len(report["problems"]) == 1 and report["problems"][0].startswith(f"{scale}: values differ")


def test_doctor_reads_a_per_expert_checkpoint(hf_vl: Path, tmp_path: Path) -> None:
    from test_doctor import diagnose

    source = HFCheckpoint(hf_vl)
    language = per_expert_stream(source)
    others = [(n, t) for n, t in source.load().items() if not n.startswith(P)]

    def checkpoint(out: Path, named: list[tuple[str, torch.Tensor]]) -> Path:
        write_dump(out, named, files=1)
        shutil.copy(hf_vl / "config.json", out / "config.json")
        file = next(out.glob("*.safetensors"))
        file.rename(out / "model.safetensors")
        return out

    status, text, _ = diagnose(hf_vl, checkpoint(tmp_path / "same", language + others))
    assert status == 0 and text.startswith("IDENTICAL"), text
    copy = dict(language)
    copy[P + "layers.3.experts.15.down_proj.weight"] = copy[P + "layers.3.experts.3.down_proj.weight"].clone()
    status, _, report = diagnose(hf_vl, checkpoint(tmp_path / "dup", list(copy.items()) + others))
    assert status == 1 and report["causes"][0]["kind"] == "expert-duplicate"
    assert "layer 3 expert 15 is a copy of expert 3" in report["causes"][0]["message"]


# ------------------------------------------------------------------------------ FP8 checkpoints


def test_quantized_checkpoint_reads_a_lazy_stack_once(hf_vl: Path) -> None:
    source = HFCheckpoint(hf_vl)
    name = P + "layers.0.experts.gate_up_proj"
    stack = source.load([name])[name]
    reads = []

    def pieces():
        reads.append(1)
        yield from stack.reshape(len(stack), -1)  # one expert a piece

    lazy = LazyTensor(tuple(stack.shape), stack.dtype, pieces)
    entries = quantized_checkpoint([(name, lazy), (P + "norm.weight", torch.ones(3))])
    assert [n for n, _ in entries][:4] == [
        P + "layers.0.experts.0.gate_proj.weight",
        P + "layers.0.experts.0.gate_proj.weight" + SCALE_SUFFIX,
        P + "layers.0.experts.0.up_proj.weight",
        P + "layers.0.experts.0.up_proj.weight" + SCALE_SUFFIX,
    ]
    produced = {n: torch.cat([p.reshape(-1) for p in t.pieces()]) for n, t in entries[:-1]}
    assert len(reads) == 1, "the lazy stack is read once, not once per expert"
    for e, piece in enumerate(stack):
        for part_name, part in split_expert(name, e, piece):
            q, scale = quantize_block_fp8(part)
            assert torch.equal(produced[part_name].view(torch.uint8), q.reshape(-1).view(torch.uint8))
            assert torch.equal(produced[part_name + SCALE_SUFFIX], scale.reshape(-1))
    assert entries[-1][0] == P + "norm.weight"


def test_ignored_layers_name_every_bf16_module(hf_vl: Path) -> None:
    source = HFCheckpoint(hf_vl)
    shapes = {n: s for n, (s, _) in source.signatures(source.names()).items()}
    ignored = ignored_layers(shapes)
    assert P + "layers.0.router.proj" in ignored and P + "embed_tokens" in ignored
    assert any(name.startswith("model.vision_tower.") for name in ignored)
    assert not any(is_quantized(name + ".weight") for name in ignored)


@pytest.mark.slow  # a conversion in this process (~20 s): not in the fast layer
def test_export_quantize_fp8_writes_a_checkpoint_vllm_serves(hf_vl: Path, tmp_path: Path, capsys) -> None:
    """At the default topology (experts streamed from the torch_dist files): the FP8 checkpoint, complete."""
    from vime_gemma4_bridge.cli import main as cli

    assert cli.main(["import", "--hf-checkpoint", str(hf_vl), "--save", str(tmp_path / "td")]) == 0
    out = tmp_path / "fp8"
    assert (
        cli.main(
            [
                "export",
                "--load",
                str(tmp_path / "td"),
                "--hf-checkpoint",
                str(hf_vl),
                "--output",
                str(out),
                "--quantize",
                "fp8",
            ]
        )
        == 0
    )
    wrote, note = capsys.readouterr().out.splitlines()[-2:]
    assert wrote.endswith("(block FP8)")
    assert note.startswith("note: vLLM's block-FP8 loader needs these multiples of 128 and will refuse")
    assert "experts.<e>.gate_proj (16 rows)" in note  # the tiny model's sizes; 26B-A4B's are 704 and 2112
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["activation_scheme"] == "dynamic"
    assert config["weight_block_size"] == [128, 128] and P + "layers.0.router.proj" in config["ignored_layers"]
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(file))
    source = HFCheckpoint(hf_vl)
    expected = [(n, t) for n, t, _ in quantize_stream((n, t, "") for n, t in per_expert_stream(source))]
    expected += [(n, t) for n, t in source.load().items() if not n.startswith(P)]
    assert sorted(written) == sorted(n for n, _ in expected)
    for name, tensor in expected:
        got = written[name]
        assert got.dtype == tensor.dtype and torch.equal(
            got.view(torch.uint8), tensor.contiguous().view(torch.uint8)
        ), name


def test_the_vime_switch_is_read_from_the_environment(monkeypatch) -> None:
    from vime_gemma4_bridge.core.expert_layout import EXPERT_LAYOUT_ENV, expert_layout, exporting_experts

    monkeypatch.delenv(EXPERT_LAYOUT_ENV, raising=False)
    assert expert_layout() == "stacked"
    monkeypatch.setenv(EXPERT_LAYOUT_ENV, "per-expert")
    assert expert_layout() == "per-expert"
    with exporting_experts("stacked"):  # a stream's own choice wins over the environment
        assert expert_layout() == "stacked"
    assert expert_layout() == "per-expert"
    monkeypatch.setenv(EXPERT_LAYOUT_ENV, "per_expert")
    with pytest.raises(
        ValueError, match=r"VIME_GEMMA4_EXPERT_LAYOUT 'per_expert': expected one of stacked, per-expert"
    ):
        expert_layout()
    with pytest.raises(ValueError, match="expert layout 'x'"):
        with exporting_experts("x"):
            pass


@pytest.mark.slow  # a conversion in this process (~20 s): not in the fast layer
def test_export_live_fp8_at_the_default_topology(hf_vl: Path, tmp_path: Path, capsys) -> None:
    """The command line at one rank: the FP8 stream, then verify-update's verdict on it."""
    from vime_gemma4_bridge.cli import main as cli

    dump = tmp_path / "dump"
    args = ["export-live", "--hf-checkpoint", str(hf_vl), "--buffer-size", "300000", "--dump", str(dump)]
    assert cli.main([*args, "--quantize", "fp8"]) == 0
    report, note = capsys.readouterr().out.splitlines()[-2:]
    assert report.endswith(f"experts per-expert, fp8 -> {dump}") and "mlp.gate_proj (" in note
    assert "quantization_config" in json.loads((dump / "config.json").read_text())
    assert cli.main(["verify-update", "--hf-checkpoint", str(hf_vl), "--dump", str(dump)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("verify-update OK:") and last.endswith(
        "experts per-expert (restacked), fp8 (against the checkpoint quantized)"
    )


def test_vllm_block_misfits_name_what_vllm_refuses() -> None:
    """26B-A4B's sizes (experts 704, dense MLP 2112) against vLLM's 128-row block rule; aligned sizes pass."""
    from vime_gemma4_bridge.convert.fp8 import vllm_block_misfits

    layer = P + "layers.0."
    shapes = {
        layer + "experts.gate_up_proj": [128, 1408, 2816],
        layer + "mlp.gate_proj.weight": [2112, 2816],
        layer + "mlp.up_proj.weight": [2112, 2816],  # the last shard of gate_up: exempt
        layer + "self_attn.q_proj.weight": [4096, 2816],
        layer + "self_attn.k_proj.weight": [2048, 2816],
        layer + "self_attn.o_proj.weight": [2816, 4096],
    }
    assert vllm_block_misfits(shapes) == ["experts.<e>.gate_proj (704 rows)", "mlp.gate_proj (2112 rows)"]
    shapes[layer + "experts.gate_up_proj"] = [128, 1536, 2816]
    shapes[layer + "mlp.gate_proj.weight"] = [2048, 2816]
    assert vllm_block_misfits(shapes) == []


def test_rollout_checkpoint_decides_which_weights_the_live_sync_sends_in_fp8() -> None:
    """core/block_fp8.rollout_block_fp8_weights: the checkpoint's own ``_scale_inv`` tensors, under its fp8 config."""
    from types import SimpleNamespace

    from vime_gemma4_bridge.core.block_fp8 import rollout_block_fp8_weights

    def opened_on(quantization: dict | None, keys: list[str]) -> SimpleNamespace:
        config = SimpleNamespace(quantization_config=quantization)
        return SimpleNamespace(config=config, state=SimpleNamespace(source=SimpleNamespace(get_all_keys=lambda: keys)))

    keys = [P + "layers.0.self_attn.q_proj.weight", P + "layers.0.self_attn.q_proj.weight" + SCALE_SUFFIX]
    keys += [P + "norm.weight"]
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    assert rollout_block_fp8_weights(opened_on(fp8, keys)) == {P + "layers.0.self_attn.q_proj.weight"}
    assert rollout_block_fp8_weights(opened_on(None, keys)) == frozenset()  # a bf16 rollout checkpoint
    assert rollout_block_fp8_weights(opened_on({"quant_method": "compressed-tensors"}, keys)) == frozenset()
    with pytest.raises(ValueError, match=r"weight_block_size is \[64, 64\]: the live sync quantizes in \[128, 128\]"):
        rollout_block_fp8_weights(opened_on({**fp8, "weight_block_size": [64, 64]}, keys))
    with pytest.raises(ValueError, match="weight_block_size is None"):  # per-tensor FP8
        rollout_block_fp8_weights(opened_on({**fp8, "weight_block_size": None}, keys))


def test_live_sync_in_the_rollout_checkpoints_fp8_keeps_tuples_and_names_what_stays(capsys) -> None:
    """core/block_fp8.as_rollout_checkpoint_stores: the build's tuple type and fields kept, one line on what stayed."""
    from typing import NamedTuple

    from vime_gemma4_bridge.core.block_fp8 import as_rollout_checkpoint_stores

    class Item(NamedTuple):  # a build's export tuple, with a third field
        param_name: str
        weight: torch.Tensor
        megatron_param_name: str

    q_proj, router = P + "layers.0.self_attn.q_proj.weight", P + "layers.0.router.proj.weight"
    weight = torch.randn(130, 64)
    stream = [Item(q_proj, weight, "decoder.layers.0.self_attention.linear_qkv.weight"), Item(router, weight, "r")]
    out = list(as_rollout_checkpoint_stores(frozenset({q_proj}), stream))
    assert [(type(i), i.param_name, i.megatron_param_name) for i in out] == [
        (Item, q_proj, "decoder.layers.0.self_attention.linear_qkv.weight"),
        (Item, q_proj + SCALE_SUFFIX, "decoder.layers.0.self_attention.linear_qkv.weight"),
        (Item, router, "r"),
    ]
    q, scale_inv = quantize_block_fp8(weight)
    assert torch.equal(out[0].weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(out[1].weight, scale_inv)
    assert out[2].weight is weight
    assert capsys.readouterr().err.splitlines() == [
        "Gemma 4 live sync in the rollout checkpoint's block FP8: 1 weight(s) in FP8; 2-D weights as trained, "
        "as it stores them: model.language_model.layers.<n>.router.proj.weight"
    ]


def test_rollout_check_scores_completions_of_unequal_length(hf_vl: Path) -> None:
    """A server that stops one completion early (issue 49: ``torch.tensor`` of ragged lists raised) is scored
    token by token on what it served; a completion with no token is a ServerError naming the prompt."""
    from unittest import mock

    from vime_gemma4_bridge.verify import rollout

    lengths = iter([1, 3, 2])  # the vocabulary probe, then one completion per prompt

    def complete(server, model, prompt, max_tokens, vocab_size, sglang=False):
        return [(7, -1.0)] * next(lengths)

    patches = (
        mock.patch.object(rollout, "served_model", lambda server, model: "m"),
        mock.patch.object(rollout, "is_sglang", lambda server: False),
        mock.patch.object(rollout, "complete", complete),
    )
    with patches[0], patches[1], patches[2]:
        check = rollout.rollout_check(str(hf_vl), "http://stub", prompts=2, prompt_len=4, max_tokens=3)
        assert check.first_divergence is not None and check.first_divergence["prompt"] == 0
        assert math.isfinite(check.max_abs) and check.max_abs > 0
        lengths = iter([1, 3, 0])
        with pytest.raises(rollout.ServerError, match="no token for prompt 1"):
            rollout.rollout_check(str(hf_vl), "http://stub", prompts=2, prompt_len=4, max_tokens=3)


def test_rollout_check_tells_a_smaller_vocabulary_by_the_servers_answers(hf_vl: Path) -> None:
    """A server that refuses the checkpoint's last token id and serves id 0 has a smaller vocabulary, however
    its error is worded (the check searched the error text for "vocab" or "token id"); a server that refuses
    both is reported as refusing, with its own answer."""
    from unittest import mock

    from vime_gemma4_bridge.verify import rollout

    refuse_from = [10]

    def complete(server, model, prompt, max_tokens, vocab_size, sglang=False):
        if prompt[0] >= refuse_from[0]:
            raise rollout.ServerError(f"{server} refused a completion (HTTP 400): input out of range")
        return [(7, -1.0)] * max_tokens

    patches = (
        mock.patch.object(rollout, "served_model", lambda server, model: "m"),
        mock.patch.object(rollout, "is_sglang", lambda server: False),
        mock.patch.object(rollout, "complete", complete),
    )
    with patches[0], patches[1], patches[2]:
        with pytest.raises(rollout.ServerError, match="vocab mismatch: http://stub refuses token id"):
            rollout.rollout_check(str(hf_vl), "http://stub", prompts=1, prompt_len=4, max_tokens=2)
        refuse_from[0] = 0
        with pytest.raises(rollout.ServerError, match="refused a completion .HTTP 400.: input out of range"):
            rollout.rollout_check(str(hf_vl), "http://stub", prompts=1, prompt_len=4, max_tokens=2)


@pytest.mark.parametrize("causal_lm", [False, True], ids=["vl", "causal"])
def test_rollout_check_scores_a_layer_at_a_time_with_the_eager_logits(tmp_path: Path, causal_lm: bool) -> None:
    """``rollout-check``'s transformers side holds the embedding and norms and reads each decoder layer
    when it runs (the towers never): its logits are the eager model's, bitwise, for the VL checkpoint and
    the CausalLM one."""
    import transformers

    from vime_gemma4_bridge.verify.parity import _layer_by_layer, hf_logits

    hf = write_tiny_checkpoint(tmp_path / "hf", TinySpec(seed=6, causal_lm=causal_lm))
    config = transformers.AutoConfig.from_pretrained(hf)
    placement = _layer_by_layer(getattr(transformers, config.architectures[0]), config)
    layers = (config.text_config if hasattr(config, "text_config") else config).num_hidden_layers
    prefix = "model.language_model." if not causal_lm else "model."
    assert {name for name, where in placement.items() if where == "disk" and ".layers." in name} == {
        f"{prefix}layers.{index}" for index in range(layers)
    }
    assert placement["lm_head"] == "cpu" and placement[f"{prefix}embed_tokens"] == "cpu"
    assert causal_lm or placement["model.vision_tower"] == "disk"
    input_ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    eager = hf_logits(str(hf), input_ids, torch.float32)
    assert torch.equal(hf_logits(str(hf), input_ids, torch.float32, layer_by_layer=True), eager)
    # --device cuda: the held modules there, where accelerate then runs each offloaded layer
    on_gpu = _layer_by_layer(getattr(transformers, config.architectures[0]), config, "cuda")
    assert on_gpu == {name: "cuda" if where == "cpu" else where for name, where in placement.items()}


def test_rollout_check_refuses_cuda_where_torch_sees_none(hf_vl: Path, capsys) -> None:
    """``--device cuda`` on a machine without one: one line, exit 2, before any server is asked."""
    from vime_gemma4_bridge.cli.main import main

    assert not torch.cuda.is_available()
    argv = ["rollout-check", "--hf-checkpoint", str(hf_vl), "--server", "http://127.0.0.1:9", "--device", "cuda"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "vime-gemma4 rollout-check: error: --device cuda: torch sees no CUDA device here; "
        "leave --device out to score on the CPU"
    ]
