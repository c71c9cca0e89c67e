"""SGLang in the loop: the engine miles rolls out with generates, after every road, what it generates on the source.

SGLang 0.5.23 runs on the CPU in its own environment (``.venv-sglang``, ``make setup``), driven as a child
(tests/sglang_engine.py) or as its HTTP server (``sglang.launch_server``, which ``rollout-check`` talks
to). Harness-only changes, each named where it is made and each with a control test here:
the libcuda stub (tests/libcuda_stub.c), the attention-backend check told "triton" for torch_native,
the CPU norm fix, the router re-fuse after a load, and the skipped-name record
(tests/sglang_site/sitecustomize.py).

What the tests prove:

- with the CPU norm fix, SGLang on the source generates transformers' greedy tokens, logprobs within
  1e-5 (fp32): the engine is a faithful yardstick here; without it, it is not (control);
- miles' colocated sync (tests/miles_flow.py, miles @31f1ca96, on the fork's seams at TP2·PP2·EP4·ETP1
  on 8 ranks), bucketed by SGLang's own ``FlattenedTensorBucket`` and loaded by
  ``update_weights_from_tensor(load_format="flattened_bucket")`` between ``begin_weight_update`` /
  ``end_weight_update``, brings an engine perturbed to the twin back to the source's generation, stacked
  and per expert; ``update_weights_from_disk`` of ``roundtrip --output`` likewise; after every sync
  SGLang's own loaded-parameter set has every name sent (no name skipped silently);
- negative controls: expert 0 sent as expert E/EP changes the generation; a name SGLang does not know
  is answered "Success" and caught by the skipped-name check;
- SGLang's router-scale bug: an update that changes only ``router.scale`` is ignored by SGLang as shipped;
  ``rollout-check --server`` passes against an SGLang server of the source and fails, naming the prompt,
  against one on a perturbed checkpoint and against one hit by the bug.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_vllm
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vime_gemma4_bridge.cli.main import main as cli
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.io.hf import HFCheckpoint
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint
from vime_gemma4_bridge.verify.parity import excluded_token_ids, fixed_token_ids, hf_logits

REPO = Path(__file__).resolve().parents[1]
#: The SGLang environment (``make setup``); a GPU host sets ``VIME_SGLANG_PYTHON`` to its own SGLang's.
SGLANG_PYTHON = Path(os.environ.get("VIME_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))
STUB = REPO / ".venv-sglang" / "stub"
#: The vLLM tests' checkpoint, topology, chunk size and yardstick: both engines judge the same roads.
SPEC, TOPOLOGY, BUFFER, MAX_TOKENS = test_vllm.SPEC, test_vllm.TOPOLOGY, test_vllm.BUFFER, test_vllm.MAX_TOKENS
LOGPROB_TOLERANCE = test_vllm.LOGPROB_TOLERANCE
assert_same_generation = test_vllm.assert_same_generation
#: Every harness change, the workarounds included; each control test drops the one it shows is needed.
FIXED = ("torch-native", "cpu-norm", "router-refuse", "record-skipped")

pytestmark = pytest.mark.sglang


def _engine_env(patches: tuple[str, ...], skipped: Path | None = None) -> dict[str, str]:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"no SGLang environment at {SGLANG_PYTHON}: run `make setup` (it builds .venv-sglang)")
    library = ":".join(filter(None, [str(STUB), os.environ.get("LD_LIBRARY_PATH")]))
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "LD_LIBRARY_PATH": library,
        "PYTHONPATH": str(REPO / "tests" / "sglang_site"),
        "VIME_SGLANG_PATCHES": ",".join(patches),
        "VIME_SGLANG_SKIPPED": str(skipped or ""),
    }


class Engine:
    """One SGLang engine in the SGLang environment, driven over tests/sglang_engine.py's line protocol."""

    def __init__(self, model: Path, patches: tuple[str, ...] = FIXED, timeout: float = 300.0) -> None:
        read, write = os.pipe()
        stamp = f"{os.getpid()}-{time.monotonic_ns()}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-engine-{stamp}.log"
        env = _engine_env(patches, self.log.with_suffix(".skipped"))
        command = [str(SGLANG_PYTHON), str(REPO / "tests" / "sglang_engine.py"), str(model), "--answers-fd", str(write)]
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=log, pass_fds=(write,), text=True, env=env,
                start_new_session=True,
            )  # fmt: skip
        os.close(write)
        self.answers = os.fdopen(read)
        self.version: str = self.ask(None, timeout)["version"]

    def ask(self, request: dict | None, timeout: float = 300.0) -> dict:
        if request is not None:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], timeout)
        line = self.answers.readline() if ready else ""
        if not line:
            self.close()
            tail = self.log.read_text()[-3000:]
            raise AssertionError(f"SGLang engine {'gave no answer' if not ready else 'ended'}:\n{tail}")
        answer = json.loads(line)
        assert "error" not in answer, answer["error"]
        return answer

    def generate(self, prompts: list[list[int]]) -> dict:
        return self.ask({"op": "generate", "prompts": prompts, "max_tokens": MAX_TOKENS})

    def sync(self, op: str, **source: object) -> list[str]:
        """``push`` (miles' colocated sync) or ``disk``; every SGLang answer must say success, and SGLang's
        loaded-parameter set must have taken every name sent."""
        results = self.ask({"op": op, **source})["results"]
        assert all("True" in r for r in results), results
        assert self.skipped() == [], "SGLang skipped names it was sent"
        return results

    def skipped(self) -> list[str]:
        return self.ask({"op": "skipped"})["skipped"]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.process.pid, 9)
                self.process.wait()
        self.answers.close()


