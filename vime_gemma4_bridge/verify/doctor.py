"""Checkpoint doctor: say *where* and *how* two Gemma 4 HF checkpoints diverge (``vime-gemma4 compare``).

Why this exists: the original bug report (HF1 → Megatron → HF2 at TP2·PP2·EP4 gave garbled
rollouts) took days of hand-built probes (LocalOwner → SOURCE → EPFULL → FULL → BUFFER → STACK)
to find that experts had been copied across expert-parallel boundaries (expert 0 == expert 32).
A bitwise "different" is not enough to act on; this names the fault directly.

:func:`compare_checkpoints` walks A and B with the comparison engine
(:mod:`vime_gemma4_bridge.verify.compare`: one pair of tensors in memory at a time) and records
missing/extra names, dtype and shape changes, bitwise equality, max |Δ| and cosine per tensor, and a
fingerprint of every routed expert of every layer; the rules of :mod:`vime_gemma4_bridge.verify.diagnose`
then recognise the faults a broken conversion produces:

* an expert duplicated from another (with the EP size at which both ids share a local slot),
* experts shifted by a block (B's expert e is A's expert (e+k) mod E, as an EP-sized
  reconstruction error would leave them) or otherwise permuted,
* gate/up halves swapped (``experts.gate_up_proj`` per expert, or ``mlp.gate_proj``/``up_proj``),
* q/k/v rows permuted by head, k and v confused,
* the tied output layer disagreeing with the embedding (an extra ``lm_head.weight``, or a changed
  ``embed_tokens``),
* a layer's tensors in another layer's place.

The summary names the cause that explains the most differing tensors first.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.core.hf_layout import text_config_dict
from vime_gemma4_bridge.verify.compare import TensorFiles, compare_tensors, difference, walk
from vime_gemma4_bridge.verify.diagnose import Evidence, diagnose
from vime_gemma4_bridge.verify.doctor_report import DoctorReport, ExpertRow, ExpertTable, TensorRecord
from vime_gemma4_bridge.verify.fingerprint import Fingerprint, fingerprint, stacked_digest, swap_halves, tensor_digest
from vime_gemma4_bridge.verify.layouts import Restacked
from vime_gemma4_bridge.verify.report import EXPERT_SUFFIXES, LAYER_RE, family_of

_ATTN_PROJ_RE = re.compile(r"\.self_attn\.(?P<which>[qkv])_proj\.weight$")


def compare_checkpoints(a_path: str | Path, b_path: str | Path, *, atol: float | None = None) -> DoctorReport:
    """Compare checkpoint B against reference A; raises ``CheckpointError`` (a ``ValueError``) on bad input.

    A checkpoint whose shards record digests is checked against them first (``DamagedCheckpoint``):
    a damaged file is named as such, not reported as a model that differs.
    """
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    if atol is not None and not atol >= 0:
        raise ValueError(f"--atol must be a number >= 0, got {atol}")
    a, b = HFCheckpoint(a_path), HFCheckpoint(b_path)
    a.check_digests()
    b.check_digests()
    return _Comparator(a, b, atol).run()


def _is_expert_tensor(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(EXPERT_SUFFIXES) and tensor.ndim == 3 and tensor.shape[0] > 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Comparator:
    """Streams A and B once; keeps digests and small per-expert data, never two whole checkpoints."""

    def __init__(self, a: Any, b: Any, atol: float | None) -> None:
        self.a, self.b, self.atol = a, b, atol
        self.report = DoctorReport(str(a.path), str(b.path), atol)
        text = text_config_dict(a.config)
        self.layer_types: list[str] = list(text.get("layer_types") or [])
        self.head_dims = [int(text[k]) for k in ("head_dim", "global_head_dim") if text.get(k)]
        self.ties = bool(a.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        self.a_expert_fps: dict[str, list[Fingerprint]] = {}

    def run(self) -> DoctorReport:
        """Every tensor of A in file order, then B's extras; one tensor pair in memory at a time.

        Per-expert experts (a live stream's dump) are read as their stacks (:class:`Restacked`).
        """
        with Restacked(TensorFiles.of_checkpoint(self.a)) as ra, Restacked(TensorFiles.of_checkpoint(self.b)) as rb:
            for pair in walk(ra, rb):
                if pair.candidate is None:
                    record = self._one_sided(pair.name, pair.reference, "missing")
                elif pair.reference is None:
                    record = self._one_sided(pair.name, pair.candidate, "extra")
                else:
                    record = self._compare(pair.name, pair.reference, pair.candidate)
                self.report.records.append(record)
                del pair
            evidence = Evidence(b=rb, b_prefix=self.b.prefix, ties=self.ties, a_expert_fps=self.a_expert_fps)
            self.report.causes = diagnose(self.report, evidence)
        return self.report

    # -- per tensor --------------------------------------------------------------------------

    def _digest(self, name: str, tensor: torch.Tensor, side: str) -> tuple[str, list[Fingerprint] | None]:
        """Whole-tensor digest; for stacked experts it is built from the per-expert digests."""
        if not _is_expert_tensor(name, tensor):
            return tensor_digest(tensor), None
        fps = [fingerprint(tensor[e]) for e in range(tensor.shape[0])]
        if side == "a":
            self.a_expert_fps[name] = fps
        return stacked_digest(tensor, (fp.digest for fp in fps)), fps

    def _one_sided(self, name: str, tensor: torch.Tensor, status: str) -> TensorRecord:
        side = "a" if status == "missing" else "b"
        digest, _ = self._digest(name, tensor, side)
        record = TensorRecord(name, family_of(name), status)
        setattr(record, f"dtype_{side}", _dtype_name(tensor.dtype))
        setattr(record, f"shape_{side}", list(tensor.shape))
        setattr(record, f"digest_{side}", digest)
        return record

    def _compare(self, name: str, ta: torch.Tensor, tb: torch.Tensor) -> TensorRecord:
        """Status, digests and differences of one name present in both; keeps what the diagnosis needs
        later (per-expert fingerprints, a head permutation) so the tensors can be dropped."""
        diff = compare_tensors(ta, tb, atol=self.atol)
        record = TensorRecord(
            name,
            family_of(name),
            diff.status,
            dtype_a=_dtype_name(ta.dtype),
            dtype_b=_dtype_name(tb.dtype),
            shape_a=list(ta.shape),
            shape_b=list(tb.shape),
            max_abs=diff.max_abs,
            cosine=diff.cosine,
        )
        if diff.status == "equal":
            record.digest_a, fps = self._digest(name, ta, "a")
            record.digest_b = record.digest_a
            if fps is not None:
                self._expert_table(name, ta, tb, fps, fps)
            return record
        record.digest_a, fps_a = self._digest(name, ta, "a")
        record.digest_b, fps_b = self._digest(name, tb, "b")
        if diff.status == "shape":
            flipped = ta.transpose(-1, -2) if ta.ndim >= 2 else None
            record.transposed = flipped is not None and same_bytes(tb, flipped)
            return record
        if diff.status == "dtype":
            cast = tb.to(ta.dtype)
            record.lossless_cast = same_bytes(cast.to(tb.dtype), tb)
            if fps_a is not None and record.lossless_cast:
                # A lossless dtype change must not hide a misplaced expert: compare content in A's dtype.
                self._expert_table(name, ta, cast, fps_a, self._digest(name, cast, "b")[1] or [])
            return record
        if fps_a is not None and fps_b is not None:
            self._expert_table(name, ta, tb, fps_a, fps_b, close=diff.status == "close")
        if diff.status == "different" and _ATTN_PROJ_RE.search(name):
            record.head_permutation = self._head_permutation(name, ta, tb)
        return record

    def _expert_table(
        self,
        name: str,
        ta: torch.Tensor,
        tb: torch.Tensor,
        fps_a: list[Fingerprint],
        fps_b: list[Fingerprint],
        *,
        close: bool = False,
    ) -> None:
        """Per-expert rows (and A's gate/up-swapped digests): the data every expert diagnosis works on."""
        match = LAYER_RE.match(name)
        kind = name.rsplit(".", 1)[-1]
        rows = []
        for e, (fa, fb) in enumerate(zip(fps_a, fps_b, strict=True)):
            row = ExpertRow(e, fa, fb)
            if fa.digest != fb.digest:
                row.status = "within --atol" if close else "changed"
                row.max_abs, row.cosine = difference(ta[e], tb[e])
            rows.append(row)
        swapped = None
        if kind == "gate_up_proj" and ta.shape[1] % 2 == 0:
            swapped = [tensor_digest(swap_halves(ta[e])) for e in range(ta.shape[0])]
        self.report.experts.append(ExpertTable(name, int(match["layer"]) if match else -1, kind, rows, swapped))

    def _head_permutation(self, name: str, ta: torch.Tensor, tb: torch.Tensor) -> tuple[int, list[int]] | None:
        """If B's rows are A's heads in another order, (head_dim, B head i = A head perm[i])."""
        if ta.ndim != 2:
            return None
        match = LAYER_RE.match(name)
        candidates = list(dict.fromkeys(self._layer_head_dims(int(match["layer"])) if match else self.head_dims))
        for head_dim in candidates:
            rows = ta.shape[0]
            if head_dim <= 0 or rows % head_dim or rows // head_dim < 2:
                continue
            heads = rows // head_dim
            a_heads = [tensor_digest(ta[h * head_dim : (h + 1) * head_dim]) for h in range(heads)]
            b_heads = [tensor_digest(tb[h * head_dim : (h + 1) * head_dim]) for h in range(heads)]
            if Counter(a_heads) != Counter(b_heads):
                continue
            where = {digest: h for h, digest in enumerate(a_heads)}
            return head_dim, [where[digest] for digest in b_heads]
        return None

    def _layer_head_dims(self, layer: int) -> list[int]:
        """Head dims to try for a layer: its own first (global layers may use ``global_head_dim``)."""
        dims = list(self.head_dims)
        if len(dims) == 2 and 0 <= layer < len(self.layer_types) and self.layer_types[layer] == "full_attention":
            dims.reverse()
        return dims
