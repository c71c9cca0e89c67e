"""The checker behind ``tests/test_units.py::test_upstream_private_names_only_in_compat``.

It reads the package's modules with :mod:`ast` and lists every place outside ``compat/`` that reaches
a private attribute of megatron, transformers or torch. A list of known names would miss the next one
(it missed a dozen); this decides from the code itself. Its decision rule is in
:func:`upstream_private_uses`.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: The libraries whose private names are reached only through compat/.
UPSTREAM = ("megatron", "transformers", "torch")
PACKAGE = "vime_gemma4_bridge"
#: Private names of the standard library that are public by design or stable by use, each with its reason.
#: None of them is an attribute that megatron, transformers or torch defines (``_replace`` is read on
#: Megatron-Bridge's ``HFWeightTuple``, but it is ``typing.NamedTuple``'s, not Megatron-Bridge's).
STDLIB_ALLOWED = {
    "_replace": "namedtuple",
    "_fields": "namedtuple",
    "_asdict": "namedtuple",
    "_make": "namedtuple",
    "_exit": "os",
    "_SubParsersAction": "argparse",
    "_option_string_actions": "argparse",
}
_REFLECTION = ("getattr", "hasattr", "setattr", "delattr")


def is_private(name: str) -> bool:
    """One leading underscore, not a dunder (``__x`` is name-mangled, the class's own)."""
    return name.startswith("_") and not name.startswith("__") and name != "_"


@dataclass
class _Module:
    name: str
    path: str
    tree: ast.Module
    aliases: dict[str, str] = field(default_factory=dict)  # local name -> dotted name it was imported as

    def resolve(self, node: ast.expr) -> str | None:
        """The dotted name ``node`` (``nn.Module``, ``TransformerLayer``) stands for, or None."""
        if isinstance(node, ast.Attribute):
            head = self.resolve(node.value)
            return None if head is None else f"{head}.{node.attr}"
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, f"{self.name}.{node.id}")
        return None


def _aliases(module: str, tree: ast.Module) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:  # ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c`` to ``a.b``
                local = alias.asname or alias.name.split(".")[0]
                aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
    return aliases


def _is_upstream(dotted: str) -> bool:
    return dotted.split(".")[0] in UPSTREAM


def _import_object(dotted: str) -> object | None:
    """The upstream object named ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
        return obj
    return None


class _Classes:
    """The package's classes and, for each, the upstream classes its instances are (mixins included)."""

    def __init__(self, modules: dict[str, _Module]) -> None:
        self.modules = modules
        self.defs: dict[str, tuple[_Module, ast.ClassDef]] = {}
        for module in modules.values():
            for node in ast.walk(module.tree):
                if isinstance(node, ast.ClassDef):
                    self.defs[f"{module.name}.{node.name}"] = (module, node)
        self._direct: dict[str, set[type]] = {}
        self._bases = {qual: self._package_bases(qual) for qual in self.defs}
        self.upstream: dict[str, set[type]] = {qual: set() for qual in self.defs}
        for qual in self.defs:  # a class's upstream classes reach its package bases too (a mixin's MRO)
            for ancestor in self._ancestors(qual):
                self.upstream[ancestor] |= self._direct_upstream(qual)

    def _package_bases(self, qual: str) -> list[str]:
        module, node = self.defs[qual]
        return [base for base in map(module.resolve, node.bases) if base in self.defs]

    def _ancestors(self, qual: str) -> set[str]:
        seen, todo = {qual}, [qual]
        while todo:
            for base in self._bases[todo.pop()]:
                if base not in seen:
                    seen.add(base)
                    todo.append(base)
        return seen

    def _direct_upstream(self, qual: str) -> set[type]:
        """The upstream classes among ``qual``'s bases and its package bases' bases."""
        if qual not in self._direct:
            self._direct[qual] = set()
            module, node = self.defs[qual]
            for dotted in filter(None, map(module.resolve, node.bases)):
                if dotted in self.defs:
                    self._direct[qual] |= self._direct_upstream(dotted)
                elif _is_upstream(dotted) and isinstance(obj := _import_object(dotted), type):
                    self._direct[qual].add(obj)
        return self._direct[qual]

    def owner(self, qual: str, name: str) -> str | None:
        """The upstream class of ``qual``'s instances that has the attribute ``name``, if one does."""
        return next((c.__qualname__ for c in self.upstream.get(qual, ()) if hasattr(c, name)), None)


def _is_super(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _enclosing_classes(tree: ast.Module) -> Iterator[tuple[ast.AST, str | None]]:
    """Every node with the name of the class whose body (methods included) it is in."""

    def visit(node: ast.AST, cls: str | None) -> Iterator[tuple[ast.AST, str | None]]:
        yield node, cls
        inner = node.name if isinstance(node, ast.ClassDef) else cls
        for child in ast.iter_child_nodes(node):
            yield from visit(child, inner)

    yield from visit(tree, None)


def _overrides(modules: dict[str, _Module], classes: _Classes) -> dict[tuple[str, int], tuple[str, str]]:
    """``(module, line) -> (name, upstream class)`` of every ``def _name`` that replaces an upstream method."""
    found = {}
    for qual, (module, node) in classes.defs.items():
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and is_private(item.name):
                owner = classes.owner(qual, item.name)
                if owner is not None:
                    found[(module.name, item.lineno)] = (item.name, owner)
    return found


def _defined(modules: dict[str, _Module], overrides: dict[tuple[str, int], tuple[str, str]]) -> set[str]:
    """The private names the package defines itself: defs, classes, assignments, attribute stores (no overrides)."""
    names = set()
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if (module.name, node.lineno) not in overrides:
                    names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if is_private(name)}


