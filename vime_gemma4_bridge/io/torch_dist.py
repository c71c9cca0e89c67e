"""torch_dist checkpoints on disk: the layout Megatron reads, checked before any rank starts, saved and loaded.

Layout written by ``import`` (what Megatron-LM's and Megatron-Bridge's ``--load`` read)::

    DIR/latest_checkpointed_iteration.txt   "0"
    DIR/iter_0000000/                       torch_dist files (metadata.json, .metadata, __<rank>_0.distcp);
                                            common state {checkpoint_version: 3.0, iteration: 0} and the same
                                            content metadata as Megatron-Bridge's checkpoints
    DIR/iter_0000000/run_config.yaml        {model: <provider>} in Megatron-Bridge's run-config format
    DIR/iter_0000000/vime_gemma4.json       the source's HF config and language-model tensor names/shapes/dtypes

The checkpoint holds model weights only (no optimizer or RNG state), like Megatron-Bridge's
``save_megatron_model`` output: training from it needs ``--no-load-optim --no-load-rng`` (or ``--finetune``).
``run_config.yaml`` lets Megatron-Bridge's ``load_megatron_model`` rebuild the model without hand-written
configuration; its ``_target_`` entries name this package (``Gemma4TextModelProvider``, the layer-spec
function ``gemma4_block_spec``), which Megatron-Bridge instantiates only after
:func:`allow_run_config_targets` (:func:`provider_from_run_config` calls it; it is not called on import,
which would import Megatron-Bridge and slow down every refusal). ``vime_gemma4.json`` is what ``export``
checks, before any rank starts, that ``--hf-checkpoint`` describes the same model
(:meth:`TorchDistCheckpoint.check_matches`).

Why megatron-core's ``dist_checkpointing.save/load`` with ``model.sharded_state_dict()`` rather than
Megatron-Bridge's ``save_megatron_model`` / ``load_megatron_model``: both live in
``megatron.bridge.training``, whose ``checkpointing`` module imports nvidia-modelopt at module level and
whose config imports ``datasets`` / tensorboard (training dependencies, absent from a conversion
environment); ``save_megatron_model`` then runs the training ``save_checkpoint``, which calls
``torch.cuda.get_rng_state()`` unconditionally; and ``load_megatron_model`` rebuilds the model from the run
config with its own wrapping instead of this plugin's one model-building path (:func:`convert.build_model`).
What they do underneath is kept: the same ``sharded_state_dict`` metadata
(``_build_sharded_state_dict_metadata``), ``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy``,
the same directory layout and run config (docs/UPSTREAM.md, entry 17). megatron-core's torch_dist writer
itself calls CUDA on CPU-only hosts; :func:`~vime_gemma4_bridge.compat.cuda.cpu_checkpointing` covers that
(entry 16). torch_dist stores every tensor as a *global* tensor (each rank's shard knows its global shape
and offset), so megatron-core's ``dist_checkpointing`` reshards on load and no resharding code lives here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.compat.cuda import cpu_checkpointing
from vime_gemma4_bridge.compat.write_results import in_process_write_results
from vime_gemma4_bridge.core.hf_layout import text_config_dict
from vime_gemma4_bridge.io.torch_dist_layout import (
    EXTRA_STATE,
    NON_MODEL_KEY,
    TOWER_KEY,
    UPSTREAM_TE_NORM_STATE,
    ConversionError,
    foreign_layout,
    is_vision_language,
    refuse_unused_keys,
    sharded_state_dict,
    upstream_te_norm_states,
)

__all__ = [
    "ITERATION",
    "ITERATION_DIR",
    "RUN_CONFIG_NAME",
    "SIDECAR_FORMAT",
    "SIDECAR_NAME",
    "SIDECAR_VERSION",
    "TRACKER_NAME",
    "ConversionError",
    "TorchDistCheckpoint",
    "allow_run_config_targets",
    "load_torch_dist",
    "provider_from_run_config",
    "save_torch_dist",
    "write_run_config",
]

#: Megatron's tracker file: the iteration ``--load`` resumes from.
TRACKER_NAME = "latest_checkpointed_iteration.txt"
#: The one iteration a converted checkpoint has (Megatron's ``iter_{:07d}``).
ITERATION = 0
ITERATION_DIR = f"iter_{ITERATION:07d}"
#: Megatron-Bridge's run config (``get_checkpoint_run_config_filename``).
RUN_CONFIG_NAME = "run_config.yaml"
#: What ``export`` checks against ``--hf-checkpoint`` before it starts ranks.
SIDECAR_NAME = "vime_gemma4.json"
SIDECAR_FORMAT = "vime-gemma4-torch-dist"
SIDECAR_VERSION = 1
#: Megatron checkpoint version written in the common state (Megatron-LM and Megatron-Bridge write 3.0).
CHECKPOINT_VERSION = 3.0


def allow_run_config_targets() -> None:
    """Let Megatron-Bridge instantiate this package's classes and functions named in a ``run_config.yaml``.

    Megatron-Bridge refuses ``_target_`` entries outside an allow-list (``megatron.``, ``torch.``, ...);
    a checkpoint written by ``import`` names ``vime_gemma4_bridge.provider.Gemma4TextModelProvider`` and
    its layer-spec function. Idempotent.
    """
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    register_allowed_target_prefix("vime_gemma4_bridge.")


class TorchDistCheckpoint:
    """A torch_dist checkpoint on disk, checked before any rank starts.

    ``path`` is a checkpoint directory with Megatron's tracker file (``--save`` of ``import``, or a
    training run's save directory) or one ``iter_*`` directory. Only metadata files are read.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ConversionError(f"torch_dist checkpoint {self.path} is not a directory; pass the DIR import wrote")
        tracker = self.path / TRACKER_NAME
        if tracker.is_file():
            text = tracker.read_text().strip()
            if text == "release":
                name = "release"
            elif text.isdigit():
                name = f"iter_{int(text):07d}"
            else:
                raise ConversionError(f"{tracker} holds {text!r}, not an iteration number; the checkpoint is damaged")
            self.iteration_dir = self.path / name
        elif (self.path / "metadata.json").is_file():
            self.iteration_dir = self.path  # an iteration directory given directly
        else:
            raise ConversionError(
                f"{self.path} is not a torch_dist checkpoint (no {TRACKER_NAME}); create one with vime-gemma4 import"
            )
        meta_file = self.iteration_dir / "metadata.json"
        if not meta_file.is_file():
            raise ConversionError(f"{self.iteration_dir} has no metadata.json; the checkpoint is incomplete or damaged")
        try:
            meta = json.loads(meta_file.read_text())
        except json.JSONDecodeError as error:
            raise ConversionError(f"{meta_file} is not valid JSON ({error}); the checkpoint is damaged") from None
        if meta.get("sharded_backend") != "torch_dist":
            raise ConversionError(
                f"{self.iteration_dir} is a {meta.get('sharded_backend')!r} checkpoint, not torch_dist; "
                "convert it to torch_dist with Megatron first"
            )
        if not (self.iteration_dir / ".metadata").is_file():
            raise ConversionError(f"{self.iteration_dir} has no .metadata; the checkpoint is incomplete or damaged")
        self.sidecar: dict | None = None
        sidecar_file = self.iteration_dir / SIDECAR_NAME
        if sidecar_file.is_file():
            try:
                self.sidecar = json.loads(sidecar_file.read_text())
            except json.JSONDecodeError as error:
                raise ConversionError(f"{sidecar_file} is no JSON ({error}); the checkpoint is damaged") from None

    def check_files(self) -> None:
        """Refuse a checkpoint whose files are missing, truncated or could run code (no tensor data read).

        PyTorch's checkpoint metadata records, for every stored item, the file and byte range that hold
        it; a missing or truncated ``.distcp`` file is found here, in one line naming the file and a
        tensor it should hold, before any rank starts. Every pickle megatron-core or PyTorch would
        unpickle (``.metadata``, each item of the ``.distcp`` files, any ``*.pt`` beside them) and the
        run config go through :mod:`vime_gemma4_bridge.io.safe_pickle`'s allow-list first.
        """
        from vime_gemma4_bridge.io.safe_pickle import check_archive, check_archives, read_checkpoint_metadata

        metadata = read_checkpoint_metadata(self.iteration_dir)  # refuses a .metadata that could run code
        needed: dict[str, tuple[int, str]] = {}
        items: dict[str, list[tuple[str, int, int]]] = {}
        for index, info in metadata.storage_data.items():
            end = info.offset + info.length
            if end > needed.get(info.relative_path, (0, ""))[0]:
                needed[info.relative_path] = (end, index.fqn)
            items.setdefault(info.relative_path, []).append((index.fqn, info.offset, info.length))
        self._check_data_files(needed)
        for relative_path, stored in sorted(items.items()):
            check_archives(self.iteration_dir / relative_path, sorted(stored, key=lambda item: item[1]))
        for archive in sorted({*self.iteration_dir.glob("*.pt"), *self.path.glob("*.pt")}):
            check_archive(archive)  # common.pt (megatron-core prefers it to common_state), train_state.pt
        self._check_run_config()

    def check_layout(self) -> None:
        """Refuse (one line, naming the layout and what to do) a layout the plugin's model does not load.

        Call :meth:`check_files` first: it vets the ``.metadata`` this reads.
        """
        from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

        layout = foreign_layout(read_checkpoint_metadata(self.iteration_dir).state_dict_metadata)
        if layout is not None:
            raise ConversionError(
                f"torch_dist checkpoint {self.path} is in the layout of {layout} (docs/INTERCHANGE.md)"
            )

    def vision_language(self) -> bool:
        """Whether the checkpoint is in the layout of Megatron-Bridge's ``Gemma4VLModel`` (``language_model.*``)."""
        from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

        return is_vision_language(read_checkpoint_metadata(self.iteration_dir).state_dict_metadata)

    def _check_data_files(self, needed: Mapping[str, tuple[int, str]]) -> None:
        for relative_path, (end, key) in sorted(needed.items()):
            file = self.iteration_dir / relative_path
            if not file.is_file():
                raise ConversionError(
                    f"torch_dist checkpoint {self.path} is damaged: {file.name} is missing (it holds {key}); "
                    "re-create it with vime-gemma4 import"
                )
            size = file.stat().st_size
            if size < end:
                raise ConversionError(
                    f"torch_dist checkpoint {self.path} is damaged: {file.name} is truncated ({size:,} of at least "
                    f"{end:,} bytes; {key} is past its end); re-create it with vime-gemma4 import"
                )

    def _check_run_config(self) -> None:
        """``run_config.yaml`` is plain YAML: a tag that constructs Python objects is refused, never built."""
        path = self.iteration_dir / RUN_CONFIG_NAME
        if path.is_file():
            _read_run_config(path)

    def check_matches(self, source: Any) -> None:
        """Refuse (one line) if ``source`` (an :class:`~vime_gemma4_bridge.io.hf.HFCheckpoint`) is another model.

        With ``vime_gemma4.json`` (written by ``import``) every language-model tensor's name, shape and
        dtype must agree; without it the architecture fields of ``run_config.yaml`` (Megatron-Bridge's
        training) are compared, else those of the ``args`` Megatron-LM's ``save_checkpoint`` keeps in the
        common state (vime's and miles' training). Ranks check every tensor again when loading. A
        vision-language checkpoint's towers must each have their place in ``source`` (:meth:`carried_towers`).
        Call :meth:`check_files` first: it vets the pickles this reads.
        """
        hint = "pass the HF checkpoint it was imported or trained from (or one with the same architecture)"
        self.carried_towers(source)
        if self.sidecar is not None:
            _check_text_config(self.sidecar.get("hf_config") or {}, source.config, self.path, source.path, hint)
            ours = self.sidecar.get("language_model") or {}
            theirs = source.signatures(source.language_model_names())
            for name in sorted(set(ours) | set(theirs)):
                if name not in theirs:
                    raise ConversionError(
                        f"torch_dist checkpoint {self.path} holds a different model than {source.path}: "
                        f"{name} is in the checkpoint but not in the HF checkpoint; {hint}"
                    )
                if name not in ours:
                    raise ConversionError(
                        f"torch_dist checkpoint {self.path} holds a different model than {source.path}: "
                        f"{name} is in the HF checkpoint but not in the torch_dist checkpoint; {hint}"
                    )
                if list(ours[name]) != list(theirs[name]):
                    (shape_a, dtype_a), (shape_b, dtype_b) = ours[name], theirs[name]
                    raise ConversionError(
                        f"torch_dist checkpoint {self.path} holds a different model than {source.path}: {name} is "
                        f"{dtype_a}{shape_a} there and {dtype_b}{shape_b} here; {hint}"
                    )
            return
        run_config = self.iteration_dir / RUN_CONFIG_NAME
        if run_config.is_file():
            _check_run_config(run_config, source.config, self.path, source.path, hint)
            return
        args = self.training_args()
        if args is not None:
            _check_fields(args, _TRAINING_ARGS, source.config, self.path, source.path, hint)

    def carried_towers(self, source: Any) -> dict[str, str]:
        """``{torch_dist key: HF name}`` of the tower tensors a vision-language checkpoint holds (:data:`TOWER_KEY`).

        They are not the language model's and go to the HF output in place of ``source``'s own (a
        training run may have changed them), so each must be a tensor of ``source`` (``model.<key>``,
        outside the language model) with the same shape and dtype: else one line says which.
        """
        from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

        stored = read_checkpoint_metadata(self.iteration_dir).state_dict_metadata
        others = set(source.names()) - set(source.language_model_names())
        tensors = [key for key, meta in stored.items() if hasattr(meta, "size")]  # not objects
        carried = {key: f"model.{key}" for key in tensors if TOWER_KEY.match(key)}
        for key, name in sorted(carried.items()):
            if name not in others:
                raise ConversionError(
                    f"torch_dist checkpoint {self.path} holds the tower tensor {key} and {source.path} has no {name} "
                    "to carry it to: pass the vision-language HF checkpoint the run started from"
                )
        locations = source.locations(carried.values())
        for key, name in sorted(carried.items()):
            location, meta = locations[name], stored[key]
            if list(location.shape) != list(meta.size) or location.dtype != meta.properties.dtype:
                raise ConversionError(
                    f"torch_dist checkpoint {self.path} holds {key} as {meta.properties.dtype}{list(meta.size)} and "
                    f"{source.path} {name} as {location.dtype}{list(location.shape)}: pass the vision-language HF "
                    "checkpoint the run started from"
                )
        return carried

    def common_state(self) -> dict[str, Any]:
        """The common state (args, iteration, content metadata), as Megatron-LM's ``load_checkpoint`` reads it."""
        from megatron.core import dist_checkpointing

        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
            warnings.simplefilter("ignore", UserWarning)
            return dist_checkpointing.load_common_state_dict(str(self.iteration_dir))

    def training_args(self) -> dict[str, Any] | None:
        """The ``args`` of a Megatron-LM training checkpoint (those set); ``None`` after ``import``."""
        args = self.common_state().get("args")
        return None if args is None else {name: value for name, value in vars(args).items() if value is not None}

    def positional_optimizer(self) -> str | None:
        """The format of the distributed-optimizer state held keyed by position (``dp_reshardable``, Megatron-LM's
        default; ``dp_zero_gather_scatter`` without content metadata), or ``None`` (name-keyed or none: Megatron-LM
        ``training/checkpointing.py`` L2219-2245 tells them apart so)."""
        from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

        common = self.common_state()
        sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
        if sharding in NAME_KEYED_OPTIMIZER:
            return None
        stored = read_checkpoint_metadata(self.iteration_dir).state_dict_metadata
        distributed = getattr(common.get("args"), "use_distributed_optimizer", False) or any(
            ".optimizer.distributed." in f".{key}" for key in stored
        )
        has_state = any(NON_MODEL_KEY.search(key) and "optimizer" in key for key in stored)
        return (sharding or "dp_zero_gather_scatter") if distributed and has_state else None

    def optimizer_order_hazard(self) -> str | None:
        """Why resuming this checkpoint's optimizer state into the plugin's model would misplace it, or ``None``:
        upstream Megatron-Bridge's Gemma 4 orders the router's scales and the post-FFN / pre-shared-expert
        norms otherwise (docs/INTERCHANGE.md), so its positional state would load with Adam's moments on the
        wrong tensors. Its TE norms' ``_extra_state`` objects mark the writer: the plugin's model writes none.
        """
        from vime_gemma4_bridge.io.safe_pickle import read_checkpoint_metadata

        sharding = self.positional_optimizer()
        if sharding is None:
            return None
        stored = read_checkpoint_metadata(self.iteration_dir).state_dict_metadata
        if not any(UPSTREAM_TE_NORM_STATE.match(key) for key in stored):
            return None  # written by the plugin's own model: its parameter order
        return (
            f"{self.path} holds distributed-optimizer state in the {sharding} format, "
            "keyed by parameter position, written by upstream Megatron-Bridge's Gemma 4, which orders the router's "
            "scales and the post-FFN / pre-shared-expert norms otherwise than this model: resuming would put "
            "Adam's moments on the wrong tensors. Resume with --no-load-optim, or re-save it with "
            "--dist-ckpt-optim-fully-reshardable (keyed by name)"
        )


