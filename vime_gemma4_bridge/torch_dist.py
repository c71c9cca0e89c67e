"""``vime-gemma4 import`` / ``export``: one-shot HF ↔ Megatron torch_dist conversion, at any topology.

``import`` loads a Gemma 4 HF checkpoint into the Megatron model at a TP/PP/VPP/EP/ETP topology
(Megatron-Bridge's ``load_hf_weights``) and saves it as a torch_dist checkpoint. ``export`` builds the
model at any valid topology — not necessarily the one it was saved at — loads the torch_dist
checkpoint into it and writes a complete HF checkpoint through Megatron-Bridge's ``export_hf_weights``
(config, tokenizer and non-language tensors copied from ``--hf-checkpoint``); at the default
topology the routed experts bypass the model (:mod:`vime_gemma4_bridge.stream_export`). torch_dist stores every
tensor as a *global* tensor (each rank's shard knows its global shape and offset), so megatron-core's
``dist_checkpointing`` reshards on load and no resharding code lives here.

Layout written (what Megatron-LM's and Megatron-Bridge's ``--load`` read)::

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
checks, before any rank starts, that ``--hf-checkpoint`` describes the same model.

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
itself calls CUDA on CPU-only hosts; :func:`_cpu_checkpointing` covers that (entry 16).

Outputs are assembled in a hidden temporary sibling (``.DIR.partial-<id>``) and renamed into place when
complete, so an interrupted run never leaves anything at ``DIR`` / ``OUT``; sources are only read. Every
refusal that can be decided from the command line and the files on disk happens before ranks start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.convert.topology import Topology
from vime_gemma4_bridge.runtime.launch import add_launch_arguments, is_reporting_process, launch, requested_world_size
from vime_gemma4_bridge.torch_dist_layout import EXTRA_STATE, ConversionError, refuse_unused_keys, sharded_state_dict

__all__ = [
    "ITERATION_DIR",
    "RUN_CONFIG_NAME",
    "SIDECAR_NAME",
    "TRACKER_NAME",
    "ConversionError",
    "TorchDistCheckpoint",
    "add_parsers",
    "allow_run_config_targets",
    "export_job",
    "import_job",
    "load_torch_dist",
    "main_export",
    "main_import",
    "provider_from_run_config",
    "save_torch_dist",
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


# --------------------------------------------------------------------------------------------
# Megatron-Bridge's instantiate allow-list
# --------------------------------------------------------------------------------------------


def allow_run_config_targets() -> None:
    """Let Megatron-Bridge instantiate this package's classes and functions named in a ``run_config.yaml``.

    Megatron-Bridge refuses ``_target_`` entries outside an allow-list (``megatron.``, ``torch.``, ...);
    a checkpoint written by ``import`` names ``vime_gemma4_bridge.provider.Gemma4TextModelProvider`` and
    its layer-spec function. Idempotent.
    """
    from megatron.bridge.utils.instantiate_utils import register_allowed_target_prefix

    register_allowed_target_prefix("vime_gemma4_bridge.")


# --------------------------------------------------------------------------------------------
# Checks before launch: sources, outputs, the torch_dist checkpoint
# --------------------------------------------------------------------------------------------


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
        """Refuse a checkpoint whose data files are missing or shorter than its metadata says (no data read).

        PyTorch's checkpoint metadata records, for every stored item, the file and byte range that hold
        it; a missing or truncated ``.distcp`` file is found here, in one line naming the file and a
        tensor it should hold, before any rank starts.
        """
        from torch.distributed.checkpoint import FileSystemReader

        try:
            metadata = FileSystemReader(str(self.iteration_dir)).read_metadata()
        except Exception as error:  # noqa: BLE001 (pickle, EOF or OS errors of a damaged .metadata)
            raise ConversionError(
                f"{self.iteration_dir / '.metadata'} is unreadable ({type(error).__name__}: {error}); "
                "the checkpoint is damaged: re-create it with vime-gemma4 import"
            ) from None
        needed: dict[str, tuple[int, str]] = {}
        for index, info in metadata.storage_data.items():
            end = info.offset + info.length
            if end > needed.get(info.relative_path, (0, ""))[0]:
                needed[info.relative_path] = (end, index.fqn)
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

    def check_matches(self, source: Any) -> None:
        """Refuse (one line) if ``source`` (an :class:`~vime_gemma4_bridge.hf_io.HFCheckpoint`) is another model.

        With ``vime_gemma4.json`` (written by ``import``) every language-model tensor's name, shape and
        dtype must agree; without it (e.g. a training checkpoint) the architecture fields of
        ``run_config.yaml`` are compared when present. Ranks check every tensor again when loading.
        """
        hint = "pass the HF checkpoint it was imported from (or one with the same architecture)"
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
    from vime_gemma4_bridge.convert.topology import text_config_dict

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


def _check_run_config(run_config: Path, hf_config: Mapping, ckpt: Path, hf: Path, hint: str) -> None:
    import yaml

    from vime_gemma4_bridge.convert.topology import text_config_dict

    try:
        model = (yaml.safe_load(run_config.read_text()) or {}).get("model") or {}
    except yaml.YAMLError as error:
        raise ConversionError(f"{run_config} is not valid YAML ({error}); the checkpoint is damaged") from None
    text = text_config_dict(hf_config)
    for megatron_field, hf_field in _ARCHITECTURE_FIELDS.items():
        if megatron_field not in model or hf_field not in text:
            continue
        ours, theirs = model[megatron_field], text[hf_field]
        if hf_field == "num_experts" and not text.get("enable_moe_block"):
            theirs = None
        if ours != theirs:
            raise ConversionError(
                f"torch_dist checkpoint {ckpt} holds a different model than {hf}: {megatron_field} is {ours} "
                f"there and {hf_field} is {theirs} here; {hint}"
            )


# --------------------------------------------------------------------------------------------
# Saving and loading torch_dist on every rank
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cpu_checkpointing() -> Iterator[None]:
    """Let megatron-core's torch_dist reader and writer run on a host without CUDA. No-op with CUDA.

    ``FileSystemWriterAsync.preload_tensors`` calls ``torch.cuda.synchronize()`` after staging tensors to
    the CPU, and ``save_state_dict_async_finalize`` broadcasts its failure flag in a tensor on
    ``torch.cuda.current_device()``; without a driver both raise. Here there is nothing to synchronize
    and the flag lives on the CPU (gloo).
    """
    import torch

    if torch.cuda.is_available():
        yield
        return
    from vime_gemma4_bridge.compat.cuda import host_cuda_device

    original = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    try:
        with host_cuda_device():
            yield
    finally:
        torch.cuda.synchronize = original  # type: ignore[assignment]


def save_torch_dist(model: list, iteration_dir: str | os.PathLike, *, leave_out: Collection[str] = ()) -> None:
    """Save the model chunks of every rank as one torch_dist checkpoint (collective; the directory exists).

    ``leave_out`` names parameters (of a one-chunk model) whose items the caller writes itself
    (:mod:`vime_gemma4_bridge.stream_import`); their modules' other entries are saved as usual.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    state, metadata = sharded_state_dict(model)
    if leave_out:
        state["model"] = {name: value for name, value in state["model"].items() if name not in leave_out}
    state["checkpoint_version"] = CHECKPOINT_VERSION
    state["iteration"] = ITERATION
    # The synchronous path goes through megatron-core's deprecated "mcore" async writer and warns on every rank.
    quiet = logging.getLogger("megatron.core.dist_checkpointing.strategies.torch")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with _cpu_checkpointing():
            dist_checkpointing.save(
                state,
                str(iteration_dir),
                TorchDistSaveShardedStrategy("torch_dist", 1),
                validate_access_integrity=True,
                content_metadata=_clean_metadata_for_serialization(metadata),
            )
    except BaseException as error:  # PyTorch's CheckpointException is a BaseException
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        raise ConversionError(
            f"writing torch_dist to {iteration_dir} failed: {_write_failure(iteration_dir)}"
        ) from None
    finally:
        quiet.setLevel(level)


