"""Checkpoint doctor: say *where* and *how* two Gemma 4 checkpoints diverge.

Why this exists: the original bug report (HF1 → Megatron → HF2 at TP2·PP2·EP4 gave garbled
rollouts) took days of hand-built probes (LocalOwner → SOURCE → EPFULL → FULL → BUFFER → STACK)
to find that experts had been copied across expert-parallel boundaries (expert 0 == expert 32).
A bitwise "different" is not enough to act on; these two commands name the fault directly.

``vime-gemma4 compare A B`` reads two HF checkpoints tensor by tensor (memory stays bounded by
the two largest tensors), reports missing/extra names, dtype and shape changes, bitwise equality,
max |Δ| and cosine per tensor, a fingerprint (short stable hash + stats) of every routed expert
of every layer, and recognises the faults a broken conversion produces:

* an expert duplicated from another (with the EP size at which both ids share a local slot),
* experts shifted by a block (B's expert e is A's expert (e+k) mod E, as an EP-sized
  reconstruction error would leave them) or otherwise permuted,
* gate/up halves swapped (``experts.gate_up_proj`` per expert, or ``mlp.gate_proj``/``up_proj``),
* q/k/v rows permuted by head, k and v confused,
* the tied output layer disagreeing with the embedding (an extra ``lm_head.weight``, or a changed
  ``embed_tokens``),
* a layer's tensors in another layer's place.

The summary names the cause that explains the most differing tensors first.

``vime-gemma4 probe --hf-checkpoint HF [topology]`` loads HF into the Megatron model at a topology
and fingerprints chosen experts at every stage of Megatron-Bridge's own export: the rank-local
parameter, after the PP broadcast, after the ETP gather, after the EP gather, and in the final
stacked HF tensor. The stages come from the bridge's own mapping objects (the conversion tasks of
``build_conversion_tasks``, run through ``stream_weights_megatron_to_hf``): this module only
listens to ``broadcast_from_pp_rank`` / ``gather_from_tp_ranks`` / ``gather_from_ep_ranks`` of
those mapping instances and never gathers anything by hand, so it probes the code that ships.
Megatron-Bridge gathers ETP before EP (``GatedMLPMapping`` / ``Column``/``RowParallelMapping``),
so the stages are listed in that order.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vime_gemma4_bridge.digest import tensor_digest
from vime_gemma4_bridge.distributed import (
    Topology,
    add_launch_arguments,
    is_reporting_process,
    launch,
    requested_world_size,
)
from vime_gemma4_bridge.report import ep_boundary_pairs, family_of, tensors_identical

#: Hex characters of a digest shown to people; comparisons always use the full digest.
SHORT_HASH = 10
#: Elements per chunk when statistics and differences are computed in float64 (bounds memory).
_CHUNK = 1 << 22
#: Names of the stacked routed-expert tensors (HF, relative to a layer).
EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj")
_LAYER_RE = re.compile(r"^(?P<stack>.*?\blayers\.)(?P<layer>\d+)\.(?P<suffix>.+)$")
_ATTN_PROJ_RE = re.compile(r"\.self_attn\.(?P<which>[qkv])_proj\.weight$")

COMPARE_DESCRIPTION = """\
Compare two Gemma 4 HF checkpoints A (reference) and B tensor by tensor and say where and how
they diverge: missing/extra tensors, dtype and shape changes, bitwise equality, max |dx| and
cosine per tensor, fingerprints of every routed expert per layer, and a diagnosis of the faults
a broken conversion leaves (duplicated or shifted experts, gate/up halves swapped, q/k/v heads
permuted, k and v confused, tied lm_head disagreeing with the embedding, layers swapped).
The first line is 'IDENTICAL: N tensors' or 'DIFFERENT: <most likely cause>'. Exit status: 0 iff
identical (or every difference within --atol), 1 otherwise, 2 on bad input."""

PROBE_DESCRIPTION = """\
Load a Gemma 4 MoE HF checkpoint into the Megatron model at the given parallel topology (gloo CPU
ranks with --nproc, or the ranks of torchrun) and follow chosen routed experts through
Megatron-Bridge's own export: the rank-local shard, after the PP broadcast, after the ETP gather,
after the EP gather, and the final stacked HF tensor. Each stage's fingerprint is checked against
what it must hold, derived from the HF source (the expert's ETP shard for the first two stages),
and the first stage that differs is flagged. Default experts: both sides of every EP boundary plus
the first and last expert. Exit status: 0 iff every stage matches, 1 otherwise, 2 on bad input."""


# =============================================================================================
# Fingerprints
# =============================================================================================


@dataclass(frozen=True)
class Fingerprint:
    """A stable content hash (dtype, shape and bytes) plus a few statistics, for people and JSON."""

    digest: str
    mean: float
    std: float
    absmax: float

    @property
    def short(self) -> str:
        return self.digest[:SHORT_HASH]

    def as_dict(self) -> dict[str, Any]:
        return {"hash": self.short, "digest": self.digest, "mean": self.mean, "std": self.std, "absmax": self.absmax}

    def __str__(self) -> str:
        return f"{self.short} (mean={self.mean:+.3g} std={self.std:.3g} absmax={self.absmax:.3g})"


def _stats(tensor: torch.Tensor) -> tuple[float, float, float]:
    """(mean, std, absmax) in float64, chunk by chunk so a 262k x 2816 embedding stays cheap."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if n == 0:
        return 0.0, 0.0, 0.0
    total = squares = 0.0
    absmax = 0.0
    for start in range(0, n, _CHUNK):
        chunk = flat[start : start + _CHUNK].double()
        total += chunk.sum().item()
        squares += chunk.square().sum().item()
        absmax = max(absmax, chunk.abs().max().item())
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean * mean, 0.0)), absmax


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """The :class:`Fingerprint` of one tensor."""
    return Fingerprint(tensor_digest(tensor), *_stats(tensor))


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, cosine(a, b)) over all elements in float64, chunked; shapes must match."""
    fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
    max_abs = dot = norm_a = norm_b = 0.0
    for start in range(0, fa.numel(), _CHUNK):
        x, y = fa[start : start + _CHUNK].double(), fb[start : start + _CHUNK].double()
        max_abs = max(max_abs, (x - y).abs().max().item())
        dot += (x * y).sum().item()
        norm_a += x.square().sum().item()
        norm_b += y.square().sum().item()
    if norm_a == 0.0 and norm_b == 0.0:
        cosine = 1.0
    elif norm_a == 0.0 or norm_b == 0.0:
        cosine = 0.0
    else:
        cosine = dot / math.sqrt(norm_a * norm_b)
    return max_abs, cosine


def swap_halves(expert: torch.Tensor) -> torch.Tensor:
    """``[gate; up]`` → ``[up; gate]`` along dim 0 (what a gate/up mix-up leaves behind)."""
    gate, up = torch.chunk(expert, 2, dim=0)
    return torch.cat([up, gate], dim=0)


# =============================================================================================
# compare: records
# =============================================================================================


@dataclass
class TensorRecord:
    """One tensor name of A ∪ B and how B's tensor relates to A's."""

    name: str
    family: str
    status: str  # equal | close | different | dtype | shape | missing | extra
    dtype_a: str | None = None
    dtype_b: str | None = None
    shape_a: list[int] | None = None
    shape_b: list[int] | None = None
    digest_a: str | None = None
    digest_b: str | None = None
    max_abs: float | None = None
    cosine: float | None = None
    note: str = ""
    head_permutation: tuple[int, list[int]] | None = None  # (head_dim, B head i = A head perm[i])
    transposed: bool = False
    lossless_cast: bool = False  # dtype changed, and casting B back to A's dtype loses nothing

    def as_dict(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "family": self.family,
            "status": self.status,
            "bitwise_equal": self.status == "equal",
            "dtype": [self.dtype_a, self.dtype_b],
            "shape": [self.shape_a, self.shape_b],
            "hash": [_short(self.digest_a), _short(self.digest_b)],
            "max_abs": _finite(self.max_abs),
            "cosine": _finite(self.cosine),
        }
        if self.note:
            data["note"] = self.note
        return data


@dataclass
class ExpertRow:
    """One expert of one stacked expert tensor: A's and B's fingerprints and what B's slot holds."""

    expert: int
    a: Fingerprint
    b: Fingerprint
    status: str = "ok"
    max_abs: float | None = None
    cosine: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "expert": self.expert,
            "a": self.a.as_dict(),
            "b": self.b.as_dict(),
            "status": self.status,
            "max_abs": _finite(self.max_abs),
            "cosine": _finite(self.cosine),
        }