# ------------------------------------------------------------------------------------------------
# checkpoints, the engine, miles' chunks
# ------------------------------------------------------------------------------------------------


def _with_router_scale(source: Path, out: Path, factor: float) -> Path:
    """``source`` with only every layer's ``router.scale`` multiplied by ``factor``."""
    shutil.copytree(source, out)
    checkpoint = HFCheckpoint(out)
    tensors = checkpoint.load(checkpoint.names())
    scaled = [name for name in tensors if name.endswith(".router.scale")]
    assert scaled, "the checkpoint has no router.scale"
    for name in scaled:
        tensors[name] = tensors[name] * factor
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang")
    hf = write_tiny_checkpoint(root / "hf", SPEC)
    return {
        "hf": hf,
        "twin": write_tiny_checkpoint(root / "twin", TinySpec(**{**vars(SPEC), "seed": SPEC.seed + 1})),
        "router": _with_router_scale(hf, root / "router-scale", 4.0),
        "root": root,
    }


@pytest.fixture(scope="module")
def prompts(ckpts: dict[str, Path]) -> list[list[int]]:
    config = json.loads((ckpts["hf"] / "config.json").read_text())
    return fixed_token_ids(SPEC.vocab_size, 4, 8, excluded_token_ids(config)).tolist()


@pytest.fixture(scope="module")
def engine(ckpts: dict[str, Path], prompts: list[list[int]]) -> Iterator[tuple[Engine, dict]]:
    """One engine (every harness change) on the source, and its generation there."""
    sglang = Engine(ckpts["hf"])
    try:
        yield sglang, sglang.generate(prompts)
    finally:
        sglang.close()