def _write_failure(directory: Path) -> str:
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
    reads itself to the torch_dist keys they use (:mod:`vime_gemma4_bridge.stream_export`): their
    entries are left out of the load and those keys count as used.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
    from megatron.core.dist_checkpointing.validation import StrictHandling

    where = str(iteration_dir)
    state, _ = sharded_state_dict(model)
    streamed = streamed or {}
    if streamed:
        state["model"] = {
            name: value for name, value in state["model"].items() if name.rpartition(".")[0] not in streamed
        }
    saved = dist_checkpointing.load_tensors_metadata(where)
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
    with _cpu_checkpointing():
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


def _write_run_config(provider: Any, path: Path) -> None:
    """``{model: provider}`` in Megatron-Bridge's run-config format (``ConfigContainer.to_yaml``)."""
    import yaml
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    from megatron.training.config.yaml_utils import safe_yaml_representers

    model = _ConfigContainerBase._convert_value_to_dict(provider)
    with safe_yaml_representers():
        path.write_text(yaml.safe_dump({"model": model}, default_flow_style=False))


def provider_from_run_config(iteration_dir: str | os.PathLike) -> Any:
    """The model provider a ``run_config.yaml`` describes, as Megatron-Bridge's ``load_model_config`` builds it."""
    import yaml
    from megatron.bridge.utils.instantiate_utils import instantiate

    allow_run_config_targets()
    config = yaml.safe_load((Path(iteration_dir) / RUN_CONFIG_NAME).read_text())
    return instantiate(config["model"])