@dataclass
class ExpertTable:
    """Per-expert fingerprints of one ``layers.L.experts.{gate_up_proj,down_proj}`` in A and B."""

    name: str
    layer: int
    kind: str  # gate_up_proj | down_proj
    rows: list[ExpertRow]
    a_swapped: list[str] | None = None  # digests of A's experts with gate/up halves swapped

    @property
    def in_place(self) -> int:
        return sum(row.status in ("ok", "within --atol") for row in self.rows)


@dataclass
class Cause:
    """One recognised fault and the tensors it explains."""

    kind: str
    message: str
    tensors: list[str]
    details: list[str] = field(default_factory=list)
    #: Changes no value (e.g. a lossless dtype change): ranked after every cause that does.
    value_preserving: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "tensors": self.tensors,
            "details": self.details,
            "value_preserving": self.value_preserving,
        }


#: Tie-break among causes explaining as many tensors: the more specific first.
_PRIORITY = {
    kind: rank
    for rank, kind in enumerate(
        (
            "expert-duplicate",
            "expert-shift",
            "expert-permutation",
            "expert-relocated",
            "layer-swap",
            "kv-swap",
            "gate-up-swap",
            "head-permutation",
            "tied-embedding",
            "renamed",
            "relocated",
            "transposed",
            "dtype",
            "shape",
            "missing",
            "extra",
            "values",
        )
    )
}


@dataclass
class DoctorReport:
    """Everything ``compare`` found; :meth:`format` is the human text, :meth:`as_dict` the JSON."""

    a_path: str
    b_path: str
    atol: float | None
    records: list[TensorRecord] = field(default_factory=list)
    experts: list[ExpertTable] = field(default_factory=list)
    causes: list[Cause] = field(default_factory=list)

    def count(self, status: str) -> int:
        """How many tensor names have this status."""
        return sum(record.status == status for record in self.records)

    @property
    def identical(self) -> bool:
        """Bitwise identical, or every value difference within ``--atol`` (nothing structural)."""
        return all(record.status in ("equal", "close") for record in self.records)

    @property
    def summary(self) -> str:
        compared = sum(record.status not in ("missing", "extra") for record in self.records)
        if self.identical:
            close = [r for r in self.records if r.status == "close"]
            if not close:
                return f"IDENTICAL: {compared} tensors"
            worst = max(r.max_abs or 0.0 for r in close)
            return (
                f"IDENTICAL: {compared} tensors within --atol {self.atol:g} "
                f"({len(close)} not bitwise, max |Δ| = {worst:.3g})"
            )
        first = self.causes[0].message if self.causes else "tensors differ"
        return f"DIFFERENT: {first}"

    def as_dict(self) -> dict[str, Any]:
        """The machine-readable report (``--json``): every tensor, every expert, the ranked causes."""
        layers: dict[str, dict[str, list]] = {}
        for table in self.experts:
            layers.setdefault(str(table.layer), {})[table.kind] = [row.as_dict() for row in table.rows]
        return {
            "identical": self.identical,
            "summary": self.summary,
            "a": self.a_path,
            "b": self.b_path,
            "atol": self.atol,
            "counts": self._counts(),
            "causes": [cause.as_dict() for cause in self.causes],
            "tensors": [record.as_dict() for record in self.records],
            "experts": layers,
        }

    def _counts(self) -> dict[str, int]:
        counts = {s: self.count(s) for s in ("equal", "close", "different", "dtype", "shape", "missing", "extra")}
        counts["compared"] = len(self.records) - counts["missing"] - counts["extra"]
        return counts

    def format(self, *, all_experts: bool = False) -> str:
        """Summary line, the causes (most likely first), then the details."""
        counts = self._counts()
        lines = [self.summary, f"A: {self.a_path}", f"B: {self.b_path}"]
        lines.append(
            f"{counts['compared']} tensors compared: {counts['equal']} bitwise equal"
            + (f", {counts['close']} within --atol {self.atol:g}" if self.atol is not None else "")
            + f", {counts['different']} different, {counts['dtype']} dtype changed, {counts['shape']} shape changed;"
            f" {counts['missing']} missing in B, {counts['extra']} extra in B"
        )
        if self.causes:
            lines.append("causes (most likely first):")
            for i, cause in enumerate(self.causes, start=1):
                lines.append(f"  {i}. [{cause.kind}] {cause.message}")
                lines.extend(f"       {detail}" for detail in cause.details[:12])
                if len(cause.details) > 12:
                    lines.append(f"       ... ({len(cause.details)} in all)")
        lines.append(f"{'family':<24}{'tensors':>8}  bitwise equal")
        families: dict[str, list[int]] = {}
        for record in self.records:
            stats = families.setdefault(record.family, [0, 0])
            stats[0] += 1
            stats[1] += record.status == "equal"
        for family in sorted(families):
            count, equal = families[family]
            lines.append(f"{family:<24}{count:>8}  {'yes' if count == equal else f'NO ({equal}/{count})'}")
        changed = [r for r in self.records if r.status != "equal"]
        if changed:
            lines.append("tensors that are not bitwise equal:")
            for r in changed[:40]:
                lines.append("  " + _format_record(r))
            if len(changed) > 40:
                lines.append(f"  ... ({len(changed)} in all; --json lists every tensor)")
        lines.extend(self._format_experts(all_experts))
        return "\n".join(lines)

    def _format_experts(self, all_experts: bool) -> list[str]:
        if not self.experts:
            return []
        by_layer: dict[int, list[ExpertTable]] = defaultdict(list)
        for table in self.experts:
            by_layer[table.layer].append(table)
        total = sum(len(t.rows) for t in self.experts)
        in_place = sum(t.in_place for t in self.experts)
        lines = [f"routed experts ({len(by_layer)} layers): {in_place}/{total} expert slices in place"]
        for layer in sorted(by_layer):
            tables = by_layer[layer]
            if not all_experts and all(t.in_place == len(t.rows) for t in tables):
                continue
            lines.append(
                f"  layer {layer}: " + ", ".join(f"{t.kind} {t.in_place}/{len(t.rows)} in place" for t in tables)
            )
            for table in tables:
                shown = [row for row in table.rows if all_experts or row.status != "ok"]
                for row in shown[:24]:
                    delta = (
                        f" max|Δ|={row.max_abs:.3g} cos={row.cosine:.4f}"
                        if row.max_abs is not None and row.cosine is not None
                        else ""
                    )
                    lines.append(
                        f"    {table.kind:<13}expert {row.expert:>3}  A {row.a}  B {row.b}  {row.status}{delta}"
                    )
                if len(shown) > 24:
                    lines.append(f"    ... ({len(shown)} experts in all; --json lists every expert)")
        return lines


