"""What the checkpoint doctor's ``compare`` found, and how it is shown: per tensor, per expert, the causes.

:class:`DoctorReport` is built by :func:`vime_gemma4_bridge.verify.doctor.compare_checkpoints` and its
causes by :mod:`vime_gemma4_bridge.verify.diagnose`; :meth:`DoctorReport.format` is the command's text,
:meth:`DoctorReport.as_dict` its ``--json``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vime_gemma4_bridge.verify.fingerprint import Fingerprint, short


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
            "hash": [short(self.digest_a), short(self.digest_b)],
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
PRIORITY = {
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
                lines.append("  " + format_record(r))
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


def format_record(r: TensorRecord) -> str:
    """One tensor's line in the report: its name, what changed, both fingerprints."""
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
    parts.append(f"A {short(r.digest_a)} B {short(r.digest_b)}")
    if r.note:
        parts.append(r.note)
    return "  ".join(parts)


def id_list(ids: Sequence[int]) -> str:
    """Expert or layer ids for a message: the first twelve, then how many in all."""
    return ", ".join(map(str, ids[:12])) + (f", ... ({len(ids)})" if len(ids) > 12 else "")


def _finite(value: float | None) -> float | None:
    """JSON has no NaN/inf: report them as null."""
    return value if value is not None and math.isfinite(value) else None
