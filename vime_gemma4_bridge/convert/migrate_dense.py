"""``migrate`` for the dense members (31B, E4B, E2B): where each tensor of each layer lives in each layout.

Three layouts (docs/INTERCHANGE.md has them against each other):

* ``ours``: attention stacked per shape (``self_attention_{sliding,global}[_kv_shared]``), the MLP per
  width (``mlp``, ``mlp_double_wide``), the rest over all layers; the input and pre-MLP norms inside
  the linears (``layer_norm_weight``), the post-attention norm inside ``linear_proj``;
* ``upstream``: Megatron-Bridge 0.6.2's ``Gemma4DenseProvider`` (``gemma4_bridge.py`` L439-496 names,
  ``modeling_gemma4.py`` L264-270, L744-776 modules): attention stacked per type, KV-shared layers
  included with a whole ``linear_qkv`` (K and V rows zero, as its load writes them, L390-420) and a
  ``k_layernorm`` (ones, its initial value) that nothing reads; norms at layer level; PLE at model level;
  E2B (``use_double_wide_mlp``) keyed one layer at a time (``hetereogenous_dist_checkpoint``,
  gemma4_provider.py L183-186);
* ``vime-native``: vime @3c06ae51 / slime e734ee75f ``models/gemma4.py``, 31B only (L1035-1047 refuse
  PLE, KV sharing and the double-wide MLP): one key per layer, norms as in its MoE layout.

Each tensor is one HF tensor of one layer on both sides, or — KV-shared attention — a KV group's query
rows of one; nothing inside a row changes, so a rewrite and its inverse are bitwise. What a target
holds and the source lacks is written as the target's own code writes it (zeros, ones, an empty
``_extra_state``); what the source holds and the target lacks (those same tensors) is dropped. dtypes
follow the target's code: upstream holds ``layer_scalar``, the PLE gates and the final norm in float32
(vime-native ``layer_scalar``), the plugin every weight in the model's dtype (the embedding's); float32
to bfloat16 rounds what a bfloat16 cannot hold, as an HF export in the model's dtype would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vime_gemma4_bridge.convert.migrate_units import COMMON_STATE, EMPTY_STATE, OBJECT_SHARD, Unit, split_key
from vime_gemma4_bridge.core.layer_pattern import (
    SLIDING,
    has_double_wide_mlp,
    is_kv_shared_layer,
    layer_group_rank,
)
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError


@dataclass(frozen=True)
class Place:
    """Where one role of one layer lives in a layout: its key, its place on the key's stack axis, and
    ``rows`` — ``(offset, length, total)`` on its first own axis when it is a piece of the tensor."""

    key: str
    stack: tuple[int, int] | None = None
    rows: tuple[int, int, int] | None = None
    #: a role only the target has: what its own code holds there (``0.0``, ``1.0``; ``None``: an object)
    fill: float | None = None
    #: the source role whose dtype and trailing shape a filled tensor takes
    like: str = ""
    #: the dtype this layout's code holds the tensor in when it is not the model's (``None``: the model's)
    dtype: str | None = None


#: Roles whose ``_extra_state`` a TE norm writes (vime-native builds its norms as TE norms; ours and
#: upstream's dense models build none): the state is created, empty, where the source has none.
TE_NORM_ROLES = ("q_norm", "k_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm")
#: Tensors a layout's code holds in float32 whatever the model's dtype (upstream: ``Gemma4RMSNorm`` of the
#: final norm, the PLE gate and projection, the ``layer_scalar`` buffer; vime-native: its ``layer_scalar`` buffer).
FLOAT32_ROLES = {
    "upstream": ("final_norm", "layer_scalar", "ple_gate", "ple_proj"),
    "vime-native": ("layer_scalar",),
    "ours": (),
}
MODEL_ROLES = {
    "ours": {
        "embedding": "embedding.word_embeddings.weight",
        "final_norm": "decoder.final_layernorm.weight",
        "ple_table": "embedding.per_layer_embedding.weight",
        "ple_model_proj": "embedding.per_layer_model_projection.weight",
        "ple_norm": "embedding.per_layer_projection_norm.weight",
    },
    "upstream": {
        "embedding": "embedding.word_embeddings.weight",
        "final_norm": "decoder.final_layernorm.weight",  # float32: FLOAT32_ROLES
        "ple_table": "per_layer_embedding.weight",
        "ple_model_proj": "per_layer_model_proj.weight",
        "ple_model_proj.state": "per_layer_model_proj._extra_state",
        "ple_norm": "per_layer_proj_norm.weight",
    },
    "vime-native": {
        "embedding": "embedding.word_embeddings.weight",
        "final_norm": "decoder.final_layernorm.weight",
        "final_norm.state": "decoder.final_layernorm._extra_state",
    },
}


class DenseModel:
    """The layers of a dense Gemma 4 as its HF text config describes them (types, KV sharing, widths, heads)."""

    def __init__(self, text_config: Mapping[str, Any]) -> None:
        self.config = SimpleNamespace(
            num_layers=int(text_config["num_hidden_layers"]),
            layer_types=list(text_config["layer_types"]),
            num_kv_shared_layers=int(text_config.get("num_kv_shared_layers") or 0),
            use_double_wide_mlp=bool(text_config.get("use_double_wide_mlp")),
        )
        self.ple = bool(text_config.get("hidden_size_per_layer_input"))
        self.heads = int(text_config["num_attention_heads"])
        kv_heads = int(text_config["num_key_value_heads"])
        global_kv = text_config.get("num_global_key_value_heads") if text_config.get("attention_k_eq_v") else None
        self.groups = {"sliding": kv_heads, "global": int(global_kv or kv_heads)}
        self.head_dim = {"sliding": int(text_config["head_dim"]), "global": int(text_config["global_head_dim"])}

    @property
    def layers(self) -> int:
        return self.config.num_layers

    def kind(self, n: int) -> str:
        return "sliding" if self.config.layer_types[n] == SLIDING else "global"

    def shared(self, n: int) -> bool:
        return is_kv_shared_layer(self.config, n + 1)

    def rank(self, n: int, group_of: Any) -> tuple[int, int]:
        return layer_group_rank(self.config, n + 1, lambda number: group_of(number - 1))

    def check_layout(self, layout: str) -> None:
        """Refuse a target the layout's own code cannot build."""
        if layout == "vime-native" and (
            self.ple or self.config.num_kv_shared_layers or self.config.use_double_wide_mlp
        ):
            raise ConversionError(
                "vime's native Gemma 4 builds the 31B dense model only: it refuses per-layer embeddings, KV "
                "sharing and the double-wide MLP (vime @3c06ae51 vime_plugins/models/gemma4.py, slime e734ee75f "
                "L1035-1047)"
            )

    # -- places ------------------------------------------------------------------------------------

    def model_places(self, layout: str) -> dict[str, Place]:
        roles = dict(MODEL_ROLES[layout])
        if not self.ple:
            roles = {role: key for role, key in roles.items() if not role.startswith("ple_")}
        return {role: Place(key, dtype=_dtype(layout, role)) for role, key in roles.items()}

    def layer_places(self, layout: str, n: int) -> dict[str, Place]:
        """Every role of HF layer ``n`` (0-based) in ``layout``."""
        if layout == "ours":
            places = self._ours(n)
        elif layout == "upstream":
            places = self._upstream(n)
        else:
            places = self._native(n)
        if not self.ple:
            places = {role: place for role, place in places.items() if not role.startswith("ple_")}
        return places

    def _query_rows(self, n: int, packed: bool) -> dict[str, tuple[int, int, int]]:
        """Each KV group's query rows in a KV-shared layer's projection: packed with its K and V rows
        (upstream's ``linear_qkv``: per group its queries, K, V) or alone (our ``linear_q``)."""
        kind = self.kind(n)
        groups, d = self.groups[kind], self.head_dim[kind]
        per_group = self.heads // groups * d
        width = per_group + (2 * d if packed else 0)
        rows = {f"q{g}": (g * width, per_group, groups * width) for g in range(groups)}
        if packed:
            rows |= {f"kv{g}": (g * width + per_group, 2 * d, groups * width) for g in range(groups)}
        return rows

    def _ours(self, n: int) -> dict[str, Place]:
        shared = self.shared(n)
        attention = f"self_attention_{self.kind(n)}" + ("_kv_shared" if shared else "")
        stack = self.rank(n, lambda m: (self.kind(m), self.shared(m)))
        a = f"decoder.layers.{attention}."
        linear = a + ("linear_q." if shared else "linear_qkv.")
        places = {
            "input_norm": Place(linear + "layer_norm_weight", stack),
            "qkv.state": Place(linear + "_extra_state", stack),
            "q_norm": Place(a + "q_layernorm.weight", stack),
            "o": Place(a + "linear_proj.weight", stack),
            "o.state": Place(a + "linear_proj._extra_state", stack),
            "post_attn_norm": Place(a + "linear_proj.post_layernorm.weight", stack),
        }
        if shared:
            places |= {role: Place(linear + "weight", stack, rows) for role, rows in self._query_rows(n, False).items()}
        else:
            places |= {"qkv": Place(linear + "weight", stack), "k_norm": Place(a + "k_layernorm.weight", stack)}
        mlp = "mlp_double_wide" if has_double_wide_mlp(self.config, n + 1) else "mlp"
        stack = self.rank(n, lambda m: has_double_wide_mlp(self.config, m + 1))
        m = f"decoder.layers.{mlp}."
        places |= {
            "pre_mlp_norm": Place(m + "linear_fc1.layer_norm_weight", stack),
            "fc1": Place(m + "linear_fc1.weight", stack),
            "fc1.state": Place(m + "linear_fc1._extra_state", stack),
            "fc2": Place(m + "linear_fc2.weight", stack),
            "fc2.state": Place(m + "linear_fc2._extra_state", stack),
        }
        every = (n, self.layers)
        return places | self._layer_level(
            "ours", "decoder.layers.", every, {"post_mlp_norm": "post_ffn_layernorm.weight"}
        )

    def _upstream(self, n: int) -> dict[str, Place]:
        per_layer = self.config.use_double_wide_mlp
        prefix = f"decoder.layers.{n}." if per_layer else "decoder.layers."
        kind = self.kind(n)
        stack = None if per_layer else self.rank(n, self.kind)
        a = f"{prefix}self_attention_{kind}."
        places = {
            "qkv.state": Place(a + "linear_qkv._extra_state", stack),
            "q_norm": Place(a + "q_layernorm.weight", stack),
            "o": Place(a + "linear_proj.weight", stack),
            "o.state": Place(a + "linear_proj._extra_state", stack),
        }
        if self.shared(n):
            for role, rows in self._query_rows(n, True).items():
                fill = 0.0 if role.startswith("kv") else None
                places[role] = Place(a + "linear_qkv.weight", stack, rows, fill=fill, like="q0")
            places["k_norm"] = Place(a + "k_layernorm.weight", stack, fill=1.0, like="q_norm")
        else:
            places |= {"qkv": Place(a + "linear_qkv.weight", stack), "k_norm": Place(a + "k_layernorm.weight", stack)}
        every = None if per_layer else (n, self.layers)
        names = {
            "input_norm": "input_layernorm.weight",
            "post_attn_norm": "post_self_attn_layernorm.weight",
            "pre_mlp_norm": "pre_mlp_layernorm.weight",
            "post_mlp_norm": "post_mlp_layernorm.weight",
            "fc1": "mlp.linear_fc1.weight",
            "fc1.state": "mlp.linear_fc1._extra_state",
            "fc2": "mlp.linear_fc2.weight",
            "fc2.state": "mlp.linear_fc2._extra_state",
        }
        return places | self._layer_level("upstream", prefix, every, names)

    def _native(self, n: int) -> dict[str, Place]:
        names = {
            "input_norm": "self_attention.linear_qkv.layer_norm_weight",
            "qkv": "self_attention.linear_qkv.weight",
            "qkv.state": "self_attention.linear_qkv._extra_state",
            "q_norm": "self_attention.q_layernorm.weight",
            "k_norm": "self_attention.k_layernorm.weight",
            "o": "self_attention.linear_proj.weight",
            "o.state": "self_attention.linear_proj._extra_state",
            "post_attn_norm": "post_attention_layernorm.weight",
            "pre_mlp_norm": "pre_mlp_layernorm.weight",
            "post_mlp_norm": "post_feedforward_layernorm.weight",
            "fc1": "mlp.linear_fc1.weight",
            "fc1.state": "mlp.linear_fc1._extra_state",
            "fc2": "mlp.linear_fc2.weight",
            "fc2.state": "mlp.linear_fc2._extra_state",
        }
        names |= {f"{role}.state": names[role].removesuffix("weight") + "_extra_state" for role in TE_NORM_ROLES}
        return self._layer_level("vime-native", f"decoder.layers.{n}.", None, names)

    def _layer_level(
        self, layout: str, prefix: str, stack: tuple[int, int] | None, names: Mapping[str, str]
    ) -> dict[str, Place]:
        names = {
            **names,
            "layer_scalar": "layer_scalar",
            "ple_gate": "per_layer_input_gate.weight",
            "ple_proj": "per_layer_projection.weight",
            "ple_post_norm": "post_per_layer_input_norm.weight",
        }
        return {role: Place(prefix + name, stack, dtype=_dtype(layout, role)) for role, name in names.items()}


