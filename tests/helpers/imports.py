"""Who imports whom in src/stagewise, read from the code as text (ast): the checks that use it import nothing.

An import counts wherever it stands: at the top of a file, under ``if TYPE_CHECKING:`` (two modules that need
each other's names to be described still need each other), inside a function (a lazy import is still an
import), and as a literal name handed to ``importlib.import_module("stagewise....")`` (the importer is then
hidden from every tool that reads ``import`` statements; a test should not be one of them).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_name(path: Path) -> str:
    """``src/stagewise/runtime/engine/runner.py`` -> ``stagewise.runtime.engine.runner`` (a package by its door)."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every module of src/stagewise, by its dotted name."""
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    """One import of a module of stagewise: where it stands (``line``) and how (``lazy``: inside a function)."""

    target: str
    line: int
    lazy: bool
    by_name: bool  # through importlib.import_module("...")


def _base(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def _import_module_literal(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name != "import_module" or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """The modules of stagewise ``module`` imports, wherever in the file and however."""
    path = modules()[module]
    return read_imports(module, path.read_text(), path.name == "__init__.py", set(modules()))


def read_imports(module: str, source: str, package: bool, known: set[str]) -> tuple[Import, ...]:
    """The imports of ``known`` modules in ``source``, the text of ``module`` (a package's door if ``package``)."""
    out: list[Import] = []

    def add(name: str, line: int, lazy: bool, by_name: bool = False) -> None:
        if name in known and name != module:
            out.append(Import(name, line, lazy, by_name))

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                base = _base(module, package, child.level, child.module)
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(full if full in known else base, child.lineno, lazy)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno, lazy)
            elif isinstance(child, ast.Call):
                literal = _import_module_literal(child)
                if literal is not None:
                    add(literal, child.lineno, lazy, by_name=True)
            visit(child, inside)

    visit(ast.parse(source), False)
    return tuple(out)


def graph() -> dict[str, set[str]]:
    """Module -> the modules of stagewise it imports."""
    return {m: {i.target for i in imports_of(m)} for m in modules()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more nodes (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _room_of(module: str, package: str) -> str | None:
    """The room of ``package`` that ``module`` stands in: its child folder or child module (None: outside)."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".")[0]


def folder_circles() -> dict[str, list[list[str]]]:
    """Circles of rooms at every depth: for each package, its rooms (child folders and child modules) in the
    graph "a module of room A imports a module of room B"; the package -> its components of two or more."""
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    out: dict[str, list[list[str]]] = {}
    for package in sorted(packages):
        rooms: dict[str, set[str]] = {}
        for module in modules():
            here = _room_of(module, package)
            if here is None:
                continue
            edges = rooms.setdefault(here, set())
            for imp in imports_of(module):
                there = _room_of(imp.target, package)
                if there is not None and there != here:
                    edges.add(there)
        found = circles(rooms)
        if found:
            out[package] = found
    return out
