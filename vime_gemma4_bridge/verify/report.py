"""HF tensor names (families, layers, experts) and the round trip's report: bitwise, per tensor family.

"Correct" is bitwise: same names, dtypes, shapes and bytes (``core/bitwise.same_bytes``), nothing missing,
nothing extra (the comparison engine's verdict, :mod:`vime_gemma4_bridge.verify.compare`). The
per-family table is what ``roundtrip`` prints; the EP-boundary check makes the original bug
(expert 0 copied over expert E/EP) visible by name even when counts match.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vime_gemma4_bridge.core.bitwise import same_bytes
from vime_gemma4_bridge.verify.compare import Source, TensorFiles, names_of

#: Names of the stacked routed-expert tensors (HF, relative to a layer).
EXPERT_SUFFIXES = ("experts.gate_up_proj", "experts.down_proj")
#: A per-layer HF name: the stack it belongs to (``model.language_model.layers.``), the layer, the rest.
LAYER_RE = re.compile(r"^(?P<stack>.*?\blayers\.)(?P<layer>\d+)\.(?P<suffix>.+)$")
_EXPERT_ENDINGS = tuple(f".{suffix}" for suffix in EXPERT_SUFFIXES)

_FAMILIES: tuple[tuple[str, str], ...] = (
    (r"(^|\.)embed_tokens\.weight$", "embedding"),
    (r"(^|\.)(embed_tokens_per_layer|per_layer_model_projection|per_layer_projection_norm)\.", "per-layer embedding"),
    (r"\.layers\.\d+\.(per_layer_input_gate|per_layer_projection|post_per_layer_input_norm)\.", "per-layer embedding"),
    (r"\.experts\.", "routed experts"),
    (r"\.router\.", "router"),
    (r"\.self_attn\.(q|k|v|o)_proj\.", "attention projections"),
    (r"\.self_attn\.(q|k)_norm\.", "q/k norms"),
    (r"\.mlp\.", "dense MLP"),
    (r"\.layer_scalar$", "layer scalar"),
    (r"\.layers\.\d+\..*norm", "layer norms"),
    (r"(^|\.)norm\.weight$", "final norm"),
)


def family_of(name: str) -> str:
    """The family a HF tensor name belongs to (for reports); ``other`` when none matches."""
    for pattern, family in _FAMILIES:
        if re.search(pattern, name):
            return family
    return "other"


@dataclass
class FamilyStats:
    """Reference tensors of one family: how many, their bytes, how many came back bitwise equal."""

    count: int = 0
    nbytes: int = 0
    equal: int = 0


@dataclass
class Comparison:
    """The outcome of comparing a candidate set of tensors against a reference set."""

    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    families: dict[str, FamilyStats] = field(default_factory=dict)
    ep_boundaries: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.missing or self.extra or self.different)

    @property
    def total(self) -> FamilyStats:
        total = FamilyStats()
        for stats in self.families.values():
            total.count += stats.count
            total.nbytes += stats.nbytes
            total.equal += stats.equal
        return total

    def as_dict(self) -> dict:
        return {
            "identical": self.identical,
            "missing": self.missing,
            "extra": self.extra,
            "different": self.different,
            "families": {name: vars(stats) for name, stats in self.families.items()},
            "ep_boundary_failures": self.ep_boundaries,
        }


def compare(
    reference: Source, candidate: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, ep: int = 1
) -> Comparison:
    """Compare ``candidate`` with ``reference`` bitwise; check experts at every EP boundary by name.

    ``candidate`` may be the ``(name, tensor)`` pairs an export yields and ``reference`` a
    :class:`~vime_gemma4_bridge.verify.compare.TensorFiles`: each pair is compared as it comes, the
    reference read :data:`BLOCK` bytes at a time, and neither side is held, so a round trip holds
    the export's tensor and one block of the source's. A name yielded twice is extra (an export
    that overwrote its own tensor would otherwise pass).
    """
    result = Comparison()
    names = names_of(reference)
    wanted, seen = set(names), set()

    def ref(name: str) -> Any:
        return reference.location(name) if isinstance(reference, TensorFiles) else reference[name]

    for name, got in candidate.items() if isinstance(candidate, Mapping) else candidate:
        if name in seen or name not in wanted:
            result.extra.append(f"{name} (yielded again)" if name in seen else name)
        else:
            _tally(result, name, ref(name), got, ep)
        seen.add(name)
        del got  # not held while the next one is made
    for name in names:
        if name not in seen:
            _tally(result, name, ref(name), None, ep)
    result.missing.sort()
    result.extra.sort()
    return result


#: How much of a reference tensor a comparison reads at a time.
BLOCK = 64 << 20


def _rows(ref: Any, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a reference: a tensor, or a ``TensorLocation`` read now."""
    return ref[start:stop] if isinstance(ref, torch.Tensor) else ref.rows(start, stop)


