"""The vime launch recipes in ``recipes/``, checked without launching anything.

Each recipe has a ``DRY_RUN=1`` switch that prints the resolved ``ray job submit ... train.py ...`` command
and exits before ``ray`` is called. The tests run every recipe that way (with ``ray`` and ``vime-gemma4``
replaced by traps that record any call), parse the command with :mod:`shlex`, and check it against the
Gemma 4 26B-A4B configuration: a topology the plugin and Megatron accept, bridge mode with the plugin
switched on, a consistent rollout layout, and for the reported 4x8 layout the disk transport with the
bitwise weight-update check.

Only one test imports the Megatron argument parser (``vime_gemma4_bridge.convert.topology`` imports no
torch); everything else is bash + shlex and takes milliseconds per recipe.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vime_gemma4_bridge.convert.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
DISAGGREGATED = "gemma4-26b-a4b-4x8-a800-disaggregated-disk.sh"
ONE_NODE = "gemma4-26b-a4b-1x8.sh"
COLOCATED = "gemma4-26b-a4b-colocated.sh"
ALL_RECIPES = (DISAGGREGATED, ONE_NODE, COLOCATED)
#: miles (radixark/miles v0.1.0 / @31f1ca96): its own 8 x H200 recipe, and the reported 4 x 8 A800 hardware.
MILES_H200 = "miles-gemma4-26b-a4b-1x8-h200.sh"
MILES_A800 = "miles-gemma4-26b-a4b-4x8-a800.sh"
MILES_RECIPES = (MILES_H200, MILES_A800)
#: A hang guard, not a speed check: a dry run's preflight imports megatron.bridge and builds the tiny
#: model (~20 s alone, over 60 s on a loaded 2-core CI machine, where a 60 s limit failed CI).
RECIPE_TIMEOUT = 600

# text_config of google/gemma-4-26B-A4B-it (the keys validate_model_topology and the recipes rely on).
GEMMA4_26B_A4B_TEXT: dict = {
    "model_type": "gemma4_text",
    "num_hidden_layers": 30,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 2,
    "head_dim": 256,
    "global_head_dim": 512,
    "attention_k_eq_v": True,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "vocab_size": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_size_per_layer_input": 0,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
}
GEMMA4_26B_A4B = {
    "model_type": "gemma4",
    "architectures": ["Gemma4ForConditionalGeneration"],
    "tie_word_embeddings": True,
    "text_config": GEMMA4_26B_A4B_TEXT,
}

# Every flag a recipe may pass, by where it is defined (vllm-project/vime at the Gemma 4 era; Megatron as
# installed). A typo or a flag vime does not define fails test_every_flag_is_defined.
VIME_FLAGS = {  # vime/utils/arguments.py
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
    "--num-gpus-per-node", "--colocate", "--megatron-to-hf-mode", "--update-weight-mode",
    "--update-weight-transport", "--update-weight-disk-dir", "--update-weight-disk-keep-files",
    "--update-weight-buffer-size", "--check-weight-update-equal", "--hf-checkpoint", "--ref-load",
    "--prompt-data", "--input-key", "--label-key", "--apply-chat-template", "--apply-chat-template-kwargs",
    "--rollout-shuffle", "--rm-type", "--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt",
    "--rollout-max-response-len", "--rollout-temperature", "--num-steps-per-rollout", "--balance-data",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "--advantage-estimator", "--entropy-coef",
    "--eps-clip", "--eps-clip-high", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type", "--loss-mask-type",
}  # fmt: skip
VIME_VLLM_FLAGS = {"--vllm-server-concurrency"}  # vime/backends/vllm_utils/arguments.py (vime-only)
VLLM_ENGINE_FLAGS = {  # vLLM EngineArgs, re-exported with a --vllm- prefix by vime/backends/vllm_utils/arguments.py
    "--vllm-gpu-memory-utilization", "--vllm-max-model-len", "--vllm-max-num-seqs",
    "--vllm-max-cudagraph-capture-size", "--vllm-language-model-only",
}  # fmt: skip
MEGATRON_FLAGS = {  # megatron/training/arguments.py (some with defaults reset by vime's reset_arg)
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--normalization", "--norm-epsilon", "--qk-layernorm",
    "--disable-bias-linear", "--position-embedding-type", "--rotary-base", "--vocab-size", "--num-experts",
    "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-token-dispatcher-type", "--moe-aux-loss-coeff",
    "--save", "--save-interval", "--load", "--finetune", "--no-load-optim", "--no-load-rng",
    "--global-batch-size", "--tensor-model-parallel-size", "--sequence-parallel",
    "--pipeline-model-parallel-size", "--context-parallel-size", "--expert-model-parallel-size",
    "--expert-tensor-parallel-size", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--calculate-per-token-loss", "--optimizer", "--lr", "--lr-decay-style", "--weight-decay", "--adam-beta1",
    "--adam-beta2", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--use-precision-aware-optimizer", "--dist-ckpt-optim-fully-reshardable",
    "--accumulate-allreduce-grads-in-fp32",
}  # fmt: skip
# In bridge mode these would bypass the plugin (a custom provider wins over the bridge provider in vime's
# model_provider.py) or contradict the checkpoint (Gemma 4 ties embeddings; vime asserts it).
FORBIDDEN_FLAGS = {"--spec", "--custom-model-provider-path", "--untie-embeddings-and-output-weights"}


# ------------------------------------------------------------------------------------------------
# Running a recipe in DRY_RUN mode
# ------------------------------------------------------------------------------------------------


@dataclass
class DryRun:
    """What a recipe printed under ``DRY_RUN=1``."""

    name: str
    info: dict[str, str]  # KEY=VALUE lines (RECIPE, NNODES, GPUS_PER_NODE, VIME_GEMMA4_BRIDGE_AUTOLOAD)
    submit: list[str]  # the whole `ray job submit ... -- python train.py ...` argv
    order: list[str] = field(default_factory=list)  # train.py flags in order
    args: dict[str, list[str]] = field(default_factory=dict)  # train.py flag -> its values

    def has(self, flag: str) -> bool:
        return flag in self.args

    def value(self, flag: str) -> str:
        values = self.args[flag]
        assert len(values) == 1, f"{self.name}: {flag} takes one value, got {values}"
        return values[0]

    def num(self, flag: str, default: int | None = None) -> int:
        if default is not None and flag not in self.args:
            return default
        return int(self.value(flag))

    @property
    def actor_gpus(self) -> int:
        return self.num("--actor-num-nodes") * self.num("--actor-num-gpus-per-node")

    @property
    def rollout_gpus(self) -> int:
        # vime sets the rollout GPUs to the actor's under --colocate (vime_validate_args).
        return self.actor_gpus if self.has("--colocate") else self.num("--rollout-num-gpus")

    @property
    def topology(self) -> Topology:
        vpp = self.num("--num-virtual-stages-per-pipeline-rank", 0) or None
        return Topology(
            tp=self.num("--tensor-model-parallel-size", 1),
            pp=self.num("--pipeline-model-parallel-size", 1),
            vpp=vpp,
            ep=self.num("--expert-model-parallel-size", 1),
            etp=self.num("--expert-tensor-parallel-size", 1),
        )

    @property
    def runtime_env(self) -> dict[str, str]:
        (spec,) = [t.split("=", 1)[1] for t in self.submit if t.startswith("--runtime-env-json=")]
        return json.loads(spec)["env_vars"]


def _parse(name: str, stdout: str) -> DryRun:
    info: dict[str, str] = {}
    command = None
    for line in stdout.splitlines():
        if line.startswith("CMD:"):
            command = line[len("CMD:") :]
        elif "=" in line:
            key, value = line.split("=", 1)
            info[key] = value
    assert command is not None, f"{name}: no CMD: line in the dry-run output:\n{stdout}"
    assert "$'" not in command, f"{name}: the command needs ANSI-C quoting, which shlex cannot read"
    submit = shlex.split(command)
    script = [i for i, token in enumerate(submit) if token.endswith("train.py")]
    assert len(script) == 1, f"{name}: expected one train.py in {submit}"
    run = DryRun(name=name, info=info, submit=submit)
    current = None
    for token in submit[script[0] + 1 :]:
        if token.startswith("--"):
            current = token
            run.order.append(token)
            run.args.setdefault(token, [])
        else:
            assert current is not None, f"{name}: value {token!r} before any flag"
            run.args[current].append(token)
    return run


def _trap(directory: Path, marker: Path, tool: str) -> None:
    exe = directory / tool
    exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{marker}"\nexit 97\n')
    exe.chmod(0o755)


@pytest.fixture(scope="module")
def recipe_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """A clean environment: no inherited overrides or plugin switch, and traps for ``ray``/``vime-gemma4``."""
    bin_dir = tmp_path_factory.mktemp("trap-bin")
    marker = bin_dir / "launched.log"
    for tool in ("ray", "vime-gemma4"):
        _trap(bin_dir, marker, tool)
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": os.environ.get("HOME", "/tmp"),
        "LANG": "C.UTF-8",
        "PYTHON": sys.executable,  # the preflight imports the plugin with this interpreter
        "DRY_RUN": "1",
    }
    return env, marker


@pytest.fixture(scope="module")
def dry_run(recipe_env: tuple[dict[str, str], Path]) -> Callable[..., DryRun]:
    """``dry_run(recipe, **env_overrides)`` -> the parsed command (cached per arguments).

    The preflight (the plugin imported, ``vime-gemma4 env``: ~30 s on a loaded CI machine) runs in
    each recipe's dry run at its defaults; the other dry runs skip it (``SKIP_PREFLIGHT=1``): it
    does not depend on the overrides.
    """
    base_env, marker = recipe_env
    cache: dict[tuple, DryRun] = {}

    def run(name: str, **overrides: str) -> DryRun:
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            skip = {"SKIP_PREFLIGHT": "1"} if overrides else {}
            proc = subprocess.run(
                ["bash", str(RECIPES / name)],
                env={**base_env, **skip, **overrides},
                capture_output=True,
                text=True,
                timeout=RECIPE_TIMEOUT,
                check=False,
            )
            assert proc.returncode == 0, f"{name} DRY_RUN failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            assert not marker.exists(), f"{name}: DRY_RUN=1 called {marker.read_text()}"
            cache[key] = _parse(name, proc.stdout)
        return cache[key]

    return run


# Each recipe at its defaults, plus the overrides its comments suggest.
CASES = [
    (DISAGGREGATED, {}),
    (DISAGGREGATED, {"ETP": "2"}),
    (ONE_NODE, {}),
    (ONE_NODE, {"UPDATE_WEIGHT_TRANSPORT": "disk"}),
    (COLOCATED, {}),
    (COLOCATED, {"NNODES": "4"}),
]
CASE_IDS = [f"{name.removesuffix('.sh')}{''.join(f'-{k}={v}' for k, v in env.items())}" for name, env in CASES]


# ------------------------------------------------------------------------------------------------
# The scripts themselves
# ------------------------------------------------------------------------------------------------


def test_every_recipe_is_present_and_documented() -> None:
    assert sorted(p.name for p in RECIPES.glob("*.sh")) == sorted(ALL_RECIPES + MILES_RECIPES)
    readme = (RECIPES / "README.md").read_text()
    for name in ALL_RECIPES + MILES_RECIPES:
        assert name in readme, f"recipes/README.md does not mention {name}"
    for command in ("vime-gemma4 import", "vime-gemma4 export", "vime-gemma4 verify-update"):
        assert command in readme


@pytest.mark.parametrize("name", ALL_RECIPES + MILES_RECIPES)
def test_script_is_strict_bash(name: str) -> None:
    text = (RECIPES / name).read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    proc = subprocess.run(["bash", "-n", str(RECIPES / name)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    # The plugin switch is exported and the preflight import comes before anything is launched.
    assert "\nexport VIME_GEMMA4_BRIDGE_AUTOLOAD=1\n" in text
    assert '"${PYTHON}" -c "import vime_gemma4_bridge"' in text
    assert text.index('-c "import vime_gemma4_bridge"') < text.index('if [[ "${DRY_RUN}" == 1 ]]')
    assert text.index('-m vime_gemma4_bridge.cli "${PREFLIGHT[@]}"') < text.index('if [[ "${DRY_RUN}" == 1 ]]')


def test_preflight_refuses_a_build_vime_cannot_use(recipe_env: tuple[dict[str, str], Path]) -> None:
    """Without DRY_RUN the recipe runs ``vime-gemma4 env --vime`` (SKIP_PREFLIGHT applies to dry runs only):
    on the release (two-field export) it stops."""
    env, marker = recipe_env
    proc = subprocess.run(
        ["bash", str(RECIPES / ONE_NODE)],
        env={**env, "DRY_RUN": "0", "SKIP_PREFLIGHT": "1"},
        capture_output=True,
        text=True,
        timeout=RECIPE_TIMEOUT,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "env FAILED: vime's bridge weight sync unpacks three fields" in proc.stderr
    assert not marker.exists(), "the recipe launched something after a failed preflight"


@pytest.mark.parametrize("name", ALL_RECIPES + MILES_RECIPES)
def test_preflight_fails_fast_without_the_plugin(name: str, recipe_env, tmp_path: Path) -> None:
    env, _ = recipe_env
    # An interpreter that cannot import vime_gemma4_bridge.
    python = tmp_path / "python-without-plugin"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(RECIPES / name)], env={**env, "PYTHON": str(python)}, capture_output=True, text=True, check=False
    )
    assert proc.returncode != 0
    assert "vime_gemma4_bridge is not importable" in proc.stderr
    assert "CMD:" not in proc.stdout


# ------------------------------------------------------------------------------------------------
# The resolved commands
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "env"), CASES, ids=CASE_IDS)
def test_every_flag_is_defined_and_given_once(name: str, env: dict, dry_run) -> None:
    run = dry_run(name, **env)
    known = VIME_FLAGS | VIME_VLLM_FLAGS | VLLM_ENGINE_FLAGS | MEGATRON_FLAGS
    unknown = sorted(set(run.order) - known)
    assert not unknown, f"{name}: flags no verified vime/vLLM/Megatron definition covers: {unknown}"
    repeated = sorted({flag for flag in run.order if run.order.count(flag) > 1})
    assert not repeated, f"{name}: flags given twice (argparse keeps the last one silently): {repeated}"
    forbidden = sorted(FORBIDDEN_FLAGS & set(run.order))
    assert not forbidden, f"{name}: {forbidden} would bypass the bridge or contradict the checkpoint"


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # Apex/TE absent; argparse 3.12
def test_megatron_flags_exist_in_megatron() -> None:
    """MEGATRON_FLAGS against the Megatron argument parser installed here (vime parses with it)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False, conflict_handler="resolve")
    add_megatron_arguments(parser)
    defined = {option for action in parser._actions for option in action.option_strings}
    assert not sorted(MEGATRON_FLAGS - defined)
    # vime's flags are not Megatron's (so they must come from vime's own parser).
    assert not sorted(VIME_FLAGS & defined)