# --------------------------------------------------------------------------------------------
# Jobs: run on every rank
# --------------------------------------------------------------------------------------------


class _Phases:
    """Wall time per phase; rank 0 says on stderr what runs (stdout carries only the final report)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, what: str) -> Iterator[None]:
        from vime_gemma4_bridge.convert.model import is_rank0

        if is_rank0():
            print(f"{self.command}: {what} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 3)
        if is_rank0():
            print(f"{self.command}: {what}: done in {self.seconds[name]:.1f} s", file=sys.stderr, flush=True)


def _directory_stats(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _commit(partial: Path, out: Path) -> None:
    """Put the complete ``partial`` directory at ``out``; an existing ``out`` goes only once it is replaced."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        out.rename(old)
    partial.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def import_job(hf_checkpoint: str, save: str, partial: str, topology: Topology) -> dict[str, Any]:
    """HF → Megatron at ``topology`` → torch_dist at ``save``. Runs on every rank; returns rank 0's report.

    The checkpoint is written into ``partial`` (rank 0's name wins under torchrun) and renamed to
    ``save`` only when complete; on failure rank 0 removes ``partial``.
    """
    import torch.distributed as dist
    from megatron.core.utils import get_model_config

    from vime_gemma4_bridge import hf_io, stream_import
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    start = time.perf_counter()
    phases = _Phases("import")
    init_model_parallel(topology)
    work = Path(convert.broadcast_from_rank0(partial))
    out = Path(save)
    rank0 = convert.is_rank0()
    try:
        if rank0:
            work.mkdir(parents=True)  # from the start: a killed run leaves this hidden directory, never DIR
        with contextlib.redirect_stdout(sys.stderr):
            with phases("build", f"building the Megatron model at {topology}"):
                bridge = convert.open_bridge(hf_checkpoint)
                # Every weight is loaded next, so random init (~3 s/GB) would be wasted; the saved run
                # config still says to initialise, as a model built from it for training must.
                model = convert.build_model(bridge, topology, initialize=False)
                get_model_config(model[0]).perform_initialization = True
                source = hf_io.HFCheckpoint(hf_checkpoint)
                plan = stream_import.plan_import(bridge, model, source) if topology == Topology() else None
            how = " (every weight streamed from the HF shards into torch_dist items)" if plan else ""
            if rank0:
                (work / ITERATION_DIR).mkdir()
            streaming = plan is not None and rank0  # one writer: the other ranks hold replicas
            with plan.streaming(work / ITERATION_DIR) if streaming else contextlib.nullcontext() as stream:
                with phases("load_hf", f"loading {hf_checkpoint}{how}"):
                    if plan is None:
                        bridge.load_hf_weights(model)
                    elif stream is not None:
                        stream.convert(bridge._model_bridge, bridge.hf_pretrained.state)
                dist.barrier()
                with phases("save", f"saving torch_dist to {out}"):
                    save_torch_dist(model, work / ITERATION_DIR, leave_out=plan.streamed_params() if plan else ())
            result: dict[str, Any] | None = None
            if rank0:
                signature = source.signatures(source.language_model_names())
                _write_run_config(get_model_config(model[0]), work / ITERATION_DIR / RUN_CONFIG_NAME)
                sidecar = {
                    "format": SIDECAR_FORMAT,
                    "version": SIDECAR_VERSION,
                    "iteration": ITERATION,
                    "source": str(Path(hf_checkpoint).resolve()),
                    "saved_at": {"topology": str(topology), **vars(topology), "world_size": dist.get_world_size()},
                    "hf_config": source.config,
                    "language_model": signature,
                }
                (work / ITERATION_DIR / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=1) + "\n")
                (work / TRACKER_NAME).write_text(f"{ITERATION}\n")  # last: marks the checkpoint complete
                files, nbytes = _directory_stats(work)
                _commit(work, out)
                tensor_bytes = sum(_nbytes(shape, dtype) for shape, dtype in signature.values())
                moved = phases.seconds["load_hf"] + phases.seconds["save"]
                result = {
                    "command": "import",
                    "ok": True,
                    "hf_checkpoint": hf_checkpoint,
                    "save": str(out),
                    "topology": str(topology),
                    "parallel": vars(topology),
                    "world_size": dist.get_world_size(),
                    "experts_streamed": plan is not None,
                    "tensors": len(signature),
                    "bytes": tensor_bytes,
                    "seconds": round(time.perf_counter() - start, 3),
                    "gb_per_s": _rate(tensor_bytes, moved),
                    "phases": phases.seconds,
                    "checkpoint": {"iteration_dir": str(out / ITERATION_DIR), "files": files, "bytes": nbytes},
                }
            result = convert.broadcast_from_rank0(result)
    except BaseException:
        if rank0:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return result