#: megatron-core's distributed-optimizer formats that key optimizer state by parameter name.
NAME_KEYED_OPTIMIZER = ("fully_reshardable", "fully_sharded_model_space")

#: HF text-config fields that fix the Megatron model's shape and layer layout.
_TEXT_CONFIG_FIELDS = (
    "num_hidden_layers",
    "layer_types",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_global_key_value_heads",
    "attention_k_eq_v",
    "head_dim",
    "global_head_dim",
    "enable_moe_block",
    "num_experts",
    "moe_intermediate_size",
    "vocab_size",
    "hidden_size_per_layer_input",
    "num_kv_shared_layers",
    "tie_word_embeddings",
)


def _check_text_config(saved: Mapping, config: Mapping, ckpt: Path, hf: Path, hint: str) -> None:
    """The recorded HF config and ``config`` agree on every field that shapes the Megatron model."""
    ours, theirs = text_config_dict(saved), text_config_dict(config)
    for field in _TEXT_CONFIG_FIELDS:
        if ours.get(field) != theirs.get(field):
            raise ConversionError(
                f"torch_dist checkpoint {ckpt} holds a different model than {hf}: {field} is {ours.get(field)!r} "
                f"there and {theirs.get(field)!r} here; {hint}"
            )


#: run_config.yaml model field -> HF text-config field, for checkpoints without vime_gemma4.json.
_ARCHITECTURE_FIELDS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "ffn_hidden_size": "intermediate_size",
    "num_moe_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "vocab_size": "vocab_size",
}


