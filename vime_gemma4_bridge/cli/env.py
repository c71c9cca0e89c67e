"""``vime-gemma4 env``: what this environment has, which of the plugin's paths are active, and whether they work.

Prints one line per component (torch, megatron-core, Megatron-Bridge with the seams it exposes,
transformers, Transformer Engine, CUDA) and per plugin path (registration and which bridge serves
each Gemma 4 class, TE or CPU modules, export tuple), then ``env OK`` or ``env FAILED: <reason>``.
Exit 1 when the plugin cannot work here; with ``--miles`` (miles v0.1.0's ``--megatron-to-hf-mode
bridge``) or ``--vime`` (vime's bridge-mode revisions), also when that trainer's bridge weight sync
cannot: both unpack the three-field export of radixark's Megatron-Bridge fork. The recipes run
``env --vime`` / ``env --miles`` before launching.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable
from typing import Any


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect(vime: bool, miles: bool = False) -> tuple[list[tuple[str, str]], list[str]]:
    """``(rows, problems)``: what to print, and every reason the plugin (or the named trainer's bridge road)
    cannot work."""
    import torch

    from vime_gemma4_bridge.compat import autoload, seams

    rows: list[tuple[str, str]] = [
        ("python", sys.version.split()[0]),
        ("torch", f"{torch.__version__} (CUDA {'available' if torch.cuda.is_available() else 'not available'})"),
        ("megatron-core", _version("megatron-core")),
        ("transformers", _version("transformers")),
    ]
    problems: list[str] = []
    te = seams.te_available()
    rows.append(("Transformer Engine", _version("transformer-engine") if te else "not installed"))
    rows.append(("modules", "Transformer Engine (GPU)" if te else "CPU twins of the TE modules (same names and keys)"))
    rows.append(("autoload", f"{autoload.ENV_VAR}={os.environ.get(autoload.ENV_VAR, '') or 'unset'}"))
    try:
        described = seams.describe()
    except Exception as error:  # noqa: BLE001 (reported, not raised: this command diagnoses)
        rows.append(("Megatron-Bridge", f"{_version('megatron-bridge')}: cannot be imported"))
        return rows, [f"Megatron-Bridge cannot be imported: {type(error).__name__}: {error}"]
    rows.append(("Megatron-Bridge", f"{_version('megatron-bridge')} ({described['build']}, as its seams tell)"))
    rows.append(("  export tuple", described["export tuple"]))
    rows.append(("  build_conversion_tasks weight_dtype", _yes(described["build_conversion_tasks weight_dtype"])))
    rows.append(("  mappings keep _pg_collection", _yes(described["mappings keep _pg_collection"])))
    problems += _check("registration", rows, _dispatched_bridges)
    problems += _check("Gemma 4 models", rows, _models)
    if te:
        problems += _check("TE modules", rows, lambda: _imports("vime_gemma4_bridge.core.te_modules"))
    if described["export tuple"] == seams.THIRD_FIELD:
        rows.append(("vime bridge mode", "ready: export yields (hf_name, tensor, megatron_param_name)"))
    else:
        # vime's bridge sync (hf_weight_iterator_bridge.py @40ec17a0) unpacks three fields of
        # export_hf_weights(model, cpu=False, conversion_tasks=...), which asks for no names.
        why = (
            "vime's bridge weight sync unpacks three fields; this build's export yields two (install vime's fork)"
            if described["export tuple"] == seams.TWO_FIELDS
            else "vime's bridge weight sync unpacks three fields without asking with_megatron_names; this build "
            "yields two unless asked, and then a tuple of names third (HFSourcedWeightTuple)"
        )
        rows.append(("vime bridge mode", f"not with this build: {why}"))
        if vime:
            problems.append(why)
    rows.append(("miles bridge road", _miles_road(described["export tuple"] == seams.THIRD_FIELD)))
    if miles and described["export tuple"] != seams.THIRD_FIELD:
        problems.append(MILES_NEEDS_THE_FORK)
    return rows, problems


#: miles' bridge iterator (radixark/miles @31f1ca96 ``hf_weight_iterator_bridge.py`` L73) unpacks three fields.
MILES_NEEDS_THE_FORK = (
    "miles' bridge weight sync unpacks three fields; this build's export yields two "
    "(install radixark's Megatron-Bridge fork, as miles' image does)"
)


def _miles_road(three_fields: bool) -> str:
    """What miles' ``--megatron-to-hf-mode bridge`` needs, and how to hand it the plugin."""
    from vime_gemma4_bridge.convert.miles import ENTRY_POINT

    if not three_fields:
        return f"not with this build: {MILES_NEEDS_THE_FORK}"
    return (
        f"ready with --colocate and --custom-megatron-init-path {ENTRY_POINT} "
        "(miles' non-colocated sync has no Gemma 4; the hook refuses it at launch)"
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _imports(module: str) -> str:
    importlib.import_module(module)
    return "import"


def _models() -> str:
    """Both Gemma 4 models are the plugin's: they need no Gemma 4 code of the installed Megatron-Bridge."""
    from vime_gemma4_bridge.core.provider import Gemma4DenseTextModelProvider, Gemma4TextModelProvider

    return (
        f"MoE 26B-A4B ({Gemma4TextModelProvider.__name__}) and dense 31B / E4B / E2B / 12B Unified "
        f"({Gemma4DenseTextModelProvider.__name__}): the plugin's own, on any build"
    )


def _dispatched_bridges() -> str:
    """Register, then ask Megatron-Bridge's dispatcher which bridge each Gemma 4 class gets."""
    import transformers
    from megatron.bridge.models.conversion import model_bridge

    import vime_gemma4_bridge
    from vime_gemma4_bridge.core.hf_layout import LANGUAGE_MODEL_PREFIX

    vime_gemma4_bridge.register()
    found = {name: type(model_bridge.get_model_bridge(getattr(transformers, name))) for name in LANGUAGE_MODEL_PREFIX}
    foreign = [
        f"{name} -> {cls.__module__}.{cls.__name__}"
        for name, cls in found.items()
        if "vime_gemma4" not in cls.__module__
    ]
    if foreign:
        raise RuntimeError(f"AutoBridge does not dispatch to the plugin: {', '.join(foreign)}")
    return ", ".join(f"{name} -> {cls.__name__}" for name, cls in found.items()) + " (the plugin's, in any order)"


def _check(what: str, rows: list[tuple[str, str]], probe: Callable[[], str]) -> list[str]:
    try:
        rows.append((what, probe()))
        return []
    except Exception as error:  # noqa: BLE001 (reported, not raised: this command diagnoses)
        reason = f"{what}: {type(error).__name__}: {error}"
        rows.append((what, f"FAILED ({type(error).__name__}: {error})"))
        return [reason]


def add_parser(sub: Any) -> None:
    """Register ``vime-gemma4 env``."""
    parser = sub.add_parser(
        "env",
        help="versions, active paths, and whether the plugin (and miles' or vime's bridge road) can work here",
        description=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--vime",
        action="store_true",
        help="also require what vime's --megatron-to-hf-mode bridge needs (the fork's three-field export)",
    )
    parser.add_argument(
        "--miles",
        action="store_true",
        help="also require what miles' --megatron-to-hf-mode bridge needs (radixark/miles v0.1.0: the fork's "
        "three-field export); the row 'miles bridge road' says how to launch it",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one row per finding; exit 1 with the first reason the plugin (or, with --vime, vime) cannot work."""
    rows, problems = collect(args.vime, args.miles)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if problems:
        print(f"env FAILED: {problems[0]}" + (f" (and {len(problems) - 1} more above)" if len(problems) > 1 else ""))
        return 1
    trainers = [
        name for name, asked in (("vime's bridge mode", args.vime), ("miles' bridge road", args.miles)) if asked
    ]
    print("env OK: the plugin works here" + (f" and {' and '.join(trainers)} can use it" if trainers else ""))
    return 0