class DensePlan:
    """Every unit of a dense source checkpoint for one target layout (no tensor data read): each stored
    tensor and object of the language model found by its key among the source layout's places, moved
    to the target's place of the same role; the target's roles the source lacks created."""

    def __init__(self, checkpoint: Any, to: str, text_config: Mapping[str, Any] | None, stored: Mapping) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from vime_gemma4_bridge.io.torch_dist_layout import is_vision_language

        if text_config is None:
            raise ConversionError(
                f"torch_dist checkpoint {checkpoint.path} holds a dense Gemma 4: pass --hf-checkpoint (its layer "
                "types, KV sharing and heads place each tensor)"
            )
        self.model, self.to = DenseModel(text_config), to
        self.model.check_layout(to)
        self.given = dict(text_config)
        self.types = [self.model.kind(n) for n in range(self.model.layers)]
        self.vision_language = is_vision_language(stored)
        keys = [split[1] for key in stored if (split := split_key(key))]
        self.source = (
            "upstream"
            if any(".post_self_attn_layernorm." in key for key in keys)
            else "vime-native"
            if any(key.startswith("decoder.layers.0.") for key in keys)
            else "ours"
        )
        if self.source == "vime-native":
            self.model.check_layout("vime-native")
        source, target = self._places(self.source), self._places(to)
        by_key: dict[str, list[tuple[int, str, Place]]] = {}
        for (n, role), place in source.items():
            by_key.setdefault(place.key, []).append((n, role, place))
        embedding = next(
            meta for key, meta in stored.items() if split_key(key) == ("", "embedding.word_embeddings.weight")
        )
        self.model_dtype = embedding.properties.dtype
        self.units: list[Any] = []
        covered: dict[str, set[tuple[int, str]]] = {}
        dtypes: dict[tuple[str, int, str], tuple[Any, tuple[int, ...]]] = {}
        for key, meta in stored.items():
            split = split_key(key.split("/")[0])
            if split is None:  # RNG, towers, ...: copied as they are
                if isinstance(meta, TensorStorageMetadata):
                    self.units.append(Unit(key, key, None, None, tuple(meta.size), meta.properties.dtype))
                elif (match := OBJECT_SHARD.match(key)) and match.group(1) != COMMON_STATE:
                    self.units.append(Unit(match.group(1), match.group(1), None, None, object_at=_object_at(match)))
                continue
            prefix, model_key = split
            if not isinstance(meta, TensorStorageMetadata):
                match = OBJECT_SHARD.match(key)
                if match is None or not model_key.split("/")[0].endswith("._extra_state"):
                    raise ConversionError(f"torch_dist item {key} of {checkpoint.path} is no megatron-core object")
                offset, found = _object_at(match)[0], by_key.get(model_key.split("/")[0])
                if found is None:
                    raise ConversionError(
                        f"torch_dist item {model_key} is no object of a Gemma 4 dense model in the {self.source} "
                        "layout (docs/INTERCHANGE.md): the checkpoint holds another model"
                    )
                for n, role, place in found:
                    if place.stack is None or offset[0] == place.stack[0]:
                        covered.setdefault(prefix, set()).add((n, role))
                        if (n, role) in target:
                            goal = target[(n, role)]
                            self.units.append(
                                Unit(
                                    match.group(1),
                                    prefix + goal.key,
                                    place.stack,
                                    goal.stack,
                                    layer=n,
                                    object_at=((), ()),
                                )
                            )
                continue
            found = by_key.get(model_key)
            if found is None:
                raise ConversionError(
                    f"torch_dist key {model_key} is no tensor of a Gemma 4 dense model in the {self.source} layout "
                    "(docs/INTERCHANGE.md): the checkpoint holds another model, or another model's --hf-checkpoint"
                )
            size = tuple(meta.size)
            for n, role, place in found:
                own = size[1:] if place.stack else size
                if place.rows:
                    own = (place.rows[1], *own[1:])
                dtypes[(prefix, n, role)] = (meta.properties.dtype, own)
                covered.setdefault(prefix, set()).add((n, role))
                if (n, role) in target:
                    goal = target[(n, role)]
                    self.units.append(
                        Unit(
                            key,
                            prefix + goal.key,
                            place.stack,
                            goal.stack,
                            own,
                            meta.properties.dtype,
                            layer=n,
                            source_rows=place.rows,
                            target_rows=goal.rows,
                            target_dtype=None if prefix else self._dtype(goal),
                        )
                    )
        for prefix, roles in covered.items():
            for (n, role), goal in target.items():
                if (n, role) in roles:
                    continue
                if role.endswith(".state"):
                    if prefix:
                        continue  # optimizer state holds no objects
                    fill = EMPTY_STATE if role.removesuffix(".state") in TE_NORM_ROLES + ("final_norm",) else None
                    self.units.append(Unit("", goal.key, None, goal.stack, layer=n, object_at=((), ()), fill=fill))
                    continue
                if prefix and (prefix, n, goal.like) not in dtypes:
                    continue  # no optimizer state for a frozen weight (``layer_scalar``) or a buffer
                if goal.fill is None or (prefix, n, goal.like) not in dtypes:
                    raise ConversionError(
                        f"torch_dist checkpoint {checkpoint.path} ({self.source} layout) lacks "
                        f"{f'layer {n}' if n >= 0 else 'the model'}'s {role} ({prefix}{goal.key} in the {to} layout)"
                    )
                dtype, like = dtypes[(prefix, n, goal.like)]
                dtype = dtype if prefix else self._dtype(goal)
                shape = (goal.rows[1], *like[1:]) if goal.rows else like
                value = goal.fill if not prefix or "fp32_param" in prefix else 0.0  # Adam's moments start at 0
                self.units.append(
                    Unit(
                        "",
                        prefix + goal.key,
                        None,
                        goal.stack,
                        shape,
                        dtype,
                        layer=n,
                        target_rows=goal.rows,
                        fill=value,
                    )
                )

    def _dtype(self, place: Place) -> Any:
        """The dtype the target's code holds a model tensor in."""
        import torch

        return torch.float32 if place.dtype == "float32" else self.model_dtype

    def _places(self, layout: str) -> dict[tuple[int, str], Place]:
        places = {(-1, role): place for role, place in self.model.model_places(layout).items()}
        for n in range(self.model.layers):
            places |= {(n, role): place for role, place in self.model.layer_places(layout, n).items()}
        return places


def _dtype(layout: str, role: str) -> str | None:
    return "float32" if role in FLOAT32_ROLES[layout] else None


def _object_at(match: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(int(x) for x in match.group(2).split(".")), tuple(int(x) for x in match.group(3).split("."))
