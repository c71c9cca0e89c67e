"""What bad input gets: the catalogue. One case per class of damaged or wrong input.

Every case asserts the exit status, the one line the user reads (and no ``Traceback``), that no output
path appeared (nor a hidden partial one), and that the source's bytes are unchanged. Refusals come
before any rank starts (in-process ``cli.main``; no world is spawned); write failures and interrupts
run a real conversion of one rank in a subprocess (megatron-core's torch_dist writer starts a helper
process, which must not outlive the command inside the test process).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from vime_gemma4_bridge.cli import main as cli
from vime_gemma4_bridge.testing.spec import TinySpec
from vime_gemma4_bridge.testing.tiny import write_tiny_checkpoint

EXPERTS = "model.language_model.layers.0.experts.down_proj"


def digest(path: Path) -> str:
    """Hash of every file's name and bytes under ``path``: sources must not change."""
    h = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(path)).encode())
        h.update(file.read_bytes())
    return h.hexdigest()


def leftovers(directory: Path, name: str) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name == name or p.name.startswith(f".{name}.partial"))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("bad-input") / "hf", TinySpec(seed=11))


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``vime-gemma4 ARGV`` in a subprocess."""
    command = [sys.executable, "-m", "vime_gemma4_bridge.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def torch_dist(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("bad-input-td") / "ckpt"
    proc = run_cli("import", "--hf-checkpoint", str(good), "--save", str(save))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return save


def damaged(good: Path, tmp_path: Path, edit) -> Path:
    """A copy of the good checkpoint with ``edit(tensors, config)`` applied (one safetensors file)."""
    copy = tmp_path / "damaged"
    shutil.copytree(good, copy)
    shard = next(copy.glob("*.safetensors"))
    with safe_open(shard, framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    config = json.loads((copy / "config.json").read_text())
    edit(tensors, config)
    for old in copy.glob("*.safetensors*"):
        old.unlink()
    (copy / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def refused(capsys, argv: list[str], status: int = 2) -> list[str]:
    """Run a command that must refuse: its exit status, no traceback; the ``error:`` lines."""
    assert cli.main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert any(": error: " in line for line in lines), err
    return lines


# ------------------------------------------------------------------------------------------------
# The HF side, from the safetensors headers, before any rank starts
# ------------------------------------------------------------------------------------------------


def _drop_expert(tensors: dict, config: dict) -> None:
    del tensors[EXPERTS]


def _fewer_experts_in_config(tensors: dict, config: dict) -> None:
    config["text_config"]["num_experts"] = 8


def _extra_tensor(tensors: dict, config: dict) -> None:
    tensors["model.language_model.layers.0.mystery.weight"] = tensors["model.language_model.norm.weight"].clone()


def _wrong_dtype(tensors: dict, config: dict) -> None:
    tensors["model.language_model.norm.weight"] = tensors["model.language_model.norm.weight"].float()


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_drop_expert, f"  {EXPERTS}: missing (config.json implies BF16 [16, 64, 16])"),
        (_fewer_experts_in_config, f"  {EXPERTS}: BF16 [16, 64, 16] found, config.json implies BF16 [8, 64, 16]"),
        (
            _extra_tensor,
            "  model.language_model.layers.0.mystery.weight: unexpected language-model tensor "
            "(config.json implies no such tensor)",
        ),
        (_wrong_dtype, "  model.language_model.norm.weight: F32 [64] found, config.json implies BF16 [64]"),
    ],
    ids=["missing-expert-tensor", "config-lies-about-experts", "unexpected-tensor", "wrong-dtype"],
)
def test_checkpoint_that_disagrees_with_its_config(good, tmp_path, capsys, edit, expected) -> None:
    source = damaged(good, tmp_path, edit)
    before = digest(source)
    save = tmp_path / "out"
    lines = refused(capsys, ["import", "--hf-checkpoint", str(source), "--save", str(save)])
    assert lines[0].startswith(f"vime-gemma4 import: error: HF checkpoint {source} does not match its config.json")
    assert expected in lines
    assert not leftovers(tmp_path, "out") and digest(source) == before


@pytest.mark.parametrize("command", ["import", "roundtrip", "parity", "probe", "export-live", "export"])
def test_every_command_runs_the_preflight(good, torch_dist, tmp_path, capsys, command) -> None:
    source = damaged(good, tmp_path, _drop_expert)
    out = tmp_path / "out"
    argv = {
        "import": ["--save", str(out)],
        "roundtrip": ["--output", str(out)],
        "parity": [],
        "probe": [],
        "export-live": ["--dump", str(out), "--buffer-size", "1MB"],
        "export": ["--load", str(torch_dist), "--output", str(out)],
    }[command]
    lines = refused(capsys, [command, "--hf-checkpoint", str(source), *argv])
    assert f"  {EXPERTS}: missing (config.json implies BF16 [16, 64, 16])" in lines
    assert not leftovers(tmp_path, "out")


def test_index_naming_a_shard_that_lacks_the_tensor(good, tmp_path, capsys) -> None:
    source = tmp_path / "hf"
    shutil.copytree(good, source)
    shard = next(source.glob("*.safetensors")).name
    index = {"metadata": {}, "weight_map": {"model.language_model.norm.weight": "model-00002-of-00002.safetensors"}}
    with safe_open(source / shard, framework="pt") as handle:
        index["weight_map"].update({name: shard for name in handle.keys() if name not in index["weight_map"]})
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    lines = refused(capsys, ["roundtrip", "--hf-checkpoint", str(source)])
    assert lines[-1].endswith("model-00002-of-00002.safetensors is missing (named by model.safetensors.index.json)")


def test_index_that_omits_a_stored_tensor(good, tmp_path, capsys) -> None:
    """A shard holds a tensor its index does not list: named before any rank starts (exit 2). It was
    read from the shard headers here while the bridge's loader, following the index, missed it:
    "Megatron parameter ... has no Gemma 4 mapping" after the ranks had started (exit 1)."""
    source = tmp_path / "hf"
    shutil.copytree(good, source)
    shard = next(source.glob("*.safetensors")).name
    with safe_open(source / shard, framework="pt") as handle:
        index = {"metadata": {}, "weight_map": {name: shard for name in handle.keys()}}
    del index["weight_map"]["model.language_model.norm.weight"]
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    lines = refused(capsys, ["roundtrip", "--hf-checkpoint", str(source)])
    assert len(lines) == 1, lines
    assert lines[-1].endswith(
        f"model.safetensors.index.json lacks tensor 'model.language_model.norm.weight', which {shard} holds "
        "(1 in all); readers that follow the index would not load it: fix the index"
    )


# ------------------------------------------------------------------------------------------------
# torch_dist integrity
# ------------------------------------------------------------------------------------------------


def _damaged_torch_dist(torch_dist: Path, tmp_path: Path, how: str) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(torch_dist, copy)
    iteration = copy / "iter_0000000"
    data = next(iteration.glob("*.distcp"))
    if how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    elif how == "missing":
        data.unlink()
    else:
        (iteration / ".metadata").write_bytes(b"not a pickle")
    return copy


@pytest.mark.parametrize(
    "how, expected",
    [
        ("truncated", "is damaged: __0_0.distcp is truncated ("),
        ("missing", "is damaged: __0_0.distcp is missing (it holds "),
        ("metadata", "/iter_0000000/.metadata is unreadable ("),
    ],
)
def test_damaged_torch_dist(good, torch_dist, tmp_path, capsys, how, expected) -> None:
    ckpt = _damaged_torch_dist(torch_dist, tmp_path, how)
    before = digest(ckpt)
    out = tmp_path / "out"
    lines = refused(capsys, ["export", "--load", str(ckpt), "--hf-checkpoint", str(good), "--output", str(out)])
    assert expected in lines[-1] and "re-create it with vime-gemma4 import" in lines[-1]
    assert not leftovers(tmp_path, "out") and digest(ckpt) == before


# ------------------------------------------------------------------------------------------------
# Sources are sacred: an output that is, is inside, or contains an input is refused, --force or not
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["roundtrip", "--hf-checkpoint", "{hf}", "--output", "{hf}", "--force"],
        ["roundtrip", "--hf-checkpoint", "{hf}", "--output", "{hf}/sub", "--force"],
        ["roundtrip", "--hf-checkpoint", "{hf}", "--output", "{parent}", "--force"],
        ["import", "--hf-checkpoint", "{hf}", "--save", "{hf}", "--force"],
        ["export-live", "--hf-checkpoint", "{hf}", "--dump", "{hf}/dump", "--buffer-size", "1MB", "--force"],
        ["export", "--load", "{td}", "--hf-checkpoint", "{hf}", "--output", "{td}", "--force"],
        ["export", "--load", "{td}", "--hf-checkpoint", "{hf}", "--output", "{hf}", "--force"],
    ],
    ids=[
        "roundtrip-self",
        "roundtrip-inside",
        "roundtrip-containing",
        "import-self",
        "live-inside",
        "export-load",
        "export-hf",
    ],
)
def test_outputs_never_overlap_inputs(good, torch_dist, tmp_path, capsys, argv) -> None:
    hf = tmp_path / "parent" / "hf"
    shutil.copytree(good, hf)
    td = tmp_path / "td"
    shutil.copytree(torch_dist, td)
    before = digest(tmp_path)
    filled = [a.format(hf=hf, td=td, parent=tmp_path / "parent") for a in argv]
    lines = refused(capsys, filled)
    assert "sources are never modified: choose another path" in lines[-1]
    assert digest(tmp_path) == before


# ------------------------------------------------------------------------------------------------
# config.json: each problem names its field, before any rank starts
# ------------------------------------------------------------------------------------------------

_ABSENT = object()

#: case: (text_config field, value (``_ABSENT``: removed), what the one line says after the path)
CONFIG_CASES = {
    "wrong-type": ("num_hidden_layers", "eight", "text_config.num_hidden_layers is 'eight', not an integer"),
    "float-size": ("num_attention_heads", 4.0, "text_config.num_attention_heads is 4.0, not an integer"),
    "bool-size": ("vocab_size", True, "text_config.vocab_size is True, not an integer"),
    "zero-size": ("hidden_size", 0, "text_config.hidden_size is 0; it must be at least 1"),
    "negative-size": ("num_experts", -4, "text_config.num_experts is -4; it must be at least 1"),
    "missing-moe-field": ("num_experts", _ABSENT, "text_config.num_experts is missing (enable_moe_block is true)"),
    "top-k-above-experts": ("top_k_experts", 99, "text_config.top_k_experts is 99, more than num_experts (16)"),
    "layer-types-length": (
        "layer_types",
        ["full_attention"],
        "text_config.layer_types has 1 entries for 4 layers (num_hidden_layers)",
    ),
    "unknown-layer-type": (
        "layer_types",
        ["sliding_attention", "full_attention", "sliding_attention", "global"],
        "text_config.layer_types holds 'global'; each entry is one of ['sliding_attention', 'full_attention']",
    ),
    "kv-shared-all-layers": ("num_kv_shared_layers", 4, "text_config.num_kv_shared_layers is 4; it must be below 4"),
    "kv-heads-not-dividing": (
        "num_key_value_heads",
        3,
        "text_config.num_key_value_heads is 3, which does not divide num_attention_heads (16)",
    ),
    "transformers-type-check": ("rms_norm_eps", "tiny", "Field 'rms_norm_eps' expected float, got str"),
}


@pytest.mark.parametrize("field, value, expected", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_config_problems_name_the_field(good, tmp_path, capsys, field, value, expected) -> None:
    copy = tmp_path / "hf"
    shutil.copytree(good, copy)
    config = json.loads((copy / "config.json").read_text())
    if value is _ABSENT:
        del config["text_config"][field]
    else:
        config["text_config"][field] = value
    (copy / "config.json").write_text(json.dumps(config))
    lines = refused(capsys, ["roundtrip", "--hf-checkpoint", str(copy)])
    assert lines[-1].startswith(f"vime-gemma4 roundtrip: error: {copy / 'config.json'}") and expected in lines[-1]
    assert len(lines) == 1, lines


def _untied(tensors: dict, config: dict) -> None:
    """A fine-tuned untied Gemma 4: ``tie_word_embeddings: false`` and an ``lm_head.weight`` of its own."""
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"].flip(0).contiguous()


UNTIED = "tie_word_embeddings is false (an lm_head of its own): untied Gemma 4 is not supported"


def test_untied_checkpoint_is_refused_before_launch(good, tmp_path, capsys) -> None:
    """Refused in one line, exit 2, before any rank starts (it died in an AttributeError inside the
    bridge, and on the fork would have left ``lm_head`` random)."""
    source = damaged(good, tmp_path, _untied)
    lines = refused(capsys, ["roundtrip", "--hf-checkpoint", str(source)])
    assert len(lines) == 1 and UNTIED in lines[0], lines


def test_untied_checkpoint_is_refused_on_vimes_road(good, tmp_path) -> None:
    """vime builds its model from the bridge's provider (``AutoBridge.to_megatron_provider``): refused there
    too, naming the field, as the plugin's ``UnsupportedCheckpoint``."""
    from megatron.bridge import AutoBridge

    import vime_gemma4_bridge
    from vime_gemma4_bridge.core.provider_config import UnsupportedCheckpoint

    vime_gemma4_bridge.register()
    bridge = AutoBridge.from_hf_pretrained(str(damaged(good, tmp_path, _untied)))
    with pytest.raises(UnsupportedCheckpoint, match=re.escape(UNTIED)):
        bridge.to_megatron_provider(load_weights=False)


