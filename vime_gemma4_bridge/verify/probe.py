"""The probe: follow routed experts through Megatron-Bridge's own export, stage by stage (``vime-gemma4 probe``).

:func:`probe_job` loads HF into the Megatron model at a topology and fingerprints chosen experts at
every stage of the export: the rank-local parameter, after the PP broadcast, after the ETP gather,
after the EP gather, and in the final stacked HF tensor. The stages come from the bridge's own
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

        export_taps.tap(mapping, "broadcast_from_pp_rank", on_pp)
        export_taps.tap(mapping, "gather_from_tp_ranks", on_tp)
        export_taps.tap(mapping, "gather_from_ep_ranks", on_ep)


def probe_job(
    hf_checkpoint: str, topology: Topology, experts: list[int] | None, layers: list[int] | None
) -> dict[str, Any]:
    """Runs on every rank: load HF at ``topology``, export the chosen layers' experts through the
    bridge's own conversion tasks while recording each stage; rank 0 judges. Returns rank 0's result."""
    import torch.distributed as dist
    from megatron.bridge.models.conversion.utils import unwrap_model
    from megatron.core import parallel_state as ps

    from vime_gemma4_bridge.convert.model import broadcast_from_rank0, build_model, open_bridge
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    init_model_parallel(topology)
    bridge = open_bridge(hf_checkpoint)
    model = build_model(bridge, topology)
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
    model_bridge = seams.model_bridge_of(bridge)
    selected = []
    for task in model_bridge.build_conversion_tasks(bridge.hf_pretrained, models):
        match = _EXPERT_PARAM_RE.match(task.global_param_name) if task is not None else None
        if match is None or (layers is not None and int(match["layer"]) not in layers):
            continue
        selected.append(task)  # every expert of a chosen layer: the stacked HF tensor needs them all
        layer, fc, slot = int(match["layer"]), int(match["fc"]), int(match["e"]) % per_rank
        watched = [e for e in chosen if e % per_rank == slot]
        if watched:
            export_taps.on_gathering_mapping(
                task, functools.partial(recorder.watch, layer=layer, fc=fc, watched=watched)
            )
    for name, tensor in model_bridge.stream_weights_megatron_to_hf(
        models, bridge.hf_pretrained, cpu=True, show_progress=False, conversion_tasks=selected
    ):
        match = LAYER_RE.match(name)
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
    return broadcast_from_rank0(result)


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
    from vime_gemma4_bridge.io.hf import HFCheckpoint

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
            f"probe OK: experts {id_list(experts)} in {len(layers)} layer(s) match the HF source at every stage {where}"
        )
    else:
        first = bad[0]
        lines.append(
            f"probe FAILED: {len(bad)} (layer, expert) pair(s) diverge {where}; first: layer {first['layer']} "
            f"expert {first['expert']}: {first['first_mismatch']}"
        )
    return "\n".join(lines)
