"""The checkpoint doctor's diagnosis: rules that turn per-tensor records into named causes.

Each rule is a function of the :class:`Findings` so far: it reads the records (and, through
:class:`Evidence`, B's tensors or A's per-expert fingerprints), names the fault it recognises with
:meth:`Findings.add`, and marks the tensors it explains so later rules leave them alone. Whole-tensor
moves are recognised before per-expert and per-head patterns (a swapped layer also moves its
experts); whatever no pattern explains is reported as a plain value difference, so every tensor that
differs appears in at least one cause. The causes come back ranked: the one explaining the most
tensors first.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from vime_gemma4_bridge.verify.compare import TensorFiles, difference, tensors_identical
from vime_gemma4_bridge.verify.doctor_report import (
    PRIORITY,
    Cause,
    DoctorReport,
    ExpertTable,
    TensorRecord,
    format_record,
    id_list,
)
from vime_gemma4_bridge.verify.fingerprint import Fingerprint
from vime_gemma4_bridge.verify.report import LAYER_RE


@dataclass(frozen=True)
class Evidence:
    """What the rules may consult beyond the records: B's tensors (read on demand) and facts about A."""

    b: TensorFiles
    b_prefix: str  # where B's language model lives (``model.language_model.`` or ``model.``)
    ties: bool  # A's config ties the output layer to the embedding
    a_expert_fps: dict[str, list[Fingerprint]]  # every stacked expert tensor of A, per expert


class Findings:
    """The diagnosis so far, shared by the rules: the causes named and the tensors they explain."""

    def __init__(self, report: DoctorReport, evidence: Evidence) -> None:
        self.report = report
        self.evidence = evidence
        self.records = {record.name: record for record in report.records}
        self.causes: list[Cause] = []
        self.explained: set[str] = set()
        self.relocated: dict[str, str] = {}  # B name -> the A name whose tensor it holds

    def add(
        self,
        kind: str,
        message: str,
        tensors: Iterable[str],
        details: Iterable[str] = (),
        *,
        value_preserving: bool = False,
    ) -> None:
        """Name a cause; the tensors it names count as explained from now on."""
        tensors = list(dict.fromkeys(tensors))
        self.explained.update(tensors)
        self.causes.append(Cause(kind, message, tensors, list(details), value_preserving))


def diagnose(report: DoctorReport, evidence: Evidence) -> list[Cause]:
    """Run the rules in order over ``report``'s records; the causes, most likely first."""
    found = Findings(report, evidence)
    for rule in (tied_embeddings, relocations, routed_experts, attention_heads):  # what moved where
        rule(found)
    content_explained = set(found.explained)
    structural(found)
    plain_values(found, content_explained)
    return sorted(found.causes, key=lambda c: (c.value_preserving, -len(set(c.tensors)), PRIORITY.get(c.kind, 99)))


# -- whole tensors in another tensor's place ---------------------------------------------


def relocations(found: Findings) -> None:
    """B tensors whose bytes are some *other* A tensor: layer swaps, k/v and gate/up mix-ups, renames."""
    by_digest: dict[str, list[str]] = defaultdict(list)
    for record in found.report.records:
        if record.digest_a:
            by_digest[record.digest_a].append(record.name)
    for record in found.report.records:
        if record.status not in ("different", "shape", "extra") or not record.digest_b:
            continue
        if record.name in found.explained:
            continue
        candidates = [name for name in by_digest.get(record.digest_b, []) if name != record.name]
        if candidates:
            found.relocated[record.name] = _pick_source(record.name, candidates)
    layer_moves: dict[tuple[str, int, int], list[str]] = defaultdict(list)
    pairs: dict[tuple[str, str], str] = {}
    for b_name, a_name in found.relocated.items():
        mb, ma = LAYER_RE.match(b_name), LAYER_RE.match(a_name)
        if mb and ma and mb["stack"] == ma["stack"] and mb["suffix"] == ma["suffix"]:
            layer_moves[(mb["stack"], int(mb["layer"]), int(ma["layer"]))].append(b_name)
        else:
            pairs[(b_name, a_name)] = b_name
    _layer_moves(found, layer_moves)
    _pair_moves(found, list(pairs))


def _layer_moves(found: Findings, moves: dict[tuple[str, int, int], list[str]]) -> None:
    """Layers whose tensors hold another layer's: two layers swapped, or one layer copied over another."""
    sizes: Counter[tuple[str, int]] = Counter()
    for record in found.report.records:
        match = LAYER_RE.match(record.name)
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
            found.add("layer-swap", message, names + back, [f"{n} = A's {found.relocated[n]}" for n in names + back])
        else:
            message = (
                f"layer {i} holds layer {j}'s tensors: B's {stack}{i}.* == A's {stack}{j}.* "
                f"({len(names)}/{sizes[(stack, i)]} tensors)"
            )
            found.add("layer-swap", message, names, [f"{n} = A's {found.relocated[n]}" for n in names])


