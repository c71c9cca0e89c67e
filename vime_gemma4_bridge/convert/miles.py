"""miles' launch hook: ``--custom-megatron-init-path vime_gemma4_bridge.miles_init``.

miles (radixark/miles, v0.1.0 and main @31f1ca96) is the trainer that keeps
``--megatron-to-hf-mode bridge``. It calls the function named by ``--custom-megatron-init-path`` with
its parsed arguments on every training rank, once Megatron is initialised and before the model is
built (``miles/backends/megatron_utils/initialize.py`` L129-133). :func:`miles_init` uses that moment:

1. it registers the plugin's bridges, so that ``AutoBridge`` serves every Gemma 4 class with the
   plugin whatever the image registered (the fork's ``Gemma4VLBridge`` registers the class *name*;
   the plugin registers the class itself, which Megatron-Bridge's dispatch prefers: any order);
2. it refuses, in one line naming what to use, a Gemma 4 launch that miles cannot carry, before a
   single weight is built or synced (:func:`launch_problems`). Any other model passes untouched.

Why each refusal (all @31f1ca96):

- ``--megatron-to-hf-mode raw``: the raw road converts with ``megatron_to_hf.convert_to_hf``, whose
  if/elif chain has no Gemma branch (``megatron_to_hf/__init__.py`` L66: ``Unsupported model``).
- not ``--colocate``: ``actor.py`` L253-264 picks ``UpdateWeightFromDistributed`` / ``P2P`` /
  ``DiskDelta``, whose full sync gathers with miles' own code and converts with the same
  ``convert_to_hf`` (``update_weight_from_distributed/mixin.py`` L124, L224), bridge mode or not;
  the bridge iterator serves those paths for LoRA only, so a LoRA run (base never pushed) passes.
- a Megatron-Bridge whose export yields two fields: ``hf_weight_iterator_bridge.py`` L73 unpacks
  three (``ValueError: not enough values to unpack``): miles' image installs radixark's fork.
- ``--load`` in a layout the plugin's model does not load (vime's native, the VL model's: ``migrate``
  rewrites them), or with upstream Megatron-Bridge's positional (``dp_reshardable``) optimizer state: its
  parameter order is not the plugin's (:meth:`TorchDistCheckpoint.optimizer_order_hazard`).
- FP8 rollouts with stacked experts: ``quantizer_fp8.py`` L115 asserts every quantized HF name ends
  in ``.weight``; stacked experts are ``experts.gate_up_proj`` / ``experts.down_proj``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vime_gemma4_bridge.compat import seams
from vime_gemma4_bridge.core.hf_layout import EXPERT_LAYOUT_ENV, LANGUAGE_MODEL_PREFIX, PER_EXPERT, STACKED
from vime_gemma4_bridge.io.torch_dist import TorchDistCheckpoint
from vime_gemma4_bridge.io.torch_dist_layout import ConversionError

#: What miles' documentation names the hook by (the package root re-exports it lazily).
ENTRY_POINT = "vime_gemma4_bridge.miles_init"


class MilesLaunchRefused(RuntimeError):
    """A Gemma 4 launch miles cannot carry: raised on every rank before the model is built, in one line."""


def _hf_config(hf_checkpoint: str | None) -> dict[str, Any] | None:
    if not hf_checkpoint:
        return None
    path = Path(hf_checkpoint) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not ours to judge: miles reports its own checkpoint problems


def is_gemma4(config: dict[str, Any] | None) -> bool:
    """Whether an HF ``config.json`` names a Gemma 4 class the plugin serves."""
    return bool(config) and any(name in LANGUAGE_MODEL_PREFIX for name in config.get("architectures") or ())


def _lora_rollout(args: Any) -> bool:
    """miles' ``lora_rollout_enabled`` (``miles/utils/lora.py`` L6-17)."""
    lora = (getattr(args, "lora_rank", 0) or 0) > 0 or getattr(args, "lora_adapter_path", None) is not None
    return lora and not getattr(args, "lora_train_only", False)


def _optimizer_order_hazard(args: Any) -> str | None:
    """Megatron-LM's ``load_checkpoint`` would resume ``--load``'s optimizer state, and it is positional
    state of a model that orders its parameters otherwise (:meth:`TorchDistCheckpoint.optimizer_order_hazard`).

    Megatron-LM loads the optimizer unless ``--no-load-optim`` or ``--finetune``
    (``training/checkpointing.py`` L2208-2212); a ``--load`` that is not a torch_dist checkpoint is
    miles' to report.
    """
    load = getattr(args, "load", None)
    if not load or getattr(args, "no_load_optim", False) or getattr(args, "finetune", False):
        return None
    try:
        return TorchDistCheckpoint(load).optimizer_order_hazard()
    except ConversionError:
        return None