@pytest.mark.parametrize(("name", "env"), CASES, ids=CASE_IDS)
def test_bridge_mode_with_the_plugin_active(name: str, env: dict, dry_run) -> None:
    run = dry_run(name, **env)
    assert run.value("--megatron-to-hf-mode") == "bridge"
    # Exported in the launching shell (printenv sees only exported variables; the test env did not set it) ...
    assert run.info["VIME_GEMMA4_BRIDGE_AUTOLOAD"] == "1"
    # ... and in the Ray job's runtime env, so every actor imports the plugin through its .pth.
    assert run.runtime_env["VIME_GEMMA4_BRIDGE_AUTOLOAD"] == "1"
    # Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 for TP > 1 before Blackwell (A800 is Ampere).
    assert run.runtime_env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert run.has("--vllm-language-model-only"), "the bridge publishes language-model tensors only"


@pytest.mark.parametrize(("name", "env"), CASES, ids=CASE_IDS)
def test_model_flags_equal_the_26b_config(name: str, env: dict, dry_run) -> None:
    """vime's _hf_validate_args asserts these equal the HF config; Megatron needs them to validate."""
    run = dry_run(name, **env)
    text = GEMMA4_26B_A4B_TEXT
    expected = {
        "--num-layers": text["num_hidden_layers"],
        "--hidden-size": text["hidden_size"],
        "--ffn-hidden-size": text["intermediate_size"],
        "--num-attention-heads": text["num_attention_heads"],
        "--num-query-groups": text["num_key_value_heads"],
        "--kv-channels": text["head_dim"],
        "--vocab-size": text["vocab_size"],
        "--num-experts": text["num_experts"],
        "--moe-ffn-hidden-size": text["moe_intermediate_size"],
        "--moe-router-topk": text["top_k_experts"],
    }
    assert {flag: run.num(flag) for flag in expected} == expected
    assert float(run.value("--norm-epsilon")) == text["rms_norm_eps"]
    assert not run.has("--untie-embeddings-and-output-weights") and text["tie_word_embeddings"]


