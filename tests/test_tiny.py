"""Tests of the tiny checkpoint factory: loadable by transformers, deterministic, every tensor distinct."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from vime_gemma4_bridge.cli import main as cli
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.testing.weights import assert_all_distinct

VOCAB = TinySpec().vocab_size
IMAGE_TOKEN, BOI, EOI = 7, 5, 6

#: name -> spec: the three kinds the bridge must handle, plus KV sharing on a dense text model.
KINDS: dict[str, TinySpec] = {
    "vl-moe": TinySpec(),
    "causal-moe": TinySpec(causal_lm=True),
    "vl-dense": TinySpec(moe=False),
    "causal-dense-kvshared": TinySpec(moe=False, causal_lm=True, kv_shared_layers=2, dtype="float16"),
}


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_checkpoint(root / name, spec) for name, spec in KINDS.items()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_loads_and_runs_in_transformers(built: dict[str, Path], kind: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec, path = KINDS[kind], built[kind]
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == [spec.architecture]
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == spec.architecture
    assert model.dtype == spec.torch_dtype
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    # Loaded weights are the written ones, bit for bit (the tied lm_head included).
    saved = _read(path)
    state = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name
    embed = next(n for n in saved if n.endswith("embed_tokens.weight"))
    assert torch.equal(model.lm_head.weight, saved[embed])

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == VOCAB and tok.pad_token_id == 0 and tok.eos_token_id == 1 and tok.bos_token_id == 2
    ids = tok("the experts and the layers", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 2 and int(ids.max()) < VOCAB
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB)
    assert torch.isfinite(logits).all() and logits.float().std() > 0.1

    if not spec.causal_lm:  # one 24x24 image = 6x6 patches of 4x4, pooled 3x3 -> 4 soft tokens
        assert tok.image_token_id == config.image_token_id == IMAGE_TOKEN
        patches = torch.rand(1, 36, 3 * 4 * 4, generator=torch.Generator().manual_seed(0))
        grid = torch.stack(torch.meshgrid(torch.arange(6), torch.arange(6), indexing="xy"), -1).reshape(1, 36, 2)
        mm_ids = torch.tensor([[2, BOI, *[IMAGE_TOKEN] * 4, EOI, 40, 41]])
        with torch.no_grad():
            with_image = model(input_ids=mm_ids, pixel_values=patches.to(model.dtype), image_position_ids=grid).logits
            other_image = model(
                input_ids=mm_ids, pixel_values=(1 - patches).to(model.dtype), image_position_ids=grid
            ).logits
        assert with_image.shape == (1, mm_ids.shape[1], VOCAB) and torch.isfinite(with_image).all()
        assert not torch.equal(with_image[0, -1], other_image[0, -1])  # the vision tower is wired in


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_tensor_distinct_and_structure(built: dict[str, Path], kind: str) -> None:
    spec, path = KINDS[kind], built[kind]
    saved = _read(path)
    assert_all_distinct(saved)
    assert {t.dtype for t in saved.values()} == {spec.torch_dtype}
    assert not any(n.startswith("lm_head") for n in saved)  # tied to the embedding, not saved
    p = "model.language_model." if not spec.causal_lm else "model."
    types = spec.resolved_layer_types()
    for i, layer_type in enumerate(types):
        layer = {n[len(f"{p}layers.{i}.") :]: t for n, t in saved.items() if n.startswith(f"{p}layers.{i}.")}
        assert layer["layer_scalar"].shape == (1,) and layer["layer_scalar"].item() > 0
        full = layer_type == "full_attention"
        head_dim = spec.global_head_dim if full else spec.head_dim
        assert layer["self_attn.q_proj.weight"].shape == (spec.heads * head_dim, spec.hidden_size)
        shared = i >= spec.layers - spec.kv_shared_layers
        if shared:
            assert not any(k.startswith(("self_attn.k_", "self_attn.v_")) for k in layer)
        else:
            kv_heads = spec.global_kv_heads if full and spec.attention_k_eq_v else spec.kv_heads
            assert layer["self_attn.k_proj.weight"].shape == (kv_heads * head_dim, spec.hidden_size)
            assert ("self_attn.v_proj.weight" in layer) == (not (full and spec.attention_k_eq_v))
        if spec.moe:
            assert layer["experts.gate_up_proj"].shape == (
                spec.experts,
                2 * spec.moe_intermediate_size,
                spec.hidden_size,
            )
            assert layer["experts.down_proj"].shape == (spec.experts, spec.hidden_size, spec.moe_intermediate_size)
            assert layer["router.per_expert_scale"].shape == (spec.experts,)
            assert "pre_feedforward_layernorm_2.weight" in layer
        else:
            assert not any(k.startswith(("experts.", "router.")) for k in layer)
            assert layer["per_layer_input_gate.weight"].shape == (spec.per_layer_input_size, spec.hidden_size)
        assert layer["mlp.gate_proj.weight"].shape == (spec.intermediate_size, spec.hidden_size)
    assert not any(n.startswith(f"{p}layers.{len(types)}.") for n in saved)
    assert any(n.startswith("model.vision_tower.") for n in saved) == (not spec.causal_lm)
    assert not any("audio" in n for n in saved)


def test_deterministic_and_seeded(built: dict[str, Path], tmp_path: Path) -> None:
    again = write_tiny_checkpoint(tmp_path / "again", TinySpec())
    assert _digests(again) == _digests(built["vl-moe"])  # every file, safetensors included, byte-identical
    other = _read(write_tiny_checkpoint(tmp_path / "seed1", TinySpec(seed=1)))
    first = _read(again)
    assert first.keys() == other.keys()
    assert all(not torch.equal(first[n], other[n]) for n in first)


def test_global_rng_untouched(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    write_tiny_checkpoint(tmp_path / "out", TinySpec(causal_lm=True))
    assert torch.equal(torch.rand(4), expected)


def test_cli_refuses_non_empty_out_and_force_replaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    before = sorted(p.name for p in tmp_path.iterdir())

    assert cli.main(["tiny", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err and "--force" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no partial sibling left behind
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"

    assert cli.main(["tiny", str(out), "--causal-lm", "--force"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and "Gemma4ForCausalLM" in summary[0] and "MoE" in summary[0] and str(out) in summary[0]
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_writes_a_family_member_like_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tiny --like e2b``: the E2B-shaped spec of the family tests (PLE, 5 KV-shared layers, double-wide MLP)."""
    import json

    out = tmp_path / "e2b"
    assert cli.main(["tiny", str(out), "--like", "e2b", "--causal-lm"]) == 0
    assert "Gemma4ForCausalLM (dense, 8 layers" in capsys.readouterr().out
    text = json.loads((out / "config.json").read_text())
    special = (text["num_kv_shared_layers"], text["use_double_wide_mlp"], text["hidden_size_per_layer_input"])
    assert special == (5, True, 4)
    saved = _read(out)
    widths = [saved[f"model.layers.{i}.mlp.down_proj.weight"].shape[1] for i in (0, 3)]
    assert widths[1] == 2 * widths[0]
    assert not any(".layers.3.self_attn.k_proj" in name for name in saved)


