"""One source per list: the public names, the runtime door's names, and every package door's map of its modules.

Read from the code as text (ast), so nothing is imported. ``stagewise/__init__.py``'s ``__all__`` is the one
list of public names; what the facade imports eagerly, defines, and imports under ``TYPE_CHECKING`` (for type
checkers: those names load on first use) must add up to it exactly, each name once. The runtime's door keeps
one map (name -> module) and derives ``__all__`` from it. A package door whose docstring lists its modules as
bullets (``* :mod:`.name```) names every one of them (the options' three lists are checked in
tests/runtime/test_options.py: they need torch).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "stagewise"


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"


def _bound(nodes: list[ast.stmt]) -> dict[str, str]:
    """name -> the module a ``from ... import`` among ``nodes`` takes it from (``.x`` relative to stagewise)."""
    out: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            for alias in node.names:
                out[alias.asname or alias.name] = module
    return out


def _assigned(tree: ast.Module, name: str) -> ast.expr:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name and node.value is not None:
            return node.value
    raise AssertionError(f"no module-level {name} =")


def test_the_facade_has_one_list_of_public_names() -> None:
    tree = _tree(SRC / "__init__.py")
    public = ast.literal_eval(_assigned(tree, "__all__"))
    assert len(public) == len(set(public)), "a name twice in __all__"
    eager = {n: m for n, m in _bound(tree.body).items() if m.startswith(".")}
    checking = _bound([n for node in tree.body if _is_type_checking(node) for n in node.body])
    defined = {
        n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")
    }
    elsewhere = ast.literal_eval(_assigned(tree, "_ELSEWHERE"))
    packages = set(ast.literal_eval(_assigned(tree, "_PACKAGES")))

    internal = {"VERSION"}  # imported for __version__
    assert set(eager) - internal <= set(public), (
        f"imported eagerly but not public: {set(eager) - internal - set(public)}"
    )
    lazy = {n for n, m in checking.items() if n in public}
    assert not lazy & set(eager), f"imported eagerly and loaded lazily: {lazy & set(eager)}"
    assert set(public) == (set(eager) - internal) | defined | lazy, (
        "__all__ must be exactly what the facade imports, defines, or loads on first use (the TYPE_CHECKING "
        f"block): missing {set(public) - (set(eager) - internal) - defined - lazy}"
    )
    for name in lazy:  # on first use: the runtime's, a subpackage, or where _ELSEWHERE says
        where = checking[name]
        if name in packages:
            assert where == ".", name
        elif name in elsewhere:
            assert where == "." + elsewhere[name].removeprefix("stagewise."), name
        else:
            assert where == ".runtime", (
                f"{name}: the TYPE_CHECKING block imports it from {where}, it loads from .runtime"
            )
    runtime_names = ast.literal_eval(_assigned(_tree(SRC / "runtime" / "__init__.py"), "_NAMES"))
    missing = sorted(n for n in lazy if checking[n] == ".runtime" and n not in runtime_names)
    assert missing == [], f"public names the runtime's door does not have: {missing}"


def test_the_runtime_door_derives_its_names_from_one_map() -> None:
    tree = _tree(SRC / "runtime" / "__init__.py")
    assert ast.unparse(_assigned(tree, "__all__")) == "sorted(_NAMES)"
    for name, module in ast.literal_eval(_assigned(tree, "_NAMES")).items():
        path = SRC / "runtime" / Path(*module.lstrip(".").split("."))
        source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
        assert source.exists(), f"{name}: no module {module}"
        assert re.search(
            rf"^(class|def) {name}\b|^{name}\b|\b{name}\b.*import|import\b.*\b{name}\b", source.read_text(), re.M
        ), f"{name} is not in {module}"


def _doors() -> list[Path]:
    return sorted(SRC.rglob("__init__.py"))


def _listed(door: Path) -> set[str]:
    """The modules a door's docstring lists as bullets (``* :mod:`.name`: ...``, more than one to a bullet)."""
    doc = ast.get_docstring(_tree(door)) or ""
    bullets = [line for line in doc.splitlines() if re.match(r"\s*\* ", line)]
    return set(re.findall(r":mod:`~?\.(\w+)", doc)) if any(":mod:`." in b for b in bullets) else set()


def _modules(door: Path) -> set[str]:
    here = door.parent
    files = {p.stem for p in here.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    return files | {p.name for p in here.iterdir() if (p / "__init__.py").exists()}


def test_a_door_that_maps_its_package_names_every_module() -> None:
    maps = {door: _listed(door) for door in _doors()}
    assert sum(1 for listed in maps.values() if listed) >= 10  # the docstrings were read
    wrong = {
        str(door.parent.relative_to(SRC)): (sorted(_modules(door) - listed), sorted(listed - _modules(door)))
        for door, listed in maps.items()
        if listed and listed != _modules(door)
    }
    assert wrong == {}, "package: (modules its door does not name, names that are no module)"