def _pair_moves(found: Findings, pairs: list[tuple[str, str]]) -> None:
    """Single tensors in another's place, a mutual pair named once (k/v, gate/up, renamed, relocated)."""
    relocated = dict(pairs)
    done: set[str] = set()
    for b_name, a_name in pairs:
        if b_name in done:
            continue
        mutual = relocated.get(a_name) == b_name
        done.update((b_name, a_name) if mutual else (b_name,))
        names = [b_name, a_name] if mutual else [b_name]
        kind, message = _classify_pair(found, b_name, a_name, mutual)
        details = [f"{n} = A's {found.relocated[n]}" for n in names]
        if kind == "renamed":
            names.append(a_name)  # the "missing" A name is the same fault
        found.add(kind, message, names, details)


def _classify_pair(found: Findings, b_name: str, a_name: str, mutual: bool) -> tuple[str, str]:
    """(kind, message) for B's ``b_name`` holding A's ``a_name``: the most specific name of that fault."""
    mb, ma = LAYER_RE.match(b_name), LAYER_RE.match(a_name)
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
    record = found.records[b_name]
    if record.status == "extra":
        if found.records[a_name].status == "missing":
            return "renamed", f"renamed: B's {b_name} is A's {a_name} (which B lacks)"
        return "extra", f"extra in B: {b_name}, a copy of A's {a_name}"
    if mutual:
        return "relocated", f"swapped tensors: {b_name} and {a_name}"
    return "relocated", f"relocated tensor: B's {b_name} holds A's {a_name}"


# -- the tied output layer -------------------------------------------------------------------