def test_probe_refuses_experts_on_a_dense_checkpoint_saying_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "e4b"
    assert cli.main(["tiny", str(out), "--like", "e4b"]) == 0
    capsys.readouterr()
    assert cli.main(["probe", "--hf-checkpoint", str(out), "--experts", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this checkpoint is dense" in err[0] and "drop --experts" in err[0], err


def test_cli_writes_into_empty_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert cli.main(["tiny", str(out), "--dense", "--causal-lm", "--per-layer-input-size", "0"]) == 0
    assert "dense" in capsys.readouterr().out
    saved = _read(out)
    assert not any("per_layer" in n for n in saved)  # PLE disabled, as in the large dense model
    assert {p.name for p in out.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_cli_non_default_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "custom"
    argv = ["tiny", str(out), "--layers", "6", "--layer-types", "sliding,sliding,full,sliding,full,full"]
    argv += ["--experts", "8", "--top-k", "2", "--no-attention-k-eq-v", "--dtype", "float32", "--seed", "7"]
    assert cli.main(argv) == 0
    assert "8x top-2, 6 layers, float32" in capsys.readouterr().out
    saved = _read(out)
    assert_all_distinct(saved)
    p = "model.language_model.layers."
    assert saved[f"{p}5.experts.gate_up_proj"].shape == (8, 32, 64)
    assert saved[f"{p}2.self_attn.v_proj.weight"].shape == (8 * 16, 64)  # full layer, K != V: kv_heads x global dim
    assert not any(n.startswith(f"{p}6.") for n in saved)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.text_config.layer_types[:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[2, 100, 200, 299, 17, 18, 19, 20, 21, 22]])).logits
    assert logits.shape == (1, 10, VOCAB) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "extra",
    [
        ["--layers", "3", "--layer-types", "sliding,full"],  # length mismatch
        ["--layer-types", "sliding,full,full,sliding"],  # last layer must be full
        ["--top-k", "32"],  # more than the experts
        ["--vocab-size", "200"],  # tokenizer does not fit
        ["--kv-shared-layers", "2"],  # dense only
    ],
)
def test_cli_rejects_bad_specs(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
    assert cli.main(["tiny", str(tmp_path / "bad"), *extra]) == 2
    assert capsys.readouterr().err.startswith("vime-gemma4 tiny: error: ")
    assert list(tmp_path.iterdir()) == []


def test_cli_takes_one_shape_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--like`` and ``--preset`` together: argparse's one-line refusal (exit 2), nothing written."""
    with pytest.raises(SystemExit) as ended:
        cli.main(["tiny", str(tmp_path / "bad"), "--like", "e2b", "--preset", "e2b"])
    assert ended.value.code == 2
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].endswith("argument --preset: not allowed with argument --like")
    )
    assert list(tmp_path.iterdir()) == []


