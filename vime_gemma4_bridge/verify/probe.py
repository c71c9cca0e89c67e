"""The probe: follow weights through Megatron-Bridge's own export, stage by stage (``vime-gemma4 probe``).

:func:`probe_job` loads HF into the Megatron model at a topology and fingerprints chosen weights at
every stage of the export. On a MoE checkpoint it follows routed experts: the rank-local parameter,
after the PP broadcast, after the ETP gather, after the EP gather, and in the final stacked HF
tensor. A dense checkpoint has no experts; there it follows each chosen layer's MLP, whose two
weights are the two ways a dense weight is split over TP (``linear_fc1``: gate and up halves, each
column-split; ``linear_fc2``: row-split): the local shard, after the PP broadcast, after the TP
gather, and the final HF ``gate_proj`` / ``up_proj`` / ``down_proj``. The stages come from the bridge's own
mapping objects (the conversion tasks of ``build_conversion_tasks``, run through
``stream_weights_megatron_to_hf``): this module only listens to ``broadcast_from_pp_rank`` /
``gather_from_tp_ranks`` / ``gather_from_ep_ranks`` of those mapping instances and never gathers
anything by hand, so it probes the code that ships. Megatron-Bridge gathers ETP before EP
(``GatedMLPMapping`` / ``Column``/``RowParallelMapping``), so the stages are listed in that order.
:func:`judge_probe` checks each stage against what it must hold, derived from the HF source.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from typing import Any

import torch

from vime_gemma4_bridge.compat import export_taps, seams
from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.core.hf_layout import STACKED
from vime_gemma4_bridge.verify.doctor_report import id_list
from vime_gemma4_bridge.verify.fingerprint import SHORT_HASH, fingerprint, swap_halves, tensor_digest
from vime_gemma4_bridge.verify.report import LAYER_RE, ep_boundary_pairs

#: Export stages in the order Megatron-Bridge runs them, with their labels.
STAGES: tuple[tuple[str, str], ...] = (
    ("local", "local shard"),
    ("pp", "after PP broadcast"),
    ("etp", "after ETP gather"),
    ("ep", "after EP gather"),
    ("final", "final HF tensor"),
)
#: A dense layer's MLP has no EP gather, and its TP gather is the tensor-parallel group's.
DENSE_STAGES: tuple[tuple[str, str], ...] = (
    ("local", "local shard"),
    ("pp", "after PP broadcast"),
    ("tp", "after TP gather"),
    ("final", "final HF tensor"),
)
#: The stages at which a shard is still a shard (each rank must hold its own).
_SHARD_STAGES = ("local", "pp")
#: The stage that gathers the shards, per model kind.
_GATHER_STAGES = ("etp", "tp")
#: A dense layer's MLP weights (global Megatron names).
_DENSE_MLP_PARAM_RE = re.compile(r"^decoder\.layers\.(?P<layer>\d+)\.mlp\.linear_fc(?P<fc>[12])\.weight$")
#: The HF names of a dense MLP, per Megatron weight (``linear_fc1`` is gate then up, fused).
DENSE_HF_KINDS = {1: ("gate_proj", "up_proj"), 2: ("down_proj",)}
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


class _Recorder:
    """Collects stage fingerprints on one rank by listening to a mapping's own collective helpers.

    ``etp_rank`` is the rank within the group whose gather is recorded: the expert-tensor-parallel
    group for experts, the tensor-parallel group for a dense MLP (``gather_stage`` names which).
    """

    def __init__(
        self, rank: int, ep_rank: int, etp_rank: int, pp_rank: int, per_rank: int, ep: int, gather_stage: str = "etp"
    ) -> None:
        self.where = {"rank": rank, "ep": ep_rank, "etp": etp_rank, "pp": pp_rank}
        self.per_rank, self.ep, self.gather_stage = per_rank, ep, gather_stage
        self.records: list[dict[str, Any]] = []

    def add(self, layer: int, fc: int, expert: int | None, stage: str, tensor: torch.Tensor) -> None:
        fp = fingerprint(tensor)
        self.records.append({**self.where, "layer": layer, "fc": fc, "expert": expert, "stage": stage, **fp.as_dict()})

    def watch(self, mapping: Any, layer: int, fc: int, watched: list[int] | None) -> None:
        """Wrap the collective helpers of the mapping instance that will run this task's export.

        ``watched`` lists the experts behind this rank's local expert slot; ``None`` watches a dense
        MLP weight, which every rank holds a shard of and no EP gather touches.
        """
        if watched is None:
            own_expert, mine = None, True
        else:
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
                self.add(layer, fc, own_expert, self.gather_stage, torch.cat(list(result), dim=0))

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

        export_taps.tap(mapping, "broadcast_from_pp_rank", on_pp)
        export_taps.tap(mapping, "gather_from_tp_ranks", on_tp)
        if watched is not None:
            export_taps.tap(mapping, "gather_from_ep_ranks", on_ep)


def probe_job(
    hf_checkpoint: str, topology: Topology, experts: list[int] | None, layers: list[int] | None
) -> dict[str, Any]:
    """Runs on every rank: load HF at ``topology``, export the chosen layers' experts (a dense
    checkpoint: their MLPs) through the bridge's own conversion tasks while recording each stage;
    rank 0 judges. Returns rank 0's result."""
    import torch.distributed as dist
    from megatron.bridge.models.conversion.utils import unwrap_model
    from megatron.core import parallel_state as ps

    from vime_gemma4_bridge.convert.integrity import verify_sources
    from vime_gemma4_bridge.convert.model import broadcast_from_rank0, loaded_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    verify_sources(hf_checkpoint)  # the digests it records, before its bytes are used
    bridge = open_bridge(hf_checkpoint)
    model = loaded_model(bridge, topology)
    models = unwrap_model(model)
    num_experts = int(models[0].config.num_moe_experts or 0)
    dense = num_experts == 0
    ep = ps.get_expert_model_parallel_world_size()
    per_rank = max(num_experts // ep, 1)
    chosen = [] if dense else experts or default_probe_experts(num_experts, ep)
    recorder = _Recorder(
        dist.get_rank(),
        ps.get_expert_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank() if dense else ps.get_expert_tensor_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        per_rank,
        ep,
        gather_stage="tp" if dense else "etp",
    )
    model_bridge = seams.model_bridge_of(bridge)
    selected = []
    for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, models):
        pattern = _DENSE_MLP_PARAM_RE if dense else _EXPERT_PARAM_RE
        match = pattern.match(task.global_param_name) if task is not None else None
        if match is None or (layers is not None and int(match["layer"]) not in layers):
            continue
        selected.append(task)  # every expert of a chosen layer: the stacked HF tensor needs them all
        layer, fc = int(match["layer"]), int(match["fc"])
        watched = None if dense else [e for e in chosen if e % per_rank == int(match["e"]) % per_rank]
        if watched is None or watched:
            export_taps.on_gathering_mapping(
                task, functools.partial(recorder.watch, layer=layer, fc=fc, watched=watched)
            )
    final = _DenseFinal(recorder) if dense else None
    from vime_gemma4_bridge.core.expert_layout import in_expert_layout

    exported = model_bridge.stream_weights_megatron_to_hf(
        models, bridge.hf_pretrained, cpu=True, show_progress=False, conversion_tasks=selected
    )
    for name, tensor in in_expert_layout(STACKED, exported):  # the stages are the stacked tensor's
        match = LAYER_RE.match(name)
        if match is None:
            continue
        if final is not None:
            final.add(int(match["layer"]), match["suffix"], tensor)
            continue
        kind = name.rsplit(".", 1)[-1]
        fc = next((f for f, k in FC_KINDS.items() if k == kind), None)
        if fc is not None:
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
            etp=ps.get_tensor_model_parallel_world_size() if dense else ps.get_expert_tensor_parallel_world_size(),
            topology=str(topology),
            world=dist.get_world_size(),
            dense=dense,
        )
    return broadcast_from_rank0(result)