def _miles_chunks_job(hf_checkpoint: str, topology: Topology, out: str, expert_layout: str) -> int | None:
    """miles' bridge iterator on every rank (fork seams); rank 0 writes each chunk it would bucket."""
    import torch.distributed as dist
    from fork_seams import fork_seams
    from miles_flow import MilesArgs, backed_up_weights, get_hf_weight_chunks
    from test_miles_roads import _miles_model

    from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV
    from vime_gemma4_bridge.runtime.world import environment

    with environment({EXPERT_LAYOUT_ENV: expert_layout}), fork_seams():
        bridge, model, _ = _miles_model(hf_checkpoint, topology)
        args = MilesArgs(hf_checkpoint, bridge.hf_pretrained.config.text_config.vocab_size, BUFFER)
        chunks = list(get_hf_weight_chunks(bridge, model, backed_up_weights(model), args, None))
    if dist.get_rank() != 0:
        return None
    Path(out).mkdir(parents=True, exist_ok=True)
    for index, chunk in enumerate(chunks):
        save_file({name: t.contiguous() for name, t in chunk}, f"{out}/chunk-{index:05d}.safetensors")
    return len(chunks)


@pytest.fixture(scope="module")
def chunks(local_world, ckpts: dict[str, Path]) -> dict[str, list[str]]:
    """miles' colocated chunks at TP2·PP2·EP4·ETP1 on 8 ranks, one safetensors file each, in push order."""
    out = {}
    for layout in ("stacked", "per-expert"):
        directory = ckpts["root"] / f"miles-{layout}"
        local_world(8).run(_miles_chunks_job, str(ckpts["hf"]), TOPOLOGY, str(directory), layout)
        out[layout] = [str(path) for path in sorted(directory.glob("chunk-*.safetensors"))]
        assert len(out[layout]) > 3, "the buffer must split the stream into many chunks"
    return out


def _perturbed(sglang: Engine, ckpts: dict[str, Path], prompts: list[list[int]], reference: dict) -> None:
    """The engine on the twin; its generation must differ, or the check after the sync could not fail."""
    sglang.sync("disk", path=str(ckpts["twin"]))
    assert sglang.generate(prompts)["tokens"] != reference["tokens"], "the perturbation must show"


# ------------------------------------------------------------------------------------------------
# the engine as a yardstick, and the harness's controls
# ------------------------------------------------------------------------------------------------


def _transformers_check(model: Path, prompts: list[list[int]], served: dict) -> tuple[bool, float]:
    """Do ``served``'s greedy tokens match transformers' argmax at every step, and by how much do logprobs differ?"""
    ids = torch.tensor(prompts)
    sequences = torch.cat([ids, torch.tensor(served["tokens"])], dim=1)
    logits = hf_logits(str(model), sequences, torch.float32).float()
    logprobs = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1, : SPEC.vocab_size], dim=-1)
    tokens = torch.tensor(served["tokens"])
    gap = (logprobs.gather(-1, tokens[..., None])[..., 0] - torch.tensor(served["logprobs"])).abs().max()
    return bool(torch.equal(logprobs.argmax(-1), tokens)), float(gap)


def test_sglang_on_the_source_generates_transformers_tokens(engine, ckpts, prompts) -> None:
    """The yardstick: SGLang's greedy tokens are transformers' argmax at every step, logprobs within 1e-5."""
    _, reference = engine
    agree, gap = _transformers_check(ckpts["hf"], prompts, reference)
    assert agree and gap <= LOGPROB_TOLERANCE, (agree, gap)


def test_sglang_cpu_norm_ignores_the_router_scale_without_the_fix(engine, ckpts, prompts) -> None:
    """Control for the CPU norm fix (UPSTREAM 64): SGLang's ``Gemma4RMSNorm.forward_native`` as shipped
    drops the router's fused scale, and its rollouts leave transformers'."""
    shipped = Engine(ckpts["hf"], patches=("torch-native",))
    try:
        served = shipped.generate(prompts)
    finally:
        shipped.close()
    agree, gap = _transformers_check(ckpts["hf"], prompts, served)
    assert not agree or gap > 1e-2, f"SGLang's CPU norm keeps the router scale now: drop cpu-norm ({gap})"