def export_job(
    load: str, hf_checkpoint: str, output: str, topology: Topology, force: bool, max_shard_size: int
) -> dict[str, Any]:
    """torch_dist at ``load`` → Megatron at ``topology`` → complete HF checkpoint at ``output``. Every rank.

    At the default topology (TP1·PP1·EP1·ETP1) the routed experts stream from the torch_dist files
    to the HF shards when the checkpoint stores them whole (:mod:`vime_gemma4_bridge.stream_export`);
    everything else, and every other topology, goes through the Megatron model.
    """
    import torch.distributed as dist

    from vime_gemma4_bridge import hf_io, stream_export
    from vime_gemma4_bridge.convert import model as convert
    from vime_gemma4_bridge.convert.topology import init_model_parallel

    start = time.perf_counter()
    phases = _Phases("export")
    init_model_parallel(topology, keep_if_same=True)
    iteration_dir = TorchDistCheckpoint(load).iteration_dir
    rank0 = convert.is_rank0()
    with contextlib.redirect_stdout(sys.stderr), contextlib.ExitStack() as stack:
        with phases("build", f"building the Megatron model at {topology}"):
            bridge = convert.open_bridge(hf_checkpoint)
            # Every weight is read next (or streamed past the model): random init would be wasted.
            model = convert.build_model(bridge, topology, initialize=False)
            plan = None
            if topology == Topology():
                reader = stack.enter_context(contextlib.closing(stream_export.TorchDistReader(iteration_dir)))
                plan = stream_export.plan_export(bridge, model, reader)
        how = " (routed experts streamed to the HF shards)" if plan else ""
        # Reading whole chunks and exporting at TP1·PP1·EP1 involves no collective: with direct reads
        # rank 0 alone does it, the others would only compete for the same cores.
        works = plan is None or plan.direct is None or rank0
        exported: dict[str, Any] = {}
        with phases("load", f"loading torch_dist {iteration_dir}{how}"):
            if plan is None:
                load_torch_dist(model, iteration_dir)
            elif plan.direct is None:
                load_torch_dist(model, iteration_dir, streamed=plan.experts.modules())
            elif works:
                plan.check_direct(reader)  # every chunk stored whole: read as the writer needs it
        source = hf_io.HFCheckpoint(hf_checkpoint)
        signature = source.signatures(source.language_model_names()) if rank0 else {}
        with phases("export", "exporting to HF names"):
            if plan is None:
                exported = convert.collect_on_rank0(bridge, model)
            elif plan.direct is not None and works:
                exported = plan.lazy_tensors(bridge, model, reader, signature)
            elif works:
                exported = convert.collect_on_rank0(bridge, model, conversion_tasks=plan.other_tasks)
            if plan is not None and rank0:
                exported.update(stream_export.streamed_export_tensors(plan.experts, reader))
        result: dict[str, Any] | None = None
        if rank0:
            _check_exported(exported, signature)
            with phases("write", f"writing {output}"):
                written = hf_io.write_hf_checkpoint(
                    output, exported, source, max_shard_size=max_shard_size, force=force, show_progress=True
                )
            tensor_bytes = sum(hf_io.tensor_nbytes(t) for t in exported.values())
            moved = phases.seconds["load"] + phases.seconds["export"] + phases.seconds["write"]
            files, nbytes = _directory_stats(written)
            result = {
                "command": "export",
                "ok": True,
                "load": str(iteration_dir),
                "hf_checkpoint": hf_checkpoint,
                "output": str(written),
                "topology": str(topology),
                "parallel": vars(topology),
                "world_size": dist.get_world_size(),
                "experts_streamed": plan is not None,
                "loader": "direct" if plan is not None and plan.direct is not None else "dist_checkpointing",
                "tensors": len(exported),
                "bytes": tensor_bytes,
                "seconds": round(time.perf_counter() - start, 3),
                "gb_per_s": _rate(tensor_bytes, moved),
                "phases": phases.seconds,
                "hf_output": {
                    "files": files,
                    "bytes": nbytes,
                    "shards": len(list(written.glob("*.safetensors"))),
                    "tensors": len(source.names()),
                },
            }
        return convert.broadcast_from_rank0(result)