@pytest.fixture(scope="module")
def validate_model_topology() -> Callable:
    from vime_gemma4_bridge.core.model_split import validate_model_topology

    return validate_model_topology


@pytest.mark.parametrize(("name", "env"), CASES, ids=CASE_IDS)
def test_actor_topology_fits_the_26b_model(name: str, env: dict, dry_run, validate_model_topology) -> None:
    run = dry_run(name, **env)
    topology = run.topology
    world = run.actor_gpus
    assert world == run.num("--actor-num-nodes") * run.num("--actor-num-gpus-per-node")
    if not run.has("--colocate"):
        assert run.num("--actor-num-gpus-per-node") <= int(run.info["GPUS_PER_NODE"])
    topology.validate(world)  # TP·PP and ETP·EP·PP divide the actor world
    validate_model_topology(GEMMA4_26B_A4B, topology)
    # The same rules, spelled out.
    text = GEMMA4_26B_A4B_TEXT
    assert text["num_experts"] % topology.ep == 0
    for heads in ("num_attention_heads", "num_key_value_heads", "num_global_key_value_heads"):
        assert text[heads] % topology.tp == 0, heads
    assert text["num_hidden_layers"] % (topology.pp * (topology.vpp or 1)) == 0
    assert text["moe_intermediate_size"] % topology.etp == 0
    assert run.num("--context-parallel-size", 1) == 1
    # Megatron: the global batch splits over data parallelism; vime: it equals the rollout's samples per step.
    data_parallel = topology.data_parallel_size(world)
    assert run.num("--global-batch-size") % data_parallel == 0
    per_step = run.num("--rollout-batch-size") * run.num("--n-samples-per-prompt") // run.num("--num-steps-per-rollout")
    assert run.num("--global-batch-size") == per_step


