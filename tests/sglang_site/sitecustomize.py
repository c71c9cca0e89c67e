"""Harness-only changes to SGLang 0.5.23, loaded into every process of a test engine (tests/sglang_engine.py
puts this directory on ``PYTHONPATH``; SGLang's scheduler is a spawned child, so a patch made in the
engine's parent would not reach it). ``VIME_SGLANG_PATCHES`` names the ones to apply, comma-separated;
unset, SGLang runs as shipped. Never loaded by the package or by a user's engine.

* ``torch-native``: SGLang's server-argument check refuses ``torch_native`` attention for Gemma 4
  (``srt/arg_groups/model_hook.py`` L636-660 @0.5.23: CUDA, ROCm, XPU, AMX and Ascend backends only), the one
  attention that runs on this CPU (no AMX). The check alone is told "triton"; the engine runs torch_native
  (UPSTREAM 66).
* ``cpu-norm``: ``Gemma4RMSNorm.forward_native`` (``srt/layers/layernorm.py`` L1421-1425 @0.5.23) drops
  its weight when ``with_scale=False``; the router keeps ``scale * hidden**-0.5`` there (``Gemma4Router.
  fuse_scale``, ``srt/models/gemma4_causal.py`` L203-207), and the CUDA kernel (L1438-1455) uses it. Only
  the native (CPU) path is wrong (docs/UPSTREAM.md 64).
* ``router-refuse``: ``Gemma4Router`` folds ``router.scale`` into its norm's weight on its first forward and
  never again (``gemma4_causal.py`` L201-215), so a weight update that changes ``router.scale`` is ignored.
  After every ``load_weights`` the routers are marked unfused, the fix proposed upstream (UPSTREAM 65).
* ``record-skipped``: every name ``load_weights`` is given goes in one at a time, and the names for which
  SGLang's own loaded-parameter set (its return value, ``gemma4_mm.py`` L877-1099) comes back empty are
  appended to the file ``VIME_SGLANG_SKIPPED`` names: the names SGLang skips without a word.
"""

import functools
import json
import os

_PATCHES = {p for p in os.environ.get("VIME_SGLANG_PATCHES", "").split(",") if p}


def _fixed_forward_native(self, x):
    normed = self._norm(x.float())
    return (normed * (self.weight.float() + self.scale_shift)).type_as(x)


def _wrap_load_weights(cls):
    shipped = cls.load_weights

    @functools.wraps(shipped)
    def load_weights(self, weights):
        if "record-skipped" in _PATCHES:
            loaded, skipped = set(), []
            for name, tensor in weights:
                got = shipped(self, [(name, tensor)])
                loaded |= got
                if not got:
                    skipped.append(name)
            if skipped:
                with open(os.environ["VIME_SGLANG_SKIPPED"], "a") as handle:
                    handle.write(json.dumps(skipped) + "\n")
        else:
            loaded = shipped(self, weights)
        if "router-refuse" in _PATCHES:
            for module in self.modules():
                if hasattr(module, "_scale_fused"):
                    module._scale_fused = False
        return loaded

    cls.load_weights = load_weights


if _PATCHES:
    from sglang.srt.arg_groups import model_hook
    from sglang.srt.layers.layernorm import Gemma4RMSNorm
    from sglang.srt.models.gemma4_mm import Gemma4ForConditionalGeneration

    if "torch-native" in _PATCHES:
        _checked = model_hook.attention_backends_of
        model_hook.attention_backends_of = lambda view: tuple(
            "triton" if backend == "torch_native" else backend for backend in _checked(view)
        )
    if "cpu-norm" in _PATCHES:
        Gemma4RMSNorm.forward_native = _fixed_forward_native
    if _PATCHES & {"router-refuse", "record-skipped"}:
        _wrap_load_weights(Gemma4ForConditionalGeneration)