#: Megatron-LM argument (``--num-layers`` ...) -> HF text-config field, for training checkpoints' ``args``.
#: miles passes these for Gemma 4 (tests/snapshots/model_args/gemma-4-26b-a4b-it.txt @31f1ca96).
_TRAINING_ARGS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_experts": "num_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "vocab_size": "vocab_size",
}


def _check_run_config(run_config: Path, hf_config: Mapping, ckpt: Path, hf: Path, hint: str) -> None:
    model = _read_run_config(run_config).get("model") or {}
    _check_fields(model, _ARCHITECTURE_FIELDS, hf_config, ckpt, hf, hint)


def _check_fields(
    saved: Mapping[str, Any], fields: Mapping[str, str], hf_config: Mapping, ckpt: Path, hf: Path, hint: str
) -> None:
    """Every Megatron field ``saved`` holds equals its HF text-config field."""
    text = text_config_dict(hf_config)
    for megatron_field, hf_field in fields.items():
        if megatron_field not in saved or hf_field not in text:
            continue
        ours, theirs = saved[megatron_field], text[hf_field]
        if hf_field == "num_experts" and not text.get("enable_moe_block"):
            theirs = None
        if ours != theirs:
            raise ConversionError(
                f"torch_dist checkpoint {ckpt} holds a different model than {hf}: {megatron_field} is {ours} "
                f"there and {hf_field} is {theirs} here; {hint}"
            )