def test_sglang_ignores_an_update_of_router_scale_as_shipped(engine, ckpts, prompts) -> None:
    """SGLang's router-scale bug (UPSTREAM 65), on any device: after a forward, an update that changes only
    ``router.scale`` is ignored. An engine as shipped (with the CPU norm fix) started on the checkpoint with
    scaled routers and updated from disk to the source keeps generating the scaled checkpoint's tokens; with
    the harness's re-fuse (the module's engine) the same update lands."""
    sglang, reference = engine
    sglang.sync("disk", path=str(ckpts["router"]))
    scaled = sglang.generate(prompts)
    assert scaled["tokens"] != reference["tokens"], "the router scale must move the generation"
    sglang.sync("disk", path=str(ckpts["hf"]))
    assert_same_generation(sglang.generate(prompts), reference)

    shipped = Engine(ckpts["router"], patches=("torch-native", "cpu-norm"))
    try:
        assert_same_generation(shipped.generate(prompts), scaled)
        assert "True" in shipped.ask({"op": "disk", "path": str(ckpts["hf"])})["results"][0]
        stuck = shipped.generate(prompts)
    finally:
        shipped.close()
    assert stuck["tokens"] == scaled["tokens"], "SGLang re-fuses router.scale now: drop router-refuse (UPSTREAM 65)"


# ------------------------------------------------------------------------------------------------
# the roads into the engine
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_sglang_miles_colocated_sync_serves_the_source(engine, ckpts, chunks, prompts, layout: str) -> None:
    """miles' colocated sync at TP2·PP2·EP4·ETP1, chunk by chunk through SGLang's flattened buckets, brings
    the perturbed engine back to the source's generation; SGLang took every name (none skipped)."""
    sglang, reference = engine
    _perturbed(sglang, ckpts, prompts, reference)
    results = sglang.sync("push", tensor_files=chunks[layout])
    assert len(results) >= len(chunks[layout]) + 2, results  # begin, one update per chunk (or dtype), end
    assert_same_generation(sglang.generate(prompts), reference)


def test_sglang_disk_sync_of_roundtrip_output_serves_the_source(engine, local_world, ckpts, prompts) -> None:
    """``update_weights_from_disk`` of what ``roundtrip --output`` wrote at TP2·PP2·EP4·ETP1 (8 ranks)."""
    from vime_gemma4_bridge.verify.roundtrip import roundtrip_job

    out = ckpts["root"] / "roundtrip-output"
    result = local_world(8).run(roundtrip_job, str(ckpts["hf"]), TOPOLOGY, str(out), False, 1 << 30)[0]
    assert result["identical"], result["report"]
    sglang, reference = engine
    _perturbed(sglang, ckpts, prompts, reference)
    sglang.sync("disk", path=str(out))
    assert_same_generation(sglang.generate(prompts), reference)


def _rewritten(files: list[str], out: Path, change) -> list[str]:
    """The chunks with ``change(name, tensor, everything) -> (name, tensor)`` applied to every tensor."""
    everything: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            everything.update({name: handle.get_tensor(name) for name in handle.keys()})
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for index, file in enumerate(files):
        with safe_open(file, framework="pt") as handle:
            chunk = dict(change(name, handle.get_tensor(name), everything) for name in handle.keys())
        written.append(str(out / f"chunk-{index:05d}.safetensors"))
        save_file(chunk, written[-1])
    return written


def test_sglang_generation_differs_when_expert_0_is_sent_as_the_next_ep_ranks_first(
    engine, ckpts, chunks, prompts, tmp_path: Path
) -> None:
    """Negative control, the reported bug in miles' per-expert chunks: expert E/EP carries expert 0's weights."""
    moved = SPEC.experts // TOPOLOGY.ep

    def copy_expert_0(name: str, tensor: torch.Tensor, everything: dict) -> tuple[str, torch.Tensor]:
        if f".experts.{moved}." in name:
            return name, everything[name.replace(f".experts.{moved}.", ".experts.0.")].clone()
        return name, tensor

    sglang, reference = engine
    sglang.sync("push", tensor_files=_rewritten(chunks["per-expert"], tmp_path, copy_expert_0))
    assert sglang.generate(prompts)["tokens"] != reference["tokens"], "SGLang served the bug unseen"
    sglang.sync("disk", path=str(ckpts["hf"]))