def _format_record(r: TensorRecord) -> str:
    if r.status == "missing":
        return f"{r.name}  missing in B  ({r.dtype_a} {r.shape_a})"
    if r.status == "extra":
        return f"{r.name}  extra in B  ({r.dtype_b} {r.shape_b})" + (f"  {r.note}" if r.note else "")
    parts = [r.name, r.status]
    if r.dtype_a != r.dtype_b:
        parts.append(f"{r.dtype_a} → {r.dtype_b}")
    if r.shape_a != r.shape_b:
        parts.append(f"{r.shape_a} → {r.shape_b}")
    if r.max_abs is not None:
        parts.append(f"max|Δ|={r.max_abs:.3g} cos={r.cosine:.4f}")
    parts.append(f"A {_short(r.digest_a)} B {_short(r.digest_b)}")
    if r.note:
        parts.append(r.note)
    return "  ".join(parts)


def _short(digest: str | None) -> str | None:
    return digest[:SHORT_HASH] if digest else None


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: report them as null."""
    return value if value is not None and math.isfinite(value) else None


# =============================================================================================
# compare: reading and comparing
# =============================================================================================


class _Reader:
    """Tensor-by-tensor access to a checkpoint, each shard opened once (memory: one tensor at a time)."""

    def __init__(self, checkpoint: Any, stack: contextlib.ExitStack) -> None:
        self.checkpoint = checkpoint
        self._stack = stack
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.checkpoint.weight_map[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(self.checkpoint.path / file, framework="pt"))
            self._handles[file] = handle
        return handle.get_tensor(name)


def _is_expert_tensor(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(EXPERT_SUFFIXES) and tensor.ndim == 3 and tensor.shape[0] > 0


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


class _Comparator:
    """Streams A and B once; keeps digests and small per-expert data, never two whole checkpoints."""

    def __init__(self, a: Any, b: Any, atol: float | None) -> None:
        self.a, self.b, self.atol = a, b, atol
        self.report = DoctorReport(str(a.path), str(b.path), atol)
        text = _text_config(a.config)
        self.layer_types: list[str] = list(text.get("layer_types") or [])
        self.head_dims = [int(text[k]) for k in ("head_dim", "global_head_dim") if text.get(k)]
        self.ties = bool(a.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        self.a_expert_fps: dict[str, list[Fingerprint]] = {}

    def run(self) -> DoctorReport:
        """Every tensor of A in file order, then B's extras; one tensor pair in memory at a time."""
        names_a, names_b = self.a.names(), self.b.names()
        set_a, set_b = set(names_a), set(names_b)
        with contextlib.ExitStack() as stack:
            ra, rb = _Reader(self.a, stack), _Reader(self.b, stack)
            for name in names_a:
                ta = ra.get(name)
                if name in set_b:
                    self.report.records.append(self._compare(name, ta, rb.get(name)))
                else:
                    self.report.records.append(self._one_sided(name, ta, "missing"))
                del ta
            for name in names_b:
                if name not in set_a:
                    self.report.records.append(self._one_sided(name, rb.get(name), "extra"))
            self.report.causes = _Diagnosis(self, rb).run()
        return self.report

    # -- per tensor --------------------------------------------------------------------------

    def _digest(self, name: str, tensor: torch.Tensor, side: str) -> tuple[str, list[Fingerprint] | None]:
        """Whole-tensor digest; for stacked experts it is built from the per-expert digests."""
        if not _is_expert_tensor(name, tensor):
            return tensor_digest(tensor), None
        fps = [fingerprint(tensor[e]) for e in range(tensor.shape[0])]
        if side == "a":
            self.a_expert_fps[name] = fps
        whole = hashlib.blake2b(digest_size=8)
        whole.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        for fp in fps:
            whole.update(bytes.fromhex(fp.digest))
        return whole.hexdigest(), fps

    def _one_sided(self, name: str, tensor: torch.Tensor, status: str) -> TensorRecord:
        digest, _ = self._digest(name, tensor, "a" if status == "missing" else "b")
        side = "a" if status == "missing" else "b"
        record = TensorRecord(name, family_of(name), status)
        setattr(record, f"dtype_{side}", _dtype_name(tensor.dtype))
        setattr(record, f"shape_{side}", list(tensor.shape))
        setattr(record, f"digest_{side}", digest)
        return record

    def _compare(self, name: str, ta: torch.Tensor, tb: torch.Tensor) -> TensorRecord:
        """Status, digests and differences of one name present in both; keeps what the diagnosis needs
        later (per-expert fingerprints, a head permutation) so the tensors can be dropped."""
        record = TensorRecord(
            name,
            family_of(name),
            "equal",
            dtype_a=_dtype_name(ta.dtype),
            dtype_b=_dtype_name(tb.dtype),
            shape_a=list(ta.shape),
            shape_b=list(tb.shape),
        )
        if tensors_identical(ta, tb):
            record.digest_a, fps = self._digest(name, ta, "a")
            record.digest_b = record.digest_a
            record.max_abs, record.cosine = 0.0, 1.0
            if fps is not None:
                self._expert_table(name, ta, tb, fps, fps)
            return record
        record.digest_a, fps_a = self._digest(name, ta, "a")
        record.digest_b, fps_b = self._digest(name, tb, "b")
        if ta.shape != tb.shape:
            record.status = "shape"
            if ta.ndim >= 2 and tb.shape == ta.transpose(-1, -2).shape and torch.equal(tb, ta.transpose(-1, -2)):
                record.transposed = True
            return record
        record.max_abs, record.cosine = difference(ta, tb)
        if ta.dtype != tb.dtype:
            record.status = "dtype"
            cast = tb.to(ta.dtype)
            record.lossless_cast = torch.equal(cast.to(tb.dtype), tb)
            if fps_a is not None and record.lossless_cast:
                # A lossless dtype change must not hide a misplaced expert: compare content in A's dtype.
                self._expert_table(name, ta, cast, fps_a, self._digest(name, cast, "b")[1] or [])
            return record
        if self.atol is not None and record.max_abs <= self.atol:
            record.status = "close"
        else:
            record.status = "different"
        if fps_a is not None and fps_b is not None:
            self._expert_table(name, ta, tb, fps_a, fps_b, close=record.status == "close")
        if record.status == "different" and _ATTN_PROJ_RE.search(name):
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
        match = _LAYER_RE.match(name)
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
        match = _LAYER_RE.match(name)
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# =============================================================================================
# compare: diagnosis
# =============================================================================================