def tied_embeddings(found: Findings) -> None:
    """vLLM uses embed_tokens as the output layer when tied; a divergent lm_head means two models."""
    b_prefix = found.evidence.b_prefix
    embed = f"{b_prefix}embed_tokens.weight"
    for record in found.report.records:
        if not record.name.endswith("lm_head.weight") or record.status not in ("extra", "different", "shape"):
            continue
        if record.name in found.explained or embed not in found.evidence.b:
            continue
        lm_head, embedding = found.evidence.b.get(record.name), found.evidence.b.get(embed)
        tie = (
            "although the config ties them (tie_word_embeddings)"
            if found.evidence.ties
            else "(config does not tie them)"
        )
        if tensors_identical(lm_head, embedding):
            if record.status == "extra":
                record.note = f"a copy of {embed}"
                found.add(
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
        found.add(
            "tied-embedding",
            f"tied embedding and output layer disagree: B's {record.name} differs from its {embed} ({how}) {tie}",
            [record.name],
        )
    record = found.records.get(embed)
    if record is not None and record.status == "different" and embed not in found.relocated and found.evidence.ties:
        found.add(
            "tied-embedding",
            f"tied embedding changed: {embed} differs from A (max |Δ| = {record.max_abs:.3g}, "
            f"cos = {record.cosine:.4f}); it is also the output layer, so every logit changes",
            [embed],
        )


# -- routed experts ----------------------------------------------------------------------


def routed_experts(found: Findings) -> None:
    """Per layer and expert tensor: which A expert each B slot holds; then duplicate / shift /
    permutation / gate-up patterns (the faults EP and ETP resharding errors leave)."""
    a_index: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    for table in found.report.experts:
        for row in table.rows:
            a_index[row.a.digest].append((table.layer, table.kind, row.expert))
    for name, fps in found.evidence.a_expert_fps.items():  # A tensors B lacks or reshaped: still sources
        match = LAYER_RE.match(name)
        if match and not any(t.name == name for t in found.report.experts):
            for e, fp in enumerate(fps):
                a_index[fp.digest].append((int(match["layer"]), name.rsplit(".", 1)[-1], e))
    duplicates: dict[tuple[int, int, int, int], list[str]] = defaultdict(list)  # (layer, e, j, E) -> kinds
    shifts: dict[tuple[int, int, int], list[str]] = defaultdict(list)  # (layer, k, E) -> kinds
    perms: dict[tuple[int, tuple], list[str]] = defaultdict(list)
    gate_up: list[tuple[int, list[int], int]] = []
    foreign: dict[tuple[int, int, int, int], list[str]] = defaultdict(list)
    tensors: dict[str, list[str]] = defaultdict(list)  # cause key -> tensor names
    for table in found.report.experts:
        record = found.records[table.name]
        unexplained = record.status in ("different", "dtype") and table.name not in found.explained
        if not unexplained or table.name in found.relocated or table.in_place == len(table.rows):
            if table.name in found.relocated:
                for row in table.rows:
                    row.status = f"tensor is A's {found.relocated[table.name]}"
            continue
        moved, swapped = _classify_experts(found, table, a_index, foreign, tensors)
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
    _expert_causes(found, duplicates, shifts, perms, gate_up, foreign, tensors)


def _classify_experts(
    found: Findings,
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
    found: Findings,
    duplicates: dict[tuple[int, int, int, int], list[str]],
    shifts: dict[tuple[int, int, int], list[str]],
    perms: dict[tuple[int, tuple], list[str]],
    gate_up: list[tuple[int, list[int], int]],
    foreign: dict[tuple[int, int, int, int], list[str]],
    tensors: dict[str, list[str]],
) -> None:
    """One cause per expert pattern found: duplicates (with the EP signature), shifts, permutations, gate/up
    swaps, experts from another layer."""

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
        found.add("expert-duplicate", message, names("dup"), items if len(items) > 1 else [])
    for (layer, k, n), kinds in sorted(shifts.items()):
        found.add(
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
                "experts permuted: " + ", ".join(f"{e}←{j}" for e, j in cycle[:8]) + (" ..." if len(cycle) > 8 else "")
            )
        found.add(
            "expert-permutation",
            f"{what} in layer {layer} ({kinds_of(kinds)})",
            [name for key, ns in tensors.items() if key == f"perm{layer}" for name in ns],
        )
    for layer, swapped, n in gate_up:
        which = f"all {n} experts" if len(swapped) == n else f"experts {id_list(swapped)} of {n}"
        found.add(
            "gate-up-swap",
            f"gate/up swap: layer {layer} experts.gate_up_proj holds [up; gate] instead of [gate; up] in {which}",
            [name for key, ns in tensors.items() if key == f"gu{layer}" for name in ns],
        )
    if foreign:
        items = [
            f"layer {layer} expert {e} holds layer {other}'s expert {j} ({kinds_of(kinds)})"
            for (layer, e, other, j), kinds in sorted(foreign.items())
        ]
        found.add("expert-relocated", "expert from another layer: " + "; ".join(items[:3]), names("foreign"), items)


# -- attention heads ---------------------------------------------------------------------


def attention_heads(found: Findings) -> None:
    """q/k/v projections whose rows are A's heads reordered (a QKV interleave or TP split error)."""
    by_layer: dict[str, list[TensorRecord]] = defaultdict(list)
    for record in found.report.records:
        if record.head_permutation and record.name not in found.explained and record.name not in found.relocated:
            match = LAYER_RE.match(record.name)
            by_layer[match["layer"] if match else record.name].append(record)
    for layer, records in by_layer.items():
        parts = []
        for record in records:
            head_dim, perm = record.head_permutation
            shown = ", ".join(map(str, perm[:16])) + (", ..." if len(perm) > 16 else "")
            parts.append(f"{_leaf(record.name)} (head_dim {head_dim}: B head i = A head [{shown}])")
        found.add(
            "head-permutation",
            f"q/k/v heads permuted: layer {layer} rows reordered by head in " + "; ".join(parts),
            [r.name for r in records],
        )


# -- dtype, shape, missing, extra, plain value changes -----------------------------------


def structural(found: Findings) -> None:
    """dtype, shape, missing and extra tensors that no earlier pattern explained."""
    dtypes: dict[tuple[str, str, bool], list[TensorRecord]] = defaultdict(list)
    for record in found.report.records:
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
        found.add(
            "dtype",
            f"dtype changed: {what} {before} → {after} ({values})",
            [r.name for r in records],
            value_preserving=lossless,
        )
    for status, kind in (("shape", "shape"), ("missing", "missing"), ("extra", "extra")):
        records = [r for r in found.report.records if r.status == status and r.name not in found.explained]
        transposed = [r for r in records if r.transposed]
        for r in transposed:
            found.add("transposed", f"transposed: B's {r.name} is A's transposed ({r.shape_a} → {r.shape_b})", [r.name])
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
        found.add(kind, message, [r.name for r in records], [format_record(r) for r in records])


def plain_values(found: Findings, content_explained: set[str]) -> None:
    """What is left: values that changed without a recognisable reordering (noise, a wrong update),
    also inside tensors whose only other change is a lossless dtype cast."""
    partly = {t.name for t in found.report.experts if any(row.status == "changed" for row in t.rows)}
    records = [
        r
        for r in found.report.records
        if (r.status == "different" or (r.status == "dtype" and r.lossless_cast and r.max_abs))
        and (r.name not in content_explained or r.name in partly)
    ]
    if not records:
        return
    worst = max(records, key=lambda r: r.max_abs if r.max_abs is not None and math.isfinite(r.max_abs) else 1e300)
    changed_experts = []
    for table in found.report.experts:
        ids = [row.expert for row in table.rows if row.status == "changed"]
        if ids and table.name in {r.name for r in records}:
            changed_experts.append(f"layer {table.layer} {table.kind}: experts {id_list(ids)} changed")
    what = records[0].name if len(records) == 1 else f"{len(records)} tensors"
    found.add(
        "values",
        f"values differ in {what} (no recognised reordering; worst {worst.name}: "
        f"max |Δ| = {worst.max_abs:.3g}, cos = {worst.cosine:.4f})",
        [r.name for r in records],
        changed_experts + [format_record(r) for r in records],
    )


def _pick_source(name: str, candidates: list[str]) -> str:
    """Of several A tensors with B's content, the most telling one: same layer, then same leaf elsewhere."""
    match = LAYER_RE.match(name)

    def rank(candidate: str) -> tuple[int, str]:
        other = LAYER_RE.match(candidate)
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
    """A shift by k reads as an EP block when k (or E - k) divides E: E/EP experts per EP rank."""
    for block in (k, num_experts - k):
        if num_experts % block == 0:
            return f"; a block of {block} = E/EP at EP{num_experts // block}, as an EP reconstruction error leaves it"
    return ""