def _check_exported(exported: Mapping[str, Any], signature: Mapping[str, list]) -> None:
    """Refuse to write an HF checkpoint whose language model differs in names, shapes or dtypes from the source's.

    The torch_dist checkpoint may hold trained weights, so values may differ; its layout may not: the
    output must load wherever the source loads (transformers, vLLM).
    """
    from vime_gemma4_bridge.hf_io import SAFETENSORS_DTYPES

    for name, (shape, dtype) in signature.items():
        if name not in exported:
            raise ConversionError(f"the export produced no {name}; refusing to write an incomplete checkpoint")
        tensor = exported[name]
        got = [list(tensor.shape), SAFETENSORS_DTYPES.get(tensor.dtype, str(tensor.dtype))]
        if got != [list(shape), dtype]:
            raise ConversionError(
                f"the export produced {name} as {got[1]}{got[0]} but --hf-checkpoint has {dtype}{list(shape)}; "
                "refusing to write a checkpoint of another layout"
            )
    extra = sorted(set(exported) - set(signature))
    if extra:
        raise ConversionError(f"the export produced {extra[0]}, which --hf-checkpoint lacks ({len(extra)} in all)")


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    from vime_gemma4_bridge.hf_io import DTYPE_BYTES

    return math.prod(shape) * DTYPE_BYTES.get(dtype, 1)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