class _Diagnosis:
    """Turns the records into causes. Whole-tensor moves are recognised before per-expert and per-head
    patterns (a swapped layer also moves its experts); whatever no pattern explains is reported as a
    plain value difference, so every tensor that differs appears in at least one cause."""

    def __init__(self, comparator: _Comparator, reader_b: _Reader) -> None:
        self.c = comparator
        self.report = comparator.report
        self.reader_b = reader_b
        self.records = {record.name: record for record in self.report.records}
        self.causes: list[Cause] = []
        self.explained: set[str] = set()
        self.relocated: dict[str, str] = {}  # B name -> the A name whose tensor it holds

    def run(self) -> list[Cause]:
        self._tied_embeddings()
        self._relocations()
        self._experts()
        self._heads()
        content_explained = set(self.explained)
        self._structural()
        self._values(content_explained)
        return sorted(self.causes, key=lambda c: (c.value_preserving, -len(set(c.tensors)), _PRIORITY.get(c.kind, 99)))

    def add(
        self,
        kind: str,
        message: str,
        tensors: Iterable[str],
        details: Iterable[str] = (),
        *,
        value_preserving: bool = False,
    ) -> None:
        tensors = list(dict.fromkeys(tensors))
        self.explained.update(tensors)
        self.causes.append(Cause(kind, message, tensors, list(details), value_preserving))

    # -- whole tensors in another tensor's place ---------------------------------------------

    def _relocations(self) -> None:
        """B tensors whose bytes are some *other* A tensor: layer swaps, k/v and gate/up mix-ups, renames."""
        by_digest: dict[str, list[str]] = defaultdict(list)
        for record in self.report.records:
            if record.digest_a:
                by_digest[record.digest_a].append(record.name)
        for record in self.report.records:
            if record.status not in ("different", "shape", "extra") or not record.digest_b:
                continue
            if record.name in self.explained:
                continue
            candidates = [name for name in by_digest.get(record.digest_b, []) if name != record.name]
            if candidates:
                self.relocated[record.name] = _pick_source(record.name, candidates)
        layer_moves: dict[tuple[str, int, int], list[str]] = defaultdict(list)
        pairs: dict[tuple[str, str], str] = {}
        for b_name, a_name in self.relocated.items():
            mb, ma = _LAYER_RE.match(b_name), _LAYER_RE.match(a_name)
            if mb and ma and mb["stack"] == ma["stack"] and mb["suffix"] == ma["suffix"]:
                layer_moves[(mb["stack"], int(mb["layer"]), int(ma["layer"]))].append(b_name)
            else:
                pairs[(b_name, a_name)] = b_name
        self._layer_moves(layer_moves)
        self._pair_moves(list(pairs))

    def _layer_moves(self, moves: dict[tuple[str, int, int], list[str]]) -> None:
        sizes: Counter[tuple[str, int]] = Counter()
        for record in self.report.records:
            match = _LAYER_RE.match(record.name)
            if match and record.status != "extra":
                sizes[(match["stack"], int(match["layer"]))] += 1
        done: set[tuple[str, int, int]] = set()
        for (stack, i, j), names in sorted(moves.items()):
            if (stack, i, j) in done:
                continue
            back = moves.get((stack, j, i))
            if back is not None:
                done.add((stack, j, i))
                message = (
                    f"layers {i} and {j} swapped: B's {stack}{i}.* holds A's {stack}{j}.* "
                    f"({len(names)}/{sizes[(stack, i)]} tensors) and vice versa ({len(back)}/{sizes[(stack, j)]})"
                )
                self.add("layer-swap", message, names + back, [f"{n} = A's {self.relocated[n]}" for n in names + back])
            else:
                message = (
                    f"layer {i} holds layer {j}'s tensors: B's {stack}{i}.* == A's {stack}{j}.* "
                    f"({len(names)}/{sizes[(stack, i)]} tensors)"
                )
                self.add("layer-swap", message, names, [f"{n} = A's {self.relocated[n]}" for n in names])

    def _pair_moves(self, pairs: list[tuple[str, str]]) -> None:
        relocated = dict(pairs)
        done: set[str] = set()
        for b_name, a_name in pairs:
            if b_name in done:
                continue
            mutual = relocated.get(a_name) == b_name
            done.update((b_name, a_name) if mutual else (b_name,))
            names = [b_name, a_name] if mutual else [b_name]
            kind, message = self._classify_pair(b_name, a_name, mutual)
            details = [f"{n} = A's {self.relocated[n]}" for n in names]
            if kind == "renamed":
                names.append(a_name)  # the "missing" A name is the same fault
            self.add(kind, message, names, details)

    def _classify_pair(self, b_name: str, a_name: str, mutual: bool) -> tuple[str, str]:
        mb, ma = _LAYER_RE.match(b_name), _LAYER_RE.match(a_name)
        same_layer = mb and ma and mb["stack"] == ma["stack"] and mb["layer"] == ma["layer"]
        if same_layer:
            layer, sb, sa = mb["layer"], mb["suffix"], ma["suffix"]
            leaves = {sb, sa}
            if leaves == {"self_attn.k_proj.weight", "self_attn.v_proj.weight"}:
                if mutual:
                    return "kv-swap", f"k and v confused: layer {layer} self_attn.k_proj and v_proj are swapped"
                return "kv-swap", f"k and v confused: layer {layer} B's self_attn.{_leaf(sb)} holds A's {_leaf(sa)}"
            if leaves == {"mlp.gate_proj.weight", "mlp.up_proj.weight"} and mutual:
                return "gate-up-swap", f"gate/up swap: layer {layer} mlp.gate_proj and mlp.up_proj are swapped"
        record = self.records[b_name]
        if record.status == "extra":
            if self.records[a_name].status == "missing":
                return "renamed", f"renamed: B's {b_name} is A's {a_name} (which B lacks)"
            return "extra", f"extra in B: {b_name}, a copy of A's {a_name}"
        if mutual:
            return "relocated", f"swapped tensors: {b_name} and {a_name}"
        return "relocated", f"relocated tensor: B's {b_name} holds A's {a_name}"

    # -- tied output layer -------------------------------------------------------------------

    def _tied_embeddings(self) -> None:
        """vLLM uses embed_tokens as the output layer when tied; a divergent lm_head means two models."""
        b_prefix = self.c.b.prefix
        embed = f"{b_prefix}embed_tokens.weight"
        for record in self.report.records:
            if not record.name.endswith("lm_head.weight") or record.status not in ("extra", "different", "shape"):
                continue
            if record.name in self.explained or embed not in self.c.b.weight_map:
                continue
            lm_head, embedding = self.reader_b.get(record.name), self.reader_b.get(embed)
            tie = "although the config ties them (tie_word_embeddings)" if self.c.ties else "(config does not tie them)"
            if tensors_identical(lm_head, embedding):
                if record.status == "extra":
                    record.note = f"a copy of {embed}"
                    self.add(
                        "extra",
                        f"extra in B: {record.name}, a copy of {embed} (the tied output layer saved twice)",
                        [record.name],
                    )
                continue
            if lm_head.shape == embedding.shape:
                max_abs, cosine = difference(lm_head, embedding)
                how = f"max |Δ| = {max_abs:.3g}, cos = {cosine:.4f}"
            else:
                how = f"shape {list(lm_head.shape)} vs {list(embedding.shape)}"
            record.note = f"differs from {embed}"
            self.add(
                "tied-embedding",
                f"tied embedding and output layer disagree: B's {record.name} differs from its {embed} ({how}) {tie}",
                [record.name],
            )
        record = self.records.get(embed)
        if record is not None and record.status == "different" and embed not in self.relocated and self.c.ties:
            self.add(
                "tied-embedding",
                f"tied embedding changed: {embed} differs from A (max |Δ| = {record.max_abs:.3g}, "
                f"cos = {record.cosine:.4f}); it is also the output layer, so every logit changes",
                [embed],
            )

    # -- routed experts ----------------------------------------------------------------------

    def _experts(self) -> None:
        """Per layer and expert tensor: which A expert each B slot holds; then duplicate / shift /
        permutation / gate-up patterns (the faults EP and ETP resharding errors leave)."""
        a_index: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
        for table in self.report.experts:
            for row in table.rows:
                a_index[row.a.digest].append((table.layer, table.kind, row.expert))
        for name, fps in self.c.a_expert_fps.items():  # A tensors B lacks or reshaped: still sources
            match = _LAYER_RE.match(name)
            if match and not any(t.name == name for t in self.report.experts):
                for e, fp in enumerate(fps):
                    a_index[fp.digest].append((int(match["layer"]), name.rsplit(".", 1)[-1], e))
        duplicates: dict[tuple[int, int, int, int], list[str]] = defaultdict(list)  # (layer, e, j, E) -> kinds
        shifts: dict[tuple[int, int, int], list[str]] = defaultdict(list)  # (layer, k, E) -> kinds
        perms: dict[tuple[int, tuple], list[str]] = defaultdict(list)
        gate_up: list[tuple[int, list[int], int]] = []
        foreign: dict[tuple[int, int, int, int], list[str]] = defaultdict(list)
        tensors: dict[str, list[str]] = defaultdict(list)  # cause key -> tensor names
        for table in self.report.experts:
            record = self.records[table.name]
            unexplained = record.status in ("different", "dtype") and table.name not in self.explained
            if not unexplained or table.name in self.relocated or table.in_place == len(table.rows):
                if table.name in self.relocated:
                    for row in table.rows:
                        row.status = f"tensor is A's {self.relocated[table.name]}"
                continue
            moved, swapped = self._classify_experts(table, a_index, foreign, tensors)
            n = len(table.rows)
            if len(moved) == n and n > 1:
                k = (moved[0] - 0) % n
                if k and all(moved[e] == (e + k) % n for e in range(n)):
                    for e, j in moved.items():
                        table.rows[e].status = f"holds expert {j} (shift {k})"
                    shifts[(table.layer, k, n)].append(table.kind)
                    tensors[f"shift{table.layer}:{k}"].append(table.name)
                    moved = {}
            in_place = {row.expert for row in table.rows if row.status == "ok"}
            targets = Counter(moved.values())
            for e, j in sorted(moved.items()):
                if j in in_place or targets[j] > 1:
                    table.rows[e].status = f"copy of expert {j}"
                    duplicates[(table.layer, e, j, n)].append(table.kind)
                    tensors[f"dup{table.layer}"].append(table.name)
            cycle = tuple(sorted((e, j) for e, j in moved.items() if table.rows[e].status == "changed"))
            if cycle:
                for e, j in cycle:
                    table.rows[e].status = f"holds expert {j}"
                perms[(table.layer, cycle)].append(table.kind)
                tensors[f"perm{table.layer}"].append(table.name)
            if swapped:
                for e in swapped:
                    table.rows[e].status = "gate/up swapped"
                gate_up.append((table.layer, swapped, n))
                tensors[f"gu{table.layer}"].append(table.name)
        self._expert_causes(duplicates, shifts, perms, gate_up, foreign, tensors)

    def _classify_experts(
        self,
        table: ExpertTable,
        a_index: dict[str, list[tuple[int, str, int]]],
        foreign: dict[tuple[int, int, int, int], list[str]],
        tensors: dict[str, list[str]],
    ) -> tuple[dict[int, int], list[int]]:
        """Per differing expert slot: which A expert it holds (same layer), gate/up swapped, or one of
        another layer; slots matching nothing keep the status "changed" (left to the value report)."""
        same_layer: dict[str, int] = {}
        for row in table.rows:
            same_layer.setdefault(row.a.digest, row.expert)
        moved: dict[int, int] = {}
        swapped: list[int] = []
        for row in table.rows:
            if row.status == "ok":
                continue
            digest = row.b.digest
            if digest in same_layer:
                moved[row.expert] = same_layer[digest]
            elif table.a_swapped is not None and digest == table.a_swapped[row.expert]:
                swapped.append(row.expert)
            else:
                elsewhere = [hit for hit in a_index.get(digest, []) if hit[0] != table.layer and hit[1] == table.kind]
                if elsewhere:
                    layer, _, j = elsewhere[0]
                    row.status = f"holds layer {layer}'s expert {j}"
                    foreign[(table.layer, row.expert, layer, j)].append(table.kind)
                    tensors[f"foreign{table.layer}"].append(table.name)
        return moved, swapped

    def _expert_causes(
        self,
        duplicates: dict[tuple[int, int, int, int], list[str]],
        shifts: dict[tuple[int, int, int], list[str]],
        perms: dict[tuple[int, tuple], list[str]],
        gate_up: list[tuple[int, list[int], int]],
        foreign: dict[tuple[int, int, int, int], list[str]],
        tensors: dict[str, list[str]],
    ) -> None:
        def names(prefix: str) -> list[str]:
            return [n for key, ns in tensors.items() if key.startswith(prefix) for n in ns]

        def kinds_of(kinds: list[str]) -> str:
            return ", ".join(sorted(set(kinds), key=lambda kind: (kind != "gate_up_proj", kind)))

        if duplicates:
            items = [
                f"layer {layer} expert {e} is a copy of expert {j} ({kinds_of(kinds)}{_ep_slot_hint(e, j, n)})"
                for (layer, e, j, n), kinds in sorted(duplicates.items())
            ]
            signature = any(_ep_slot_hint(e, j, n) for (_, e, j, n) in duplicates)
            head = "duplicated expert: " if len(items) == 1 else f"duplicated experts ({len(items)}): "
            message = head + "; ".join(items[:2]) + (f"; ... (+{len(items) - 2} more)" if len(items) > 2 else "")
            if signature:
                message += " — the signature of an EP gather/broadcast error"
            self.add("expert-duplicate", message, names("dup"), items if len(items) > 1 else [])
        for (layer, k, n), kinds in sorted(shifts.items()):
            self.add(
                "expert-shift",
                f"experts shifted by {k}: layer {layer} expert e holds expert (e+{k}) mod {n} "
                f"({kinds_of(kinds)}){_block_hint(k, n)}",
                [name for key, ns in tensors.items() if key == f"shift{layer}:{k}" for name in ns],
            )
        for (layer, cycle), kinds in sorted(perms.items()):
            if len(cycle) == 2 and cycle[0] == (cycle[1][1], cycle[1][0]):
                what = f"experts {cycle[0][0]} and {cycle[0][1]} swapped"
            else:
                what = (
                    "experts permuted: "
                    + ", ".join(f"{e}←{j}" for e, j in cycle[:8])
                    + (" ..." if len(cycle) > 8 else "")
                )
            self.add(
                "expert-permutation",
                f"{what} in layer {layer} ({kinds_of(kinds)})",
                [name for key, ns in tensors.items() if key == f"perm{layer}" for name in ns],
            )
        for layer, swapped, n in gate_up:
            which = f"all {n} experts" if len(swapped) == n else f"experts {_id_list(swapped)} of {n}"
            self.add(
                "gate-up-swap",
                f"gate/up swap: layer {layer} experts.gate_up_proj holds [up; gate] instead of [gate; up] in {which}",
                [name for key, ns in tensors.items() if key == f"gu{layer}" for name in ns],
            )
        if foreign:
            items = [
                f"layer {layer} expert {e} holds layer {other}'s expert {j} ({kinds_of(kinds)})"
                for (layer, e, other, j), kinds in sorted(foreign.items())
            ]
            self.add("expert-relocated", "expert from another layer: " + "; ".join(items[:3]), names("foreign"), items)

    # -- attention heads ---------------------------------------------------------------------

    def _heads(self) -> None:
        """q/k/v projections whose rows are A's heads reordered (a QKV interleave or TP split error)."""
        by_layer: dict[str, list[TensorRecord]] = defaultdict(list)
        for record in self.report.records:
            if record.head_permutation and record.name not in self.explained and record.name not in self.relocated:
                match = _LAYER_RE.match(record.name)
                by_layer[match["layer"] if match else record.name].append(record)
        for layer, records in by_layer.items():
            parts = []
            for record in records:
                head_dim, perm = record.head_permutation
                shown = ", ".join(map(str, perm[:16])) + (", ..." if len(perm) > 16 else "")
                parts.append(f"{_leaf(record.name)} (head_dim {head_dim}: B head i = A head [{shown}])")
            self.add(
                "head-permutation",
                f"q/k/v heads permuted: layer {layer} rows reordered by head in " + "; ".join(parts),
                [r.name for r in records],
            )

    # -- dtype, shape, missing, extra, plain value changes -----------------------------------

    def _structural(self) -> None:
        """dtype, shape, missing and extra tensors that no earlier pattern explained."""
        dtypes: dict[tuple[str, str, bool], list[TensorRecord]] = defaultdict(list)
        for record in self.report.records:
            if record.status == "dtype":  # a fact of its own even when an expert fault is found inside
                dtypes[(record.dtype_a, record.dtype_b, record.lossless_cast)].append(record)
        for (before, after, lossless), records in dtypes.items():
            if all(r.max_abs == 0.0 for r in records):
                values = "values preserved"
            elif lossless:
                values = "a lossless cast; the value changes inside are separate causes"
            else:
                values = f"lossy: max |Δ| = {max(r.max_abs for r in records):.3g}"
            what = records[0].name if len(records) == 1 else f"{len(records)} tensors (first {records[0].name})"
            self.add(
                "dtype",
                f"dtype changed: {what} {before} → {after} ({values})",
                [r.name for r in records],
                value_preserving=lossless,
            )
        for status, kind in (("shape", "shape"), ("missing", "missing"), ("extra", "extra")):
            records = [r for r in self.report.records if r.status == status and r.name not in self.explained]
            transposed = [r for r in records if r.transposed]
            for r in transposed:
                self.add(
                    "transposed", f"transposed: B's {r.name} is A's transposed ({r.shape_a} → {r.shape_b})", [r.name]
                )
            records = [r for r in records if not r.transposed]
            if not records:
                continue
            if status == "shape":
                first = records[0]
                message = f"shape changed: {first.name} {first.shape_a} → {first.shape_b}"
            else:
                message = f"{status} in B: {records[0].name}"
            if len(records) > 1:
                message += f" (+{len(records) - 1} more)"
            self.add(kind, message, [r.name for r in records], [_format_record(r) for r in records])

    def _values(self, content_explained: set[str]) -> None:
        """What is left: values that changed without a recognisable reordering (noise, a wrong update),
        also inside tensors whose only other change is a lossless dtype cast."""
        partly = {t.name for t in self.report.experts if any(row.status == "changed" for row in t.rows)}
        records = [
            r
            for r in self.report.records
            if (r.status == "different" or (r.status == "dtype" and r.lossless_cast and r.max_abs))
            and (r.name not in content_explained or r.name in partly)
        ]
        if not records:
            return
        worst = max(records, key=lambda r: r.max_abs if r.max_abs is not None and math.isfinite(r.max_abs) else 1e300)
        changed_experts = []
        for table in self.report.experts:
            ids = [row.expert for row in table.rows if row.status == "changed"]
            if ids and table.name in {r.name for r in records}:
                changed_experts.append(f"layer {table.layer} {table.kind}: experts {_id_list(ids)} changed")
        what = records[0].name if len(records) == 1 else f"{len(records)} tensors"
        self.add(
            "values",
            f"values differ in {what} (no recognised reordering; worst {worst.name}: "
            f"max |Δ| = {worst.max_abs:.3g}, cos = {worst.cosine:.4f})",
            [r.name for r in records],
            changed_experts + [_format_record(r) for r in records],
        )