def _uses(module: _Module, classes: _Classes, defined: set[str]) -> Iterator[tuple[int, str, str]]:
    """``(line, name, kind)`` of each use in ``module`` that reaches upstream privately."""
    for node, cls in _enclosing_classes(module.tree):
        qual = None if cls is None else f"{module.name}.{cls}"
        named: tuple[str, ast.expr] | None = None
        if isinstance(node, ast.Attribute):
            named = (node.attr, node.value)
            if node.attr == "__class__" and isinstance(node.ctx, ast.Store | ast.Del):
                yield node.lineno, node.attr, "class swap"
            elif isinstance(node.ctx, ast.Store | ast.Del) and _is_upstream(module.resolve(node.value) or ""):
                yield node.lineno, f"{module.resolve(node.value)}.{node.attr}", "store into upstream"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _REFLECTION:
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                named = (node.args[1].value, node.args[0])
                if named[0] == "__class__" and node.func.id in ("setattr", "delattr"):
                    yield node.lineno, named[0], "class swap"
        elif isinstance(node, ast.ImportFrom) and _is_upstream(node.module or ""):
            for alias in node.names:
                if is_private(alias.name) or any(map(is_private, (node.module or "").split("."))):
                    yield node.lineno, f"{node.module}.{alias.name}", "import"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_upstream(alias.name) and any(map(is_private, alias.name.split("."))):
                    yield node.lineno, alias.name, "import"
        if named is None or not is_private(named[0]) or named[0] in STDLIB_ALLOWED:
            continue
        name, target = named
        on_self = isinstance(target, ast.Name) and target.id == "self" or _is_super(target)
        owner = classes.owner(qual, name) if qual is not None and on_self else None
        if owner is not None:
            yield node.lineno, name, f"{owner}'s"
        elif name not in defined:
            yield node.lineno, name, "not the package's"


def upstream_private_uses(sources: dict[str, tuple[str, str]], exempt: str | None = f"{PACKAGE}.compat") -> list[str]:
    """``path:line name (why)`` for every use of an upstream private name outside the package ``exempt`` (None: none).

    ``sources``: module name -> (path, source text), the whole package (every module's definitions count).

    Decision rule, per module outside compat/:

    * **a private attribute** (``_name``: one leading underscore, not a dunder) named by an attribute
      access ``x._name`` (load, store or delete), by ``getattr`` / ``hasattr`` / ``setattr`` /
      ``delattr(x, "_name")``, or imported (``from megatron.x import _name``, a private module of
      theirs) is upstream's **unless the package defines it**: a def, a class, an assignment or an
      attribute store of that name anywhere in the package, overrides (below) excepted. A name the
      package defines is still upstream's where it is read on ``self`` / ``super()`` inside a class
      whose upstream classes have it. Standard-library names that are public by design
      (:data:`STDLIB_ALLOWED`, each with its reason) are allowed.
    * **an override**: a ``def _name`` in a class whose instances are of an upstream class (a base
      imported from megatron, transformers or torch, directly or through package classes, a compat
      one included; for a mixin, the classes that derive from it) that has ``_name``, checked on the
      real class with ``hasattr``.
    * **an assignment to an upstream object**: ``x.__class__ = ...`` (or ``setattr(x, "__class__", ...)``),
      and any store into a megatron / transformers / torch module or object imported by name.

    What it cannot see: a private name reached through a string built at run time, or a package name
    that happens to equal an upstream one on an object whose type the code does not state.
    """
    modules = {}
    for name, (path, text) in sources.items():
        tree = ast.parse(text)
        modules[name] = _Module(name, path, tree, _aliases(name, tree))
    classes = _Classes(modules)
    overrides = _overrides(modules, classes)
    defined = _defined(modules, overrides)
    found = []
    for module in modules.values():
        if exempt is not None and (module.name == exempt or module.name.startswith(exempt + ".")):
            continue
        uses = [
            (line, name, f"override of {owner}") for (m, line), (name, owner) in overrides.items() if m == module.name
        ]
        uses += _uses(module, classes, defined)
        found += [(module.path, line, f"{name} ({why})") for line, name, why in set(uses)]
    return [f"{path}:{line} {what}" for path, line, what in sorted(found)]


def package_sources(root: Path) -> dict[str, tuple[str, str]]:
    """Every module of the package under ``root``: module name -> (path relative to the repository, text)."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        sources[name] = (str(path.relative_to(root.parent)), path.read_text())
    return sources
