"""Import the real Megatron-Bridge on hosts with or without Transformer Engine (TE).

Megatron-Bridge 0.6.2 imports ``transformer_engine.pytorch`` unconditionally in
``megatron/bridge/peft/lora_layers.py`` (reached from the conversion code through
``peft_bridge``), so ``import megatron.bridge`` fails on a CPU host. Megatron-core itself
handles a missing TE, and must keep doing so: a global fake ``transformer_engine`` module
would make it pick TE layer specs and read ``te.__version__``.

The guard is therefore scoped to the *statements of the listed modules only*: a meta-path
finder loads each of them with a private ``__import__`` that answers ``transformer_engine``
imports with an inert placeholder. Nothing is put into ``sys.modules`` under a TE name, so
every other module (megatron-core included) still gets ``ModuleNotFoundError``. The PEFT modules
that read megatron-core's TE-less stand-ins as TE get ``HAVE_TE = False`` (``TE_FLAG_READERS``), so a
LoRA transform takes megatron-core's linears (UPSTREAM 52). Where TE is installed, :func:`install`
does nothing.

Upstream: NVIDIA-NeMo/Megatron-Bridge issue 3295 (CPU-only conversion); see docs/UPSTREAM.md.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

#: Megatron-Bridge modules whose top level imports TE without a guard.
UNGUARDED_TE_IMPORTERS = frozenset({"megatron.bridge.peft.lora_layers"})

#: Megatron-Bridge modules whose ``HAVE_TE`` says True without TE: they test that megatron-core's
#: ``extensions.transformer_engine`` defines its TE classes, which it does without TE too (``MagicMock``
#: stand-ins), and a LoRA transform then fails ``isinstance(m, <MagicMock>)`` on every linear.
TE_FLAG_READERS = frozenset({"megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher"})


class _AbsentTE(type):
    """Metaclass of the placeholder: every attribute is another placeholder class.

    Placeholders work in annotations and ``isinstance`` checks (nothing is an instance of
    them); constructing one raises, so TE-only code paths fail loudly instead of silently.
    """

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentTE(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ModuleNotFoundError(f"{cls.__name__} needs Transformer Engine, which is not installed on this host")


_PLACEHOLDER = _AbsentTE("transformer_engine", (), {})


def _scoped_import(name: str, globals=None, locals=None, fromlist=(), level: int = 0):  # noqa: A002
    if level == 0 and (name == "transformer_engine" or name.startswith("transformer_engine.")):
        # ``import transformer_engine.pytorch as te`` binds the attribute chain of the top
        # package, which the placeholder supplies; ``from ... import X`` reads fromlist names.
        return _PLACEHOLDER
    return builtins.__import__(name, globals, locals, fromlist, level)


class _GuardedLoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module: ModuleType) -> None:
        guarded_builtins = dict(vars(builtins))
        guarded_builtins["__import__"] = _scoped_import
        module.__dict__["__builtins__"] = guarded_builtins
        super().exec_module(module)


class _NoTELoader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        module.HAVE_TE = False


class _GuardFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._searching = False  # re-entrancy guard: we ask the other finders, which may include a guard

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in UNGUARDED_TE_IMPORTERS | TE_FLAG_READERS or self._searching:
            return None
        loader = _GuardedLoader if fullname in UNGUARDED_TE_IMPORTERS else _NoTELoader
        self._searching = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
                    spec.loader = loader(spec.loader.name, spec.loader.path)
                    return spec
        finally:
            self._searching = False
        return None


def is_placeholder(value: object) -> bool:
    """Whether ``value`` is what a guarded module's ``import transformer_engine...`` bound instead of TE."""
    return isinstance(value, _AbsentTE)


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch package can be imported here."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


def install() -> bool:
    """Install the scoped guard when TE is absent; return whether it is active. Idempotent."""
    if te_available():
        return False
    if not any(isinstance(f, _GuardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardFinder())
    return True