def _pick_source(name: str, candidates: list[str]) -> str:
    """Of several A tensors with B's content, the most telling one: same layer, then same leaf elsewhere."""
    match = _LAYER_RE.match(name)

    def rank(candidate: str) -> tuple[int, str]:
        other = _LAYER_RE.match(candidate)
        if match and other and match["stack"] == other["stack"]:
            if match["layer"] == other["layer"]:
                return 0, candidate
            if match["suffix"] == other["suffix"]:
                return 1, candidate
        return 2, candidate

    return min(candidates, key=rank)


def _leaf(name: str) -> str:
    """``…self_attn.q_proj.weight`` → ``q_proj``."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "weight" and len(parts) > 1 else parts[-1]


def _id_list(ids: Sequence[int]) -> str:
    return ", ".join(map(str, ids[:12])) + (f", ... ({len(ids)})" if len(ids) > 12 else "")


def _ep_slot_hint(e: int, j: int, num_experts: int) -> str:
    """The smallest EP size at which experts e and j share a local slot on different EP ranks: the
    original bug (expert 0 == expert 32 at EP4 of 128) copied exactly such pairs."""
    for ep in range(2, num_experts + 1):
        if num_experts % ep:
            continue
        per_rank = num_experts // ep
        if e % per_rank == j % per_rank and e // per_rank != j // per_rank:
            return f"; local slot {j % per_rank} of EP ranks {j // per_rank} and {e // per_rank} at EP{ep}"
    return ""


def _block_hint(k: int, num_experts: int) -> str:
    for block in (k, num_experts - k):
        if num_experts % block == 0:
            return f"; a block of {block} = E/EP at EP{num_experts // block}, as an EP reconstruction error leaves it"
    return ""


def compare_checkpoints(a_path: str | Path, b_path: str | Path, *, atol: float | None = None) -> DoctorReport:
    """Compare checkpoint B against reference A; raises ``CheckpointError`` (a ``ValueError``) on bad input."""
    from vime_gemma4_bridge.hf_io import HFCheckpoint

    if atol is not None and not atol >= 0:
        raise ValueError(f"--atol must be a number >= 0, got {atol}")
    return _Comparator(HFCheckpoint(a_path), HFCheckpoint(b_path), atol).run()


# =============================================================================================
# compare: command line
# =============================================================================================


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``vime-gemma4 compare`` (registered by cli.py)."""
    parser = subparsers.add_parser(
        "compare",
        help="say where and how two Gemma 4 HF checkpoints diverge; exit 0 iff identical",
        description=COMPARE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("a", metavar="A", help="reference HF checkpoint (e.g. HF1)")
    parser.add_argument("b", metavar="B", help="HF checkpoint to examine (e.g. HF2 after a round trip)")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    parser.add_argument(
        "--atol",
        type=float,
        default=None,
        metavar="X",
        help="accept value differences up to max |dx| <= X (same names, dtypes, shapes); default: bitwise",
    )
    parser.add_argument(
        "--all-experts", action="store_true", help="list every expert's fingerprints, not just moved ones"
    )
    parser.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    """Exit 0 iff identical (or within --atol), 1 if not, 2 on bad input (one line on stderr)."""
    try:
        report = compare_checkpoints(args.a, args.b, atol=args.atol)
    except (ValueError, OSError) as error:
        print(f"vime-gemma4 compare: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.format(all_experts=args.all_experts))
    return 0 if report.identical else 1


# =============================================================================================
# probe
# =============================================================================================

#: Export stages in the order Megatron-Bridge runs them, with their labels.
STAGES: tuple[tuple[str, str], ...] = (
    ("local", "local shard"),
    ("pp", "after PP broadcast"),
    ("etp", "after ETP gather"),
    ("ep", "after EP gather"),
    ("final", "final HF tensor"),
)
#: Megatron expert parameters (global names) and the HF stacked tensor each one ends up in.
_EXPERT_PARAM_RE = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.mlp\.experts\.linear_fc(?P<fc>[12])\.weight(?P<e>\d+)$"
)
FC_KINDS = {1: "gate_up_proj", 2: "down_proj"}


def default_probe_experts(num_experts: int, ep: int) -> list[int]:
    """Both sides of every EP boundary (report.ep_boundary_pairs), plus the first and last expert."""
    ids = {0, num_experts - 1}
    if ep > 1:
        for left, right in ep_boundary_pairs(num_experts, ep):
            ids.update((left, right))
    return sorted(ids)


def parse_id_list(text: str, limit: int, flag: str) -> list[int]:
    """``"0,7-9"`` → ``[0, 7, 8, 9]``; every id must be below ``limit``."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            low, _, high = part.partition("-")
            first, last = int(low), int(high) if high else int(low)
        except ValueError:
            raise ValueError(f"{flag}: {part!r} is not a number or a range like 0-3") from None
        if first < 0 or last >= limit or first > last:
            raise ValueError(f"{flag}: {part!r} is out of range; ids go from 0 to {limit - 1}")
        ids.update(range(first, last + 1))
    if not ids:
        raise ValueError(f"{flag}: no ids given")
    return sorted(ids)


class _Recorder:
    """Collects stage fingerprints on one rank by listening to a mapping's own collective helpers."""

    def __init__(self, rank: int, ep_rank: int, etp_rank: int, pp_rank: int, per_rank: int, ep: int) -> None:
        self.where = {"rank": rank, "ep": ep_rank, "etp": etp_rank, "pp": pp_rank}
        self.per_rank, self.ep = per_rank, ep
        self.records: list[dict[str, Any]] = []

    def add(self, layer: int, fc: int, expert: int, stage: str, tensor: torch.Tensor) -> None:
        fp = fingerprint(tensor)
        self.records.append({**self.where, "layer": layer, "fc": fc, "expert": expert, "stage": stage, **fp.as_dict()})

    def watch(self, mapping: Any, layer: int, fc: int, watched: list[int]) -> None:
        """Wrap the collective helpers of the mapping instance that will run this task's export."""
        own_expert = (watched[0] % self.per_rank) + self.where["ep"] * self.per_rank
        mine = own_expert in watched
        pending_gate: dict[int, torch.Tensor] = {}

        def on_pp(args: tuple, result: Any) -> None:
            local = args[0] if args else None
            if mine and local is not None:
                self.add(layer, fc, own_expert, "local", local)
            if mine and result is not None:
                self.add(layer, fc, own_expert, "pp", result)

        def on_tp(args: tuple, result: Any) -> None:
            if mine:
                self.add(layer, fc, own_expert, "etp", torch.cat(list(result), dim=0))

        def on_ep(args: tuple, result: Any) -> None:
            (value,) = result.values()
            name = str(args[2]) if len(args) > 2 else ""
            for expert in watched:
                piece = value[expert // self.per_rank] if self.ep > 1 else value
                if fc == 1 and name.endswith(".gate"):
                    pending_gate[expert] = piece
                elif fc == 1:
                    self.add(layer, fc, expert, "ep", torch.cat([pending_gate.pop(expert), piece], dim=0))
                else:
                    self.add(layer, fc, expert, "ep", piece)

        _tap(mapping, "broadcast_from_pp_rank", on_pp)
        _tap(mapping, "gather_from_tp_ranks", on_tp)
        _tap(mapping, "gather_from_ep_ranks", on_ep)


def _tap(obj: Any, method: str, listener: Callable[[tuple, Any], None]) -> None:
    """Shadow ``obj.method`` (this instance only) with a call-through that reports args and result."""
    original = getattr(obj, method)

    def call_through(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        listener(args, result)
        return result

    setattr(obj, method, call_through)


def _watch_task(recorder: _Recorder, task: Any, layer: int, fc: int, watched: list[int]) -> None:
    """Find the mapping object that does the gathers for this task (fc1: the gated delegate; fc2: the
    Column/RowParallelMapping that AutoMapping creates on first use) and listen to it."""
    mapping = task.mapping
    gated = getattr(mapping, "_gated_mapping", None)
    if gated is not None:
        recorder.watch(gated, layer, fc, watched)
        return
    if getattr(mapping, "_mapping", None) is not None:
        recorder.watch(mapping._mapping, layer, fc, watched)
        return
    create = mapping._get_or_create_mapping

    def create_and_watch(parallelism_type: str) -> Any:
        delegate = create(parallelism_type)
        recorder.watch(delegate, layer, fc, watched)
        return delegate

    mapping._get_or_create_mapping = create_and_watch


def probe_job(
    hf_checkpoint: str, topology: Topology, experts: list[int] | None, layers: list[int] | None
) -> dict[str, Any]:
    """Runs on every rank: load HF at ``topology``, export the chosen layers' experts through the
    bridge's own conversion tasks while recording each stage; rank 0 judges. Returns rank 0's result."""
    import torch.distributed as dist
    from megatron.bridge.models.conversion.utils import unwrap_model
    from megatron.core import parallel_state as ps

    from vime_gemma4_bridge import convert
    from vime_gemma4_bridge.distributed import init_model_parallel

    init_model_parallel(topology)
    bridge = convert.open_bridge(hf_checkpoint)
    model = convert.build_model(bridge, topology)
    bridge.load_hf_weights(model)
    models = unwrap_model(model)
    num_experts = int(models[0].config.num_moe_experts)
    ep = ps.get_expert_model_parallel_world_size()
    per_rank = num_experts // ep
    chosen = experts or default_probe_experts(num_experts, ep)
    recorder = _Recorder(
        dist.get_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_expert_tensor_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        per_rank,
        ep,
    )
    model_bridge = bridge._model_bridge
    selected = []
    for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, models):
        match = _EXPERT_PARAM_RE.match(task.global_param_name) if task is not None else None
        if match is None or (layers is not None and int(match["layer"]) not in layers):
            continue
        selected.append(task)  # every expert of a chosen layer: the stacked HF tensor needs them all
        layer, fc, slot = int(match["layer"]), int(match["fc"]), int(match["e"]) % per_rank
        watched = [e for e in chosen if e % per_rank == slot]
        if watched:
            _watch_task(recorder, task, layer, fc, watched)
    for name, tensor in model_bridge.stream_weights_megatron_to_hf(
        models, bridge.hf_pretrained, cpu=True, show_progress=False, conversion_tasks=selected
    ):
        match = _LAYER_RE.match(name)
        kind = name.rsplit(".", 1)[-1]
        fc = next((f for f, k in FC_KINDS.items() if k == kind), None)
        if match and fc is not None:
            for expert in chosen:
                recorder.add(int(match["layer"]), fc, expert, "final", tensor[expert])
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(recorder.records, gathered, dst=0)
    result = None
    if dist.get_rank() == 0:
        records = [record for rank_records in gathered for record in rank_records]
        seen_layers = sorted({r["layer"] for r in records}) if layers is None else layers
        result = judge_probe(
            hf_checkpoint,
            records,
            chosen,
            seen_layers,
            ep=ep,
            etp=ps.get_expert_tensor_parallel_world_size(),
            topology=str(topology),
            world=dist.get_world_size(),
        )
    return convert.broadcast_from_rank0(result)


def _expected_pieces(source: torch.Tensor, fc: int, etp: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What the Megatron side must hold for one HF expert: its ETP shards (as GatedMLPMapping /
    RowParallelMapping load them) and the shards concatenated along dim 0 (the ETP-gather stage)."""
    if fc == 1:
        gate, up = torch.chunk(source, 2, dim=0)
        shards = [
            torch.cat([g, u], dim=0)
            for g, u in zip(torch.chunk(gate, etp, dim=0), torch.chunk(up, etp, dim=0), strict=True)
        ]
    else:
        shards = [s.contiguous() for s in torch.chunk(source, etp, dim=1)]
    return shards, torch.cat(shards, dim=0)


def judge_probe(
    hf_checkpoint: str,
    records: list[dict[str, Any]],
    experts: list[int],
    layers: list[int],
    *,
    ep: int,
    etp: int,
    topology: str = "",
    world: int = 1,
) -> dict[str, Any]:
    """Compare every recorded stage fingerprint with what it must hold, derived from the HF source."""
    from vime_gemma4_bridge.hf_io import HFCheckpoint

    source = HFCheckpoint(hf_checkpoint)
    by_key: dict[tuple[int, int, int, str], list[dict]] = defaultdict(list)
    for record in records:
        by_key[(record["layer"], record["fc"], record["expert"], record["stage"])].append(record)
    entries = []
    for layer in layers:
        tensors = {
            fc: source.load([f"{source.prefix}layers.{layer}.experts.{kind}"])[
                f"{source.prefix}layers.{layer}.experts.{kind}"
            ]
            for fc, kind in FC_KINDS.items()
        }
        num_experts = tensors[1].shape[0]
        per_rank = num_experts // ep
        catalog = {fc: _catalog(tensor, fc, etp) for fc, tensor in tensors.items()}
        for expert in experts:
            entry: dict[str, Any] = {
                "layer": layer,
                "expert": expert,
                "ep_rank": expert // per_rank,
                "local_slot": expert % per_rank,
                "source": {FC_KINDS[fc]: fingerprint(t[expert]).as_dict() for fc, t in tensors.items()},
                "stages": [],
                "first_mismatch": None,
            }
            for stage, label in STAGES:
                row: dict[str, Any] = {"stage": stage, "label": label}
                for fc, tensor in tensors.items():
                    cell = _judge_stage(by_key[(layer, fc, expert, stage)], stage, tensor[expert], fc, etp, catalog[fc])
                    row[FC_KINDS[fc]] = cell
                    if cell["status"] == "MISMATCH" and entry["first_mismatch"] is None:
                        entry["first_mismatch"] = f"{FC_KINDS[fc]} {label}: {cell['problem']}"
                entry["stages"].append(row)
            entries.append(entry)
    ok = all(entry["first_mismatch"] is None for entry in entries)
    return {"ok": ok, "topology": topology, "world": world, "ep": ep, "etp": etp, "entries": entries}


def _catalog(stacked: torch.Tensor, fc: int, etp: int) -> dict[str, dict[str, str]]:
    """Digest → which source expert it is, per granularity, to say what a wrong stage holds instead."""
    shards: dict[str, str] = {}
    gathered: dict[str, str] = {}
    full: dict[str, str] = {}
    for expert in range(stacked.shape[0]):
        pieces, cat = _expected_pieces(stacked[expert], fc, etp)
        for t, piece in enumerate(pieces):
            shards.setdefault(tensor_digest(piece), f"expert {expert} ETP shard {t}")
        gathered.setdefault(tensor_digest(cat), f"expert {expert}")
        full.setdefault(tensor_digest(stacked[expert]), f"expert {expert}")
        if fc == 1:
            full.setdefault(tensor_digest(swap_halves(stacked[expert])), f"expert {expert} with gate/up swapped")
    return {"shard": shards, "etp": gathered, "full": full}


def _judge_stage(
    records: list[dict], stage: str, source: torch.Tensor, fc: int, etp: int, catalog: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """One cell of the table: ok iff every rank's fingerprint is what that rank must hold at this stage
    (its own ETP shard for local/PP, the whole expert after the gathers); on mismatch, say which source
    expert the wrong tensor actually is."""
    shards, cat = _expected_pieces(source, fc, etp)
    expected_shards = [tensor_digest(s) for s in shards]
    whole = tensor_digest(cat) if stage == "etp" else tensor_digest(source)

    def expected_of(record: dict) -> str:
        return expected_shards[record["etp"]] if stage in ("local", "pp") else whole

    index = catalog["shard"] if stage in ("local", "pp") else catalog["etp"] if stage == "etp" else catalog["full"]
    if stage == "etp" and etp == 1 and not records:
        return {"status": "skipped", "fingerprints": [], "ranks": [], "problem": "ETP1: no gather"}
    cell: dict[str, Any] = {"status": "ok", "fingerprints": [], "ranks": sorted({r["rank"] for r in records})}
    if stage in ("local", "pp"):
        by_shard: dict[int, list[str]] = defaultdict(list)
        for r in records:
            if r["hash"] not in by_shard[r["etp"]]:
                by_shard[r["etp"]].append(r["hash"])
        cell["fingerprints"] = ["|".join(by_shard[t]) for t in sorted(by_shard)]
        missing = [t for t in range(etp) if t not in by_shard]
    else:
        cell["fingerprints"] = list(dict.fromkeys(r["hash"] for r in records))
        missing = [] if records else [0]
    bad = [r for r in records if r["digest"] != expected_of(r)]
    if bad:
        first = bad[0]
        holds = index.get(first["digest"], "no source expert")
        cell.update(
            status="MISMATCH",
            problem=(
                f"rank(s) {', '.join(str(r['rank']) for r in bad)} hold {first['hash']} = {holds}, "
                f"expected {expected_of(first)[:SHORT_HASH]}"
            ),
        )
    elif missing:
        cell.update(status="MISMATCH", problem=f"no rank reported this stage (ETP shards {missing})")
    return cell


def format_probe(result: dict[str, Any]) -> str:
    """One compact table per (layer, expert): stage → fingerprint → ok/MISMATCH, then the verdict."""
    lines = []
    width = 36
    for entry in result["entries"]:
        src = entry["source"]
        lines.append(
            f"layer {entry['layer']} · expert {entry['expert']} (EP rank {entry['ep_rank']} of {result['ep']}, "
            f"local weight{entry['local_slot']}, ETP{result['etp']})   source: gate_up_proj "
            f"{src['gate_up_proj']['hash']}  down_proj {src['down_proj']['hash']}"
        )
        lines.append(f"  {'stage':<20}{'gate_up_proj (linear_fc1)':<{width}}down_proj (linear_fc2)")
        for row in entry["stages"]:
            cells = []
            for kind in FC_KINDS.values():
                cell = row[kind]
                shown = "/".join(h[:8] for h in cell["fingerprints"]) or "—"
                cells.append(f"{cell['status']:<9}{shown}"[: width - 1].ljust(width))
            lines.append(f"  {row['label']:<20}" + "".join(cells).rstrip())
        if entry["first_mismatch"]:
            lines.append(f"  first mismatch: {entry['first_mismatch']}")
    bad = [e for e in result["entries"] if e["first_mismatch"]]
    experts = sorted({e["expert"] for e in result["entries"]})
    layers = sorted({e["layer"] for e in result["entries"]})
    where = f"at {result['topology']} on {result['world']} rank(s)"
    if not bad:
        lines.append(
            f"probe OK: experts {_id_list(experts)} in {len(layers)} layer(s) match the HF source "
            f"at every stage {where}"
        )
    else:
        first = bad[0]
        lines.append(
            f"probe FAILED: {len(bad)} (layer, expert) pair(s) diverge {where}; first: layer {first['layer']} "
            f"expert {first['expert']}: {first['first_mismatch']}"
        )
    return "\n".join(lines)


def add_probe_parser(subparsers: argparse._SubParsersAction) -> None:
    """``vime-gemma4 probe`` (registered by cli.py)."""
    parser = subparsers.add_parser(
        "probe",
        help="follow experts through the HF -> Megatron -> HF export stage by stage; flag the first bad stage",
        description=PROBE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="source Gemma 4 MoE HF checkpoint")
    Topology.add_arguments(parser)
    add_launch_arguments(parser)
    parser.add_argument(
        "--experts", metavar="LIST", help="expert ids, e.g. 0,31,32 or 0-3 (default: both sides of every EP boundary)"
    )
    parser.add_argument("--layers", metavar="LIST", help="layer ids, e.g. 0,5 or 0-3 (default: all layers)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    """Validate everything before starting ranks (bad input: one line on stderr, exit 2); exit 0 iff all ok."""
    from vime_gemma4_bridge import convert, hf_io, preflight

    try:
        topology = Topology.from_args(args)
        topology.validate(requested_world_size(args.nproc))
        source = hf_io.HFCheckpoint(args.hf_checkpoint)
        convert.validate_model_topology(source.config, topology)
        text = convert.text_config_dict(source.config)
        if not text.get("enable_moe_block"):
            raise ValueError("probe follows routed experts; this checkpoint is dense (no enable_moe_block)")
        experts = parse_id_list(args.experts, int(text["num_experts"]), "--experts") if args.experts else None
        layers = parse_id_list(args.layers, int(text["num_hidden_layers"]), "--layers") if args.layers else None
        preflight.check_language_model(source)
    except ValueError as error:
        print(f"vime-gemma4 probe: error: {error}", file=sys.stderr)
        return 2
    result = launch(args.nproc, probe_job, str(Path(args.hf_checkpoint)), topology, experts, layers)[0]
    if is_reporting_process():
        print(json.dumps(result, indent=2) if args.json else format_probe(result))
    return 0 if result["ok"] else 1