IMPORT_DESCRIPTION = """\
Convert a Gemma 4 HF checkpoint to a Megatron torch_dist checkpoint at the given parallel topology
(gloo CPU ranks with --nproc, or the ranks of torchrun). Megatron-Bridge loads the language model
into the sharded Megatron model; megatron-core writes DIR/iter_0000000 and
DIR/latest_checkpointed_iteration.txt, with Megatron-Bridge's run_config.yaml and the source's HF
config beside it. The checkpoint loads at any other valid topology (vime-gemma4 export, or Megatron
with --no-load-optim --no-load-rng). DIR appears only when complete."""

EXPORT_DESCRIPTION = """\
Convert a Megatron torch_dist checkpoint (from vime-gemma4 import or a training run) back to a
complete HF checkpoint, at any valid topology: the one it was saved at does not matter. The HF
checkpoint it came from supplies the config, tokenizer and the non-language (vision) tensors and
must describe the same model (checked before ranks start). OUT is sharded by --max-shard-size with
a model.safetensors.index.json and appears only when complete.

At the default topology (no topology flags, or all of them 1: the fast path) the routed experts
stream from the torch_dist files to the HF shards, one expert in memory at a time, when the
checkpoint stores them whole (saved at --etp 1); the rest goes through Megatron-Bridge as always.
Any other topology loads the checkpoint into the Megatron model at that topology first (slower; a
check that it loads there)."""


def _add_common(parser: argparse.ArgumentParser) -> None:
    Topology.add_arguments(parser)
    add_launch_arguments(parser)
    parser.add_argument("--force", action="store_true", help="replace the output if it exists")
    parser.add_argument("--json", action="store_true", help="print the final report as JSON (progress goes to stderr)")


def build_import_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--hf-checkpoint", required=True, metavar="HF", help="source Gemma 4 HF checkpoint")
    parser.add_argument("--save", required=True, metavar="DIR", help="torch_dist checkpoint directory to create")
    _add_common(parser)
    parser.set_defaults(func=run_import, prog=parser.prog)
    return parser