def _read_run_config(path: Path) -> dict:
    """A run config read as plain data (``yaml.safe_load``): one line for a hostile or damaged file."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except yaml.constructor.ConstructorError as error:
        from vime_gemma4_bridge.io.safe_pickle import UnsafeCheckpoint

        raise UnsafeCheckpoint(
            f"{path} refused: it names the YAML tag {error.problem.split()[-1] if error.problem else '?'}, which "
            "builds Python objects and a run config never holds; do not use this checkpoint, re-create it with "
            "vime-gemma4 import"
        ) from None
    except yaml.YAMLError as error:
        raise ConversionError(f"{path} is not valid YAML ({error}); the checkpoint is damaged") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds a {type(config).__name__}, not a run config; the checkpoint is damaged")
    return config


def save_torch_dist(model: list, iteration_dir: str | os.PathLike, *, leave_out: Collection[str] = ()) -> None:
    """Save the model chunks of every rank as one torch_dist checkpoint (collective; the directory exists).

    ``leave_out`` names parameters (of a one-chunk model) whose items the caller writes itself
    (:mod:`vime_gemma4_bridge.convert.stream_import`); their modules' other entries are saved as usual.
    A MoE model's save also holds the ``_extra_state`` objects of the norms upstream Megatron-Bridge's Gemma 4
    builds with Transformer Engine (:func:`upstream_te_norm_states`), so that its default-strict load takes
    the checkpoint; the plugin's own loads ignore them.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.utils import get_model_config

    state, metadata = sharded_state_dict(model)
    if get_model_config(model[0]).num_moe_experts:  # what upstream's Gemma 4 MoE model asks for besides ours
        for chunk in [key for key in state if key.startswith("model")]:
            state[chunk] = {**state[chunk], **upstream_te_norm_states(state[chunk])}
    if leave_out:
        state["model"] = {name: value for name, value in state["model"].items() if name not in leave_out}
    state["checkpoint_version"] = CHECKPOINT_VERSION
    state["iteration"] = ITERATION
    # The synchronous path goes through megatron-core's deprecated "mcore" async writer and warns on every rank.
    quiet = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with cpu_checkpointing(), in_process_write_results():
            dist_checkpointing.save(
                state,
                str(iteration_dir),
                TorchDistSaveShardedStrategy("torch_dist", 1),
                validate_access_integrity=True,
                content_metadata=seams.serializable_content_metadata(metadata),
            )
    except BaseException as error:  # PyTorch's CheckpointException is a BaseException
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        raise ConversionError(f"writing torch_dist to {iteration_dir} failed: {write_failure(iteration_dir)}") from None
    finally:
        quiet.setLevel(level)