class _DenseFinal:
    """Records the final HF tensors of a dense MLP: ``gate_proj`` and ``up_proj`` arrive as two
    tensors and are recorded fused (gate then up), as ``linear_fc1`` holds them."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.pending_gate: dict[int, torch.Tensor] = {}

    def add(self, layer: int, suffix: str, tensor: torch.Tensor) -> None:
        if suffix == "mlp.gate_proj.weight":
            self.pending_gate[layer] = tensor
        elif suffix == "mlp.up_proj.weight":
            self.recorder.add(layer, 1, None, "final", torch.cat([self.pending_gate.pop(layer), tensor], dim=0))
        elif suffix == "mlp.down_proj.weight":
            self.recorder.add(layer, 2, None, "final", tensor)


def _expected_pieces(source: torch.Tensor, fc: int, etp: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What the Megatron side must hold for one HF expert (or dense MLP weight): its (E)TP shards
    (as GatedMLPMapping / RowParallelMapping load them) and the shards concatenated along dim 0
    (the gather stage)."""
    if fc == 1:
        gate, up = torch.chunk(source, 2, dim=0)
        shards = [
            torch.cat([g, u], dim=0)
            for g, u in zip(torch.chunk(gate, etp, dim=0), torch.chunk(up, etp, dim=0), strict=True)
        ]
    else:
        shards = [s.contiguous() for s in torch.chunk(source, etp, dim=1)]
    return shards, torch.cat(shards, dim=0)


