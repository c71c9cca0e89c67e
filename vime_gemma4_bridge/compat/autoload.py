"""Registration on demand: the plugin's bridges are registered before Megatron-Bridge first dispatches.

``import vime_gemma4_bridge`` stays cheap (no Megatron import). Once ``megatron.bridge`` has been
imported (at once if it already is), Megatron-Bridge's bridge dispatcher ``get_model_bridge`` is
wrapped so that its first use registers the Gemma 4 bridges and then steps aside. Registering at
first use rather than at import time keeps every import order working: the plugin's own modules
import ``megatron.bridge``, so registering in the middle of that import would be circular.

Fail safe: if registering raises (an import the plugin needs is missing on this build, say), the
error is logged, every other architecture dispatches as before, and a Gemma 4 look-up raises
:class:`PluginUnavailable` with that error in one line: a failure of the plugin never breaks
Megatron-Bridge for other models, and is never swallowed either.

Drop-in for vime: the distribution installs ``vime_gemma4_bridge_autoload.pth`` into
site-packages. When the environment variable ``VIME_GEMMA4_BRIDGE_AUTOLOAD=1`` is set, every
Python process (the vime actor included) imports this package at start-up, so a launch with
``--megatron-to-hf-mode bridge`` uses the plugin with no edit to vime. Unset, the ``.pth`` does
nothing and the plugin is active only where it is imported explicitly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Collection
from types import ModuleType

ENV_VAR = "VIME_GEMMA4_BRIDGE_AUTOLOAD"
TRIGGER = "megatron.bridge"
#: The one line of ``vime_gemma4_bridge_autoload.pth`` (site executes ``.pth`` lines starting with ``import``).
PTH_LINE = (
    f'import os; os.environ.get("{ENV_VAR}", "").lower() in ("1", "true", "yes", "on") '
    'and __import__("vime_gemma4_bridge")'
)


class _ThenCall(importlib.abc.Loader):
    """Wraps the real loader of ``megatron.bridge``; calls the callback once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self.loader = loader
        self.callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.callback()


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenCall(spec.loader, self.callback)
                return spec
        return None


class PluginUnavailable(RuntimeError):
    """The plugin is loaded but could not register its bridges; its architectures cannot be converted."""


class _RefuseArchitectures:
    """``get_model_bridge`` after a failed registration: the plugin's architectures raise, others dispatch."""

    def __init__(self, dispatcher: object, architectures: Collection[str], message: str) -> None:
        self._dispatcher = dispatcher
        self._architectures = frozenset(architectures)
        self._message = message

    def __call__(self, hf_architecture: object, *args, **kwargs):
        if getattr(hf_architecture, "__name__", hf_architecture) in self._architectures:
            raise PluginUnavailable(self._message)
        return self._dispatcher(hf_architecture, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._dispatcher, name)


class _RegisterOnFirstUse:
    """Stands in for ``model_bridge.get_model_bridge`` until its first call or attribute access."""

    def __init__(
        self, module: ModuleType, dispatcher: object, register: Callable[[], None], architectures: Collection[str]
    ) -> None:
        self._module = module
        self._dispatcher = dispatcher
        self._register = register
        self._architectures = architectures

    def _resolve(self) -> object:
        if self._module.get_model_bridge is self:
            self._module.get_model_bridge = self._dispatcher  # restore first: registration uses it
            try:
                self._register()
            except Exception as error:  # noqa: BLE001 (any failure: other models must keep working)
                message = (
                    f"vime-gemma4-bridge could not register its Gemma 4 bridges: {type(error).__name__}: {error} "
                    f"(unset {ENV_VAR} to leave Gemma 4 to this Megatron-Bridge build's own bridge)"
                )
                logging.getLogger("vime_gemma4_bridge").error(message)
                self._module.get_model_bridge = _RefuseArchitectures(self._dispatcher, self._architectures, message)
        return self._module.get_model_bridge

    def __call__(self, *args, **kwargs):
        return self._resolve()(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._resolve(), name)


def register_before_first_dispatch(register: Callable[[], None], architectures: Collection[str]) -> None:
    """Arrange for ``register`` to run before Megatron-Bridge's first bridge lookup (idempotent).

    ``architectures`` are the HF class names ``register`` serves: the ones refused if it fails.
    """

    def install() -> None:
        from megatron.bridge.models.conversion import model_bridge

        current = model_bridge.get_model_bridge
        if not isinstance(current, _RegisterOnFirstUse | _RefuseArchitectures):
            model_bridge.get_model_bridge = _RegisterOnFirstUse(model_bridge, current, register, architectures)

    call_when_megatron_bridge_imported(install)


def call_when_megatron_bridge_imported(callback: Callable[[], None]) -> None:
    """Run ``callback`` now if ``megatron.bridge`` is imported, else right after it is."""
    if TRIGGER in sys.modules:
        callback()
    elif not any(isinstance(f, _AfterImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder(callback))