def test_an_impossible_topology_is_caught(dry_run, validate_model_topology) -> None:
    """The checks above do reject a layout the model cannot take (EP3: 128 experts do not split in 3)."""
    from vime_gemma4_bridge.core.model_split import TopologyError

    run = dry_run(DISAGGREGATED, EP="3", ETP="1")
    with pytest.raises(TopologyError, match="experts"):
        validate_model_topology(GEMMA4_26B_A4B, run.topology)


@pytest.mark.parametrize(("name", "env"), CASES, ids=CASE_IDS)
def test_rollout_layout(name: str, env: dict, dry_run) -> None:
    run = dry_run(name, **env)
    per_engine = run.num("--rollout-num-gpus-per-engine")
    assert run.rollout_gpus % per_engine == 0
    assert per_engine <= int(run.info["GPUS_PER_NODE"]), "engines stay inside one node"
    # vLLM tensor parallelism: query heads split; KV heads split or are replicated evenly.
    text = GEMMA4_26B_A4B_TEXT
    assert text["num_attention_heads"] % per_engine == 0
    for kv_heads in (text["num_key_value_heads"], text["num_global_key_value_heads"]):
        assert kv_heads % per_engine == 0 or per_engine % kv_heads == 0
    assert run.num("--vllm-max-model-len") > run.num("--rollout-max-response-len")
    total = int(run.info["NNODES"]) * int(run.info["GPUS_PER_NODE"])
    if run.has("--colocate"):
        assert run.rollout_gpus == run.actor_gpus == total
        assert run.args.get("--update-weight-transport") != ["disk"], "vime's disk sync is for non-colocated runs"
    else:
        assert run.actor_gpus + run.rollout_gpus == total, "disaggregated: actor and rollout share out the nodes"