def build_export_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--load", required=True, metavar="DIR", help="torch_dist checkpoint (DIR or DIR/iter_*)")
    parser.add_argument(
        "--hf-checkpoint",
        required=True,
        metavar="HF",
        help="HF checkpoint of the same model: config, tokenizer, non-language tensors",
    )
    parser.add_argument("--output", required=True, metavar="OUT", help="HF checkpoint directory to create")
    parser.add_argument(
        "--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors shard of OUT (default 5GB)"
    )
    _add_common(parser)
    parser.set_defaults(func=run_export, prog=parser.prog)
    return parser


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register ``vime-gemma4 import`` and ``vime-gemma4 export``."""
    build_import_parser(
        subparsers.add_parser(
            "import",
            help="HF -> Megatron torch_dist checkpoint at a topology",
            description=IMPORT_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    build_export_parser(
        subparsers.add_parser(
            "export",
            help="Megatron torch_dist checkpoint -> HF, at any topology",
            description=EXPORT_DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def _refuse(args: argparse.Namespace, error: Exception) -> int:
    print(f"{args.prog}: error: {error}", file=sys.stderr)
    return 2


def _report(args: argparse.Namespace, result: Mapping[str, Any]) -> None:
    if not is_reporting_process():
        return
    if args.json:
        print(json.dumps(result, indent=2))
        return
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result["phases"].items())
    head = (
        f"{result['command']} OK: {result['tensors']} language-model tensors, {result['bytes']:,} bytes, "
        f"at {result['topology']} on {result['world_size']} rank(s), {result['seconds']:.1f} s "
        f"({phases}), {result['gb_per_s']:.3f} GB/s"
    )
    print(head)
    if result["command"] == "import":
        ckpt = result["checkpoint"]
        print(f"wrote torch_dist {ckpt['iteration_dir']}: {ckpt['files']} files, {ckpt['bytes']:,} bytes")
    else:
        hf = result["hf_output"]
        print(
            f"wrote HF {result['output']}: {hf['tensors']} tensors in {hf['shards']} safetensors shard(s), "
            f"{hf['files']} files, {hf['bytes']:,} bytes"
        )


def run_import(args: argparse.Namespace) -> int:
    """``import``: every refusal before ranks start; exit 0 on success, 1 if a rank failed, 2 on bad input."""
    from vime_gemma4_bridge import hf_io
    from vime_gemma4_bridge.cli import errors, preflight
    from vime_gemma4_bridge.convert import topology as convert

    try:
        topology = Topology.from_args(args)
        topology.validate(requested_world_size(args.nproc))
        source = hf_io.HFCheckpoint(args.hf_checkpoint)
        convert.validate_model_topology(source.config, topology)
        hf_io.refuse_overlap(args.save, "--save", {"--hf-checkpoint": source.path})
        out = hf_io.prepare_output(args.save, force=args.force)
        preflight.check_language_model(source)
    except ValueError as error:
        return _refuse(args, error)
    partial = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
    try:
        results = launch(args.nproc, import_job, str(source.path), str(out), str(partial), topology)
    except KeyboardInterrupt as interrupt:  # SIGINT or SIGTERM; the local ranks are gone (LocalWorld kills them)
        shutil.rmtree(partial, ignore_errors=True)
        print(f"{args.prog}: interrupted; {out} was not written", file=sys.stderr)
        return errors.interrupted_status(interrupt)
    except BaseException as error:  # noqa: BLE001 (a rank failed; the world is gone)
        shutil.rmtree(partial, ignore_errors=True)
        return errors.report(args.prog, error, debug=args.debug)
    _report(args, results[0])
    return 0


def run_export(args: argparse.Namespace) -> int:
    """``export``: every refusal before ranks start; exit 0 on success, 1 if a rank failed, 2 on bad input."""
    from vime_gemma4_bridge import hf_io
    from vime_gemma4_bridge.cli import errors, preflight
    from vime_gemma4_bridge.convert import topology as convert

    try:
        topology = Topology.from_args(args)
        topology.validate(requested_world_size(args.nproc))
        source = hf_io.HFCheckpoint(args.hf_checkpoint)
        convert.validate_model_topology(source.config, topology)
        checkpoint = TorchDistCheckpoint(args.load)
        hf_io.refuse_overlap(args.output, "--output", {"--hf-checkpoint": source.path, "--load": checkpoint.path})
        out = hf_io.prepare_output(args.output, force=args.force)
        max_shard_size = hf_io.parse_size(args.max_shard_size, "--max-shard-size")
        preflight.check_language_model(source)  # the HF checkpoint agrees with itself, then with the torch_dist one
        checkpoint.check_files()
        checkpoint.check_matches(source)
    except ValueError as error:
        return _refuse(args, error)
    try:
        job_args = (str(checkpoint.path), str(source.path), str(out), topology, args.force, max_shard_size)
        results = launch(args.nproc, export_job, *job_args)
    except KeyboardInterrupt as interrupt:
        print(f"{args.prog}: interrupted; {out} was not written", file=sys.stderr)
        return errors.interrupted_status(interrupt)
    except BaseException as error:  # a rank failed; the world is gone
        return errors.report(args.prog, error, debug=args.debug)
    _report(args, results[0])
    return 0


def main_import(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``scripts/convert_hf_to_torch_dist.py``: the ``import`` command as a standalone program."""
    parser = argparse.ArgumentParser(
        prog=prog, description=IMPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from vime_gemma4_bridge.cli.errors import add_output_options, run_command

    args = add_output_options(build_import_parser(parser)).parse_args(argv)
    return run_command(args.prog, args)


def main_export(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``scripts/convert_torch_dist_to_hf.py``: the ``export`` command as a standalone program."""
    parser = argparse.ArgumentParser(
        prog=prog, description=EXPORT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    from vime_gemma4_bridge.cli.errors import add_output_options, run_command

    args = add_output_options(build_export_parser(parser)).parse_args(argv)
    return run_command(args.prog, args)
