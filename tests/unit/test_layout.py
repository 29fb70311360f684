"""The package's layout rules, checked on its source: no import cycles, no borrowed private
names, no oversized modules, so the layout cannot drift back unnoticed."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sitsmesh"
GENERATED = PACKAGE / "admin" / "v1"
# The swap state machine reads best as one table of phases; everything else stays short.
LONG_ALLOWED = {PACKAGE / "swap" / "machine.py"}
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(GENERATED):
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names: the longest known prefix."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, tree: ast.Module) -> set[str]:
    """Project modules `module` imports, at any depth of its code (lazy imports count too:
    a cycle through a function-level import is still a cycle in the design)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import mod` imports pkg.mod when it is a module.
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[module] = imports_of(module, tree)
    # No implicit edge from a module to its package: a package that re-exports its modules
    # is the usual layout, and it only cycles if a module imports a name from the package,
    # which is an explicit edge.
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the path that closes it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = _graph()
    # Guard the checker itself: it must see the package's real edges.
    assert "sitsmesh.app.compose" in graph["sitsmesh.app.server"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_a_cycle_is_found_when_one_exists() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    graph["c"] = set()
    assert find_cycle(graph) is None


def test_lazy_and_relative_imports_count_as_edges() -> None:
    tree = ast.parse("def f():\n    from sitsmesh import logs\n    from . import errors\n")
    # `from sitsmesh import logs` runs sitsmesh/__init__ too: both are edges.
    assert imports_of("sitsmesh.config", tree) == {"sitsmesh", "sitsmesh.logs",
                                                   "sitsmesh.errors"}


def borrowed_private_names(module: str, tree: ast.Module) -> list[str]:
    """Private names `module` takes from another project module: imported by name, or read
    as an attribute of a project module it imported (`cli._table`)."""
    found = []
    modules: dict[str, str] = {}  # local name -> project module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sitsmesh"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{module}: {node.module}.{alias.name}")
                if f"{node.module}.{alias.name}" in MODULES:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{module}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    borrowed = []
    for module, path in MODULES.items():
        borrowed += borrowed_private_names(module, ast.parse(path.read_text(encoding="utf-8")))
    assert borrowed == []


def test_borrowed_private_names_are_seen_both_ways() -> None:
    tree = ast.parse("from sitsmesh import cli\nfrom sitsmesh.config import _x\ncli._table()\n")
    assert borrowed_private_names("sitsmesh.other", tree) == [
        "sitsmesh.other: sitsmesh.config._x", "sitsmesh.other: sitsmesh.cli._table"]


def test_modules_stay_short() -> None:
    long = {module: n for module, path in MODULES.items()
            if path not in LONG_ALLOWED
            and (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


# __main__ runs the CLI when imported; it is checked by running `python -m sitsmesh`.
@pytest.mark.parametrize("module", sorted(set(MODULES) - {"sitsmesh.__main__"}))
def test_every_module_imports(module: str) -> None:
    assert importlib.import_module(module).__name__ == module