def _load_layout_problem(args: Any) -> str | None:
    """``--load`` holds a layout the plugin's model does not load in training (megatron-core would fail
    inside its load with missing keys): one line naming the layout and the ``migrate`` that rewrites it."""
    load = getattr(args, "load", None)
    if not load:
        return None
    try:
        checkpoint = TorchDistCheckpoint(load)
    except ConversionError:
        return None  # no checkpoint there yet (a first run's --load), or not torch_dist: miles reports it
    try:
        checkpoint.check_layout()
    except ConversionError as error:
        return f"--load: {error}"
    if checkpoint.vision_language():
        return (
            f"--load {load} is in the layout of Megatron-Bridge's Gemma4VLModel (language_model.*), which the plugin's "
            f"text model does not load: rewrite it with vime-gemma4 migrate --load {load} --to ours --save OUT and "
            "--load OUT"
        )
    return None


def launch_problems(args: Any, export_tuple: str | None = None) -> list[str]:
    """Every reason miles cannot run this launch with Gemma 4, each one line naming what to use; [] if none.

    ``export_tuple``: the installed build's, as :func:`vime_gemma4_bridge.compat.seams.describe` tells
    it (asked only for a Gemma 4 launch in bridge mode when not given).
    """
    config = _hf_config(getattr(args, "hf_checkpoint", None))
    if not is_gemma4(config):
        return []
    problems = []
    if getattr(args, "megatron_to_hf_mode", "raw") != "bridge":
        problems.append(
            "miles' raw weight road has no Gemma 4 (megatron_to_hf.convert_to_hf: Unsupported model): "
            "launch with --megatron-to-hf-mode bridge"
        )
    if not getattr(args, "colocate", False) and not _lora_rollout(args):
        mode = getattr(args, "update_weight_transfer_mode", "broadcast")
        problems.append(
            f"miles' non-colocated weight sync (--update-weight-transfer-mode {mode}) converts with its own "
            "converters, which have no Gemma 4: launch with --colocate (or sync a LoRA adapter only)"
        )
    if getattr(args, "megatron_to_hf_mode", "raw") == "bridge":
        export_tuple = export_tuple or seams.describe()["export tuple"]
        if export_tuple != seams.THIRD_FIELD:
            problems.append(
                "miles' bridge weight sync unpacks (hf_name, tensor, megatron_name) and this Megatron-Bridge "
                "yields two fields: install radixark's Megatron-Bridge fork, as miles' image does"
            )
    layout = _load_layout_problem(args)
    if layout:
        problems.append(layout)
    hazard = _optimizer_order_hazard(args)
    if hazard and not layout:
        problems.append(hazard)
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    layout = os.environ.get(EXPERT_LAYOUT_ENV, STACKED)
    if quantization == "fp8" and (config.get("text_config") or config).get("enable_moe_block") and layout != PER_EXPERT:
        problems.append(
            "miles' FP8 quantizer takes per-expert names only (quantizer_fp8.py asserts '.weight'): "
            f"set {EXPERT_LAYOUT_ENV}=per-expert on the training ranks"
        )
    return problems


def serving_bridges() -> dict[str, str]:
    """Which bridge class ``AutoBridge`` dispatches each Gemma 4 class to, as ``module.Class``."""
    import transformers
    from megatron.bridge.models.conversion import model_bridge

    found = {}
    for name in LANGUAGE_MODEL_PREFIX:
        hf_class = getattr(transformers, name, None)
        if hf_class is not None:
            bridge = type(model_bridge.get_model_bridge(hf_class))
            found[name] = f"{bridge.__module__}.{bridge.__qualname__}"
    return found


def miles_init(args: Any) -> None:
    """miles' ``--custom-megatron-init-path`` hook: register the plugin, then refuse what miles cannot carry.

    Raises :class:`MilesLaunchRefused` (one line) on every rank alike, before the model is built.
    """
    import vime_gemma4_bridge

    vime_gemma4_bridge.register()
    problems = launch_problems(args)
    if problems:
        raise MilesLaunchRefused(f"vime-gemma4-bridge: {problems[0]}")
    if is_gemma4(_hf_config(getattr(args, "hf_checkpoint", None))):
        foreign = {name: bridge for name, bridge in serving_bridges().items() if "vime_gemma4_bridge" not in bridge}
        if foreign:
            raise MilesLaunchRefused(f"vime-gemma4-bridge: AutoBridge dispatches Gemma 4 elsewhere: {foreign}")