def _same(ref: Any, got: torch.Tensor) -> bool:
    """``same_bytes`` of the reference (a tensor or a location) and ``got``, :data:`BLOCK` bytes of rows at a time."""
    if ref.dtype != got.dtype or tuple(ref.shape) != tuple(got.shape):
        return False
    if not ref.shape:
        return same_bytes(ref if isinstance(ref, torch.Tensor) else ref.mapped(), got)
    step = max(1, BLOCK // max(1, ref.nbytes // max(1, ref.shape[0])))
    return all(same_bytes(_rows(ref, a, a + step), got[a : a + step]) for a in range(0, ref.shape[0], step))


def _tally(result: Comparison, name: str, ref: Any, got: torch.Tensor | None, ep: int) -> None:
    stats = result.families.setdefault(family_of(name), FamilyStats())
    stats.count += 1
    stats.nbytes += ref.nbytes
    if got is None:
        result.missing.append(name)
        return
    if _same(ref, got):
        stats.equal += 1
    else:
        result.different.append(name)
    if name.endswith(_EXPERT_ENDINGS):
        result.ep_boundaries.extend(_check_expert_boundaries(name, ref, got, ep))


def ep_boundary_pairs(num_experts: int, ep: int) -> list[tuple[int, int]]:
    """The expert ids on both sides of each expert-parallel boundary: (last of rank r, first of r+1)."""
    per_rank = num_experts // ep if ep > 0 and num_experts % ep == 0 else num_experts
    return [(b - 1, b) for b in range(per_rank, num_experts, per_rank)]


def _check_expert_boundaries(name: str, ref: Any, got: torch.Tensor, ep: int) -> list[str]:
    if tuple(got.shape) != tuple(ref.shape) or len(ref.shape) < 1:
        return []
    failures = []
    for left, right in ep_boundary_pairs(ref.shape[0], max(ep, 2)):
        for expert in (left, right):
            if not same_bytes(got[expert], _rows(ref, expert, expert + 1)[0]):
                failures.append(f"{name}: expert {expert} is not in place")
        if same_bytes(got[left], got[right]):
            failures.append(f"{name}: experts {left} and {right} are duplicates across an EP boundary")
    return failures


def format_report(result: Comparison, title: str) -> str:
    """The per-family table (count, bytes, bitwise equal) and the list of problems, if any."""
    lines = [title, f"{'family':<24}{'tensors':>8}{'bytes':>14}  bitwise equal"]
    for family in sorted(result.families):
        stats = result.families[family]
        mark = "yes" if stats.equal == stats.count else f"NO ({stats.equal}/{stats.count})"
        lines.append(f"{family:<24}{stats.count:>8}{stats.nbytes:>14,}  {mark}")
    total = result.total
    mark = "yes" if result.identical else f"NO ({total.equal}/{total.count})"
    lines.append(f"{'total':<24}{total.count:>8}{total.nbytes:>14,}  {mark}")
    for label, names in (("missing", result.missing), ("extra", result.extra), ("different", result.different)):
        if names:
            shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
            lines.append(f"{label}: {shown}")
    lines.extend(result.ep_boundaries[:10])
    return "\n".join(lines)
