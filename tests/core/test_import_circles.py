"""No import circles in src/stagewise: not at module level, not hidden in a function's lazy import, and not
through ``importlib.import_module("stagewise....")`` either.

Read from the code as text (:mod:`helpers.imports`), so the check imports nothing: a circle is a strongly
connected component of two or more modules in the graph "module A imports module B" (a package door counts as
its own module). Imports under ``if TYPE_CHECKING:`` count too: a circle through annotations is still two
modules that need each other.
"""

from __future__ import annotations

from helpers.imports import circles, graph, read_imports


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