def test_disaggregated_recipe_is_the_reported_layout(dry_run) -> None:
    run = dry_run(DISAGGREGATED)
    assert (int(run.info["NNODES"]), int(run.info["GPUS_PER_NODE"])) == (4, 8)
    assert run.topology == Topology(tp=2, pp=2, ep=4, etp=1)
    assert (run.actor_gpus, run.rollout_gpus) == (16, 16)
    assert not run.has("--colocate")
    assert run.value("--update-weight-mode") == "full"
    assert run.value("--update-weight-transport") == "disk"
    assert run.value("--update-weight-disk-dir")
    assert run.has("--check-weight-update-equal")
    assert run.has("--vllm-language-model-only")
    assert run.has("--optimizer-cpu-offload"), "41.4 GB/GPU of weights+grads+Adam does not fit a 40 GB A800"


def test_colocated_recipe(dry_run) -> None:
    run = dry_run(COLOCATED)
    assert run.has("--colocate")
    assert run.topology == Topology(tp=2, pp=2, ep=4, etp=1)
    assert not run.has("--update-weight-transport"), "colocated engines are updated over CUDA IPC"
    assert run.has("--check-weight-update-equal")


def test_one_node_recipe_transport_switch(dry_run) -> None:
    nccl = dry_run(ONE_NODE)
    assert nccl.value("--update-weight-transport") == "nccl" and not nccl.has("--update-weight-disk-dir")
    disk = dry_run(ONE_NODE, UPDATE_WEIGHT_TRANSPORT="disk")
    assert disk.value("--update-weight-transport") == "disk" and disk.value("--update-weight-disk-dir")


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_first_run_loads_ref_and_resume_loads_save(name: str, dry_run, tmp_path: Path) -> None:
    """Bridge mode uses --load as given, so it is passed only when the save dir holds a Megatron checkpoint."""
    fresh = dry_run(name, SAVE_DIR=str(tmp_path / "empty"))
    assert not fresh.has("--load")
    assert fresh.has("--finetune") and fresh.has("--no-load-optim") and fresh.has("--no-load-rng")
    assert fresh.value("--ref-load")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("20")
    resumed = dry_run(name, SAVE_DIR=str(tmp_path / "ckpt"))
    assert resumed.value("--load") == str(tmp_path / "ckpt")
    assert not (resumed.has("--finetune") or resumed.has("--no-load-optim"))


