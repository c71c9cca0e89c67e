"""The live weight-export path of RL training (vime ``--megatron-to-hf-mode bridge``), and its check.

During training the Megatron actor pushes its weights to vLLM after every step, streaming
HF-named tensors out of Megatron-Bridge's export. This module is that stream for Gemma 4:

* :func:`iter_hf_weights` yields ``(hf_name, tensor, megatron_name)`` for the language model only
  — the tuple vime's bridge weight iterator unpacks — whichever tuple shape the installed
  Megatron-Bridge build yields (0.6.2 yields ``(hf_name, tensor)``; vime's build adds the Megatron
  name). Names, shapes and dtypes are those of the HF checkpoint: stacked experts, no ``v_proj`` on
  k_eq_v layers, no ``lm_head`` (tied), no vision/audio tensors — the layout vLLM's Gemma 4 loader
  takes.
* :func:`chunk_by_bytes` groups the stream into chunks below N bytes (a tensor of N or more stands
  alone), like vime's ``chunk_named_params_by_size``. Peak extra memory is one chunk plus what
  Megatron-Bridge holds to stack one layer's experts.
* ``vime-gemma4 export-live`` drives it from the command line and writes each chunk as one
  safetensors file, the way vime's disk transport does; ``vime-gemma4 verify-update`` checks such
  a directory against the HF checkpoint, bitwise and by fingerprint, naming every mismatch.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.launch import add_launch_arguments, is_reporting_process, launch, requested_world_size
from vime_gemma4_bridge.verify.fingerprint import tensor_digest

NamedWeight = tuple[str, torch.Tensor, str]


def megatron_names_by_hf_name(conversion_tasks: Iterable[Any]) -> dict[str, str]:
    """HF tensor name → the Megatron parameter it comes from (per-expert suffix dropped for stacks)."""
    names: dict[str, str] = {}
    for task in conversion_tasks:
        if task is None:
            continue
        hf = task.mapping.hf_param
        megatron = task.global_param_name
        if getattr(task.mapping, "is_grouped_export", False):
            megatron = re.sub(r"(weight|bias)\d+$", r"\1", megatron)
        for hf_name in hf.values() if isinstance(hf, dict) else (hf,):
            names.setdefault(hf_name, megatron)
    return names


def iter_hf_weights(
    bridge: Any, model: list[torch.nn.Module], *, cpu: bool = False, conversion_tasks: list | None = None
) -> Iterator[NamedWeight]:
    """Stream ``(hf_name, tensor, megatron_name)`` of the language model; collective over all ranks."""
    tasks = conversion_tasks if conversion_tasks is not None else bridge.get_conversion_tasks(model)
    megatron_names = megatron_names_by_hf_name(tasks)
    seen: set[str] = set()
    for item in bridge.export_hf_weights(model, cpu=cpu, conversion_tasks=tasks, show_progress=False):
        hf_name, tensor = item[0], item[1]
        megatron_name = item[2] if len(item) > 2 else megatron_names[hf_name]
        if hf_name in seen:
            raise ValueError(f"live export produced {hf_name!r} twice")
        seen.add(hf_name)
        yield hf_name, tensor, megatron_name


def chunk_by_bytes(weights: Iterable[NamedWeight], max_bytes: int) -> Iterator[list[NamedWeight]]:
    """Group a stream into chunks below ``max_bytes``; a tensor that reaches it alone is a chunk alone.

    vime's rule (``chunk_named_params_by_size``): a chunk is closed when adding the next tensor would
    bring it to ``max_bytes`` or more.
    """
    if max_bytes < 1:
        raise ValueError(f"--buffer-size must be at least 1 byte, got {max_bytes}")
    chunk: list[NamedWeight] = []
    size = 0
    for item in weights:
        nbytes = item[1].numel() * item[1].element_size()
        if chunk and size + nbytes >= max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += nbytes
    if chunk:
        yield chunk


# ------------------------------------------------------------------------------------------------
# export-live
# ------------------------------------------------------------------------------------------------


def export_live_job(hf_checkpoint: str, topology: Topology, dump: str, buffer_size: int, force: bool) -> dict:
    """Runs on every rank: load HF at ``topology``, stream the live export, rank 0 writes the chunks."""
    from safetensors.torch import save_file

    from vime_gemma4_bridge import hf_io
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    writer = convert.is_rank0()
    out = Path(dump)
    tmp = out.parent / f".{out.name}.partial"
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    files: list[tuple[str, list[str], int]] = []
    start = time.perf_counter()
    for index, chunk in enumerate(chunk_by_bytes(iter_hf_weights(bridge, model, cpu=True), buffer_size), start=1):
        if not writer:
            continue
        name = f"model-{index:05d}.safetensors"
        state = {hf_name: tensor.contiguous() for hf_name, tensor, _ in chunk}
        save_file(state, tmp / name, metadata={"format": "pt"})
        files.append((name, list(state), sum(t.numel() * t.element_size() for t in state.values())))
    seconds = time.perf_counter() - start
    result: dict[str, Any] | None = None
    if writer:
        total = len(files)
        weight_map: dict[str, str] = {}
        for index, (name, names, _) in enumerate(files, start=1):
            final = f"model-{index:05d}-of-{total:05d}.safetensors"
            (tmp / name).rename(tmp / final)
            weight_map.update({n: final for n in names})
        source = hf_io.HFCheckpoint(hf_checkpoint)
        for item in source.path.iterdir():  # side files, as vime's disk transport copies them
            if item.is_file() and not item.name.endswith(".safetensors") and item.name != hf_io.INDEX_NAME:
                shutil.copy2(item, tmp / item.name)
        total_bytes = sum(size for *_, size in files)
        index_data = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp / hf_io.INDEX_NAME).write_text(json.dumps(index_data, indent=2) + "\n")
        if out.exists() and force:
            shutil.rmtree(out)
        tmp.rename(out)
        result = {
            "dump": str(out),
            "chunks": total,
            "tensors": len(weight_map),
            "bytes": total_bytes,
            "largest_chunk_bytes": max(size for *_, size in files),
            "chunk_tensor_counts": [len(names) for _, names, _ in files],
            "seconds": seconds,
        }
    return convert.broadcast_from_rank0(result)


def add_export_live_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export-live",
        help="drive the live (training-time) export at a topology; write each chunk as a safetensors file",
        description=(
            "Load a Gemma 4 HF checkpoint into the Megatron model at the given topology and stream it out "
            "through the live export path vime uses with --megatron-to-hf-mode bridge: (hf_name, tensor, "
            "megatron_name) for the language model only, in chunks below --buffer-size bytes (vime's rule; a "
            "larger tensor alone). Each chunk is written as one safetensors file, as vime's disk transport does, with "
            "an index and the checkpoint's side files; check the result with `vime-gemma4 verify-update`."
        ),
    )
    parser.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="Gemma 4 HF checkpoint to load")
    Topology.add_arguments(parser)
    add_launch_arguments(parser)
    parser.add_argument(
        "--buffer-size",
        required=True,
        metavar="BYTES",
        help="chunk bound (vime's --update-weight-buffer-size), e.g. 1GiB",
    )
    parser.add_argument("--dump", required=True, metavar="DIR", help="directory to write the chunk files into")
    parser.add_argument("--force", action="store_true", help="replace --dump if it exists")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run_export_live)


def run_export_live(args: argparse.Namespace) -> int:
    from vime_gemma4_bridge import hf_io
    from vime_gemma4_bridge.cli import preflight
    from vime_gemma4_bridge.convert import topology as convert

    try:
        topology = Topology.from_args(args)
        topology.validate(requested_world_size(args.nproc))
        source = hf_io.HFCheckpoint(args.hf_checkpoint)
        convert.validate_model_topology(source.config, topology)
        hf_io.refuse_overlap(args.dump, "--dump", {"--hf-checkpoint": source.path})
        hf_io.prepare_output(args.dump, force=args.force)
        buffer_size = hf_io.parse_size(args.buffer_size, "--buffer-size")
        preflight.check_language_model(source)
    except ValueError as error:
        print(f"vime-gemma4 export-live: error: {error}", file=sys.stderr)
        return 2
    result = launch(args.nproc, export_live_job, args.hf_checkpoint, topology, args.dump, buffer_size, args.force)[0]
    if not is_reporting_process():
        return 0
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"export-live: {result['tensors']} tensors, {result['bytes']:,} bytes in {result['chunks']} chunk "
            f"file(s) (largest {result['largest_chunk_bytes']:,} bytes, buffer {buffer_size:,}) at {topology} "
            f"-> {result['dump']}"
        )
    return 0


# ------------------------------------------------------------------------------------------------
# verify-update
# ------------------------------------------------------------------------------------------------


def latest_version_dir(dump: Path) -> Path:
    """A disk-transport root holds ``weight_v<N>/`` directories; a version directory is used as is."""
    versions = sorted(p for p in dump.iterdir() if p.is_dir() and re.fullmatch(r"weight_v\d+", p.name))
    return versions[-1] if versions else dump


def verify_update(hf_checkpoint: str | Path, dump: str | Path) -> dict[str, Any]:
    """Compare what was pushed (chunk files under ``dump``) with the checkpoint's language model.

    Returns a report whose ``problems`` lists every mismatch by tensor name: missing, unexpected,
    pushed twice, dtype/shape changed, or different values (with expected and received fingerprints).
    The comparison engine pairs the pushed tensors, in file order, with the checkpoint's, reading
    one pair at a time.
    """
    from vime_gemma4_bridge import hf_io
    from vime_gemma4_bridge.verify.compare import TensorFiles, compare_tensors, difference, walk

    source = hf_io.HFCheckpoint(hf_checkpoint)
    directory = latest_version_dir(Path(dump))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise hf_io.CheckpointError(f"{directory} holds no .safetensors chunk files")
    expected = source.language_model_names()
    problems: list[str] = []
    matched = 0
    with TensorFiles.of_checkpoint(source, expected) as reference, TensorFiles.of_files(files) as pushed:
        for pair in walk(reference, pushed, order="candidate"):
            name, ref, got = pair.name, pair.reference, pair.candidate
            if pair.again_in is not None:
                problems.append(f"{name}: pushed twice ({pushed.file(name).name} and {pair.again_in.name})")
            elif ref is None:
                problems.append(f"{name}: not a language-model tensor of the checkpoint ({pushed.file(name).name})")
            elif got is None:
                problems.append(f"{name}: missing from the update")
            elif (status := compare_tensors(ref, got, measure=False).status) in ("dtype", "shape"):
                problems.append(
                    f"{name}: {got.dtype} {tuple(got.shape)} pushed, checkpoint has {ref.dtype} {tuple(ref.shape)}"
                )
            elif status != "equal":
                problems.append(
                    f"{name}: values differ (fingerprint {tensor_digest(got)} pushed, "
                    f"{tensor_digest(ref)} expected, max |Δ|={difference(ref, got)[0]:.3g})"
                )
            else:
                matched += 1
    return {
        "directory": str(directory),
        "files": len(files),
        "expected": len(expected),
        "matched": matched,
        "problems": problems,
        "ok": not problems and matched == len(expected),
    }


def add_verify_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify-update",
        help="check a disk-transport weight update (chunk files) against the HF checkpoint, bitwise",
        description=(
            "Compare the tensors pushed to the rollout workers — a directory of safetensors chunk files as "
            "written by vime's disk transport (or `vime-gemma4 export-live`); a transport root with weight_v<N>/ "
            "directories is checked at its latest version — with the language model of the HF checkpoint: every "
            "tensor present once, same dtype and shape, bitwise equal. Every mismatch is named with fingerprints. "
            "Exit status: 0 iff all match, 1 otherwise, 2 on bad input."
        ),
    )
    parser.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="reference Gemma 4 HF checkpoint")
    parser.add_argument("--dump", required=True, metavar="DIR", help="directory of pushed chunk files")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from vime_gemma4_bridge import hf_io

    try:
        if not Path(args.dump).is_dir():
            raise hf_io.CheckpointError(f"--dump {args.dump} is not a directory")
        report = verify_update(args.hf_checkpoint, args.dump)
    except ValueError as error:
        print(f"vime-gemma4 verify-update: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for problem in report["problems"]:
            print(f"MISMATCH {problem}")
        verdict = "OK" if report["ok"] else "FAILED"
        print(
            f"verify-update {verdict}: {report['matched']}/{report['expected']} language-model tensors bitwise "
            f"identical in {report['files']} file(s) of {report['directory']}"
        )
    return 0 if report["ok"] else 1