def _source_weights(source: Any, layer: int, dense: bool) -> dict[int, torch.Tensor]:
    """The HF tensors behind ``linear_fc1`` / ``linear_fc2`` of one layer: the expert stacks, or a
    dense MLP's ``gate_proj``/``up_proj`` fused (gate then up) and ``down_proj``."""
    base = f"{source.prefix}layers.{layer}."
    if not dense:
        names = {fc: f"{base}experts.{kind}" for fc, kind in FC_KINDS.items()}
        loaded = source.load(list(names.values()))
        return {fc: loaded[name] for fc, name in names.items()}
    names = {fc: [f"{base}mlp.{kind}.weight" for kind in kinds] for fc, kinds in DENSE_HF_KINDS.items()}
    loaded = source.load([name for group in names.values() for name in group])
    return {fc: torch.cat([loaded[name] for name in group], dim=0) for fc, group in names.items()}


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
    dense: bool = False,
) -> dict[str, Any]:
    """Compare every recorded stage fingerprint with what it must hold, derived from the HF source.

    ``dense``: the entries are the layers' MLPs (``expert`` None), ``etp`` is the TP size."""
    from vime_gemma4_bridge.io.hf import HFCheckpoint

    source = HFCheckpoint(hf_checkpoint)
    by_key: dict[tuple[int, int, int | None, str], list[dict]] = defaultdict(list)
    for record in records:
        by_key[(record["layer"], record["fc"], record["expert"], record["stage"])].append(record)
    stages = DENSE_STAGES if dense else STAGES
    # A wrong dense shard is most likely another layer's: a dense MLP is small, so every probed layer
    # is read up front and catalogued together. Expert stacks are large: one layer at a time.
    if dense:
        weights = {layer: _source_weights(source, layer, True) for layer in layers}
        labelled = {fc: [(f"layer {layer}", w[fc]) for layer, w in weights.items()] for fc in FC_KINDS}
        shared = {fc: _catalog(named, fc, etp, "TP") for fc, named in labelled.items()}
    per_layer = weights.items() if dense else ((layer, _source_weights(source, layer, False)) for layer in layers)
    entries = []
    for layer, tensors in per_layer:
        if dense:
            units: list[tuple[int | None, dict[str, Any]]] = [(None, {})]
            catalog = shared
        else:
            per_rank = tensors[1].shape[0] // ep
            units = [(e, {"ep_rank": e // per_rank, "local_slot": e % per_rank}) for e in experts]
            catalog = {
                fc: _catalog([(f"expert {e}", t[e]) for e in range(t.shape[0])], fc, etp) for fc, t in tensors.items()
            }
        for expert, where in units:
            unit = {fc: t if expert is None else t[expert] for fc, t in tensors.items()}
            entry: dict[str, Any] = {
                "layer": layer,
                "expert": expert,
                **where,
                "source": {FC_KINDS[fc]: fingerprint(t).as_dict() for fc, t in unit.items()},
                "stages": [],
                "first_mismatch": None,
            }
            for stage, label in stages:
                row: dict[str, Any] = {"stage": stage, "label": label}
                for fc, tensor in unit.items():
                    cell = _judge_stage(by_key[(layer, fc, expert, stage)], stage, tensor, fc, etp, catalog[fc])
                    row[FC_KINDS[fc]] = cell
                    if cell["status"] == "MISMATCH" and entry["first_mismatch"] is None:
                        entry["first_mismatch"] = f"{FC_KINDS[fc]} {label}: {cell['problem']}"
                entry["stages"].append(row)
            entries.append(entry)
    ok = all(entry["first_mismatch"] is None for entry in entries)
    return {"ok": ok, "dense": dense, "topology": topology, "world": world, "ep": ep, "etp": etp, "entries": entries}


def _catalog(named: list[tuple[str, torch.Tensor]], fc: int, etp: int, group: str = "ETP") -> dict[str, dict[str, str]]:
    """Digest → which source tensor it is (``named``: expert or layer labels; ``group``: the group
    the shards belong to), per granularity, to say what a wrong stage holds instead."""
    shards: dict[str, str] = {}
    gathered: dict[str, str] = {}
    full: dict[str, str] = {}
    for label, tensor in named:
        pieces, cat = _expected_pieces(tensor, fc, etp)
        for t, piece in enumerate(pieces):
            shards.setdefault(tensor_digest(piece), f"{label} {group} shard {t}")
        gathered.setdefault(tensor_digest(cat), label)
        full.setdefault(tensor_digest(tensor), label)
        if fc == 1:
            full.setdefault(tensor_digest(swap_halves(tensor)), f"{label} with gate/up swapped")
    return {"shard": shards, "gather": gathered, "full": full}


def _judge_stage(
    records: list[dict], stage: str, source: torch.Tensor, fc: int, etp: int, catalog: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """One cell of the table: ok iff every rank's fingerprint is what that rank must hold at this stage
    (its own (E)TP shard for local/PP, the whole tensor after the gathers); on mismatch, say which
    source tensor the wrong one actually is."""
    shards, cat = _expected_pieces(source, fc, etp)
    expected_shards = [tensor_digest(s) for s in shards]
    gather = stage in _GATHER_STAGES
    whole = tensor_digest(cat) if gather else tensor_digest(source)

    def expected_of(record: dict) -> str:
        return expected_shards[record["etp"]] if stage in _SHARD_STAGES else whole

    index = catalog["shard"] if stage in _SHARD_STAGES else catalog["gather"] if gather else catalog["full"]
    if gather and etp == 1 and not records:
        return {"status": "skipped", "fingerprints": [], "ranks": [], "problem": f"{stage.upper()}1: no gather"}
    cell: dict[str, Any] = {"status": "ok", "fingerprints": [], "ranks": sorted({r["rank"] for r in records})}
    if stage in _SHARD_STAGES:
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
        holds = index.get(first["digest"], "no source tensor")
        cell.update(
            status="MISMATCH",
            problem=(
                f"rank(s) {', '.join(str(r['rank']) for r in bad)} hold {first['hash']} = {holds}, "
                f"expected {expected_of(first)[:SHORT_HASH]}"
            ),
        )
    elif missing:
        cell.update(status="MISMATCH", problem=f"no rank reported this stage (shards {missing})")
    return cell


def format_probe(result: dict[str, Any]) -> str:
    """One compact table per (layer, expert) or dense layer: stage → fingerprint → ok/MISMATCH, then the verdict."""
    dense = result.get("dense", False)
    lines = []
    width = 36
    fc1_label = "gate_proj|up_proj (linear_fc1)" if dense else "gate_up_proj (linear_fc1)"
    for entry in result["entries"]:
        src = entry["source"]
        what = (
            f"layer {entry['layer']} · MLP (TP{result['etp']})"
            if dense
            else f"layer {entry['layer']} · expert {entry['expert']} (EP rank {entry['ep_rank']} of {result['ep']}, "
            f"local weight{entry['local_slot']}, ETP{result['etp']})"
        )
        lines.append(
            f"{what}   source: {fc1_label.split(' ')[0]} {src['gate_up_proj']['hash']}  "
            f"down_proj {src['down_proj']['hash']}"
        )
        lines.append(f"  {'stage':<20}{fc1_label:<{width}}down_proj (linear_fc2)")
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
    layers = sorted({e["layer"] for e in result["entries"]})
    where = f"at {result['topology']} on {result['world']} rank(s)"
    if dense and not bad:
        lines.append(f"probe OK: the MLP of layers {id_list(layers)} matches the HF source at every stage {where}")
    elif dense:
        first = bad[0]
        lines.append(
            f"probe FAILED: the MLP of {len(bad)} layer(s) diverges {where}; first: layer {first['layer']}: "
            f"{first['first_mismatch']}"
        )
    elif not bad:
        experts = sorted({e["expert"] for e in result["entries"]})
        lines.append(
            f"probe OK: experts {id_list(experts)} in {len(layers)} layer(s) match the HF source at every stage {where}"
        )
    else:
        first = bad[0]
        lines.append(
            f"probe FAILED: {len(bad)} (layer, expert) pair(s) diverge {where}; first: layer {first['layer']} "
            f"expert {first['expert']}: {first['first_mismatch']}"
        )
    return "\n".join(lines)