def test_memory_comments_use_the_26b_parameter_count() -> None:
    """The per-GPU arithmetic in the recipes starts from 25.23e9 parameters; recompute it from the config."""
    text = GEMMA4_26B_A4B_TEXT
    hidden, vocab, heads = text["hidden_size"], text["vocab_size"], text["num_attention_heads"]
    head, global_head = text["head_dim"], text["global_head_dim"]
    kv, global_kv = text["num_key_value_heads"], text["num_global_key_value_heads"]
    sliding = 2 * heads * head * hidden + 2 * kv * head * hidden + 2 * head  # q, o, k, v, q/k norms
    full = 2 * heads * global_head * hidden + global_kv * global_head * hidden + 2 * global_head  # k_eq_v: no v
    router = (text["num_experts"] + 1) * hidden + text["num_experts"]  # proj, scale, per-expert scale
    per_layer = (
        3 * text["intermediate_size"] * hidden  # dense MLP
        + text["num_experts"] * 3 * text["moe_intermediate_size"] * hidden  # experts (gate_up + down)
        + router
        + 7 * hidden  # norms
    )
    attention = sum(full if kind == "full_attention" else sliding for kind in text["layer_types"])
    total = attention + text["num_hidden_layers"] * per_layer + vocab * hidden + hidden  # + tied embedding, final norm
    assert total == 25_233_141_760
    for name in ALL_RECIPES:
        assert "25.23e9" in (RECIPES / name).read_text(), name


