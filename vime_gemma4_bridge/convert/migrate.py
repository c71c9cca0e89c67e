"""``migrate``: a Gemma 4 torch_dist checkpoint rewritten in another implementation's layout, bitwise.

Layouts (docs/INTERCHANGE.md has their derivations, with citations):

* ``ours``: the plugin's — ``decoder.layers.*`` stacked over all layers (layer axis first), attention
  stacked per layer type (``decoder.layers.self_attention_{sliding,global}.*``); a MoE model's also
  holds the 8 TE-norm ``_extra_state`` objects upstream's model asks for (what ``import`` writes);
* ``upstream``: upstream Megatron-Bridge's Gemma 4 MoE text model — for the MoE model the same keys;
* ``vime-native``: vime's native Gemma 4 (@3c06ae51, ``vime_plugins/models/gemma4.py``; slime's PR #2135):
  one key per layer (``decoder.layers.<global index>.``, no layer axis) and its own names.

Every tensor is one HF tensor of one layer on both sides (a rename, and a slice of, or a place on, a
stack axis); nothing inside a tensor changes, so the rewrite is bitwise. megatron-core reads and writes
every item: a layer's slice of a stacked tensor is described as a ``ShardedTensor`` with the layer's
offset on the stack axis and ``dist_checkpointing.load`` assembles it from whatever chunks the source
holds; ``dist_checkpointing.save`` writes the target. Each rank moves the layers ``N % world == rank``
(memory divides with the ranks). Optimizer state keyed by name (no distributed optimizer,
``fully_reshardable``: ``optimizer.state.<family>.<model key>``) moves with its parameter; positional
state (``dp_reshardable``) cannot be moved by names and is refused. Common state (``args``, iteration,
optimizer groups, content metadata) and the RNG objects are copied unchanged; the vocabulary rows too
(the embedding keeps its padding).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert.migrate_dense import DensePlan
from vime_gemma4_bridge.convert.migrate_units import (
    COMMON_STATE,
    EMPTY_STATE,
    OBJECT_SHARD,
    Unit,
    split_key,
)
from vime_gemma4_bridge.io.torch_dist import (
    TRACKER_NAME,
    TorchDistCheckpoint,
)
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError, is_vision_language

LAYOUTS = ("ours", "upstream", "vime-native")

#: Our attention module paths (under ``decoder.layers.self_attention_<type>.``) -> vime-native's (under
#: ``decoder.layers.<N>.``): vime_plugins/models/gemma4.py L966-985 (slime e734ee75f, same lines).
ATTENTION_NATIVE = (
    ("linear_qkv.", "self_attention.linear_qkv."),
    ("q_layernorm.", "self_attention.q_layernorm."),
    ("k_layernorm.", "self_attention.k_layernorm."),
    ("linear_proj.post_layernorm.", "post_attention_layernorm."),
    ("linear_proj.", "self_attention.linear_proj."),
)
#: Our layer paths (under ``decoder.layers.``) -> vime-native's: joined on the HF names (the two
#: pre-feed-forward norms cross: native ``pre_mlp_layernorm`` feeds its dense MLP, L499 -> L420, ours the
#: routed experts; native ``mlp.pre_feedforward_layernorm_2`` is ours, L214/L280).
LAYER_NATIVE = (
    ("pre_shared_expert_layernorm.", "pre_mlp_layernorm."),
    ("pre_mlp_layernorm.", "mlp.pre_feedforward_layernorm_2."),
    ("mlp.shared_experts.", "dense_mlp."),
    ("mlp.post_shared_expert_layernorm.", "post_feedforward_layernorm_1."),
    ("mlp.post_moe_layernorm.", "post_feedforward_layernorm_2."),
    ("post_ffn_layernorm.", "post_feedforward_layernorm."),
    ("mlp.router.weight", "mlp.router.proj.weight"),
    ("mlp.router.", "mlp.router."),
    ("mlp.experts.", "mlp.experts."),
    ("layer_scalar", "layer_scalar"),
)
#: Every tensor of a MoE layer, by our path (an ``_extra_state`` object goes by its module's ``weight``).
ATTENTION_LEAVES = frozenset(
    f"{module}.{leaf}"
    for module, leaf in (
        ("linear_qkv", "weight"),
        ("linear_qkv", "layer_norm_weight"),
        ("q_layernorm", "weight"),
        ("k_layernorm", "weight"),
        ("linear_proj", "weight"),
        ("linear_proj.post_layernorm", "weight"),
    )
)
LAYER_LEAVES = frozenset(
    {
        "pre_shared_expert_layernorm.weight",
        "pre_mlp_layernorm.weight",
        "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc2.weight",
        "mlp.post_shared_expert_layernorm.weight",
        "mlp.post_moe_layernorm.weight",
        "post_ffn_layernorm.weight",
        "mlp.router.weight",
        "mlp.router.scale",
        "mlp.router.per_expert_scale",
        "mlp.experts.experts.linear_fc1.weight",
        "mlp.experts.experts.linear_fc2.weight",
        "layer_scalar",
    }
)
#: Norms each layout builds as TE norms, whose ``_extra_state`` its load asks for (ours: upstream's 8,
#: io/torch_dist_layout.UPSTREAM_TE_NORM; native: every TENorm of its spec, L352-398, L974-983), by our path.
TE_NORMS = {
    "ours": {
        "attention": ("q_layernorm.", "k_layernorm.", "linear_proj.post_layernorm."),
        "layer": ("pre_mlp_layernorm.",),
    },
    "vime-native": {
        "attention": ("q_layernorm.", "k_layernorm.", "linear_proj.post_layernorm."),
        "layer": (
            "pre_mlp_layernorm.",
            "pre_shared_expert_layernorm.",
            "mlp.post_shared_expert_layernorm.",
            "mlp.post_moe_layernorm.",
            "post_ffn_layernorm.",
        ),
    },
}
FINAL_NORM = "decoder.final_layernorm."
NATIVE_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
ATTENTION = re.compile(r"^decoder\.layers\.self_attention_(sliding|global)\.(.*)$")


def _replace_prefix(path: str, table: Iterable[tuple[str, str]], reverse: bool = False) -> str | None:
    """``path`` with its first matching prefix in ``table`` replaced (ours -> native, or back), or ``None``."""
    for ours, native in table:
        old, new = (native, ours) if reverse else (ours, native)
        if path.startswith(old):
            return new + path[len(old) :]
    return None


def make_plan(checkpoint: TorchDistCheckpoint, to: str, text_config: Mapping[str, Any] | None) -> Any:
    """The plan that moves ``checkpoint`` to layout ``to``: :class:`Plan` for the MoE model,
    :class:`~vime_gemma4_bridge.convert.migrate_dense.DensePlan` for a dense one (it has no router).
    ``text_config``: the HF text config (``--hf-checkpoint``), or ``None``."""
    from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

    if to not in LAYOUTS:
        raise ConversionError(f"--to {to!r}: choose one of {', '.join(LAYOUTS)}")
    sharding = checkpoint.positional_optimizer()
    if sharding:
        raise ConversionError(
            f"torch_dist checkpoint {checkpoint.path} holds distributed-optimizer state in the {sharding} "
            "format, keyed by position, which no key map can move: migrate a checkpoint saved with "
            "--dist-ckpt-optim-fully-reshardable (keyed by name), or one saved with --no-save-optim"
        )
    stored = read_checkpoint_metadata(checkpoint.iteration_dir).state_dict_metadata
    if any(key.endswith("mlp.router.scale") for key in stored):
        plan = Plan(checkpoint, to, (text_config or {}).get("layer_types"), stored)
    else:
        plan = DensePlan(checkpoint, to, text_config, stored)
    plan.common = checkpoint.common_state()
    return plan


class Plan:
    """Every unit of a MoE source checkpoint for one target layout (no tensor data read)."""

    def __init__(
        self, checkpoint: TorchDistCheckpoint, to: str, layer_types: list[str] | None, stored: Mapping
    ) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.checkpoint, self.to = checkpoint, to
        tensors = {key: meta for key, meta in stored.items() if isinstance(meta, TensorStorageMetadata)}
        objects = [key for key in stored if key not in tensors]
        model = {split[1]: meta for key, meta in tensors.items() if (split := split_key(key)) and not split[0]}
        self.source = "vime-native" if any(NATIVE_LAYER.match(key) for key in model) else "ours"
        self.vision_language = is_vision_language(stored)
        self.types = self._layer_types(model, layer_types)
        self.index = {kind: [n for n, t in enumerate(self.types) if t == kind] for kind in ("sliding", "global")}
        self.model_dtype = model["embedding.word_embeddings.weight"].properties.dtype
        self.units: list[Unit] = []
        for key, meta in tensors.items():
            self.units += self._tensor_units(key, tuple(meta.size), meta.properties.dtype)
        for unique in objects:
            self.units += self._object_units(unique)
        self.units += self._created_norm_states()

    # -- layer types -------------------------------------------------------------------------------

    def _layer_types(self, tensors: Mapping[str, Any], given: list[str] | None) -> list[str]:
        """The type of every layer: ``given`` (an HF config's), else native's per-layer q-norm sizes (the
        global head dim is the larger), else native's own periodic rule (L310-314, L1092-1096) on our stacks."""
        if self.source == "vime-native":
            sizes = {}
            for key, meta in tensors.items():
                match = NATIVE_LAYER.match(key)
                if match and match.group(2) == "self_attention.q_layernorm.weight":
                    sizes[int(match.group(1))] = meta.size[0]
            found = ["global" if size == max(sizes.values()) else "sliding" for _, size in sorted(sizes.items())]
        else:
            layers = tensors["decoder.layers.layer_scalar"].size[0] if "decoder.layers.layer_scalar" in tensors else 0
            full = next(
                (
                    meta.size[0]
                    for key, meta in tensors.items()
                    if key.startswith("decoder.layers.self_attention_global.")
                ),
                0,
            )
            if not layers or not full or layers % full:
                found = []
            else:
                period = layers // full
                found = ["global" if (n + 1) % period == 0 else "sliding" for n in range(layers)]
        if given is not None:
            given = ["global" if kind == "full_attention" else "sliding" for kind in given]
            if found and given != found:
                raise ConversionError(
                    f"torch_dist checkpoint {self.checkpoint.path} stores layer types {found} and --hf-checkpoint "
                    f"says {given}: pass the HF checkpoint the run started from"
                )
            return given
        if not found:
            raise ConversionError(
                f"cannot tell the layer types of {self.checkpoint.path}: pass --hf-checkpoint (its layer_types)"
            )
        return found

    # -- keys --------------------------------------------------------------------------------------

    def _layer_place(self, model_key: str, layout: str, n: int, attention: bool, path: str) -> tuple[str, tuple | None]:
        """Where layer ``n``'s ``path`` (our name) is in ``layout``: the key and its ``(index, size)`` on the stack."""
        if layout == "vime-native":
            table = ATTENTION_NATIVE if attention else LAYER_NATIVE
            native = _replace_prefix(path, table)
            if native is None:
                raise ConversionError(f"torch_dist key {model_key} has no place in vime's native layout")
            return f"decoder.layers.{n}.{native}", None
        if attention:
            kind = self.types[n]
            return f"decoder.layers.self_attention_{kind}.{path}", (self.index[kind].index(n), len(self.index[kind]))
        return f"decoder.layers.{path}", (n, len(self.types))

    def _ours(self, model_key: str) -> list[tuple[int, bool, str, tuple | None]]:
        """``model_key`` of the source as ``(layer, attention?, our path, stack)`` per layer it holds; a key no
        Gemma 4 MoE layer has is refused, naming it."""
        found = self._parse(model_key)
        for n, attention, path, _ in found:
            if n >= 0 and path not in (ATTENTION_LEAVES if attention else LAYER_LEAVES):
                raise ConversionError(
                    f"torch_dist key {model_key} is no tensor of a Gemma 4 MoE layer in the {self.source} layout "
                    "(docs/INTERCHANGE.md): the checkpoint holds another model"
                )
        return found

    def _parse(self, model_key: str) -> list[tuple[int, bool, str, tuple | None]]:
        if self.source == "vime-native":
            match = NATIVE_LAYER.match(model_key)
            if match is None:
                return [(-1, False, model_key, None)]
            n, native = int(match.group(1)), match.group(2)
            for attention, table in ((True, ATTENTION_NATIVE), (False, LAYER_NATIVE)):
                path = _replace_prefix(native, table, reverse=True)
                if path is not None:
                    return [(n, attention, path, None)]
            raise ConversionError(f"torch_dist key {model_key} is not a key of vime's native Gemma 4 layer")
        match = ATTENTION.match(model_key)
        if match:
            kind, path = match.groups()
            members = self.index[kind]
            return [(n, True, path, (j, len(members))) for j, n in enumerate(members)]
        if model_key.startswith("decoder.layers."):
            path = model_key[len("decoder.layers.") :]
            return [(n, False, path, (n, len(self.types))) for n in range(len(self.types))]
        return [(-1, False, model_key, None)]

    def _target(self, prefix: str, model_key: str, n: int, attention: bool, path: str) -> tuple[str, tuple | None]:
        if n < 0:
            return prefix + model_key, None
        key, stack = self._layer_place(model_key, self.to, n, attention, path)
        return prefix + key, stack

    def _tensor_units(self, key: str, size: tuple[int, ...], dtype: Any) -> list[Unit]:
        split = split_key(key)
        if split is None:
            return [Unit(key, key, None, None, size, dtype)]  # not the language model's: copied as it is
        prefix, model_key = split
        units = []
        for n, attention, path, stack in self._ours(model_key):
            target, target_stack = self._target(prefix, model_key, n, attention, path)
            shape = size[1:] if stack is not None else size
            cast = None if prefix else self._target_dtype(path)
            units.append(Unit(key, target, stack, target_stack, shape, dtype, layer=n, target_dtype=cast))
        return units

    def _target_dtype(self, path: str) -> Any:
        """The dtype the target's code holds a model tensor in: vime-native's ``layer_scalar`` is a float32
        buffer (L371: kept so on purpose), the plugin holds every weight in the model's (the embedding's)."""
        import torch

        if self.to == "vime-native":
            return torch.float32 if path == "layer_scalar" else None
        return self.model_dtype

    def _object_units(self, unique: str) -> list[Unit]:
        match = OBJECT_SHARD.match(unique)
        if match is None:
            raise ConversionError(f"torch_dist item {unique} of {self.checkpoint.path} is no megatron-core object")
        key = match.group(1)
        if key == COMMON_STATE:
            return []  # megatron-core stores the common state itself, beside common.pt
        offset = tuple(int(x) for x in match.group(2).split("."))
        shape = tuple(int(x) for x in match.group(3).split("."))
        split = split_key(key)
        if split is None or split[0] or not key.endswith("._extra_state"):
            return [Unit(key, key, None, None, object_at=(offset, shape))]  # RNG, ...: copied as it is
        module = split[1].removesuffix("_extra_state")
        units = []
        for n, attention, path, stack in self._ours(module + "weight"):
            if stack is not None and offset[0] != stack[0]:
                continue  # the object of another layer of this stack
            path = path.removesuffix("weight")
            if self._is_norm(path, attention, n, "ours") or self._is_norm(path, attention, n, "vime-native"):
                if not self._is_norm(path, attention, n, self.to):
                    continue  # a TE norm's state the target's model does not ask for
            target, target_stack = self._target("", module + "weight", n, attention, path + "weight")
            rest = (offset[1:], shape[1:]) if stack is not None else _axes(offset, shape)
            target = target.removesuffix("weight") + "_extra_state"
            units.append(Unit(key, target, stack, target_stack, object_at=rest, layer=n))
        return units

    def _is_norm(self, path: str, attention: bool, n: int, layout: str) -> bool:
        if n < 0:
            return path == FINAL_NORM
        norms = TE_NORMS["vime-native" if layout == "vime-native" else "ours"]
        return path in norms["attention" if attention else "layer"]

    def _created_norm_states(self) -> list[Unit]:
        """The TE-norm states the target's model asks for and the source lacks: an empty uint8 tensor each (a TE
        RMSNorm's without FP8); their ``source`` is ``""``."""
        norms = TE_NORMS["vime-native" if self.to == "vime-native" else "ours"]
        covered = {(unit.target, unit.target_stack) for unit in self.units if unit.object_at is not None}
        wanted = [(-1, False, FINAL_NORM)]
        for n in range(len(self.types)):
            wanted += [(n, True, path) for path in norms["attention"]] + [(n, False, path) for path in norms["layer"]]
        created = []
        for n, attention, path in wanted:
            target, stack = self._target("", path + "weight", n, attention, path + "weight")
            target = target.removesuffix("weight") + "_extra_state"
            if (target, stack) not in covered:
                created.append(Unit("", target, None, stack, object_at=((), ()), layer=n, fill=EMPTY_STATE))
        return created


def _axes(offset: tuple[int, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An object's own axes: megatron-core stores an object of a module without offsets as ``(0,)`` of ``(1,)``
    (``transformer/utils._get_extra_state_offsets``)."""
    return ((), ()) if (offset, shape) == ((0,), (1,)) else (offset, shape)


def _place(stack: tuple[int, int] | None, rest: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[tuple, tuple]:
    """``(global offset, global shape)`` of an object: its stack axis, then its own axes (or ``(0,)`` of ``(1,)``)."""
    offset = ((stack[0],) if stack else ()) + rest[0]
    shape = ((stack[1],) if stack else ()) + rest[1]
    return (offset or (0,)), (shape or (1,))


def _item(unit: Unit, key: str, stack: tuple[int, int] | None, rows: tuple[int, int, int] | None, data: Any) -> Any:
    """The megatron-core description of ``unit`` at ``key`` (with ``stack`` and ``rows``), holding ``data``.

    A tensor is described without a regular grid (``axis_fragmentations=None``): pieces of one key need
    not divide it evenly (a KV group's query rows), and PyTorch's planner checks that the pieces a save
    writes cover each tensor exactly once."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if unit.object_at is not None:
        offset, shape = _place(stack, unit.object_at)
        return ShardedObject(key, data, shape, offset, replica_id=0)
    own = tuple(data.shape)
    whole = (rows[2], *own[1:]) if rows else own
    offsets = ((rows[0] if rows else 0),) + (0,) * (len(own) - 1) if own else ()
    if stack:  # the stack axis as the data's own (PyTorch's planner takes no prepended axis off a regular grid)
        data, own, whole, offsets = data.unsqueeze(0), (1, *own), (stack[1], *whole), (stack[0], *offsets)
    return ShardedTensor(key, data, data.dtype, own, whole, offsets, None, replica_id=0)


def _loaded(unit: Unit, data: Any) -> Any:
    """A loaded unit's data without the stack axis :func:`_item` gave it, in the target's dtype."""
    if unit.object_at is not None:
        return data
    data = data.reshape(unit.shape)
    return data if unit.target_dtype is None else data.to(unit.target_dtype)


def _created(unit: Unit) -> Any:
    """What a unit the source lacks holds in the target (what the target's own code writes there)."""
    import torch

    if unit.object_at is not None:
        return torch.empty(0, dtype=torch.uint8) if unit.fill == EMPTY_STATE else None
    return torch.full(unit.shape, unit.fill, dtype=unit.dtype)


def migrate_job(load: str, save: str, partial: str, to: str, text_config: dict[str, Any] | None) -> dict[str, Any]:
    """``load`` rewritten in layout ``to`` at ``save`` (written into ``partial``, committed when complete).
    Every rank moves its layers; returns rank 0's report."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from vime_gemma4_bridge.compat.cuda import cpu_checkpointing
    from vime_gemma4_bridge.compat.write_results import in_process_write_results
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.io.commit import commit_directory
    from vime_gemma4_bridge.io.torch_dist import write_failure

    start = time.perf_counter()
    checkpoint = TorchDistCheckpoint(load)
    plan = make_plan(checkpoint, to, text_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [unit for unit in plan.units if max(unit.layer, 0) % world == rank]
    work, out = Path(convert.broadcast_from_rank0(partial)), Path(save)
    target_dir = work / checkpoint.iteration_dir.name
    rank0 = convert.is_rank0()
    try:
        if rank0:
            target_dir.mkdir(parents=True)
        dist.barrier()
        wanted = {
            f"u{i}": _item(
                unit,
                unit.source,
                unit.source_stack,
                unit.source_rows,
                None if unit.object_at else torch.empty(unit.shape, dtype=unit.dtype),
            )
            for i, unit in enumerate(mine)
            if unit.source
        }
        with cpu_checkpointing():
            loaded = dist_checkpointing.load(
                wanted, str(checkpoint.iteration_dir), strict=StrictHandling.ASSUME_OK_UNEXPECTED
            )
        moved = {
            f"u{i}": _item(
                unit,
                unit.target,
                unit.target_stack,
                unit.target_rows,
                _created(unit) if not unit.source else _loaded(unit, loaded[f"u{i}"]),
            )
            for i, unit in enumerate(mine)
        }
        try:
            with cpu_checkpointing(), in_process_write_results():
                dist_checkpointing.save(
                    {**plan.common, "migrated": moved},
                    str(target_dir),
                    TorchDistSaveShardedStrategy("torch_dist", 1),
                    validate_access_integrity=True,
                )
        except BaseException as error:  # PyTorch's CheckpointException is a BaseException
            if isinstance(error, KeyboardInterrupt | SystemExit):
                raise
            raise ConversionError(f"writing torch_dist to {target_dir} failed: {write_failure(target_dir)}") from None
        result: dict[str, Any] | None = None
        if rank0:
            shutil.copy(checkpoint.path / TRACKER_NAME, work / TRACKER_NAME)  # last: marks it complete
            commit_directory(work, out, replace=True)
            result = {
                "command": "migrate",
                "ok": True,
                "load": str(checkpoint.iteration_dir),
                "from": plan.source
                + (" (vision-language: language_model.*, towers kept)" if plan.vision_language else ""),
                "to": to,
                "save": str(out / checkpoint.iteration_dir.name),
                "layer_types": plan.types,
                "tensors": sum(1 for unit in plan.units if unit.object_at is None),
                "objects": sum(1 for unit in plan.units if unit.object_at is not None),
                "created": sum(1 for unit in plan.units if not unit.source),
                "world_size": world,
                "seconds": round(time.perf_counter() - start, 3),
            }
        return convert.broadcast_from_rank0(result)
    except BaseException:
        if rank0:
            shutil.rmtree(work, ignore_errors=True)
        raise