def test_assert_all_distinct_catches_mixups() -> None:
    g = torch.Generator().manual_seed(0)
    good = {"a": torch.randn(4, 3, generator=g), "b": torch.randn(3, 4, generator=g), "s": torch.tensor([0.7])}
    assert_all_distinct(good)
    with pytest.raises(AssertionError, match="b equals a"):
        assert_all_distinct({**good, "b": good["a"].reshape(3, 4).clone()})  # equal after flattening
    with pytest.raises(AssertionError, match="constant"):
        assert_all_distinct({**good, "norm.weight": torch.ones(8)})
    with pytest.raises(AssertionError, match="init value"):
        assert_all_distinct({**good, "layer_scalar": torch.ones(1)})
    experts = torch.randn(4, 2, 3, generator=g)
    experts[3] = experts[1]
    with pytest.raises(AssertionError, match="slices 1 and 3"):
        assert_all_distinct({**good, "experts.down_proj": experts})
    with pytest.raises(AssertionError, match="non-finite"):
        assert_all_distinct({**good, "c": torch.tensor([1.0, float("nan")])})


#: The published text configs the presets carry (issue 35; sources in testing/spec.PUBLISHED):
#: hidden, layers, MLP, heads, KV heads, global KV heads (k_eq_v), head dims, KV-shared layers, PLE width.
PUBLISHED_FIELDS = {
    "26b-a4b": (2816, 30, 2112, 16, 8, 2, 256, 512, 0, 0),
    "31b": (5376, 60, 21504, 32, 16, 4, 256, 512, 0, 0),
    "12b": (3840, 48, 15360, 16, 8, 1, 256, 512, 0, None),
    "e4b": (2560, 42, 10240, 8, 2, 2, 256, 512, 18, 256),
    "e2b": (1536, 35, 6144, 8, 1, 1, 256, 512, 20, 256),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_FIELDS))
def test_presets_carry_the_published_shapes(name: str) -> None:
    """The config a preset writes has the member's published fields; cut to N layers it keeps the first N (the
    last made full) and their KV sharing; 26B-A4B cut to 2 layers is the 4.76 GB of language model issue 35 measured."""
    from vime_gemma4_bridge.testing.spec import PUBLISHED, preset
    from vime_gemma4_bridge.testing.synthetic import spec_bytes

    text = PUBLISHED[name].text_config().to_dict()
    fields = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    fields += ("num_global_key_value_heads", "head_dim", "global_head_dim", "num_kv_shared_layers")
    fields += ("hidden_size_per_layer_input",)
    assert tuple(text.get(field) for field in fields) == PUBLISHED_FIELDS[name]
    assert text["vocab_size"] == 262144
    cut = preset(name, 2)
    assert cut.resolved_layer_types() == ["sliding_attention", "full_attention"] and cut.kv_shared_layers == 0
    if name == "26b-a4b":
        assert (text["num_experts"], text["top_k_experts"], text["moe_intermediate_size"]) == (128, 8, 704)
        assert round(spec_bytes(cut) / 1e9, 2) == 4.76
    if name == "e2b":  # layers 15.. share K/V in the published model: the first 17 keep two of them
        assert preset(name, 17).kv_shared_layers == 2 and preset(name, 17).double_wide_mlp


def test_cli_preset_writes_tensor_by_tensor_and_refuses_a_bad_cut(tmp_path: Path, capsys) -> None:
    """``tiny --preset e2b --layers 1``: real widths (a 262144 x 1536 embedding), the pre-flight accepts it,
    its shards carry digests; ``--layers 0`` is refused in one line and writes nothing."""
    from vime_gemma4_bridge.io.hf import HFCheckpoint
    from vime_gemma4_bridge.io.hf_model import check_config, check_language_model

    out = tmp_path / "e2b"
    assert cli.main(["tiny", str(out), "--preset", "e2b", "--layers", "1"]) == 0
    assert "Gemma4ForConditionalGeneration (dense, 1 layers, bfloat16)" in capsys.readouterr().out
    checkpoint = HFCheckpoint(out)
    check_config(checkpoint)
    check_language_model(checkpoint)
    assert checkpoint.shapes()["model.language_model.embed_tokens.weight"] == [262144, 1536]
    assert cli.main(["verify-checkpoint", str(out)]) == 0
    assert cli.main(["tiny", str(tmp_path / "bad"), "--preset", "31b", "--layers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "vime-gemma4 tiny: error: --layers 0: 31b has 60 layers; choose 1 to 60"
    assert not (tmp_path / "bad").exists()
