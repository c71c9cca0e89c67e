"""``verify-update``'s proof: what a weight update pushed equals the checkpoint's language model, bitwise.

A disk-transport update (chunk files written by vime, or by ``vime-gemma4 export-live``) is paired
name by name with the HF checkpoint through the one comparison engine
(:mod:`vime_gemma4_bridge.verify.compare`); every mismatch is named, with the one fingerprint
(:mod:`vime_gemma4_bridge.verify.fingerprint`) of what was pushed and what was expected.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert.fp8 import SCALE_SUFFIX
from vime_gemma4_bridge.core.hf_layout import PER_EXPERT, STACKED
from vime_gemma4_bridge.io import hf as hf_io
from vime_gemma4_bridge.verify.compare import TensorFiles, compare_tensors, difference, walk
from vime_gemma4_bridge.verify.fingerprint import tensor_digest
from vime_gemma4_bridge.verify.layouts import Quantized, Restacked

__all__ = ["latest_version_dir", "verify_update"]


def latest_version_dir(dump: Path) -> Path:
    """A disk-transport root holds ``weight_v<N>/`` directories; a version directory is used as is."""
    versions = sorted(p for p in dump.iterdir() if p.is_dir() and re.fullmatch(r"weight_v\d+", p.name))
    return versions[-1] if versions else dump


def _reference(source: hf_io.HFCheckpoint, pushed: TensorFiles) -> TensorFiles:
    """The checkpoint's language model as the update should hold it: FP8-quantized if it holds FP8 scales."""
    reference = TensorFiles.of_checkpoint(source, source.language_model_names())
    return Quantized(reference) if any(name.endswith(SCALE_SUFFIX) for name in pushed.names()) else reference


def verify_update(hf_checkpoint: str | Path, dump: str | Path) -> dict[str, Any]:
    """Compare what was pushed (chunk files under ``dump``) with the checkpoint's language model.

    Returns a report whose ``problems`` lists every mismatch by tensor name: missing, unexpected,
    pushed twice, dtype/shape changed, or different values (with expected and received fingerprints).
    The comparison engine pairs the pushed tensors, in file order, with the checkpoint's, reading
    one pair at a time. Per-expert experts are compared as their restacked stacks, and an FP8
    update with the checkpoint quantized the same way (:mod:`vime_gemma4_bridge.verify.layouts`),
    bitwise in both cases.
    """
    source = hf_io.HFCheckpoint(hf_checkpoint)
    directory = latest_version_dir(Path(dump))
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise hf_io.CheckpointError(f"{directory} holds no .safetensors chunk files")
    problems: list[str] = []
    matched = 0
    with Restacked(TensorFiles.of_files(files)) as pushed, _reference(source, pushed) as reference:
        expected = reference.names()
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
        layout = PER_EXPERT if pushed.restacked else STACKED
        fp8 = isinstance(reference, Quantized)
    return {
        "directory": str(directory),
        "files": len(files),
        "expert_layout": layout,
        "fp8": fp8,
        "expected": len(expected),
        "matched": matched,
        "problems": problems,
        "ok": not problems and matched == len(expected),
    }