# ------------------------------------------------------------------------------------------------
# Inputs the commands refused already (kept refused)
# ------------------------------------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "case, expected",
    [
        ("indivisible-ep", "16 experts do not divide by --ep 3"),
        ("world-size", "does not fit 3 rank(s)"),
        ("no-config", "has no config.json"),
        ("bad-config", "config.json is not valid JSON"),
        ("not-gemma", "not a Gemma 4 checkpoint"),
        ("truncated-safetensors", "is unreadable or corrupt"),
        ("occupied-output", "already exists and is not empty; pass --force to replace it"),
    ],
)
def test_refusals_already_handled(good, tmp_path, capsys, case, expected) -> None:
    source = tmp_path / "hf"
    shutil.copytree(good, source)
    out = tmp_path / "out"
    argv = ["import", "--hf-checkpoint", str(source), "--save", str(out)]
    if case == "indivisible-ep":
        argv += ["--ep", "3", "--nproc", "3"]
    elif case == "world-size":
        argv += ["--tp", "2", "--nproc", "3"]
    elif case == "no-config":
        (source / "config.json").unlink()
    elif case == "bad-config":
        _write(source / "config.json", "{not json")
    elif case == "not-gemma":
        config = json.loads((source / "config.json").read_text())
        config["architectures"] = ["LlamaForCausalLM"]
        _write(source / "config.json", json.dumps(config))
    elif case == "truncated-safetensors":
        shard = next(source.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "occupied-output":
        out.mkdir()
        _write(out / "keep.txt", "mine")
    before = digest(source)
    lines = refused(capsys, argv)
    assert expected in lines[-1], lines
    assert digest(source) == before
    assert leftovers(tmp_path, "out") == (["out"] if case == "occupied-output" else [])
    if case == "occupied-output":
        assert (out / "keep.txt").read_text() == "mine"


def test_torch_dist_of_another_model(good, torch_dist, tmp_path, capsys) -> None:
    other = write_tiny_checkpoint(tmp_path / "other", TinySpec(seed=11, experts=8))
    lines = refused(capsys, ["export", "--load", str(torch_dist), "--hf-checkpoint", str(other), "--output", "o"])
    assert "holds a different model than" in lines[-1]


# ------------------------------------------------------------------------------------------------
# Write failures: disk full, read-only file system
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(path: Path, *options: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.parametrize("command", ["roundtrip", "import", "export-live"])
def test_disk_full_is_one_line_and_leaves_nothing(good, tmp_path, command) -> None:
    before = digest(good)
    with small_filesystem(tmp_path / "fs", "size=300k") as fs:
        flag = {"roundtrip": "--output", "import": "--save", "export-live": "--dump"}[command]
        extra = ["--buffer-size", "100000"] if command == "export-live" else []
        proc = run_cli(command, "--hf-checkpoint", str(good), *extra, flag, str(fs / "out"))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.splitlines()[-1]
        assert last.startswith(f"vime-gemma4 {command}: error: writing ") and "No space left on device" in last
        assert list(fs.iterdir()) == []
    assert digest(good) == before


def test_debug_shows_the_traceback_of_a_failure(good, tmp_path) -> None:
    with small_filesystem(tmp_path / "fs", "size=300k") as fs:
        proc = run_cli("roundtrip", "--hf-checkpoint", str(good), "--output", str(fs / "out"), "--debug")
        assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
        assert "No space left on device" in proc.stderr.splitlines()[-1]
        assert list(fs.iterdir()) == []


@pytest.mark.parametrize("command", ["roundtrip", "import", "export-live"])
def test_unwritable_output_is_refused_before_launch(good, tmp_path, capsys, command) -> None:
    """A read-only file system stands in for permission denied (root ignores file modes)."""
    with small_filesystem(tmp_path / "fs", "size=1m", "ro") as fs:
        flag = {"roundtrip": ["--output"], "import": ["--save"], "export-live": ["--buffer-size", "1MB", "--dump"]}
        lines = refused(capsys, [command, "--hf-checkpoint", str(good), *flag[command], str(fs / "out")])
        expected = f"cannot write output {fs / 'out'}: Read-only file system ({fs}); choose another path"
        assert lines[-1] == f"vime-gemma4 {command}: error: {expected}"


# ------------------------------------------------------------------------------------------------
# Interrupts
# ------------------------------------------------------------------------------------------------


def _start_import(good: Path, save: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vime_gemma4_bridge.cli", "import", "--hf-checkpoint", str(good), "--save", str(save)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_partial(proc: subprocess.Popen, parent: Path, name: str) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.name.startswith(f".{name}.partial") for p in parent.iterdir()):
            return
        time.sleep(0.02)
    pytest.fail(f"no partial output appeared (exit {proc.poll()})")


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_interrupt_removes_partial_output(good, tmp_path, sig, status) -> None:
    """The signal lands while the import writes its partial output: exit 128 + signal, nothing left.

    The tiny import writes its partial for well under a second, so on a busy machine the signal can
    arrive after the import finished (exit 0, the output complete): that try says nothing about an
    interrupt, so its output is removed and the import started again (up to 5 tries)."""
    before = digest(good)
    for _ in range(5):
        proc = _start_import(good, tmp_path / "out")
        _wait_for_partial(proc, tmp_path, "out")
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            break
        assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").is_file(), err[-2000:]
        shutil.rmtree(tmp_path / "out")
    assert proc.returncode == status, err[-2000:]
    assert "Traceback" not in err and "interrupted" in err.splitlines()[-1]
    assert leftovers(tmp_path, "out") == [] and digest(good) == before


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (from /proc: the rank processes of a launcher, and theirs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(pid)
    return alive


@pytest.mark.parametrize("run", range(5))
def test_export_live_interrupted_mid_stream_leaves_nothing(good, tmp_path, run) -> None:
    """SIGINT while export-live streams (its dump's partial exists), at 5 moments, on 2 local ranks and in
    process: exit 130 (or 0 saying the dump was complete), no partial, no rank process left. Before, rank
    0's partial stayed behind when the launcher killed the world, and a signal in the interpreter's
    teardown after a complete run ended it by SIGINT (-2) without a word (cli/errors.exit_program)."""
    dump = tmp_path / "dump"
    ranks = ["--nproc", "2"] if run % 2 == 0 else []
    argv = ["export-live", "--hf-checkpoint", str(good), "--buffer-size", "20000", "--dump", str(dump), *ranks]
    command = [sys.executable, "-m", "vime_gemma4_bridge.cli", *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_partial(proc, tmp_path, "dump")
    time.sleep([0.0, 0.0, 0.02, 0.05, 0.1][run])
    below = _descendants(proc.pid)
    assert below or not ranks, "the local ranks must be running"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    last = err.splitlines()[-1]
    if proc.returncode == 0:  # the dump was committed first: said by the interrupt, or by the report (signal too late)
        said = {f"vime-gemma4 export-live: interrupted after {dump} was complete; it is kept"}
        assert last in said or out.rstrip().endswith(f"-> {dump}"), (out, err[-2000:])
        assert leftovers(tmp_path, "dump") == ["dump"] and (dump / "model.safetensors.index.json").is_file()
    else:
        assert proc.returncode == 130, err[-2000:]
        assert last == f"vime-gemma4 export-live: interrupted; {dump} was not written", err[-2000:]
        assert leftovers(tmp_path, "dump") == []
    deadline = time.monotonic() + 10
    while _alive(below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(below), f"processes left behind: {_alive(below)}"


def test_signal_after_the_commit_is_no_failure(good, tmp_path, capsys, monkeypatch) -> None:
    """SIGTERM right after ``import`` put its output in place: exit 0, the output complete and kept."""
    from vime_gemma4_bridge.convert import torch_dist_jobs
    from vime_gemma4_bridge.io.commit import commit_directory

    def commit_then_signal(partial, out, **kwargs):
        committed = commit_directory(partial, out, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        return committed

    monkeypatch.setattr(torch_dist_jobs, "commit_directory", commit_then_signal)
    out = tmp_path / "out"
    assert cli.main(["import", "--hf-checkpoint", str(good), "--save", str(out)]) == 0
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"vime-gemma4 import: interrupted after {out} was complete; it is kept", last
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert leftovers(tmp_path, "out") == ["out"]
    assert signal.getsignal(signal.SIGTERM) is not None and "errors" not in str(signal.getsignal(signal.SIGTERM))


# ------------------------------------------------------------------------------------------------
# Concurrent runs to one output
# ------------------------------------------------------------------------------------------------


def test_only_partials_of_dead_writers_are_removed(good, tmp_path, capsys) -> None:
    """A run writing the same output (its process alive) keeps its partial; a killed run's goes."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    alive, dead = tmp_path / f".out.partial-{os.getpid()}-00", tmp_path / f".out.partial-{int(ended.stdout)}-00"
    alive.mkdir()
    dead.mkdir()
    assert cli.main(["import", "--hf-checkpoint", str(good), "--save", str(tmp_path / "out")]) == 0
    assert alive.is_dir() and not dead.exists()


def test_an_output_that_appears_while_writing_is_kept(good, tmp_path, capsys, monkeypatch) -> None:
    """Without --force, a run never replaces the output another run committed while it was writing."""
    from vime_gemma4_bridge.convert import torch_dist_jobs

    out = tmp_path / "out"
    count = torch_dist_jobs._directory_stats

    def another_run_commits_first(path: Path) -> tuple[int, int]:
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
        return count(path)

    monkeypatch.setattr(torch_dist_jobs, "_directory_stats", another_run_commits_first)
    assert cli.main(["import", "--hf-checkpoint", str(good), "--save", str(out)]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        f"vime-gemma4 import: error: {out} appeared while this run was writing it (another run?); it was kept "
        "and this run's output discarded: pass --force to replace it"
    ), last
    assert [p.name for p in out.iterdir()] == ["theirs.txt"] and leftovers(tmp_path, "out") == ["out"]


def test_sigkill_leaves_a_hidden_partial_that_the_next_run_cleans(good, tmp_path) -> None:
    proc = _start_import(good, tmp_path / "out")
    _wait_for_partial(proc, tmp_path, "out")
    proc.kill()
    proc.communicate(timeout=120)
    left = leftovers(tmp_path, "out")
    assert left and all(name.startswith(".out.partial") for name in left), left
    assert run_cli("import", "--hf-checkpoint", str(good), "--save", str(tmp_path / "out")).returncode == 0
    assert leftovers(tmp_path, "out") == ["out"]


# ------------------------------------------------------------------------------------------------
# Hostile files: nothing in a checkpoint executes
# ------------------------------------------------------------------------------------------------


class _RunsCode:
    """A pickle that runs a shell command when loaded (what a hostile ``.metadata`` holds)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_item(iteration: Path, key: str, payload: object) -> None:
    """Point the stored item of ``key`` at a ``torch.save`` of ``payload`` appended to its ``.distcp`` file."""
    import dataclasses
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(iteration)).read_metadata()
    index, info = next((index, info) for index, info in metadata.storage_data.items() if index.fqn.split("/")[0] == key)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = iteration / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as handle:
        handle.write(buffer.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buffer.getvalue()))
    (iteration / ".metadata").write_bytes(pickle.dumps(metadata))


def _hostile_metadata(iteration: Path, marker: Path) -> str:
    import pickle

    (iteration / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    return "/iter_0000000/.metadata refused: its pickle names posix.system"


def _hostile_byte_item(iteration: Path, marker: Path) -> str:
    """megatron-core's common state: PyTorch's load planner unpickles it with ``weights_only=False``."""
    _plant_item(iteration, "common_state", [_RunsCode(marker)])
    return ".distcp (item common_state/shard_0_1) refused: its pickle names posix.system"


def _hostile_tensor_item(iteration: Path, marker: Path) -> str:
    _plant_item(iteration, "embedding.word_embeddings.weight", _RunsCode(marker))
    return ".distcp (item embedding.word_embeddings.weight) refused: its pickle names posix.system"


def _hostile_common_pt(iteration: Path, marker: Path) -> str:
    """A legacy ``common.pt``, which megatron-core's ``load_common_state_dict`` prefers to the common state."""
    import torch

    torch.save({"iteration": 0, "checkpoint_version": 3.0, "args": _RunsCode(marker)}, iteration / "common.pt")
    return "/iter_0000000/common.pt refused: its pickle names posix.system"


def _hostile_nested_archive(iteration: Path, marker: Path) -> str:
    """An archive nested as bytes (``torch.storage._load_from_bytes``, as legacy TE extra state holds)."""
    import io

    import torch

    inner = io.BytesIO()
    torch.save(_RunsCode(marker), inner)
    _plant_item(iteration, "common_state", [_LoadsBytes(inner.getvalue())])
    return ".distcp (item common_state/shard_0_1) refused: its pickle names posix.system"


def _hostile_run_config(iteration: Path, marker: Path) -> str:
    config = iteration / "run_config.yaml"
    config.write_text(config.read_text() + f"hostile: !!python/object/apply:os.system ['touch {marker}']\n")
    return "run_config.yaml refused: it names the YAML tag 'tag:yaml.org,2002:python/object/apply:os.system'"


class _LoadsBytes:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        import torch

        return torch.storage._load_from_bytes, (self.data,)


HOSTILE = {
    "metadata": _hostile_metadata,
    "byte-item": _hostile_byte_item,
    "tensor-item": _hostile_tensor_item,
    "common-pt": _hostile_common_pt,
    "nested-archive": _hostile_nested_archive,
    "run-config": _hostile_run_config,
}


@pytest.mark.parametrize("plant", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("topology", [[], ["--ep", "2", "--nproc", "2"]], ids=["default", "ep2"])
def test_hostile_checkpoint_files_never_run(good, torch_dist, tmp_path, capsys, topology, plant) -> None:
    """Each pickle (and the YAML) megatron-core or PyTorch would load is refused, exit 2; the code never ran."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(torch_dist, ckpt)
    marker = tmp_path / "marker"
    expected = plant(ckpt / "iter_0000000", marker)
    out = tmp_path / "out"
    argv = ["export", "--load", str(ckpt), "--hf-checkpoint", str(good), "--output", str(out), *topology]
    lines = refused(capsys, argv)
    assert expected in lines[-1] and len(lines) == 1, lines
    assert not marker.exists(), "the hostile pickle ran"
    assert not leftovers(tmp_path, "out")


def test_planted_items_are_what_megatron_core_would_load(torch_dist, tmp_path) -> None:
    """The planted byte item is reachable: PyTorch's own scan names the hostile global in the bytes it reads."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    iteration = tmp_path / "ckpt" / "iter_0000000"
    shutil.copytree(torch_dist, tmp_path / "ckpt")
    _hostile_byte_item(iteration, tmp_path / "marker")
    metadata = FileSystemReader(str(iteration)).read_metadata()
    info = next(info for index, info in metadata.storage_data.items() if index.fqn.startswith("common_state/"))
    with open(iteration / info.relative_path, "rb") as handle:
        handle.seek(info.offset)
        item = io.BytesIO(handle.read(info.length))
    assert torch.serialization.get_unsafe_globals_in_checkpoint(item) == ["posix.system"]


def test_metadata_allow_list_reads_a_real_checkpoint(torch_dist) -> None:
    """The allow-list admits what megatron-core writes: the result equals PyTorch's own (plain pickle) read."""
    from torch.distributed.checkpoint import FileSystemReader

    from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

    ours = read_checkpoint_metadata(torch_dist / "iter_0000000")
    theirs = FileSystemReader(str(torch_dist / "iter_0000000")).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_allow_list_covers_what_megatron_core_writes(tmp_path) -> None:
    """Every class megatron-core's checkpoints may hold (its ``SAFE_GLOBALS``) passes; one more name does not."""
    import torch
    from megatron.core.safe_globals import SAFE_GLOBALS

    from vime_gemma4_bridge.io.safe_pickle import UnsafeCheckpoint, check_archive

    torch.save(list(SAFE_GLOBALS), tmp_path / "common.pt")  # each class or function pickled by its name
    check_archive(tmp_path / "common.pt")
    torch.save([*SAFE_GLOBALS, shutil.rmtree], tmp_path / "hostile.pt")
    with pytest.raises(UnsafeCheckpoint, match=r"hostile\.pt refused: its pickle names shutil\.rmtree"):
        check_archive(tmp_path / "hostile.pt")