# ------------------------------------------------------------------------------------------------
# miles' recipes
# ------------------------------------------------------------------------------------------------

#: Every miles flag the miles recipes pass, each defined in miles/utils/arguments.py @31f1ca96 (read there).
MILES_FLAGS = {
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--num-gpus-per-node", "--colocate",
    "--rollout-num-gpus-per-engine", "--no-offload-train", "--no-offload-rollout", "--megatron-to-hf-mode",
    "--custom-megatron-init-path", "--hf-checkpoint", "--ref-load", "--prompt-data", "--input-key",
    "--label-key", "--apply-chat-template", "--rollout-shuffle", "--balance-data", "--rm-type",
    "--num-rollout", "--rollout-batch-size", "--n-samples-per-prompt", "--rollout-max-response-len",
    "--rollout-temperature", "--advantage-estimator", "--use-kl-loss", "--kl-loss-coef", "--kl-loss-type",
    "--entropy-coef", "--eps-clip", "--eps-clip-high", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
    "--use-rollout-routing-replay", "--qkv-format",
}  # fmt: skip
#: SGLang ServerArgs fields, re-exported with a --sglang- prefix (miles/backends/sglang_utils/arguments.py).
SGLANG_FLAGS = {
    "--sglang-mem-fraction-static", "--sglang-attention-backend", "--sglang-moe-runner-backend",
    "--sglang-disable-custom-all-reduce", "--sglang-disable-cuda-graph", "--sglang-disable-overlap-schedule",
    "--sglang-disable-radix-cache",
}  # fmt: skip
MILES_CASES = [(MILES_H200, {}), (MILES_A800, {})]


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize(("name", "env"), MILES_CASES, ids=[n.removesuffix(".sh") for n, _ in MILES_CASES])
def test_miles_recipe_is_a_launch_miles_can_carry(name: str, env: dict, dry_run, tmp_path: Path) -> None:
    """Every flag is miles', SGLang's (prefixed) or the installed Megatron's, given once; bridge mode with the
    plugin's init hook, colocated; the topology fits the 26B-A4B; the hook's launch check passes it (with the
    fork's export) and refuses it made disaggregated."""
    import argparse
    from types import SimpleNamespace

    from megatron.training.arguments import add_megatron_arguments

    from vime_gemma4_bridge.convert.miles import ENTRY_POINT, launch_problems
    from vime_gemma4_bridge.core.model_split import validate_model_topology

    run = dry_run(name, **env)
    parser = argparse.ArgumentParser(allow_abbrev=False, conflict_handler="resolve")
    add_megatron_arguments(parser)
    megatron = {option for action in parser._actions for option in action.option_strings}
    unknown = sorted(set(run.order) - MILES_FLAGS - SGLANG_FLAGS - megatron)
    assert not unknown, f"{name}: flags no verified miles/SGLang/Megatron definition covers: {unknown}"
    assert not sorted({flag for flag in run.order if run.order.count(flag) > 1})
    assert not sorted(FORBIDDEN_FLAGS & set(run.order))
    assert run.value("--megatron-to-hf-mode") == "bridge" and run.has("--colocate")
    assert run.value("--custom-megatron-init-path") == ENTRY_POINT
    assert run.runtime_env["VIME_GEMMA4_BRIDGE_AUTOLOAD"] == "1"
    world = run.actor_gpus
    run.topology.validate(world)
    validate_model_topology(GEMMA4_26B_A4B, run.topology)
    assert world % run.num("--rollout-num-gpus-per-engine") == 0
    assert run.num("--global-batch-size") % run.topology.data_parallel_size(world) == 0
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(GEMMA4_26B_A4B))
    args = SimpleNamespace(hf_checkpoint=str(hf), megatron_to_hf_mode="bridge", colocate=True, lora_rank=0)
    assert launch_problems(args, export_tuple="(hf_name, tensor, megatron_param_name)") == []
    args.colocate = False
    assert "--colocate" in launch_problems(args, export_tuple="(hf_name, tensor, megatron_param_name)")[0]