def write_failure(directory: Path) -> str:
    """Why a write into ``directory`` failed, as far as the file system tells (the writer's errors do not)."""
    probe = directory / ".vime-gemma4-write-probe"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * 65536)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        return f"{error.strerror} ({directory})"
    finally:
        probe.unlink(missing_ok=True)
    free = shutil.disk_usage(directory).free
    return (
        f"the torch_dist writer failed with {free:,} bytes free on that file system (run with --debug for its errors)"
    )


def load_torch_dist(
    model: list, iteration_dir: str | os.PathLike, *, streamed: Mapping[str, Sequence[str]] | None = None
) -> None:
    """Load a torch_dist checkpoint into the model chunks of every rank (collective), at any topology.

    Every tensor this model needs must be in the checkpoint with the same global shape and dtype, and
    every model tensor of the checkpoint must be used; otherwise :class:`ConversionError` names the
    first difference. ``_extra_state`` entries (FP8 metadata of TE modules) are not loaded, as in
    Megatron-Bridge's ``_load_model_weights_from_checkpoint``.

    ``streamed`` maps modules (state-dict prefixes of a one-chunk model) whose weights the caller
    reads itself to the torch_dist keys they use (:mod:`vime_gemma4_bridge.convert.stream_export`): their
    entries are left out of the load and those keys count as used.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.dist_checkpointing.validation import StrictHandling

    where = str(iteration_dir)
    saved = dist_checkpointing.load_tensors_metadata(where)
    state, _ = sharded_state_dict(model, stored=saved.keys())
    streamed = streamed or {}
    if streamed:
        state["model"] = {
            name: value for name, value in state["model"].items() if name.rpartition(".")[0] not in streamed
        }
    for sharded in nested_values(state):
        if not isinstance(sharded, ShardedTensor) or sharded.key not in saved:
            continue  # factories and objects: checked by dist_checkpointing itself
        stored = saved[sharded.key]
        if tuple(stored.global_shape) != tuple(sharded.global_shape) and not sharded.allow_shape_mismatch:
            raise ConversionError(
                f"torch_dist tensor {sharded.key} has shape {list(stored.global_shape)} but this model needs "
                f"{list(sharded.global_shape)}: the checkpoint holds a different model than --hf-checkpoint"
            )
        if stored.dtype != sharded.dtype:
            raise ConversionError(
                f"torch_dist tensor {sharded.key} is {stored.dtype} but this model is {sharded.dtype}: the checkpoint "
                "was saved from a checkpoint of another dtype than --hf-checkpoint"
            )
    with cpu_checkpointing():
        loaded, unused, absent = dist_checkpointing.load(
            state,
            where,
            TorchDistLoadShardedStrategy(),
            strict=StrictHandling.RETURN_ALL,
        )
    absent = sorted(key for key in absent if not EXTRA_STATE.search(key))
    if absent:
        raise ConversionError(
            f"torch_dist checkpoint lacks {len(absent)} tensor(s) this model needs (e.g. {absent[0]}): "
            "it holds a different model than --hf-checkpoint"
        )
    used_elsewhere = {key for keys in streamed.values() for key in keys}
    refuse_unused_keys(key for key in unused if key not in used_elsewhere)
    for i, chunk in enumerate(model):
        key = "model" if len(model) == 1 else f"model{i}"
        weights = {name: value for name, value in loaded[key].items() if not EXTRA_STATE.search(name)}
        result = chunk.load_state_dict(weights, strict=False)
        wrong = [
            name
            for name in result.missing_keys + result.unexpected_keys
            if not EXTRA_STATE.search(name) and name.rpartition(".")[0] not in streamed
        ]
        if wrong:
            raise ConversionError(f"torch_dist weights do not fit the model: {wrong[:3]} ({len(wrong)} in all)")


def write_run_config(provider: Any, path: Path) -> None:
    """``{model: provider}`` in Megatron-Bridge's run-config format (``ConfigContainer.to_yaml``)."""
    import yaml
    from megatron.training.config.yaml_utils import safe_yaml_representers

    model = seams.run_config_dict(provider)
    with safe_yaml_representers():
        path.write_text(yaml.safe_dump({"model": model}, default_flow_style=False))


def provider_from_run_config(iteration_dir: str | os.PathLike) -> Any:
    """The model provider a ``run_config.yaml`` describes, as Megatron-Bridge's ``load_model_config`` builds it."""
    from megatron.bridge.utils.instantiate_utils import instantiate

    allow_run_config_targets()
    return instantiate(_read_run_config(Path(iteration_dir) / RUN_CONFIG_NAME)["model"])
