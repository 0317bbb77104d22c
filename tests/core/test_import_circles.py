"""No import circles in src/stagewise: not at module level, not hidden in a function's lazy import, and not
through ``importlib.import_module("stagewise....")`` either; no circle of folders at any depth (two rooms of one
package, a folder and a folder or a folder and a module, that import each other); and no ``import_module`` of a
name computed at run time (which no reader of the code can follow) outside an allow-list that says why.

Read from the code as text (:mod:`helpers.imports`), so the check imports nothing: a circle is a strongly
connected component of two or more modules in the graph "module A imports module B" (a package door counts as
its own module). Imports under ``if TYPE_CHECKING:`` count too: a circle through annotations is still two
modules that need each other.
"""

from __future__ import annotations

import ast

from helpers.imports import SRC, circles, folder_circles, graph, read_imports

#: modules allowed to import a module by a name computed at run time, each with why (lazy doors: a public name
#: loads its module on first use, so ``import stagewise`` stays light and torch-free; the names are a literal map)
COMPUTED_IMPORTS: dict[str, str] = {
    "stagewise/__init__.py": "the package's lazy door: a public name -> its module, from the literal maps above it",
    "stagewise/runtime/__init__.py": "the runtime's lazy door: a public name -> its room, from the literal _NAMES",
}


def test_the_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_every_kind_of_import_is_read() -> None:
    """Top-level, relative, lazy (in a function), under TYPE_CHECKING, and a literal name given to importlib."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .b import x\n"
        "if TYPE_CHECKING:\n"
        "    from pkg import c\n"
        "def f():\n"
        "    import pkg.d\n"
        "    return importlib.import_module('pkg.e').y, importlib.import_module(f'pkg.{f}')\n"
    )
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e"}
    found = {(i.target, i.lazy, i.by_name) for i in read_imports("pkg.a", source, False, known)}
    assert found == {("pkg.b", False, False), ("pkg.c", False, False), ("pkg.d", True, False), ("pkg.e", True, True)}


def test_no_module_of_stagewise_imports_itself_round_a_circle() -> None:
    g = graph()
    assert sum(len(v) for v in g.values()) > 300  # the graph was read
    assert circles(g) == []


def test_no_circle_of_folders_at_any_depth() -> None:
    """For every package, its rooms (child folders and child modules) import each other in no circle."""
    assert folder_circles() == {}


def _computed_imports(source: str) -> list[int]:
    """Lines of ``import_module(...)`` / ``__import__(...)`` calls whose name is not a literal."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            literal = bool(node.args) and isinstance(node.args[0], ast.Constant)
            if name in ("import_module", "__import__") and not literal:
                out.append(node.lineno)
    return out


def test_the_finder_sees_a_computed_name() -> None:
    source = "import importlib\nimportlib.import_module('a.b')\nimportlib.import_module(f'a.{x}')\n__import__(n)\n"
    assert _computed_imports(source) == [3, 4]


def test_no_module_imports_by_a_computed_name_unless_listed_with_a_reason() -> None:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = _computed_imports(path.read_text())
        if lines:
            found[str(path.relative_to(SRC))] = lines
    unlisted = {where: lines for where, lines in found.items() if where not in COMPUTED_IMPORTS}
    assert unlisted == {}, "imports by a computed name (the circle test cannot follow them): use literal imports"
    assert sorted(set(COMPUTED_IMPORTS) - set(found)) == [], "listed, but no longer importing by a computed name"