def test_sglang_answers_success_for_a_name_it_skips_and_the_check_catches_it(
    engine, ckpts, chunks, prompts, tmp_path: Path
) -> None:
    """Negative control for the skipped-name check: one stacked expert tensor sent under a name SGLang does
    not know. SGLang answers success for every call; its loaded-parameter set misses exactly that name."""
    unknown = next(
        name
        for file in chunks["stacked"]
        for name in safe_open(file, framework="pt").keys()
        if name.endswith(".experts.gate_up_proj")
    )

    def rename(name: str, tensor: torch.Tensor, everything: dict) -> tuple[str, torch.Tensor]:
        return (name + "_renamed" if name == unknown else name), tensor

    sglang, _ = engine
    answer = sglang.ask({"op": "push", "tensor_files": _rewritten(chunks["stacked"], tmp_path, rename)})
    assert all("True" in r for r in answer["results"]), answer["results"]
    assert sglang.skipped() == [unknown + "_renamed"]
    sglang.sync("disk", path=str(ckpts["hf"]))


# ------------------------------------------------------------------------------------------------
# rollout-check against SGLang's HTTP server
# ------------------------------------------------------------------------------------------------


class Server:
    """SGLang's HTTP server on 127.0.0.1 (tests/sglang_engine.py ``--serve``: the engine's settings, no
    tokenizer, as miles' engines), started for a test and stopped after."""

    def __init__(self, model: Path, log: Path, patches: tuple[str, ...], timeout: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{test_vllm._free_port()}"
        port = self.url.rsplit(":", 1)[1]
        command = [str(SGLANG_PYTHON), str(REPO / "tests" / "sglang_engine.py"), str(model), "--serve", port]
        self.log = log
        with log.open("w") as handle:
            self.process = subprocess.Popen(
                command, stdout=handle, stderr=handle, env=_engine_env(patches), start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"SGLang server ended:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        self.close()
        raise AssertionError(f"SGLang server not up after {timeout} s:\n{log.read_text()[-3000:]}")

    def post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(
            f"{self.url}{route}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
        return json.loads(text) if text.lstrip().startswith("{") else {"text": text}

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()


def test_rollout_check_against_sglang_server(ckpts, tmp_path: Path, capsys) -> None:
    """Passes against an SGLang server of the source; fails, naming the prompt, against one on a perturbed
    checkpoint (expert E/EP = expert 0) and against one hit by the router-scale bug (started on scaled
    routers, updated from disk to the source: SGLang answers success and keeps the old scale)."""
    hf = str(ckpts["hf"])
    cases = {
        "source": (ckpts["hf"], None, 0),
        "perturbed": (test_vllm._with_expert_0_copied(ckpts["hf"], tmp_path / "perturbed"), None, 1),
        "router-scale bug": (ckpts["router"], hf, 1),
    }
    for case, (model, update_to, expected) in cases.items():
        server = Server(model, tmp_path / f"serve-{case.replace(' ', '-')}.log", ("torch-native", "cpu-norm"))
        try:
            if update_to is not None:  # the server's warm-up request has run a forward: the scale is fused
                server.post("/flush_cache?timeout=60", {})  # waits until idle (see tests/sglang_engine.py)
                answer = server.post("/update_weights_from_disk", {"model_path": update_to})
                assert answer.get("success"), answer
                server.post("/flush_cache", {})
            assert cli(["rollout-check", "--hf-checkpoint", hf, "--server", server.url]) == expected, case
            out = capsys.readouterr().out
            if expected == 0:
                assert "rollout-check OK" in out and "greedy tokens identical" in out, out
            else:
                assert "rollout-check FAILED" in out and "prompt " in out and "diverges at token" in out, (case, out)
        finally:
            server.close()
